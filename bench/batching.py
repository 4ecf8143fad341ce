"""Static vs continuous batching on the same workload, side by side in one run.

Requests of mixed output lengths arrive together. Static batching admits a batch and runs it until
its longest member finishes; continuous batching lets a finished request's slot go to a waiting
one at the next step. Same engine settings otherwise (max_running caps both batches).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time

from radixserve.ops.stats import percentile

HELP = "static vs continuous batching: throughput and TTFT on one workload"


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="model dir (default: the bench model)")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-running", type=int, default=16, help="batch size cap for both modes")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens")
    parser.add_argument("--min-output", type=int, default=4, help="shortest output (tokens)")
    parser.add_argument("--max-output", type=int, default=64, help="longest output (tokens)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    from bench.models import bench_model_path
    from radixserve import Engine, SamplingParams

    model = args.model or str(bench_model_path())
    rng = random.Random(0)
    prompts = [[rng.randrange(7, 30000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    params = [SamplingParams(max_tokens=rng.randint(args.min_output, args.max_output), temperature=0.0, ignore_eos=True) for _ in prompts]
    results = {}
    for mode in ("static", "continuous"):
        engine = Engine(
            model,
            batching=mode,
            max_running=args.max_running,
            enable_prefix_cache=False,
            kv_cache_tokens=args.max_running * (args.prompt_len + args.max_output) * 2,
            max_batched_tokens=max(2048, args.max_running * args.prompt_len),
        )
        print(f"running {mode} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        wall = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for o in outs)
        ttft = [o.ttft_s for o in outs]
        results[mode] = {
            "wall_s": wall,
            "output_tok_s": tokens / wall,
            "requests_s": len(outs) / wall,
            "ttft_p50_s": statistics.median(ttft),
            "ttft_p99_s": percentile(ttft, 99),
            "e2e_p50_s": statistics.median(o.e2e_s for o in outs),
            "steps": engine.stats()["steps"],
        }
    results["throughput_ratio"] = results["continuous"]["output_tok_s"] / results["static"]["output_tok_s"]
    if args.json:
        print(json.dumps(results))
        return 0
    print(
        f"{args.requests} requests, prompt {args.prompt_len} tokens, output {args.min_output}-{args.max_output} "
        f"tokens, max_running {args.max_running}, all arriving at once"
    )
    print(f"{'mode':<11} {'wall':>8} {'throughput':>13} {'TTFT p50':>10} {'TTFT p99':>10} {'E2E p50':>10} {'steps':>6}")
    for mode in ("static", "continuous"):
        r = results[mode]
        print(
            f"{mode:<11} {r['wall_s']:>6.1f} s {r['output_tok_s']:>7.1f} tok/s {r['ttft_p50_s']:>8.2f} s "
            f"{r['ttft_p99_s']:>8.2f} s {r['e2e_p50_s']:>8.2f} s {r['steps']:>6}"
        )
    print(f"continuous / static throughput: {results['throughput_ratio']:.2f} x")
    return 0

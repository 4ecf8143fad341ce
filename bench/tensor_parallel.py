"""Engine step time at tensor parallel N vs 1 on the same model (bench model by default).

Each round runs one batch of ``--batch`` random prompts of ``--prompt`` tokens to ``--new``
generated tokens on each engine, one after the other, timing every model step (the
runner's forward, logits included): steps that carry prefill chunks count as prefill, the
rest as decode. Medians over all rounds. With N ranks on a machine of few cores the ranks share
the cores and pay two all_reduces per layer, so expect no speedup on 2 cores; the command prints
the ratio, whatever it is.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from bench.common import add_common_args, machine_line, machine_summary, random_ids, rng, setup

HELP = "engine step time, tensor parallel N vs 1 (gloo, CPU)"


def add_arguments(parser) -> None:
    add_common_args(parser)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks to compare against 1")
    parser.add_argument("--batch", type=int, default=8, help="requests per round")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--new", type=int, default=16, help="generated tokens per request")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per engine (after one warm-up)")


def _round(engine, prompts, params) -> tuple[list[float], list[float]]:
    """Time every forward step of one batch (what tensor parallel changes: the model's step);
    a step with any prefill chunk counts as prefill."""
    prefill, decode = [], []
    forward = engine.runner.forward

    def timed(items, groups=()):
        t0 = time.perf_counter()
        out = forward(items, groups)
        (prefill if any(item.num_tokens > 1 for item in items) else decode).append(time.perf_counter() - t0)
        return out

    engine.runner.forward = timed
    try:
        engine.generate(prompts, params)
    finally:
        del engine.runner.forward
    return prefill, decode


def run(args) -> int:
    from radixserve import Engine, SamplingParams

    model = setup(args)
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    engines = {1: Engine(model, device=args.device, kv_cache_tokens=args.batch * (args.prompt + args.new) * 2, enable_prefix_cache=False)}
    engines[args.tp] = Engine(
        model, device=args.device, kv_cache_tokens=args.batch * (args.prompt + args.new) * 2, enable_prefix_cache=False, tensor_parallel=args.tp
    )
    times = {tp: ([], []) for tp in engines}
    try:
        for r in range(args.rounds + 1):
            g = rng(r)
            prompts = [random_ids(g, args.prompt, engines[1].vocab_size) for _ in range(args.batch)]
            for tp, engine in engines.items():
                prefill, decode = _round(engine, prompts, params)
                if r:  # round 0 warms up
                    times[tp][0].extend(prefill)
                    times[tp][1].extend(decode)
            print(f"round {r}/{args.rounds} done", file=sys.stderr)
    finally:
        for engine in engines.values():
            engine.shutdown()
    result = {
        f"tp{tp}": {
            "prefill_step_ms": 1000 * statistics.median(p),
            "decode_step_ms": 1000 * statistics.median(d),
            "prefill_steps": len(p),
            "decode_steps": len(d),
        }
        for tp, (p, d) in times.items()
    }
    one, many = result["tp1"], result[f"tp{args.tp}"]
    result["decode_speedup"] = one["decode_step_ms"] / many["decode_step_ms"]
    result["prefill_speedup"] = one["prefill_step_ms"] / many["prefill_step_ms"]
    result["machine"] = machine_summary()
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"batch {args.batch} x {args.prompt} prompt tokens, {args.new} new; {args.rounds} rounds; " + machine_line(result["machine"]))
    print(f"{'run':<6} {'prefill step (ms)':>18} {'decode step (ms)':>17} {'steps (prefill/decode)':>23}")
    for tp in engines:
        row = result[f"tp{tp}"]
        print(f"{'TP=' + str(tp):<6} {row['prefill_step_ms']:>18.1f} {row['decode_step_ms']:>17.1f} {row['prefill_steps']:>11}/{row['decode_steps']:<11}")
    print(f"TP={args.tp} vs TP=1: decode {result['decode_speedup']:.2f}x, prefill {result['prefill_speedup']:.2f}x (>1 is faster)")
    return 0

"""Cost of cache-aware admission with a deep queue.

Longest-prefix-first admission peeks at the radix tree for every waiting request at every step
that can admit. This measures that cost with 1,000 requests waiting (generated-shared-prefix
prompts, half of the groups already cached), next to FCFS order, so the claim "no fall-back to
FCFS is needed" has a number behind it.
"""

from __future__ import annotations

import json
import random
import statistics
import time

HELP = "time longest-prefix-first queue ordering with 1,000 requests waiting"


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="model dir (default: the bench model)")
    parser.add_argument("--waiting", type=int, default=1000, help="requests in the queue")
    parser.add_argument("--groups", type=int, default=16, help="shared-prefix groups")
    parser.add_argument("--prefix", type=int, default=1024, help="shared prefix length (tokens)")
    parser.add_argument("--question", type=int, default=128, help="unique suffix length (tokens)")
    parser.add_argument("--repeats", type=int, default=20, help="timed orderings per policy")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    from bench.models import bench_model_path
    from radixserve import Engine, SamplingParams

    rng = random.Random(0)
    engine = Engine(args.model or str(bench_model_path()), kv_cache_tokens=64 * 1024)
    vocab = engine.vocab_size
    prefixes = [[rng.randrange(7, vocab) for _ in range(args.prefix)] for _ in range(args.groups)]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    # Warm half of the groups, so the queue holds a mix of hits and misses.
    engine.generate([p + [7] for p in prefixes[: args.groups // 2]], params)
    for i in range(args.waiting):
        question = [rng.randrange(7, vocab) for _ in range(args.question)]
        engine.add_request(engine.make_request(prefixes[i % args.groups] + question, params))
    engine.drain_inbox()
    scheduler = engine.scheduler
    assert len(scheduler.waiting) == args.waiting

    results = {}
    for policy in ("lpm", "fcfs"):
        scheduler.config.schedule_policy = policy
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            order = scheduler.admission_order()
            times.append(time.perf_counter() - start)
        hits = sum(engine.cache.peek(r) for r in order[:64])
        results[policy] = {"median_ms": statistics.median(times) * 1e3, "max_ms": max(times) * 1e3, "first_64_cached_tokens": hits}
    out = {"waiting": args.waiting, "prompt_tokens": args.prefix + args.question, **results}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"queue: {args.waiting} waiting requests of {args.prefix + args.question} tokens, {args.groups} groups, half cached")
    print(f"{'policy':<6} {'order median':>14} {'order max':>11} {'cached tokens in first 64':>27}")
    for policy, r in results.items():
        print(f"{policy:<6} {r['median_ms']:>11.1f} ms {r['max_ms']:>8.1f} ms {r['first_64_cached_tokens']:>20} tokens")
    return 0

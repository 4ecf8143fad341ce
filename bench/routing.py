"""Routing policies side by side on a generated shared-prefix workload.

``python -m bench routing [--model PATH] [--workers 2] [--groups 8 ...]``

Starts ``radixserve serve`` once per policy, sends ``groups x per_group`` requests (each group
shares a ``prefix_tokens`` system prompt, then ``question_tokens`` of its own), shuffled, with
``concurrency`` calls in flight, and prints the prefix-cache hit rate (cached / prompt tokens),
throughput and TTFT p50/p99 per policy. The KV pool per worker is sized to hold about half the
groups' prefixes, so a policy that scatters groups across workers thrashes the cache. With no
``--model`` a tiny random Llama is built in a temporary directory (fast on CPU; the numbers
show routing effects, not model speed).
"""

from __future__ import annotations

import asyncio
import os
import random
import tempfile
import time

from radixserve.ops.stats import percentile
from radixserve.testing import ServerProcess, spawn_server

HELP = "routing policies side by side on live workers (hit rate, throughput, TTFT)"


def _start(model: str, policy: str, workers: int, kv_tokens: int, threads: int) -> ServerProcess:
    return spawn_server(
        model,
        "--policy",
        policy,
        "--kv-cache-tokens",
        str(kv_tokens),
        "--worker-threads",
        str(threads),
        "--max-queue",
        "100000",
        workers=workers,
        env={"OMP_NUM_THREADS": str(threads)},
        ready_timeout=120.0,
    )


async def _run(address: str, workers: int, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    from radixserve.client import AsyncClient

    sem = asyncio.Semaphore(concurrency)
    async with AsyncClient(address, timeout=600) as client:
        await client.wait_ready(workers, timeout=120)

        async def one(p):
            async with sem:
                return await client.generate(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

        t0 = time.monotonic()
        outs = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.monotonic() - t0
        stats = await client.stats()
    prompt = sum(o.usage.prompt_tokens for o in outs)
    cached = sum(o.usage.cached_tokens for o in outs)
    gen = sum(o.usage.completion_tokens for o in outs)
    ttft = [o.timings.ttft_s for o in outs]
    return {
        "hit_rate": cached / prompt,
        "req_per_s": len(outs) / wall,
        "tok_per_s": (prompt + gen) / wall,
        "ttft_p50_ms": 1e3 * percentile(ttft, 50),
        "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "wall_s": wall,
        "per_worker": {k: w["routed"] for k, w in stats["workers"].items()},
    }


def add_arguments(ap) -> None:
    ap.add_argument("--model", default=None, help="model directory (default: a tiny random Llama)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--prefix-tokens", type=int, default=400)
    ap.add_argument("--question-tokens", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--kv-cache-tokens", type=int, default=None, help="per worker (default: half the groups' prefixes + room)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument(
        "--policies", default="single,round_robin,least_load,cache_aware", help="'single' is the baseline: one worker holding the pooled KV of all workers"
    )
    ap.add_argument("--seed", type=int, default=0)


def _model(args) -> tuple[str, int, tempfile.TemporaryDirectory | None]:
    """The model directory, its vocabulary size, and the temporary directory holding it (or None)."""
    if args.model is not None:
        import json

        with open(os.path.join(args.model, "config.json")) as f:
            return args.model, json.load(f)["vocab_size"], None
    from radixserve.testing import make_tiny_model_dir

    tmp = tempfile.TemporaryDirectory()
    return str(make_tiny_model_dir(os.path.join(tmp.name, "tiny"), "llama", max_position_embeddings=2048)), 512, tmp


def _workload(args, vocab: int) -> tuple[list[list[int]], int]:
    """The shuffled prompts and the KV tokens per worker."""
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(10, vocab) for _ in range(args.prefix_tokens)] for _ in range(args.groups)]
    prompts = [prefixes[g] + [rng.randrange(10, vocab) for _ in range(args.question_tokens)] for g in range(args.groups) for _ in range(args.per_group)]
    rng.shuffle(prompts)
    per_req = args.prefix_tokens + args.question_tokens + args.max_tokens
    kv = args.kv_cache_tokens or (-(-args.groups // args.workers) * args.prefix_tokens + args.concurrency * (args.question_tokens + args.max_tokens) + per_req)
    ideal = 1 - args.groups * args.prefix_tokens / sum(len(p) for p in prompts)  # one miss per group
    print(
        f"workload: {args.groups} groups x {args.per_group} requests, {args.prefix_tokens}-token shared prefix + "
        f"{args.question_tokens}-token question, {args.max_tokens} tokens out; {args.workers} workers, "
        f"KV {kv} tokens each; ideal hit rate {ideal:.1%}",
        flush=True,
    )
    return prompts, kv


def _policy_run(args, model: str, policy: str, prompts: list[list[int]], kv: int) -> dict:
    single = policy == "single"
    workers = 1 if single else args.workers
    with _start(model, "round_robin" if single else policy, workers, kv * args.workers if single else kv, args.threads) as server:
        return asyncio.run(_run(server.address, workers, prompts, args.max_tokens, args.concurrency))


def _print_table(rows: list[tuple[str, dict]]) -> None:
    base = dict(rows).get("single", {}).get("hit_rate")
    print(f"{'policy':<12} {'hit rate':>9} {'of single':>10} {'req/s':>8} {'tok/s':>9} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12}  routed per worker")
    for policy, r in rows:
        share = f"{r['hit_rate'] / base:>10.1%}" if base else f"{'-':>10}"
        print(
            f"{policy:<12} {r['hit_rate']:>9.1%} {share} {r['req_per_s']:>8.1f} {r['tok_per_s']:>9.0f} "
            f"{r['ttft_p50_ms']:>12.1f} {r['ttft_p99_ms']:>12.1f}  {r['per_worker']}"
        )


def run(args) -> int:
    model, vocab, tmp = _model(args)
    try:
        prompts, kv = _workload(args, vocab)
        rows = [(policy, _policy_run(args, model, policy, prompts, kv)) for policy in args.policies.split(",")]
        _print_table(rows)
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0

"""Load-test a running server: radixserve over the ZMQ SDK, or any OpenAI-compatible HTTP endpoint.

``python -m bench serve --target sdk --address tcp://127.0.0.1:7700`` or
``python -m bench serve --target http --base-url http://127.0.0.1:8000/v1`` (vLLM, SGLang,
llama-server, radixserve's gateway: the same measurements for all), or ``--start`` to launch
``radixserve serve`` on the bench model (or ``--model``) for the run.

Load: open loop with Poisson arrivals (``--rate R`` req/s, the default), open loop replaying a
Mooncake trace's timestamps (``--trace F --time-scale S``, prompts rebuilt as token ids from the
chained 512-token block hashes), or closed loop (``--agents N``: N clients, each sending its next
request when the previous one finished). Workload: generated shared prefix (G groups x Q
prompts, a group's prefix + a unique question, shuffled), all token ids, output ``ignore_eos``.

Every request streams, so TTFT (send to first token), ITL (gaps between streamed chunks), TPOT
((E2E - TTFT) / (output tokens - 1)) and E2E are measured by the client the same way for every
target. Hit rate = sum cached prompt tokens / sum prompt tokens from the usage the server
reports (SDK ``usage.cached_tokens``; HTTP ``usage.prompt_tokens_details.cached_tokens``, absent
on servers that do not report it). Queue depth: SDK polls the router stats (router queue +
requests waiting in the workers' engines); HTTP counts requests in flight on the client.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

from bench.common import fmt, log, machine_summary, table
from radixserve.ops.stats import percentile
from radixserve.testing import ServerProcess, spawn_server

HELP = "load-test a running server (SDK or OpenAI HTTP): TTFT/TPOT/ITL/E2E, hit rate, queue depth"


def add_arguments(p) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--target", choices=["sdk", "http"], default="sdk")
    g.add_argument("--address", default="tcp://127.0.0.1:7700", help="router address (sdk)")
    g.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="OpenAI-compatible base URL (http)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"), help="http: bearer key")
    g.add_argument("--served-model", default=None, help="http: model name (default: the first of GET /models)")
    g.add_argument("--start", action="store_true", help="start `radixserve serve` (with --http-port for --target http) for this run")
    g.add_argument("--model", default=None, help="--start: model directory (default: the bench model)")
    g.add_argument("--workers", type=int, default=2, help="--start: worker processes")
    g.add_argument("--policy", default="cache_aware", help="--start: routing policy")
    g.add_argument("--kv-cache-tokens", type=int, default=None, help="--start: KV pool per worker")
    g.add_argument("--max-running", type=int, default=None, help="--start: requests running per worker engine")
    g.add_argument("--worker-threads", type=int, default=1, help="--start: torch threads per worker")
    g.add_argument("--vocab-size", type=int, default=None, help="token ids are drawn below this (default: the model's config, else 32000)")
    ld = p.add_argument_group("load (default: Poisson --rate)")
    ld.add_argument("--rate", type=float, default=2.0, help="open loop: Poisson arrivals, requests/s (inf: all at once)")
    ld.add_argument("--agents", type=int, default=None, help="closed loop: N clients back to back")
    ld.add_argument("--trace", default=None, help="Mooncake .jsonl: replay its timestamps and prefixes")
    ld.add_argument("--time-scale", type=float, default=1.0, help="--trace: multiply inter-arrival times by this")
    ld.add_argument("--max-requests", type=int, default=None, help="stop after this many requests (trace: first N)")
    ld.add_argument("--block-tokens", type=int, default=512, help="--trace: tokens per hash block (less than 512 shrinks every prompt in proportion)")
    ld.add_argument("--max-output", type=int, default=None, help="cap output tokens per request")
    ld.add_argument("--seed", type=int, default=0)
    w = p.add_argument_group("workload (generated shared prefix)")
    w.add_argument("--groups", type=int, default=4)
    w.add_argument("--per-group", type=int, default=8)
    w.add_argument("--prefix-tokens", type=int, default=256)
    w.add_argument("--question-tokens", type=int, default=32)
    w.add_argument("--output-tokens", type=int, default=8)
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    o.add_argument(
        "--timeline", default=None, metavar="FILE.jsonl", help="write one JSON line per second: TTFT of requests whose first token came then, queue depth"
    )
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    o.add_argument("--timeout", type=float, default=600.0, help="seconds per request")


# -- workload ----------------------------------------------------------------------------------
@dataclass
class Item:
    prompt: list[int]
    max_tokens: int
    at: float = 0.0  # open loop: seconds after start


def _vocab(args) -> int:
    if args.vocab_size:
        return args.vocab_size
    if args.model or args.start:
        try:
            with open(os.path.join(args.model_dir, "config.json")) as f:
                return int(json.load(f)["vocab_size"])
        except (OSError, KeyError, ValueError, AttributeError):
            pass
    return 32000


def gsp_items(args, vocab: int) -> list[Item]:
    rng = random.Random(args.seed)
    ids = lambda n: [rng.randrange(7, vocab) for _ in range(n)]  # noqa: E731  (ids < 7 are special)
    prefixes = [ids(args.prefix_tokens) for _ in range(args.groups)]
    out = args.output_tokens if args.max_output is None else min(args.output_tokens, args.max_output)
    items = [Item(prefixes[g] + ids(args.question_tokens), out) for g in range(args.groups) for _ in range(args.per_group)]
    rng.shuffle(items)
    if args.max_requests:
        items = items[: args.max_requests]
    if args.agents is None:  # Poisson arrivals
        t = 0.0
        for it in items:
            it.at = t
            t += rng.expovariate(args.rate) if math.isfinite(args.rate) and args.rate > 0 else 0.0
    return items


def trace_items(args, vocab: int) -> list[Item]:
    """Mooncake rows as token ids: each hash id gets a fixed block of ids (seeded by the id)."""
    rows = []
    with open(args.trace) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
            if args.max_requests and len(rows) >= args.max_requests:
                break
    bt, blocks, items = args.block_tokens, {}, []
    t0 = rows[0]["timestamp"] if rows else 0
    for r in rows:
        toks: list[int] = []
        for h in r["hash_ids"]:
            if h not in blocks:
                rr = random.Random(h * 1_000_003 + args.seed)
                blocks[h] = [rr.randrange(7, vocab) for _ in range(bt)]
            toks += blocks[h]
        n = max(1, min(len(toks), round(r["input_length"] * bt / 512)))
        out = max(1, r["output_length"] if args.max_output is None else min(r["output_length"], args.max_output))
        items.append(Item(toks[:n], out, (r["timestamp"] - t0) / 1000.0 * args.time_scale))
    return items


# -- targets -----------------------------------------------------------------------------------
@dataclass
class Result:
    ok: bool
    start: float = 0.0
    ttft: float = float("nan")
    e2e: float = float("nan")
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    completion_tokens: int = 0
    error: str = ""


class SdkTarget:
    def __init__(self, args):
        from radixserve.client import AsyncClient

        self.client = AsyncClient(args.address, timeout=args.timeout)
        self.timeout = args.timeout

    async def ready(self, workers: int | None) -> None:
        await self.client.wait_ready(workers or 1, timeout=180)

    async def request(self, it: Item, r: Result) -> None:
        from radixserve.client import Completion

        async for msg in self.client.stream(it.prompt, max_tokens=it.max_tokens, temperature=0.0, ignore_eos=True):
            now = time.perf_counter()
            if isinstance(msg, Completion):
                r.prompt_tokens = msg.usage.prompt_tokens
                r.cached_tokens = msg.usage.cached_tokens
                r.completion_tokens = msg.usage.completion_tokens
            elif msg.token_ids:
                r.chunk_times.append(now)

    async def queue_depth(self) -> dict | None:
        s = await self.client.stats(timeout=5.0)
        router = s["router"]["gauges"]["queue_depth"]
        waiting = sum(int(w.get("engine", {}).get("waiting", 0) or 0) for w in s["workers"].values() if w.get("alive"))
        return {"router_queue": router, "engine_waiting": waiting, "queue_depth": router + waiting}

    async def close(self) -> None:
        await self.client.close()


class HttpTarget:
    def __init__(self, args):
        from openai import AsyncOpenAI

        self.client = AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=args.timeout)
        self.model = args.served_model

    async def ready(self, workers: int | None) -> None:
        deadline = time.monotonic() + 180
        while True:
            try:
                models = await self.client.models.list()
                if self.model is None:
                    self.model = models.data[0].id
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)

    async def request(self, it: Item, r: Result) -> None:
        stream = await self.client.completions.create(
            model=self.model,
            prompt=it.prompt,
            max_tokens=it.max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                r.chunk_times.append(now)
            if chunk.usage is not None:
                u = chunk.usage
                r.prompt_tokens, r.completion_tokens = u.prompt_tokens, u.completion_tokens
                details = getattr(u, "prompt_tokens_details", None)
                cached = getattr(details, "cached_tokens", None) if details is not None else None
                r.cached_tokens = int(cached) if cached is not None else None

    async def queue_depth(self) -> dict | None:
        return None  # HTTP: client-side in-flight count only

    async def close(self) -> None:
        await self.client.close()


# -- server ------------------------------------------------------------------------------------
def start_server(args) -> ServerProcess:
    extra = ["--policy", args.policy, "--max-queue", "100000", "--worker-threads", str(args.worker_threads)]
    if args.kv_cache_tokens:
        extra += ["--kv-cache-tokens", str(args.kv_cache_tokens)]
    if args.max_running:
        extra += ["--max-running", str(args.max_running)]
    return spawn_server(
        args.model_dir, *extra, workers=args.workers, http=args.target == "http", env={"OMP_NUM_THREADS": str(args.worker_threads)}, ready_timeout=180
    )


# -- driver ------------------------------------------------------------------------------------
class Bar:
    """tqdm when installed, else a line on stderr every few seconds."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.n, self.enabled, self.last, self.t0 = total, 0, enabled, 0.0, time.perf_counter()
        self.tqdm = None
        if enabled:
            try:
                from tqdm import tqdm

                self.tqdm = tqdm(total=total, desc="requests", unit="req", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, failed: int, inflight: int) -> None:
        self.n += 1
        if self.tqdm is not None:
            self.tqdm.set_postfix(inflight=inflight, failed=failed, refresh=False)
            self.tqdm.update(1)
        elif self.enabled and (time.perf_counter() - self.last > 3 or self.n == self.total):
            self.last = time.perf_counter()
            log(f"  {self.n}/{self.total} requests done ({failed} failed), {inflight} in flight, {self.last - self.t0:.1f} s")

    def close(self) -> None:
        if self.tqdm is not None:
            self.tqdm.close()


async def drive(args, target, items: list[Item]) -> dict:
    results = [Result(ok=False) for _ in items]
    state = {"inflight": 0, "max_inflight": 0, "failed": 0}
    samples: list[tuple[float, int, dict | None]] = []  # (t, client inflight, server depth)
    bar = Bar(len(items), not args.no_progress)
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        it, r = items[i], results[i]
        state["inflight"] += 1
        state["max_inflight"] = max(state["max_inflight"], state["inflight"])
        r.start = time.perf_counter()
        try:
            await target.request(it, r)
            r.ok = bool(r.chunk_times) and r.completion_tokens > 0
            if not r.ok:
                r.error = "no tokens streamed"
        except Exception as exc:  # a failed request is counted, not fatal
            r.ok, r.error = False, f"{type(exc).__name__}: {exc}"[:300]
        end = time.perf_counter()
        if r.chunk_times:
            r.ttft = r.chunk_times[0] - r.start
        r.e2e = end - r.start
        state["inflight"] -= 1
        state["failed"] += not r.ok
        bar.update(state["failed"], state["inflight"])

    async def poll() -> None:
        while True:
            depth = None
            try:
                depth = await target.queue_depth()
            except Exception:
                pass
            samples.append((time.perf_counter() - t0, state["inflight"], depth))
            await asyncio.sleep(0.25)

    poller = asyncio.ensure_future(poll())
    try:
        if args.agents:
            nxt = iter(range(len(items)))

            async def agent() -> None:
                for i in nxt:
                    await one(i)

            await asyncio.gather(*(agent() for _ in range(args.agents)))
        else:
            tasks = []
            for i, it in enumerate(items):
                delay = t0 + it.at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(one(i)))
            await asyncio.gather(*tasks)
    finally:
        poller.cancel()
        bar.close()
    wall = time.perf_counter() - t0
    return summarize(args, items, results, samples, state, wall, t0)


def _dist(values: list[float]) -> dict:
    v = [x for x in values if x == x]
    return {"mean": sum(v) / len(v) if v else float("nan"), "p50": percentile(v, 50), "p99": percentile(v, 99), "n": len(v)}


def summarize(args, items, results, samples, state, wall, t0) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    e2e = [r.e2e for r in ok]
    tpot = [(r.e2e - r.ttft) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    prompt = sum(r.prompt_tokens for r in ok)
    out = sum(r.completion_tokens for r in ok)
    reported = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens for r in reported)
    hit = cached / sum(r.prompt_tokens for r in reported) if reported and sum(r.prompt_tokens for r in reported) else None
    depths = [d for _, _, d in samples if d is not None]
    queue = {
        "source": "router stats (router queue + engine waiting), polled every 0.25 s" if depths else "client: requests in flight",
        "max_inflight_client": state["max_inflight"],
    }
    if depths:
        queue.update(
            max_queue_depth=max(d["queue_depth"] for d in depths),
            max_router_queue=max(d["router_queue"] for d in depths),
            max_engine_waiting=max(d["engine_waiting"] for d in depths),
        )
    else:
        queue["max_queue_depth"] = state["max_inflight"]
    timeline = build_timeline(ok, samples, t0, wall)
    if args.timeline:
        with open(args.timeline, "w") as f:
            for row in timeline:
                f.write(json.dumps(row) + "\n")
    errors = sorted({r.error for r in results if not r.ok})[:5]
    return {
        "command": "serve",
        "target": args.target,
        "endpoint": args.base_url if args.target == "http" else args.address,
        "load": (
            {"kind": "closed", "agents": args.agents}
            if args.agents
            else {"kind": "trace", "trace": args.trace, "time_scale": args.time_scale}
            if args.trace
            else {"kind": "poisson", "rate_per_s": args.rate}
        ),
        "workload": (
            {"kind": "mooncake", "block_tokens": args.block_tokens}
            if args.trace
            else {
                "kind": "gsp",
                "groups": args.groups,
                "per_group": args.per_group,
                "prefix_tokens": args.prefix_tokens,
                "question_tokens": args.question_tokens,
                "output_tokens": args.output_tokens,
            }
        ),
        "requests": len(items),
        "succeeded": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "duration_s": wall,
        "request_throughput_per_s": len(ok) / wall,
        "output_token_throughput_per_s": out / wall,
        "total_token_throughput_per_s": (prompt + out) / wall,
        "prompt_tokens": prompt,
        "completion_tokens": out,
        "cached_tokens": cached if reported else None,
        "hit_rate": hit,
        "ttft_s": _dist(ttft),
        "tpot_s": _dist(tpot),
        "itl_s": _dist(itl),
        "e2e_s": _dist(e2e),
        "queue": queue,
        "timeline": args.timeline,
        "machine": machine_summary(),
    }


def build_timeline(ok: list[Result], samples, t0: float, wall: float) -> list[dict]:
    secs = max(1, int(math.ceil(wall)))
    rows = [
        {"t_s": s, "first_tokens": 0, "ttft_mean_s": None, "ttft_max_s": None, "queue_depth_max": None, "inflight_max": 0, "completed": 0} for s in range(secs)
    ]
    secs -= 1  # the last row's index
    ttfts: dict[int, list[float]] = {}
    for r in ok:
        s = min(secs, int(r.chunk_times[0] - t0))
        ttfts.setdefault(s, []).append(r.ttft)
        rows[min(secs, int(r.start + r.e2e - t0))]["completed"] += 1
    for s, v in ttfts.items():
        rows[s].update(first_tokens=len(v), ttft_mean_s=sum(v) / len(v), ttft_max_s=max(v))
    for t, inflight, depth in samples:
        row = rows[min(secs, int(t))]
        row["inflight_max"] = max(row["inflight_max"], inflight)
        if depth is not None:
            row["queue_depth_max"] = max(row["queue_depth_max"] or 0, depth["queue_depth"])
    for row in rows:  # HTTP: the queue is what the client has in flight
        if row["queue_depth_max"] is None:
            row["queue_depth_max"] = row["inflight_max"]
    return rows


def render(r: dict) -> str:
    ld = r["load"]
    load = (
        f"closed loop, {ld['agents']} agents"
        if ld["kind"] == "closed"
        else f"trace {ld['trace']} x{ld['time_scale']}"
        if ld["kind"] == "trace"
        else f"Poisson {ld['rate_per_s']} req/s"
    )
    wl = r["workload"]
    work = (
        f"GSP {wl['groups']} groups x {wl['per_group']}, prefix {wl['prefix_tokens']} + question {wl['question_tokens']} tokens, {wl['output_tokens']} out"
        if wl["kind"] == "gsp"
        else f"Mooncake trace, {wl['block_tokens']} tokens per block"
    )
    m = r["machine"]
    lines = [
        f"serve benchmark: {r['target']} {r['endpoint']}; {load}; {work}",
        f"client machine: {m['cpu_count']} CPUs, load average {fmt(m.get('load_average_at_start'), 2)} at start / "
        f"{fmt(m.get('load_average_at_end'), 2)} at end; git {m.get('git') or '-'}",
        "",
    ]
    hit = r["hit_rate"]
    q = r["queue"]
    rows = [
        ("successful requests", f"{r['succeeded']:,}"),
        ("failed requests", f"{r['failed']:,}"),
        ("duration (s)", fmt(r["duration_s"], 2)),
        ("request throughput (req/s)", fmt(r["request_throughput_per_s"], 2)),
        ("output token throughput (tok/s)", fmt(r["output_token_throughput_per_s"], 1)),
        ("total token throughput (tok/s)", fmt(r["total_token_throughput_per_s"], 1)),
        ("prefix hit rate (%)", fmt(100 * hit, 1) if hit is not None else "- (not reported)"),
        ("max queue depth", f"{q['max_queue_depth']:,} ({q['source']})"),
        ("max in flight (client)", f"{q['max_inflight_client']:,}"),
    ]
    out = "\n".join(lines) + "\n" + table(["", "value"], rows, "ll")
    dist = [
        (
            name,
            r[key]["mean"] * 1e3,
            r[key]["p50"] * 1e3 if r[key]["p50"] == r[key]["p50"] else None,
            r[key]["p99"] * 1e3 if r[key]["p99"] == r[key]["p99"] else None,
        )
        for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E", "e2e_s"))
    ]
    dist = [(n, a if a == a else None, b, c) for n, a, b, c in dist]
    out += "\n\n" + table(["latency", "mean (ms)", "p50 (ms)", "p99 (ms)"], dist)
    if r["errors"]:
        out += "\n\nerrors: " + "; ".join(r["errors"])
    if r["timeline"]:
        out += f"\n\ntimeline: {r['timeline']}"
    return out


def run(args) -> int:
    from bench.common import emit

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    server = None
    args.model_dir = args.model
    if args.start:
        if not args.model_dir:
            from bench.models import bench_model_path

            args.model_dir = str(bench_model_path())
    from bench.common import mark_start

    mark_start()
    vocab = _vocab(args)
    items = trace_items(args, vocab) if args.trace else gsp_items(args, vocab)
    if not items:
        log("no requests to send")
        return 2
    try:
        if args.start:
            log(f"starting radixserve serve on {args.model_dir} ({args.workers} workers) ...")
            server = start_server(args)  # returns once its workers are up
            args.address = server.address
            if server.http_url:
                args.base_url = server.http_url.rstrip("/")
                if not args.base_url.endswith("/v1"):
                    args.base_url += "/v1"
            log(f"server at {args.address}" + (f", HTTP {args.base_url}" if server.http_url else ""))
        result = asyncio.run(_main(args, items))
    finally:
        if server is not None:
            server.stop(30)
    emit(args, result, render)
    return 0 if result["succeeded"] else 1


async def _main(args, items) -> dict:
    target = HttpTarget(args) if args.target == "http" else SdkTarget(args)
    try:
        await target.ready(args.workers if args.start else None)
        return await drive(args, target, items)
    finally:
        await target.close()

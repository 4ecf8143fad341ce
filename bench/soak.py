"""Soak a live server and watch its memory: ``python -m bench soak --minutes 10``.

Starts ``radixserve serve`` (loopback only, the bench model or ``--model``, 2 workers, the HTTP
gateway on) and drives it for ``--minutes`` with a bounded closed loop of ``--agents`` SDK clients
mixing what a real fleet sends: shared-prefix generates (cache hits), streams, streams left early
(aborts), calls that time out, bad requests (answered ``bad_request``), health and stats polls,
and a few HTTP completions. Every ``--sample-s`` seconds it records the resident set size (RSS,
from /proc) of the router process and of every worker. It prints RSS at the end of the warm-up
(``--warmup-minutes``) and at the end, and the least-squares slope after warm-up in MiB/min; a
slope above ``--max-slope`` MiB/min or any failed request makes it exit 1.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
import urllib.request

from bench.common import fmt, load_average, log, machine_summary, table
from radixserve.ops.stats import linear_fit
from radixserve.testing import ServerProcess, spawn_server

HELP = "soak a live server for N minutes; router and worker RSS sampled (flat after warm-up?)"


def add_arguments(p) -> None:
    p.add_argument("--minutes", type=float, default=10.0, help="how long to drive the server")
    p.add_argument("--warmup-minutes", type=float, default=2.0, help="RSS slope is fitted after this")
    p.add_argument("--agents", type=int, default=4, help="concurrent SDK clients (closed loop)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--model", default=None, help="model directory (default: the bench model)")
    p.add_argument("--kv-cache-tokens", type=int, default=16384, help="KV pool per worker (small: evictions happen)")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--max-slope", type=float, default=2.0, help="MiB/min after warm-up that counts as growth")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, metavar="FILE.jsonl", help="write every RSS sample as a JSON line")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def start(args, model: str) -> ServerProcess:
    """The soaked server: loopback, HTTP gateway on, no worker restarts; up once its workers are."""
    return spawn_server(
        model,
        "--host",
        "127.0.0.1",
        "--worker-threads",
        "1",
        "--kv-cache-tokens",
        str(args.kv_cache_tokens),
        "--no-restart",
        workers=args.workers,
        http=True,
        env={"OMP_NUM_THREADS": "1"},
        ready_timeout=300,
    )


def _fetch(req: urllib.request.Request) -> bytes:
    with urllib.request.urlopen(req, timeout=120) as resp:
        return resp.read()


async def agent(i: int, address: str, http: str | None, deadline: float, counts: dict, vocab: int, seed: int):
    from radixserve.client import AsyncClient
    from radixserve.errors import BadRequestError, RequestTimeoutError

    rng = random.Random(seed * 1000 + i)
    prefixes = [[rng.randrange(2, vocab) for _ in range(256)] for _ in range(4)]
    async with AsyncClient(address, timeout=120) as c:
        while time.monotonic() < deadline:
            kind = rng.choices(["gen", "stream", "leave", "timeout", "bad", "poll", "http"], [40, 20, 10, 5, 10, 10, 5])[0]
            prompt = rng.choice(prefixes) + [rng.randrange(2, vocab) for _ in range(rng.randint(8, 64))]
            ns = f"tenant-{rng.randrange(3)}"
            try:
                if kind == "gen":
                    await c.generate(
                        prompt, max_tokens=rng.randint(4, 24), temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(1000), namespace=ns, ignore_eos=True
                    )
                elif kind in ("stream", "leave"):
                    n = 0
                    async for _ in c.stream(prompt, max_tokens=24, namespace=ns, ignore_eos=True):
                        n += 1
                        if kind == "leave" and n >= 2:
                            break  # leaving early aborts on the server
                elif kind == "timeout":
                    try:
                        await c.generate(prompt, max_tokens=400, ignore_eos=True, timeout=0.05, namespace=ns)
                    except RequestTimeoutError:
                        pass
                elif kind == "bad":
                    try:
                        await c.generate(prompt, max_tokens=4, repetition_penalty=1e-300)
                        counts["unexpected"] += 1
                    except BadRequestError:
                        pass
                elif kind == "poll":
                    await c.health()
                    await c.stats()
                elif kind == "http" and http:
                    body = json.dumps({"prompt": prompt[:64], "max_tokens": 4}).encode()
                    req = urllib.request.Request(http + "/completions", body, {"Content-Type": "application/json"})
                    await asyncio.to_thread(_fetch, req)
                counts[kind] = counts.get(kind, 0) + 1
            except Exception as exc:  # noqa: BLE001 - counted and reported
                counts["failed"] += 1
                counts.setdefault("errors", []).append(f"{kind}: {type(exc).__name__}: {exc}"[:200])


def run(args) -> int:
    from bench.models import bench_model_path
    from radixserve.client import Client

    load_at_start = load_average()
    model = args.model or str(bench_model_path())
    vocab = json.load(open(os.path.join(model, "config.json"))).get("vocab_size", 512)
    t_start = time.monotonic()
    server = start(args, model)
    address, http = server.address, server.http_url
    log(f"soak: server up in {time.monotonic() - t_start:.0f} s at {address} (HTTP {http}); {args.minutes:g} min with {args.agents} agents")
    with Client(address, timeout=30) as c:
        pids = {"router": server.pid, **{name: w["pid"] for name, w in c.stats()["workers"].items()}}
    counts: dict = {"failed": 0, "unexpected": 0}
    samples: list[dict] = []
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    stop_sampling = threading.Event()

    def sampler():
        out = open(args.out, "w") if args.out else None
        while True:
            row = {"t_min": (time.monotonic() - t0) / 60, **{k: rss_mib(p) for k, p in pids.items()}}
            samples.append(row)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()
            done = sum(v for k, v in counts.items() if isinstance(v, int))
            log(f"soak: {row['t_min']:.1f} min, {done} calls, RSS " + ", ".join(f"{k} {fmt(v)} MiB" for k, v in row.items() if k != "t_min"))
            if stop_sampling.wait(args.sample_s):
                break
        if out:
            out.close()

    th = threading.Thread(target=sampler, daemon=True)
    th.start()

    async def drive():
        await asyncio.gather(*(agent(i, address, http, deadline, counts, vocab, args.seed) for i in range(args.agents)))

    try:
        asyncio.run(drive())
        with Client(address, timeout=30) as c:
            final_stats = c.stats()
    finally:
        stop_sampling.set()
        th.join(10)
        server.stop(60)
    after = [s for s in samples if s["t_min"] >= args.warmup_minutes]
    rows, result = (
        [],
        {
            "machine": {**machine_summary(), "load_average_at_start": load_at_start},
            "minutes": args.minutes,
            "agents": args.agents,
            "calls": {k: v for k, v in counts.items() if k != "errors"},
            "errors": counts.get("errors", [])[:10],
            "processes": {},
        },
    )
    worst = 0.0
    for name in pids:
        warm = next((s[name] for s in after if s[name] is not None), None)
        end = next((s[name] for s in reversed(samples) if s[name] is not None), None)
        first = next((s[name] for s in samples if s[name] is not None), None)
        points = [(s["t_min"], s[name]) for s in after if s[name] is not None]
        k = linear_fit([x for x, _ in points], [y for _, y in points]).slope  # MiB/min
        worst = max(worst, k)
        result["processes"][name] = {"rss_start_mib": first, "rss_warm_mib": warm, "rss_end_mib": end, "slope_mib_per_min": k}
        rows.append([name, first, warm, end, (end - warm) if warm is not None and end is not None else None, round(k, 3)])
    counters = final_stats["router"]["counters"]
    result["router_counters"] = {k: counters[k] for k in ("requests", "completed", "aborted", "bad_frames", "worker_deaths", "errors_bad_request")}
    ok = counts["failed"] == 0 and counts["unexpected"] == 0 and worst <= args.max_slope
    result["ok"] = ok
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        m = result["machine"]
        print(
            f"soak: {args.minutes:g} min, {args.agents} agents, {args.workers} workers; git {m['git']}; "
            f"load average {m['load_average_at_start']} at start / {m['load_average_at_end']} at end"
        )
        print("calls: " + ", ".join(f"{k} {v}" for k, v in result["calls"].items()))
        print("router counters: " + ", ".join(f"{k} {v}" for k, v in result["router_counters"].items()))
        print(
            table(
                [
                    "process",
                    "RSS start (MiB)",
                    f"RSS at {args.warmup_minutes:g} min (MiB)",
                    "RSS end (MiB)",
                    "growth after warm-up (MiB)",
                    "slope after warm-up (MiB/min)",
                ],
                rows,
            )
        )
        for e in result["errors"]:
            print("error:", e)
        print("verdict:", "flat" if ok else "FAILED (growth or failed calls)")
    return 0 if ok else 1

"""Reliability under failure and abuse (issue 49): ``python -m bench reliability``.

Each scenario starts its own ``radixserve serve`` (loopback, the bench model or ``--model``, one
torch thread per worker), drives it with the SDK and raw HTTP, and checks one criterion:

- ``kill``: 2 workers (restarted with backoff), ``--kill-agents`` SDK clients in a closed loop of
  short generates and streams; ``--kills`` SIGKILLs of a worker, alternately w0 and w1, each once
  the previous victim is back. Every call ends as ok (all its tokens; a stream's chunks equal its
  final tokens), coded ``worker_lost``, another coded error, *hung* (no end within
  ``--call-timeout``) or *lost* (an uncoded error or wrong tokens). Then the router itself is
  SIGKILLed under ``--router-calls`` pending calls (``timeout=None``): each must raise
  RouterLostError (code ``router_lost``), by the SDK's heartbeat. Criterion: 0 hung, 0 lost,
  every pending call ``router_lost``.
- ``overload``: 1 worker, ``--max-inflight`` in flight and ``--max-queue`` queued (the capacity);
  ``--overload-rounds`` bursts of ``--overload-factor`` x the capacity of long generates, over
  ZMQ as bare frames on one socket (the router's time), over ZMQ as SDK calls on one client (the
  router's and the SDK's), and over HTTP (one connection each, ``POST /v1/completions``, a bare
  asyncio client). Criterion: the refusals (``overloaded`` / HTTP 503) answered with p99 <
  ``--refusal-p99-ms``, per transport; each refusal timed from its own send.
- ``idle-sockets``: 1 worker, serve under ``prlimit --nofile`` ``--nofile`` (by a resource limit set
  in the child, as prlimit does); ``--idle-sockets`` DEALER sockets connect to the client port and
  stay idle; then w0 is SIGKILLed. Criterion: the restart starts within its backoff (the
  supervisor's first delay, plus two of the router's 0.5 s ticks), w0 serves again, and new
  clients are served once the idle sockets close (while they are open, more than ``max_clients``
  connections are refused by design). A second kill without the sockets is the control.
- ``hostile``: 2 workers, HTTP on; ``--tenants`` other tenants (an SDK connection and namespace
  each, a closed loop of short generates) for ``--phase-s`` seconds alone (baseline), then as long
  with one tenant sending volleys of 10 hostile messages (2 MB choose messages, 128 choices x 2 KiB,
  64 KB nested JSON schemas, 4096-choice grammars; some over HTTP as ``guided_json`` /
  ``guided_choice``; each one new, so no cache answers it), the next volley when the last is
  answered, from a process of its own; then alone again (drift check). Before the baseline each
  worker compiles one small grammar (its compile process is started, as on a server in use).
  Criterion: the others' p99 latency under attack within ``--hostile-ratio`` x their baseline p99.

Progress on stderr, numbers on stdout (``--json``: one object); exit status 1 when a criterion
fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import resource
import signal
import string
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from bench.common import emit, fmt, git_revision, load_average, log, machine_summary, table
from radixserve.ops.stats import percentile

HELP = "SIGKILLs under load, overload refusals, idle client sockets, hostile tenants: PASS/FAIL per criterion"

SCENARIOS = ("kill", "overload", "idle-sockets", "hostile")


def add_arguments(p) -> None:
    p.add_argument("--scenario", default=",".join(SCENARIOS), help=f"comma-separated scenarios to run, of {', '.join(SCENARIOS)}")
    p.add_argument("--model", default=None, metavar="PATH", help="model directory (default: the bench model)")
    p.add_argument("--kv-cache-tokens", type=int, default=16384, help="KV pool per worker")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    k = p.add_argument_group("kill")
    k.add_argument("--kills", type=int, default=10, help="worker SIGKILLs under load")
    k.add_argument("--kill-agents", type=int, default=8, help="SDK clients in a closed loop during the kills")
    k.add_argument("--kill-gap-s", type=float, default=4.0, help="seconds of load after a victim is back, before the next kill")
    k.add_argument("--call-timeout", type=float, default=120.0, help="seconds after which a call counts as hung")
    k.add_argument("--router-calls", type=int, default=16, help="calls pending when the router is SIGKILLed (half streams)")
    k.add_argument("--router-timeout", type=float, default=10.0, help="the SDK's router_timeout for those calls: silence after which it raises RouterLostError")
    o = p.add_argument_group("overload")
    o.add_argument("--max-inflight", type=int, default=10, help="serve --max-inflight (one worker)")
    o.add_argument("--max-queue", type=int, default=20, help="serve --max-queue")
    o.add_argument("--overload-factor", type=float, default=10.0, help="burst size as a multiple of inflight + queue")
    o.add_argument("--overload-rounds", type=int, default=3, help="bursts per transport")
    o.add_argument("--refusal-p99-ms", type=float, default=100.0, help="criterion: refusals' p99 below this")
    i = p.add_argument_group("idle-sockets")
    i.add_argument("--idle-sockets", type=int, default=1100, help="idle DEALER sockets connected to the client port")
    i.add_argument("--nofile", type=int, default=1024, help="serve's open-file limit (soft and hard)")
    h = p.add_argument_group("hostile")
    h.add_argument("--tenants", type=int, default=4, help="other tenants (closed loop each)")
    h.add_argument("--phase-s", type=float, default=40.0, help="seconds of each phase: baseline, attack, after")
    h.add_argument("--hostile-ratio", type=float, default=2.0, help="criterion: others' p99 under attack / baseline p99")


# -- shared helpers ----------------------------------------------------------------------------
def dist(seconds: list[float]) -> dict:
    """n, p50, p99 and max of durations given in seconds, in ms."""
    return {
        "n": len(seconds),
        "p50_ms": percentile(seconds, 50) * 1e3,
        "p99_ms": percentile(seconds, 99) * 1e3,
        "max_ms": max(seconds) * 1e3 if seconds else float("nan"),
    }


def dist_text(d: dict) -> str:
    return f"p50 {fmt(d['p50_ms'])} ms, p99 {fmt(d['p99_ms'])} ms, max {fmt(d['max_ms'])} ms (n {d['n']})"


def criterion(name: str, passed: bool, measured: str, limit: str) -> dict:
    return {"criterion": name, "pass": bool(passed), "measured": measured, "limit": limit}


def start_server(args, model: str, *extra: str, workers: int, http: bool = False, restart: bool = True, preexec_fn: Callable[[], None] | None = None):
    from radixserve.testing import spawn_server

    return spawn_server(
        model,
        "--host",
        "127.0.0.1",
        "--worker-threads",
        "1",
        "--kv-cache-tokens",
        str(args.kv_cache_tokens),
        *([] if restart else ["--no-restart"]),
        *extra,
        workers=workers,
        http=http,
        env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
        ready_timeout=300,
        preexec_fn=preexec_fn,
    )


def worker_pids(stats: dict) -> dict[str, int]:
    return {name: w["pid"] for name, w in stats["workers"].items()}


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def child_worker_pid(parent: int, name: str) -> int | None:
    """The pid of the live process started by ``parent`` that runs local worker ``name``."""
    tag = f'"worker_id":"{name}"'.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(") ", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if tag in f.read() and alive(int(entry)):
                    return int(entry)
        except (OSError, IndexError, ValueError):
            continue
    return None


async def wait_back(ctl, name: str, old_pid: int, timeout: float) -> float | None:
    """Seconds until the router lists worker ``name`` alive with another pid than ``old_pid``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            w = (await ctl.stats(timeout=5.0))["workers"].get(name, {})
            if w.get("alive") and w.get("pid") not in (None, old_pid):
                return time.monotonic() - t0
        except Exception:  # noqa: BLE001 - a slow stats reply: ask again
            pass
        await asyncio.sleep(0.05)
    return None


def cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by ``root`` (serve: the router and the HTTP gateway),
    its workers, and the workers' grammar compile processes (live ones, plus those the workers reaped)."""
    tick = os.sysconf("SC_CLK_TCK")
    procs: dict[int, tuple[int, list[int]]] = {}  # pid -> (ppid, [utime, stime, cutime, cstime])
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(") ", 1)[1].split()
                procs[int(entry)] = (int(fields[1]), [int(x) for x in fields[11:15]])
            except (OSError, IndexError, ValueError):
                continue
    out = {"router": 0.0, "workers": 0.0, "grammar": 0.0}
    if root in procs:
        out["router"] = sum(procs[root][1][:2]) / tick
    for ppid, t in procs.values():
        if ppid == root:
            out["workers"] += (t[0] + t[1]) / tick
            out["grammar"] += (t[2] + t[3]) / tick  # its reaped children: killed compile processes
        elif procs.get(ppid, (0,))[0] == root:
            out["grammar"] += (t[0] + t[1]) / tick
    return out


def random_prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(7, vocab) for _ in range(n)]  # ids below 7: the special tokens


async def http_request(port: int, method: str, path: str, body: dict | None = None, timeout: float = 120.0) -> tuple[int, dict]:
    """One HTTP/1.1 request on a connection of its own (``Connection: close``); (status, JSON body).
    Raw asyncio streams: 300 of them at once cost the client little."""
    data = json.dumps(body).encode() if body is not None else b""
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    ).encode()

    async def go() -> tuple[int, dict]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(head + data)
            await writer.drain()
            raw = await reader.read()  # to EOF: the server closes after its response
        finally:
            writer.close()
        header, _, payload = raw.partition(b"\r\n\r\n")
        status = int(header.split(b" ", 2)[1])
        if b"transfer-encoding: chunked" in header.lower():
            payload = _dechunk(payload)
        try:
            return status, json.loads(payload or b"{}")
        except ValueError:
            return status, {"raw": payload[:200].decode(errors="replace")}

    return await asyncio.wait_for(go(), timeout)


def _dechunk(payload: bytes) -> bytes:
    out, rest = b"", payload
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out, rest = out + rest[:size], rest[size + 2 :]
    return out


def vocab_size(model: str) -> int:
    with open(os.path.join(model, "config.json")) as f:
        return int(json.load(f).get("vocab_size", 512))


# -- kill --------------------------------------------------------------------------------------
async def _load_agent(i: int, address: str, vocab: int, stop: asyncio.Event, tally: Counter, problems: list, call_timeout: float) -> None:
    """Closed loop of short greedy generates and streams; each call's end goes into ``tally``."""
    from radixserve.client import AsyncClient, Completion
    from radixserve.errors import RadixServeError, RequestTimeoutError, WorkerLostError

    rng = random.Random(1000 + i)
    async with AsyncClient(address, timeout=call_timeout) as c:
        while not stop.is_set():
            prompt = random_prompt(rng, vocab, rng.randint(16, 64))
            n, stream = rng.randint(8, 32), rng.random() < 0.5
            streamed: list[int] = []
            try:
                if stream:
                    final = None
                    async for item in c.stream(prompt, max_tokens=n, temperature=0.0, ignore_eos=True):
                        if isinstance(item, Completion):
                            final = item
                        else:
                            streamed += item.token_ids
                    good = final is not None and len(final.token_ids) == n and streamed == final.token_ids
                else:
                    out = await c.generate(prompt, max_tokens=n, temperature=0.0, ignore_eos=True)
                    good = len(out.token_ids) == n
                if good:
                    tally["ok"] += 1
                else:
                    tally["lost"] += 1
                    problems.append(f"agent {i}: a {'stream' if stream else 'call'} ended with wrong tokens")
            except WorkerLostError:
                tally["worker_lost (stream with tokens)" if stream and streamed else "worker_lost (other)"] += 1
            except RequestTimeoutError:
                tally["hung"] += 1
                problems.append(f"agent {i}: no end within {call_timeout:g} s")
            except RadixServeError as exc:
                tally[f"coded {exc.code}"] += 1
                problems.append(f"agent {i}: {exc.code}: {exc}"[:200])
            except Exception as exc:  # noqa: BLE001 - an uncoded failure is what this counts
                tally["lost"] += 1
                problems.append(f"agent {i}: {type(exc).__name__}: {exc}"[:200])


async def _kill_workers(args, server, vocab: int) -> dict:
    from radixserve.client import AsyncClient

    stop, tally, problems = asyncio.Event(), Counter[str](), list[str]()
    agents = [asyncio.ensure_future(_load_agent(i, server.address, vocab, stop, tally, problems, args.call_timeout)) for i in range(args.kill_agents)]
    kills: list[dict] = []
    t_load = time.monotonic()
    async with AsyncClient(server.address, timeout=30) as ctl:
        await asyncio.sleep(args.kill_gap_s)
        for k in range(args.kills):
            name = f"w{k % 2}"
            stats = await ctl.stats()
            pid = worker_pids(stats)[name]
            before = sum(tally.values())
            os.kill(pid, signal.SIGKILL)
            back = await wait_back(ctl, name, pid, timeout=120.0)
            kills.append({"worker": name, "pid": pid, "back_s": back, "calls_before": before})
            log(
                f"kill: {k + 1}/{args.kills}: SIGKILL {name} (pid {pid}); back in "
                f"{fmt(back, 2) if back is not None else 'NEVER'} s; calls so far: {dict(tally)}"
            )
            if back is None:
                break
            await asyncio.sleep(args.kill_gap_s)
        stop.set()
        t_stop = time.monotonic()
        done, pending = await asyncio.wait(agents, timeout=args.call_timeout + 30)
        for t in pending:  # an agent still waiting on a call: that call hung
            tally["hung"] += 1
            problems.append("an agent's call did not end after the load stopped")
            t.cancel()
        counters = (await ctl.stats())["router"]["counters"]
    return {
        "kills": kills,
        "calls": dict(tally),
        "problems": problems[:20],
        "load_s": t_stop - t_load,
        "router_counters": {k: counters.get(k) for k in ("requests", "completed", "retries", "worker_deaths")},
    }


async def _kill_router(args, server, vocab: int) -> dict:
    """SIGKILL serve under pending calls (timeout=None): each must end with RouterLostError."""
    from radixserve.client import AsyncClient, Completion
    from radixserve.errors import RadixServeError, RouterLostError

    rng = random.Random(7)
    first_token = asyncio.Event()
    async with AsyncClient(server.address, timeout=30) as ctl:
        pids = worker_pids(await ctl.stats())
    ends: list[tuple[str, float]] = []
    killed_at: list[float] = []

    async def one(c, i: int) -> None:
        prompt = random_prompt(rng, vocab, 16)
        try:
            if i % 2:
                async for item in c.stream(prompt, max_tokens=1000, temperature=0.0, ignore_eos=True):
                    if not isinstance(item, Completion):
                        first_token.set()
            else:
                await c.generate(prompt, max_tokens=1000, temperature=0.0, ignore_eos=True)
            ends.append(("finished before the kill", 0.0))
        except RouterLostError as exc:
            ends.append((f"coded {exc.code}", time.monotonic() - killed_at[0]))
        except RadixServeError as exc:
            ends.append((f"coded {exc.code}", time.monotonic() - (killed_at or [0.0])[0]))
        except Exception as exc:  # noqa: BLE001
            ends.append((f"uncoded {type(exc).__name__}", time.monotonic() - (killed_at or [0.0])[0]))

    clients = [AsyncClient(server.address, timeout=None, router_timeout=args.router_timeout) for _ in range(2)]
    router_timeout = args.router_timeout
    calls = [asyncio.ensure_future(one(clients[i % 2], i)) for i in range(args.router_calls)]
    await asyncio.wait_for(first_token.wait(), 60)
    await asyncio.sleep(0.5)
    killed_at.append(time.monotonic())
    os.kill(server.pid, signal.SIGKILL)
    log(f"kill: SIGKILL the router (serve, pid {server.pid}) under {args.router_calls} calls")
    _, pending = await asyncio.wait(calls, timeout=router_timeout + 30)
    for t in pending:
        t.cancel()
    for c in clients:
        await c.close()
    t0 = time.monotonic()
    while any(alive(p) for p in pids.values()) and time.monotonic() - t0 < 30:
        await asyncio.sleep(0.1)
    left = [p for p in pids.values() if alive(p)]
    workers_exit_s = time.monotonic() - killed_at[0] if not left else None
    return {
        "calls": args.router_calls,
        "hung": len(pending),
        "ends": dict(Counter(k for k, _ in ends)),
        "router_lost_after": dist([s for k, s in ends if k == "coded router_lost"]),
        "sdk_router_timeout_s": router_timeout,
        "workers_left": len(left),
        "workers_exit_s": workers_exit_s,
    }


def scenario_kill(args, model: str) -> dict:
    vocab = vocab_size(model)
    server = start_server(args, model, workers=2)
    log(f"kill: serve up at {server.address}, 2 workers; {args.kill_agents} agents, {args.kills} kills")
    try:
        workers = asyncio.run(_kill_workers(args, server, vocab))
        router = asyncio.run(_kill_router(args, server, vocab))
    finally:
        try:
            os.killpg(server.pid, signal.SIGKILL)  # the session: serve and whatever workers are left
        except OSError:
            pass
        server.proc.wait(30)
    calls = workers["calls"]
    hung, lost = calls.get("hung", 0), calls.get("lost", 0)
    back = [k["back_s"] for k in workers["kills"] if k["back_s"] is not None]
    workers["back_s"] = {"median": percentile(back, 50), "max": max(back) if back else None}
    coded = router["ends"].get("coded router_lost", 0)
    return {
        "workers": workers,
        "router": router,
        "criteria": [
            criterion(
                f"{args.kills} worker SIGKILLs under load: 0 hung, 0 lost",
                hung == 0 and lost == 0 and len(back) == args.kills,
                f"{len(back)} kills, {calls.get('ok', 0):,} ok, "
                f"{sum(v for k, v in calls.items() if k.startswith('worker_lost')):,} worker_lost, "
                f"{hung} hung, {lost} lost",
                "0 hung, 0 lost",
            ),
            criterion(
                "router SIGKILL: every pending call raises RouterLostError",
                coded == args.router_calls and router["hung"] == 0,
                f"{coded}/{args.router_calls} router_lost, p99 {fmt(router['router_lost_after']['p99_ms'] / 1e3, 1)} s after the kill",
                f"all {args.router_calls}, none hung",
            ),
        ],
    }


# -- overload ----------------------------------------------------------------------------------
async def _zmq_burst(address: str, n: int, vocab: int, seed: int) -> dict:
    from radixserve.client import AsyncClient
    from radixserve.errors import OverloadedError, RadixServeError

    rng = random.Random(seed)
    prompts = [random_prompt(rng, vocab, 16) for _ in range(n)]
    refused: list[float] = []
    admitted: list[float] = []
    other: Counter[str] = Counter()
    async with AsyncClient(address, timeout=300) as c:
        await c.health()  # connected before the burst

        async def one(p):
            t0 = time.monotonic()
            try:
                await c.generate(p, max_tokens=256, temperature=0.0, ignore_eos=True)
                admitted.append(time.monotonic() - t0)
            except OverloadedError:
                refused.append(time.monotonic() - t0)
            except RadixServeError as exc:
                other[exc.code] += 1

        await asyncio.gather(*(one(p) for p in prompts))
    return {"sent": n, "refused": dist(refused), "admitted": len(admitted), "admitted_e2e": dist(admitted), "other": dict(other), "refused_s": refused}


def _raw_zmq_burst(address: str, n: int, vocab: int, seed: int) -> dict:
    """The burst as bare frames on one DEALER socket, no SDK: each refusal's time from its frame's
    send to its error frame's arrival (what the router takes; the SDK's own cost per call is not in it)."""
    import zmq

    from radixserve import protocol as P
    from radixserve.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    frames = [P.encode(P.Generate(id=f"raw-{i}", token_ids=random_prompt(rng, vocab, 16), params=params)) for i in range(n)]
    ctx = zmq.Context()
    refused: list[float] = []
    admitted, other = 0, Counter[str]()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sock.send(P.encode(P.Health(id="raw-health")))
        if not sock.poll(30_000):
            raise RuntimeError("no answer to a health probe within 30 s")
        sock.recv()
        sent: dict[str, float] = {}
        for i, frame in enumerate(frames):
            sent[f"raw-{i}"] = time.monotonic()
            sock.send(frame)
        while sent and sock.poll(300_000):
            msg = P.decode(sock.recv(), max_frame_bytes=P.WORKER_MAX_FRAME_BYTES)
            if isinstance(msg, P.Error) and msg.id in sent:
                t = sent.pop(msg.id)
                if msg.code == P.OVERLOADED:
                    refused.append(time.monotonic() - t)
                else:
                    other[msg.code] += 1
            elif isinstance(msg, P.Final) and msg.id in sent:
                sent.pop(msg.id)
                admitted += 1
        other["no answer"] += len(sent)
    finally:
        ctx.destroy(linger=0)
    return {
        "sent": n,
        "refused": dist(refused),
        "admitted": admitted,
        "admitted_e2e": dist([]),
        "other": {k: v for k, v in other.items() if v},
        "refused_s": refused,
    }


async def _http_burst(port: int, n: int, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)
    bodies = [{"prompt": random_prompt(rng, vocab, 16), "max_tokens": 256, "temperature": 0.0, "ignore_eos": True} for _ in range(n)]
    refused: list[float] = []
    admitted: list[float] = []
    other: Counter[str] = Counter()

    async def one(body):
        t0 = time.monotonic()
        try:
            status, data = await http_request(port, "POST", "/v1/completions", body, timeout=300)
        except Exception as exc:  # noqa: BLE001 - a connection that failed is counted, not raised
            other[type(exc).__name__] += 1
            return
        dt = time.monotonic() - t0
        if status == 503 and (data.get("error") or {}).get("code") == "overloaded":
            refused.append(dt)
        elif status == 200:
            admitted.append(dt)
        else:
            other[f"HTTP {status}"] += 1

    await asyncio.gather(*(one(b) for b in bodies))
    return {"sent": n, "refused": dist(refused), "admitted": len(admitted), "admitted_e2e": dist(admitted), "other": dict(other), "refused_s": refused}


def scenario_overload(args, model: str) -> dict:
    vocab = vocab_size(model)
    capacity = args.max_inflight + args.max_queue
    n = int(round(args.overload_factor * capacity))
    server = start_server(args, model, "--max-inflight", str(args.max_inflight), "--max-queue", str(args.max_queue), workers=1, http=True, restart=False)
    port = int(server.http_url.split(":")[2].split("/")[0])
    log(
        f"overload: serve up at {server.address} / {server.http_url}; capacity {capacity} "
        f"({args.max_inflight} in flight + {args.max_queue} queued), bursts of {n}"
    )
    rounds: dict[str, list[dict]] = {"zmq": [], "zmq-sdk": [], "http": []}
    try:
        for r in range(args.overload_rounds):
            for transport in rounds:
                if transport == "zmq":
                    res = _raw_zmq_burst(server.address, n, vocab, r)
                elif transport == "zmq-sdk":
                    res = asyncio.run(_zmq_burst(server.address, n, vocab, 50 + r))
                else:
                    res = asyncio.run(_http_burst(port, n, vocab, 100 + r))
                rounds[transport].append(res)
                log(
                    f"overload: round {r + 1} {transport}: {len(res['refused_s'])} refused, {dist_text(res['refused'])}; "
                    f"{res['admitted']} admitted; other {res['other']}"
                )
    finally:
        server.stop(60)
    out: dict[str, Any] = {"capacity": capacity, "burst": n, "rounds": args.overload_rounds, "transports": {}}
    crits = []
    for transport, runs in rounds.items():
        refused = [s for res in runs for s in res.pop("refused_s")]
        d = dist(refused)
        out["transports"][transport] = {"refused": d, "admitted": sum(res["admitted"] for res in runs), "sent": n * len(runs), "runs": runs}
        label = {"zmq": "ZMQ overloaded (frames)", "zmq-sdk": "ZMQ overloaded (SDK calls)", "http": "HTTP 503"}[transport]
        crits.append(
            criterion(
                f"{label} at {args.overload_factor:g}x capacity: refusals' p99 < {args.refusal_p99_ms:g} ms",
                d["p99_ms"] < args.refusal_p99_ms,
                dist_text(d),
                f"p99 < {args.refusal_p99_ms:g} ms",
            )
        )
    out["criteria"] = crits
    return out


# -- idle sockets ------------------------------------------------------------------------------
async def _kill_and_time(server, ctl, name: str, timeout: float = 120.0) -> dict:
    """SIGKILL local worker ``name``; seconds until its new process exists (spawn_s) and until the
    router lists it alive (back_s)."""
    pid = worker_pids(await ctl.stats())[name]
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    spawn = None
    while time.monotonic() - t0 < timeout:
        new = child_worker_pid(server.pid, name)
        if new is not None and new != pid:
            spawn = time.monotonic() - t0
            break
        await asyncio.sleep(0.01)
    back = await wait_back(ctl, name, pid, max(1.0, timeout - (time.monotonic() - t0)))
    return {"pid": pid, "spawn_s": spawn, "back_s": None if back is None else time.monotonic() - t0}


async def _serve_new_clients(address: str, n: int, timeout: float) -> tuple[int, list[str]]:
    from radixserve.client import AsyncClient

    async def one(i: int) -> str | None:
        try:
            async with AsyncClient(address, timeout=timeout) as c:
                out = await c.generate([7 + i, 8, 9], max_tokens=2, temperature=0.0)
                return None if len(out.token_ids) == 2 else "wrong tokens"
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"[:160]

    errors = await asyncio.gather(*(one(i) for i in range(n)))
    return sum(e is None for e in errors), [e for e in errors if e is not None]


async def _idle_sockets(args, server) -> dict:
    import zmq

    from radixserve.client import AsyncClient
    from radixserve.errors import RadixServeError
    from radixserve.serve.supervisor import BACKOFF_FIRST_S

    out: dict[str, Any] = {}
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, args.idle_sockets + 64)
    socks = []
    async with AsyncClient(server.address, timeout=30) as ctl:
        await ctl.health()  # connected before the flood
        try:
            for _ in range(args.idle_sockets):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(server.address)
                socks.append(s)
            await asyncio.sleep(3.0)  # the handshakes
            stats = await ctl.stats()
            out["with_sockets"] = {
                "clients": stats["router"]["gauges"]["clients"],
                "max_clients": stats["router"]["gauges"]["max_clients"],
                "refused_clients": stats["router"]["counters"].get("refused_clients"),
            }
            log(f"idle-sockets: {args.idle_sockets} sockets connected: {out['with_sockets']}; SIGKILL w0")
            out["kill"] = await _kill_and_time(server, ctl, "w0")
            log(f"idle-sockets: w0's restart started after {fmt(out['kill']['spawn_s'], 2)} s, serving after {fmt(out['kill']['back_s'], 2)} s")
            try:
                done = await ctl.generate([5, 6, 7], max_tokens=2, temperature=0.0)
                out["old_client_served"] = len(done.token_ids) == 2
            except RadixServeError as exc:
                out["old_client_served"] = False
                out["old_client_error"] = str(exc)
            # A client that connects now is past max_clients: refused at the handshake (by design).
            served, errors = await _serve_new_clients(server.address, 1, timeout=5.0)
            out["new_client_during"] = {"served": served, "errors": errors}
        finally:
            for s in socks:
                s.close()
            ctx.term()
        await asyncio.sleep(2.0)  # the disconnects
        served, errors = await _serve_new_clients(server.address, 8, timeout=30.0)
        out["new_clients_after"] = {"tried": 8, "served": served, "errors": errors[:3]}
        await asyncio.sleep(1.0)
        log("idle-sockets: control: SIGKILL w0 again without the sockets")
        out["control_kill"] = await _kill_and_time(server, ctl, "w0")
        out["backoff_s"] = BACKOFF_FIRST_S
    return out


def scenario_idle_sockets(args, model: str) -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.idle_sockets + 256
    if soft < need:  # this process holds the idle sockets
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard) if hard != resource.RLIM_INFINITY else need, hard))

    def limit_open_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, args.nofile))

    server = start_server(args, model, workers=1, preexec_fn=limit_open_files)
    log(f"idle-sockets: serve up at {server.address} under an open-file limit of {args.nofile}")
    try:
        res = asyncio.run(_idle_sockets(args, server))
    finally:
        server.stop(60)
    kill = res["kill"]
    bound = res["backoff_s"] + 1.0  # the first delay, plus two 0.5 s ticks (exit seen, restart due)
    # The control kill comes within a minute of the first: the supervisor doubles its delay.
    res["control_backoff_s"] = 2 * res["backoff_s"]
    after = res["new_clients_after"]
    started = kill["spawn_s"] is not None and kill["spawn_s"] <= bound
    res["criteria"] = [
        criterion(
            f"{args.idle_sockets} idle sockets (nofile {args.nofile}), SIGKILL w0: restart within its backoff, w0 serves, new clients served",
            started and kill["back_s"] is not None and res["old_client_served"] and after["served"] == after["tried"],
            f"restart started {fmt(kill['spawn_s'], 2)} s after the kill (backoff {res['backoff_s']:g} s), serving "
            f"after {fmt(kill['back_s'], 2)} s; {after['served']}/{after['tried']} new clients served",
            f"restart <= {bound:g} s, serving, all new clients served",
        )
    ]
    return res


# -- hostile -----------------------------------------------------------------------------------
def nested_schema(target_chars: int) -> dict:
    """A JSON schema nested 12 levels (anyOf of an object of two and an array, each level the one
    below), padded with a description to ``target_chars`` of JSON: seconds to compile."""
    s: dict = {"type": "string"}
    for _ in range(6):
        s = {"anyOf": [{"type": "object", "properties": {"a": s, "b": s}, "required": ["a", "b"]}, {"type": "array", "items": s}]}
    s["description"] = ""
    s["description"] = "x" * max(0, target_chars - len(json.dumps(s)))
    return s


def words(rng: random.Random, n: int, chars: int) -> list[str]:
    return ["".join(rng.choices(string.ascii_lowercase + " ", k=chars)) for _ in range(n)]


HOSTILE = (
    "choose 2 MB of choices",
    "choose 2 MB prompt",
    "choose 128 x 2 KiB",
    "choose 128 x 2 KiB",
    "json 64 KB nested (SDK)",
    "guided_json 64 KB nested (HTTP)",
    "guided_json 64 KB nested (HTTP)",
    "4096-choice grammar (SDK)",
    "guided_choice 4096 (HTTP)",
    "4096-choice grammar (SDK)",
)


class Payloads:
    """The hostile messages' bulk, built once before the attack (building 2 MB of random text takes
    the client ~0.5 s: inside the loop it would be the client's own stall); :meth:`fresh` makes each
    message new (a salt in its first item) at the cost of a copy, so no cache answers it."""

    def __init__(self, seed: int = 0):
        from radixserve.sampling_params import MAX_SCHEMA_CHARS

        rng = random.Random(seed)
        self.choices_2mb = words(rng, 1000, 2000)
        self.prompt_2mb = "".join(rng.choices(string.ascii_lowercase + " ", k=2_000_000))
        self.choices_128 = words(rng, 128, 2048)
        self.schema = nested_schema(MAX_SCHEMA_CHARS - 512)
        self.grammar_4096 = words(rng, 4096, 60)

    @staticmethod
    def fresh(items: list[str], salt: str) -> list[str]:
        return [salt + items[0][len(salt) :], *items[1:]]

    def schema_with(self, salt: str) -> dict:
        return {**self.schema, "description": salt + self.schema["description"][len(salt) :]}


async def _hostile_message(kind: str, salt: str, c, port: int, data: Payloads) -> str:
    """Send one hostile message of ``kind``; how it ended: ``ok``, an error code or ``HTTP <status> <code>``."""
    from radixserve.errors import RadixServeError
    from radixserve.sampling_params import StructuredOutput

    try:
        if kind == "choose 2 MB of choices":
            await c.choose("Which one?", data.fresh(data.choices_2mb, salt), namespace="evil")
        elif kind == "choose 2 MB prompt":
            await c.choose(salt + data.prompt_2mb, ["yes", "no"], namespace="evil")
        elif kind == "choose 128 x 2 KiB":
            await c.choose("Which one?", data.fresh(data.choices_128, salt), namespace="evil")
        elif kind == "json 64 KB nested (SDK)":
            await c.generate("{", max_tokens=8, namespace="evil", structured=StructuredOutput(json_schema=data.schema_with(salt)))
        elif kind == "4096-choice grammar (SDK)":
            await c.generate("Pick:", max_tokens=8, namespace="evil", structured=StructuredOutput(choice=data.fresh(data.grammar_4096, salt)))
        else:
            field = {"guided_json": data.schema_with(salt)} if kind.startswith("guided_json") else {"guided_choice": data.fresh(data.grammar_4096, salt)}
            status, body = await http_request(port, "POST", "/v1/completions", {"prompt": "Pick:", "max_tokens": 8, **field}, timeout=120)
            if status != 200:
                err = body.get("error") or {}
                return f"HTTP {status} {err.get('code') or err.get('type')}"
        return "ok"
    except RadixServeError as exc:
        return exc.code
    except Exception as exc:  # noqa: BLE001 - counted
        return type(exc).__name__


async def _volleys(c, port: int, data: Payloads, ends: dict) -> None:
    """Volleys of the 10 messages of :data:`HOSTILE` at once, the next when all are answered."""
    v = 0
    while True:
        v += 1

        async def one(j: int, kind: str, v: int, t0: float) -> None:
            try:
                end = await _hostile_message(kind, f"volley {v} message {j} ", c, port, data)
            except asyncio.CancelledError:
                ends.setdefault(kind, []).append(("in flight at the end", time.monotonic() - t0))
                raise
            ends.setdefault(kind, []).append((end, time.monotonic() - t0))

        t0 = time.monotonic()
        await asyncio.gather(*(one(j, kind, v, t0) for j, kind in enumerate(HOSTILE)))


def attacker(address: str, port: int, go, stop, results) -> None:
    """(In a process of its own, so that its client-side work does not slow the others' client.)
    Build the payloads, wait for ``go``, send volleys of the 10 messages of :data:`HOSTILE` until
    ``stop``; then put {kind: [(end, seconds)]} on ``results``."""
    from radixserve.client import AsyncClient

    data = Payloads()
    ends: dict[str, list] = {}

    async def main() -> None:
        async with AsyncClient(address, timeout=120) as c:
            await c.health()
            while not go.is_set():
                await asyncio.sleep(0.02)
            attack = asyncio.ensure_future(_volleys(c, port, data, ends))
            while not stop.is_set():
                await asyncio.sleep(0.05)
            attack.cancel()  # the SDK aborts its calls (a compile is stopped), HTTP connections close
            await asyncio.gather(attack, return_exceptions=True)

    asyncio.run(main())
    results.put(ends)


async def _tenant(i: int, address: str, vocab: int, stop: asyncio.Event, lat: list, errors: Counter) -> None:
    from radixserve.client import AsyncClient

    rng = random.Random(500 + i)
    async with AsyncClient(address, timeout=120) as c:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                await c.generate(random_prompt(rng, vocab, 32), max_tokens=16, temperature=0.0, ignore_eos=True, namespace=f"tenant-{i}")
                lat.append(time.monotonic() - t0)
            except Exception as exc:  # noqa: BLE001
                errors[type(exc).__name__] += 1


async def _phase(args, server, vocab: int, name: str, go=None) -> dict:
    stop, lat, errors = asyncio.Event(), list[float](), Counter[str]()
    cpu0, t0 = cpu_seconds(server.pid), time.monotonic()
    tenants = [asyncio.ensure_future(_tenant(i, server.address, vocab, stop, lat, errors)) for i in range(args.tenants)]
    if go is not None:
        go.set()
    await asyncio.sleep(args.phase_s)
    stop.set()
    await asyncio.gather(*tenants)
    cpu1, wall = cpu_seconds(server.pid), time.monotonic() - t0
    latency, cpu = dist(lat), {k: cpu1[k] - cpu0[k] for k in cpu0}
    log(
        f"hostile: {name}: others' latency {dist_text(latency)}; errors {dict(errors)}; CPU seconds in "
        f"{wall:.0f} s: " + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items())
    )
    return {"latency": latency, "errors": dict(errors), "wall_s": wall, "cpu_s": cpu}


def _warm_grammars(address: str, workers: int, rounds: int = 6) -> list[str]:
    """Rounds of small choice grammars (``workers`` at once, so they spread) until every worker has
    compiled one; the workers that did."""
    from radixserve.client import AsyncClient
    from radixserve.sampling_params import StructuredOutput

    async def main() -> list[str]:
        served: set[str] = set()
        async with AsyncClient(address, timeout=180) as c:
            for r in range(rounds):
                if len(served) >= workers:
                    break
                outs = await asyncio.gather(
                    *(
                        c.generate(f"{i * 7 + r} warm-up:", max_tokens=4, structured=StructuredOutput(choice=[f"yes {r} {i}", f"no {r} {i}"]))
                        for i in range(2 * workers)
                    )
                )
                served.update(str(o.worker) for o in outs)
        return sorted(served)

    return asyncio.run(main())


def _hostile(args, server, vocab: int) -> dict:
    import multiprocessing

    from radixserve.client import Client

    port = int(server.http_url.split(":")[2].split("/")[0])
    mp = multiprocessing.get_context("spawn")
    go, stop, results = mp.Event(), mp.Event(), mp.Queue()
    evil = mp.Process(target=attacker, args=(server.address, port, go, stop, results), daemon=True)
    evil.start()
    warm = _warm_grammars(server.address, workers=2)
    log(f"hostile: grammar compile processes started on {warm}")
    phases = {"baseline": asyncio.run(_phase(args, server, vocab, "baseline"))}
    phases["attack"] = asyncio.run(_phase(args, server, vocab, "attack", go))
    stop.set()
    ends = results.get(timeout=120)
    evil.join(30)
    time.sleep(2.0)
    phases["after"] = asyncio.run(_phase(args, server, vocab, "after"))
    with Client(server.address, timeout=30) as c:
        stats = c.stats()
    hostile = {kind: {"sent": len(v), "ends": dict(Counter(e for e, _ in v)), "latency": dist([s for _, s in v])} for kind, v in ends.items()}
    return {
        "phases": phases,
        "hostile": hostile,
        "worker_deaths": stats["router"]["counters"].get("worker_deaths"),
        "workers_alive": sum(1 for w in stats["workers"].values() if w["alive"]),
    }


def scenario_hostile(args, model: str) -> dict:
    vocab = vocab_size(model)
    server = start_server(args, model, workers=2, http=True)
    log(f"hostile: serve up at {server.address} / {server.http_url}; {args.tenants} tenants, 3 phases of {args.phase_s:g} s")
    try:
        res = _hostile(args, server, vocab)
    finally:
        server.stop(60)
    base, attack = res["phases"]["baseline"]["latency"], res["phases"]["attack"]["latency"]
    ratio = attack["p99_ms"] / base["p99_ms"] if base["p99_ms"] else float("nan")
    res["p99_ratio"] = ratio
    res["criteria"] = [
        criterion(
            f"volleys of 10 hostile messages from one tenant: others' p99 within {args.hostile_ratio:g}x baseline",
            ratio <= args.hostile_ratio,
            f"p99 {fmt(attack['p99_ms'])} ms under attack vs {fmt(base['p99_ms'])} ms baseline = {fmt(ratio, 2)}x",
            f"<= {args.hostile_ratio:g}x",
        )
    ]
    return res


# -- the command -------------------------------------------------------------------------------
RUNNERS: dict[str, Callable[[Any, str], dict]] = {
    "kill": scenario_kill,
    "overload": scenario_overload,
    "idle-sockets": scenario_idle_sockets,
    "hostile": scenario_hostile,
}


def render(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"reliability: git {m['git']}; {m['cpu_count']} CPUs; load average {m['load_average_at_start']} at start / "
        f"{m['load_average_at_end']} at end; scenarios {', '.join(result['scenarios'])}"
    ]
    s = result["scenarios"]
    if "kill" in s:
        w, r = s["kill"]["workers"], s["kill"]["router"]
        lines += [
            "",
            f"kill: {len(w['kills'])} worker SIGKILLs over {fmt(w['load_s'])} s of load; victims back in "
            f"median {fmt(w['back_s']['median'], 2)} s, max {fmt(w['back_s']['max'], 2)} s",
            "  calls: " + ", ".join(f"{k} {v:,}" for k, v in sorted(w["calls"].items())),
            "  router counters: " + ", ".join(f"{k} {v}" for k, v in w["router_counters"].items()),
            f"  router SIGKILL under {r['calls']} calls: "
            + ", ".join(f"{k} {v}" for k, v in r["ends"].items())
            + f", hung {r['hung']}; router_lost after the kill: p50 {fmt(r['router_lost_after']['p50_ms'] / 1e3, 2)} s, "
            f"max {fmt(r['router_lost_after']['max_ms'] / 1e3, 2)} s "
            f"(SDK router_timeout {r['sdk_router_timeout_s']:g} s); workers exited "
            + (f"{fmt(r['workers_exit_s'], 1)} s after it" if r["workers_exit_s"] is not None else f"NOT ({r['workers_left']} left after 30 s)"),
        ]
        lines += [f"  problem: {p}" for p in w["problems"][:5]]
    if "overload" in s:
        o = s["overload"]
        rows = [
            [t, v["sent"], v["refused"]["n"], v["admitted"], v["refused"]["p50_ms"], v["refused"]["p99_ms"], v["refused"]["max_ms"]]
            for t, v in o["transports"].items()
        ]
        lines += [
            "",
            f"overload: capacity {o['capacity']} (in flight + queued), {o['rounds']} bursts of {o['burst']} per transport",
            table(["transport", "sent", "refused", "admitted", "refusal p50 (ms)", "refusal p99 (ms)", "refusal max (ms)"], rows),
        ]
    if "idle-sockets" in s:
        i = s["idle-sockets"]
        k, c = i["kill"], i["control_kill"]
        lines += [
            "",
            f"idle-sockets: with the sockets open: {i['with_sockets']}",
            table(
                ["SIGKILL w0", "backoff (s)", "restart started (s)", "serving again (s)"],
                [
                    ["with the idle sockets", i["backoff_s"], k["spawn_s"], k["back_s"]],
                    ["control, sockets closed", i["control_backoff_s"], c["spawn_s"], c["back_s"]],
                ],
            ),
            f"  the client connected before the flood served after the restart: {i['old_client_served']}; "
            f"a new client while the sockets are open: {i['new_client_during']}; "
            f"after they close: {i['new_clients_after']['served']}/{i['new_clients_after']['tried']} served",
        ]
    if "hostile" in s:
        h = s["hostile"]
        rows = [
            [
                p,
                v["latency"]["n"],
                v["latency"]["p50_ms"],
                v["latency"]["p99_ms"],
                v["latency"]["max_ms"],
                v["cpu_s"]["workers"],
                v["cpu_s"]["grammar"],
                v["cpu_s"]["router"],
                ", ".join(f"{k} {n}" for k, n in v["errors"].items()) or "-",
            ]
            for p, v in h["phases"].items()
        ]
        lines += [
            "",
            f"hostile: the other tenants' requests (32-token prompt, 16 tokens); CPU seconds used in each "
            f"{fmt(h['phases']['baseline']['wall_s'], 0)} s phase (2 cores)",
            table(
                ["phase", "requests", "p50 (ms)", "p99 (ms)", "max (ms)", "workers' CPU (s)", "grammar compiles' CPU (s)", "serve's CPU (s)", "errors"], rows
            ),
            table(
                ["hostile message", "sent", "p50 (ms)", "max (ms)", "ends"],
                [
                    [k, v["sent"], v["latency"]["p50_ms"], v["latency"]["max_ms"], ", ".join(f"{e} {n}" for e, n in v["ends"].items())]
                    for k, v in h["hostile"].items()
                ],
            ),
            f"  worker deaths {h['worker_deaths']}; workers alive at the end {h['workers_alive']}",
        ]
    lines += [
        "",
        table(
            ["criterion", "verdict", "measured", "limit"],
            [[c["criterion"], "PASS" if c["pass"] else "FAIL", c["measured"], c["limit"]] for c in result["criteria"]],
            align="llll",
        ),
    ]
    return "\n".join(lines)


def run(args) -> int:
    from bench.models import bench_model_path

    names = [n.strip() for n in args.scenario.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNNERS]
    if unknown or not names:
        log(f"reliability: unknown scenario(s) {unknown}; expected some of {', '.join(SCENARIOS)}")
        return 2
    load_at_start, git_at_start = load_average(), git_revision()  # the code that runs: edits made meanwhile do not count
    model = args.model or str(bench_model_path())
    results: dict[str, dict] = {}
    for name in names:
        t0 = time.monotonic()
        results[name] = RUNNERS[name](args, model)
        results[name]["wall_s"] = time.monotonic() - t0
        for c in results[name]["criteria"]:
            log(f"reliability: {name}: {'PASS' if c['pass'] else 'FAIL'}: {c['criterion']}: {c['measured']}")
    criteria = [c for r in results.values() for c in r["criteria"]]
    result = {
        "command": "reliability",
        "machine": {**machine_summary(), "load_average_at_start": load_at_start, "git": git_at_start},
        "model": model,
        "scenarios": results,
        "criteria": criteria,
        "ok": all(c["pass"] for c in criteria),
    }
    emit(args, result, render)
    return 0 if result["ok"] else 1

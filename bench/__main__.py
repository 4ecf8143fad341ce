"""``python -m bench <command> [options]``: the radixserve benchmarks.

Each command lives in its own module ``bench/<name>.py`` exposing ``HELP`` (one line),
``add_arguments(parser)`` and ``run(args) -> int``. To add one, write the module and list
its name in :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = [
    "throughput",
    "fleet",
    "schedule",
    "cascade",
    "simulate",
    "batching",
    "serve",
    "plots",
    "soak",
    "structured",
    "kv_quant",
    "peers",
    "tensor_parallel",
    "routing",
    "kernels",
    "qlinear",
    "roofline",
    "floor",
    "layers",
    "sampler",
    "bigmodel",
    "reliability",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="radixserve benchmarks (numbers on stdout, progress on stderr)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"bench.{name}")
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(handler=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    from radixserve.runtime import default_malloc, default_omp_wait

    default_omp_wait()  # before anything loads torch
    default_malloc()
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

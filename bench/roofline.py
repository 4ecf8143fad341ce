"""Batch-1 decode step against the memory-bandwidth floor.

A batch-1 decode step reads every weight once (the output embedding included), so it cannot
beat ``weight bytes / memory bandwidth``. This command measures the read bandwidth (a sum over
a buffer far larger than the caches, with the engine's thread count), the model's weight bytes,
and the median decode step of one request (``--context`` tokens of prompt, then
``--steps`` decodes through ``Engine.step``), and prints their ratio.
"""

from __future__ import annotations

import json
import statistics
import time

HELP = "batch-1 decode step vs weight bytes / measured memory bandwidth"


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None, metavar="PATH", help="model directory (default: the bench model)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (bandwidth and engine)")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens before the decodes")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed")
    parser.add_argument("--buffer-mib", type=int, default=1024, help="bandwidth buffer (MiB)")
    parser.add_argument("--json", action="store_true")


def bandwidth(mib: int, repeats: int = 7) -> float:
    """Read bandwidth in bytes/s: the median of ``repeats`` sums over a ``mib`` MiB fp32 buffer."""
    import torch

    x = torch.ones(mib << 18)  # mib MiB of float32
    x.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(times)


def run(args) -> int:
    import torch

    from radixserve import Engine, SamplingParams

    torch.set_num_threads(args.threads)
    if args.model is None:
        from bench.models import bench_model_path

        args.model = str(bench_model_path())
    bw = bandwidth(args.buffer_mib)
    engine = Engine(args.model, dtype=args.dtype, max_running=1, seed=0)
    model = engine.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = [7 + i % 1000 for i in range(args.context)]
    engine.add_request(engine.make_request(ids, SamplingParams(max_tokens=args.steps + 2, temperature=0.0,
                                                               ignore_eos=True)))
    engine.step()  # drains the inbox and prefills
    times = []
    while engine.scheduler.has_work:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    step = statistics.median(times[1:])  # the first decode may still warm caches
    floor = weight_bytes / bw
    result = {"dtype": args.dtype, "threads": args.threads, "bandwidth_gb_s": bw / 1e9, "weight_mb": weight_bytes / 1e6,
              "floor_ms": floor * 1e3, "decode_step_ms": step * 1e3, "ratio": step / floor,
              "backend": type(engine.runner.attention).__name__}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.dtype}, {args.threads} thread(s), {result['backend']}: read bandwidth {result['bandwidth_gb_s']:.1f} GB/s, "
          f"weights {result['weight_mb']:.1f} MB -> floor {result['floor_ms']:.2f} ms; batch-1 decode step "
          f"{result['decode_step_ms']:.2f} ms (median of {len(times) - 1}) = {result['ratio']:.2f}x the floor")
    return 0

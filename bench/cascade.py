"""Decode attention, flat paged vs shared-prefix (cascade), on a CPU backend (the csrc/ kernels or torch).

A batch of decode requests shares one cached prefix (an agent fleet's system prompt) and each has
a private suffix. Flat attention gathers and reads the prefix once per request; cascade reads it
once per group, as one GEMM-shaped computation, and merges by log-sum-exp. Times cover one
``plan`` plus one ``forward`` per layer of the bench model's shape (8 layers, 8 query heads,
4 KV heads, head_dim 64).
"""

from __future__ import annotations

import json
import statistics
import time

HELP = "decode attention time, flat vs cascade (shared prefix), CPU"


def add_arguments(parser) -> None:
    parser.add_argument("--batch", type=int, default=64, help="decode requests sharing the prefix")
    parser.add_argument("--prefix", type=int, default=2048, help="shared prefix (tokens)")
    parser.add_argument("--suffix", type=int, default=128, help="private suffix per request (tokens)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument(
        "--backend", default="cpu", choices=["cpu", "torch"], help="cpu: the csrc/ kernels (falls back to torch if they do not build); torch: the oracle"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="q and KV pool dtype")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per mode (median reported)")
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also measure the GEMM rate (bench floor's, same run) and print the cascade step's FLOPs at that rate, and the step against it",
    )
    parser.add_argument("--json", action="store_true", help='print {"backend", "dtype", "flat_s", "cascade_s", "ratio"} (and the floor\'s fields)')


def run(args) -> int:
    import torch

    from radixserve.attention.cpu_backend import CpuAttention
    from radixserve.attention.metadata import build_metadata
    from radixserve.attention.torch_backend import TorchAttention
    from radixserve.kernels import attention as attention_ops
    from radixserve.kv.pool import KVPool

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    page = args.page_size
    tokens = args.prefix + args.batch * (args.suffix + page)
    pool = KVPool(
        num_layers=args.layers,
        num_pages=-(-tokens // page) + args.batch,
        page_size=page,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=dtype,
        device="cpu",
    )
    g = torch.Generator().manual_seed(0)
    for layer in range(args.layers):
        pool.k[layer].normal_(generator=g)
        pool.v[layer].normal_(generator=g)
    prefix_pages = pool.alloc(args.prefix // page)
    tables = [prefix_pages + pool.alloc(-(-(args.suffix + 1) // page)) for _ in range(args.batch)]
    kv_lens = [args.prefix // page * page + args.suffix + 1] * args.batch
    q = torch.randn(args.batch, args.heads, args.head_dim, generator=g).to(dtype)
    k = torch.randn(args.batch, args.kv_heads, args.head_dim, generator=g).to(dtype)
    v = torch.randn(args.batch, args.kv_heads, args.head_dim, generator=g).to(dtype)
    ext = attention_ops.ops() if args.backend == "cpu" else None
    backend = CpuAttention(pool, args.head_dim**-0.5, ext) if ext else TorchAttention(pool, args.head_dim**-0.5)

    def once(groups) -> float:
        start = time.perf_counter()
        backend.plan(build_metadata(tables, kv_lens, [1] * args.batch, page, groups=groups))
        for layer in range(args.layers):
            backend.forward(q, k, v, layer)
        return time.perf_counter() - start

    modes = {"flat": (), "cascade": [(0, args.batch, args.prefix // page * page)]}
    times = {name: [] for name in modes}
    for groups in modes.values():
        once(groups)  # warm-up
    for _ in range(args.repeats):  # interleaved, so drift hits both modes alike
        for name, groups in modes.items():
            times[name].append(once(groups))
    flat_s, cascade_s = statistics.median(times["flat"]), statistics.median(times["cascade"])
    result = {"backend": type(backend).__name__, "dtype": args.dtype, "flat_s": flat_s, "cascade_s": cascade_s, "ratio": flat_s / cascade_s}
    if args.floor:
        result.update(floor(args, kv_lens[0]))
        result["cascade_over_floor"] = cascade_s / result["floor_s"]
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"decode attention, {args.batch} requests x ({args.prefix} shared + {args.suffix} own) tokens, "
        f"{args.layers} layers, {args.heads}/{args.kv_heads} heads x {args.head_dim}, page {page}, "
        f"{type(backend).__name__} {args.dtype}, median of {args.repeats}"
    )
    print(f"flat     {flat_s * 1e3:9.1f} ms/step")
    print(f"cascade  {cascade_s * 1e3:9.1f} ms/step")
    print(f"ratio    {result['ratio']:9.2f} x (flat / cascade)")
    if args.floor:
        print(
            f"floor    {result['floor_s'] * 1e3:9.1f} ms/step: {result['gflop']:.2f} GFLOP (QK^T and PV over every "
            f"visible key) at {result['gemm_gflop_per_s']:.0f} GFLOP/s (bench floor's GEMM rate, {args.batch} rows, "
            f"this run); cascade {result['cascade_over_floor']:.2f}x it"
        )
    return 0


def floor(args, visible_keys: int) -> dict:
    """The step's attention FLOPs (QK^T and PV: 4 x keys x head_dim per query head and request,
    every layer) and the time they take at the GEMM rate of ``bench floor``, measured now on a
    model of this attention's width (hidden = heads x head_dim, 4x that for the MLP)."""
    from bench.floor import gemm_rate
    from bench.shapes import Shape

    hidden = args.heads * args.head_dim
    shape = Shape(
        dict(
            hidden_size=hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            head_dim=args.head_dim,
            intermediate_size=4 * hidden,
            vocab_size=32000,
        )
    )
    import torch

    rate = gemm_rate(shape, args.batch, args.dtype, args.threads or torch.get_num_threads())
    flops = 4 * args.batch * visible_keys * args.head_dim * args.heads * args.layers
    return {"gflop": flops / 1e9, "gemm_gflop_per_s": rate / 1e9, "floor_s": flops / rate}

"""One layer of CPU attention per batch shape: the csrc/ decode kernel alone ("kernel"), the
kernel with the many-row chunks on torch's flash kernel ("flash"), with them on the csrc/ GEMM
prefill kernel ("gemm", ``CpuAttention``'s default), and the torch backend ("torch"). With
``--dtype bfloat16``, "gemm-fp32" is the GEMM kernel with bf16 widened to fp32 (the path of CPUs
with neither AMX nor AVX512-BF16; "gemm" takes AMX tiles or vdpbf16ps where the CPU has them).

Shapes are the fleet/GSP steps' (bench model: 8 query heads, 4 KV heads, head_dim 64): decodes
over long contexts, a fresh prefill, prefill chunks over a cached prefix, short chunks over short
contexts (a cascade group's suffix level), GSP-like chunks over one shared cached prefix (their
page tables share its pages) next to a fresh prefill, and whole cascade groups (the shared prefix
once for all members, each member's own keys, the merge), of extend chunks or of decodes. Each
case is timed ``--repeats`` times with the modes interleaved (drift hits all alike); the median is
printed, with the effective GFLOP/s of the attention products (4 * query rows * heads * visible
keys * D).

By default the calls run back to back, so a case whose KV fits the caches is read from them. In
the engine, a layer's KV has usually left the caches by the time the layer runs (every step
streams the model's weights through them): ``--cold-mib N`` reads an N MiB buffer before each
timed call (about the model's weight bytes), and ``--shuffle-pages`` hands out the pages in a
random order, as a pool does once requests have come and gone.

``--against DIR`` times another version of the kernels next to this checkout's, in the same
process: DIR is another checkout's csrc/ (say from ``git worktree add /tmp/base HEAD~1``), whose
attention module (attention.cpp, prefill.cpp, decode.cpp) is built into the kernel cache with its
ops under a namespace of its own (a checkout from before the ops were torch ops: a Python module
of its own). Every mode except "torch" then also runs on it ("MODE@against"), the two calls
alternating in each repeat, and the table adds the median over repeats of each repeat's own
ratio (this checkout / DIR): on these VMs, whose speed drifts by tens of percent from minute to
minute, runs of two builds one after the other could not tell a 1% change from a 20% one.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

HELP = "one layer of CPU attention per batch shape: csrc/ decode kernel vs flash path vs csrc/ GEMM path vs torch"

CASES = {
    "decode64x2200": [(1, 2200)] * 64,
    "decode1x2200": [(1, 2200)],
    # one agent's decode over a short and a mid context (the split over keys of a lone decode)
    "decode1x264": [(1, 264)],
    "decode1x1024": [(1, 1024)],
    "fresh2048": [(2048, 2048)],
    "extend16x128/2176": [(128, 2176)] * 16,
    "extend16x8/2200": [(8, 2200)] * 16,
    "extend16x17/2200": [(17, 2200)] * 16,
    "extend16x32/2200": [(32, 2200)] * 16,
    "extend16x64/2200": [(64, 2200)] * 16,
    "extend4x512/1536": [(512, 1536)] * 4,
    # cascade suffix levels: each member's new tokens against its own short suffix (the fleet's
    # turns: 17 new tokens over ~200 private keys; GSP's questions: 128 over 130)
    "extend64x17/200": [(17, 200)] * 64,
    "extend7x128/130": [(128, 130)] * 7,
    "gsp8x128/1152+fresh1024": [(128, 1152)] * 8 + [(1024, 1024)],
    # cascade groups, as the engine plans shared prefixes: the members' new tokens against the
    # prefix once (level 0, not causal), each against its own suffix (level 1), then merged (the
    # fleet's later turns: 17 new tokens over 2,048 shared + ~200 own; a GSP group's questions)
    "cascade64x17/2048+200": [(17, 2248)] * 64,
    "cascade8x128/1024+128": [(128, 1152)] * 8,
    # a decode step of one (GSP's decode-only steps: a group's 8 members, one new token each)
    "cascade8x1/1024+136": [(1, 1160)] * 8,
}
SHARED = {
    "gsp8x128/1152+fresh1024": (8, 1024),
    "cascade64x17/2048+200": (64, 2048),
    "cascade8x128/1024+128": (8, 1024),
    "cascade8x1/1024+136": (8, 1024),
}  # (sequences, tokens) of a prefix the first ones share
CASCADE = {n for n in CASES if n.startswith("cascade")}  # their shared prefix planned as one cascade group
MODES = ("kernel", "flash", "gemm", "torch")
EXTRA_MODES = ("gemm-fp32",)


class _WidenedBf16:
    """The extension with ``prefill_attention``'s bf16 products widened to fp32 (``bf16_gemm="fp32"``)."""

    def __init__(self, ext) -> None:
        self._ext = ext

    def __getattr__(self, name):
        return getattr(self._ext, name)

    def prefill_attention(self, *args, **kwargs):
        return self._ext.prefill_attention(*args, bf16_gemm="fp32", **kwargs)


def add_arguments(parser) -> None:
    parser.add_argument("--cases", default=",".join(CASES), help="comma list from " + ",".join(CASES))
    parser.add_argument("--modes", default=",".join(MODES), help="comma list from " + ",".join(MODES + EXTRA_MODES))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cold-mib", type=int, default=0, help="read a buffer of this many MiB before each timed call (0: warm calls)")
    parser.add_argument("--shuffle-pages", action="store_true", help="hand out the pages in a random order")
    parser.add_argument("--against", metavar="DIR", default=None, help="another checkout's csrc/ directory: time its kernels next to these, alternating")
    parser.add_argument("--json", action="store_true")


AGAINST_SOURCES = ("attention.cpp", "prefill.cpp", "decode.cpp")
QUANT_SOURCES = ("quant.cpp", "quant_int8.cpp")


def build_against(csrc: str | Path):
    """The attention ops of another checkout's ``csrc`` (its ``AGAINST_SOURCES``, with quant.cpp and
    layers.cpp where its decode.cpp calls them directly; linear.cpp's ops stay this checkout's, which
    decode.cpp finds by name), built under
    a namespace of its own in the kernel cache so that they load next to this checkout's. A
    checkout whose attention.cpp still binds with pybind11 loads as a module of its own name."""
    from torch.utils import cpp_extension

    from radixserve.kernels import attention, build

    csrc = Path(csrc)
    missing = [s for s in AGAINST_SOURCES if not (csrc / s).is_file()]
    if missing:
        raise SystemExit(f"--against {csrc}: no {', '.join(missing)} there (give another checkout's csrc/)")
    tag = build._sources_tag(csrc)
    directory = build.build_dir().parent / f"against-{tag}"
    directory.mkdir(parents=True, exist_ok=True)
    staged = build._stage_sources(directory, csrc)  # (headers too; unchanged copies keep ninja's build)
    print(f"  loading {csrc}'s attention kernels from {directory} (the first time: a minute or two to build)", flush=True, file=sys.stderr)
    name = f"radixserve_attention_{tag}"
    pybind = "PYBIND11_MODULE" in (csrc / "attention.cpp").read_text()
    # a decode.cpp that multiplies by quantized weights itself links quant.cpp's product: those two
    # files come along, their ops under the same namespace of their own
    quant = '#include "quant.h"' in (csrc / "decode.cpp").read_text()
    # ... and one that calls layers.cpp's rows (layers.h) links that file, its ops likewise renamed
    layers = '#include "layers.h"' in (csrc / "decode.cpp").read_text()
    sources = AGAINST_SOURCES + (QUANT_SOURCES if quant else ()) + (("layers.cpp",) if layers else ())
    loaded = cpp_extension.load(
        name=name,
        sources=[str(staged / s) for s in sources],
        build_directory=str(directory),
        extra_cflags=build.CFLAGS
        + ([] if pybind else [f"-DRADIXSERVE_ATTENTION_NS={name}"])
        + ([f"-DRADIXSERVE_QUANT_NS={name}_quant"] if quant else [])
        + ([f"-DRADIXSERVE_LAYERS_NS={name}_layers"] if layers else []),
        extra_ldflags=["-fopenmp"],
        verbose=False,
        is_python_module=pybind,
    )
    return loaded if pybind else attention.ops(name)


def _case(shape, dtype, page, shared=(0, 0), shuffle=False, cascade=False):
    import torch

    from radixserve.attention.metadata import build_metadata
    from radixserve.kv.pool import KVPool

    heads, kv_heads, dim = 8, 4, 64
    need = sum(-(-kv // page) for _, kv in shape) + 1
    pool = KVPool(num_layers=1, num_pages=need, page_size=page, num_kv_heads=kv_heads, head_dim=dim, dtype=dtype, device="cpu")
    g = torch.Generator().manual_seed(0)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g))
    order = torch.randperm(need - 1, generator=g).tolist() if shuffle else list(range(need - 1))
    tables, first = [], 0
    for _, kv in shape:
        n = -(-kv // page)
        tables.append(order[first : first + n])
        first += n
    members, tokens = shared
    for table in tables[1:members]:  # the prefix's pages are the first sequence's
        table[: tokens // page] = tables[0][: tokens // page]
    groups = [(0, members, tokens)] if cascade else []
    meta = build_metadata(tables, [kv for _, kv in shape], [qo for qo, _ in shape], page, groups=groups)
    t = sum(qo for qo, _ in shape)
    q = torch.randn(t, heads, dim, generator=g).to(dtype)
    k = torch.randn(t, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(t, kv_heads, dim, generator=g).to(dtype)
    flops = sum(4 * heads * dim * (qo * (kv - qo) + qo * (qo + 1) // 2) for qo, kv in shape)
    return pool, meta, q, k, v, flops


def run(args) -> int:
    import torch

    from radixserve.attention.cpu_backend import CpuAttention
    from radixserve.attention.torch_backend import TorchAttention
    from radixserve.kernels import attention

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    ext = attention.ops()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if ext is None:
        modes = [m for m in modes if m == "torch"]
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [n for n in names if n not in CASES] + [m for m in modes if m not in MODES + EXTRA_MODES]
    if unknown:
        raise SystemExit(f"unknown case or mode {', '.join(unknown)}: cases are {', '.join(CASES)}; modes {', '.join(MODES + EXTRA_MODES)}")
    other = None
    if args.against:
        if ext is None:
            raise SystemExit("--against needs this checkout's kernels, which are unavailable here")
        other = build_against(args.against)
    cold = torch.ones(args.cold_mib << 18) if args.cold_mib > 0 else None  # fp32: 2**18 per MiB
    results = {}
    for name in names:
        pool, meta, q, k, v, flops = _case(CASES[name], dtype, args.page_size, SHARED.get(name, (0, 0)), args.shuffle_pages, name in CASCADE)
        backends = {}
        for mode in modes:
            if mode == "torch":
                backends[mode] = TorchAttention(pool, 64**-0.5)
                continue
            for label, kernels in ((mode, ext), (f"{mode}@against", other)):
                if kernels is None:
                    continue
                b = CpuAttention(pool, 64**-0.5, _WidenedBf16(kernels) if mode == "gemm-fp32" else kernels)
                if mode == "kernel":
                    b.dense_min_tokens = 1 << 30
                elif mode == "flash":
                    b.dense_path = "flash"
                elif mode in ("gemm", "gemm-fp32"):
                    b.dense_path = "gemm"
                backends[label] = b
        times = {m: [] for m in backends}
        order = list(backends)
        for rep in range(args.repeats + 1):
            for mode in order if rep % 2 else order[::-1]:  # (alternating, so neither build always goes first)
                b = backends[mode]
                if cold is not None:
                    cold.sum()  # push the case's KV out of the caches
                start = time.perf_counter()
                b.plan(meta)
                b.forward(q, k, v, 0)
                if rep:  # the first round is a warm-up
                    times[mode].append(time.perf_counter() - start)
        results[name] = {m: {"ms": statistics.median(ts) * 1e3, "gflops": flops / statistics.median(ts) / 1e9} for m, ts in times.items()}
        for mode in modes:  # this checkout / --against: the median of each repeat's ratio
            if f"{mode}@against" in times:
                ratios = [a / b for a, b in zip(times[mode], times[f"{mode}@against"], strict=True)]
                results[name][mode]["vs_against"] = statistics.median(ratios)
        print(f"  {name} done", flush=True, file=sys.stderr)
    if args.json:
        print(
            json.dumps(
                {
                    "dtype": args.dtype,
                    "threads": args.threads,
                    "page_size": args.page_size,
                    "cold_mib": args.cold_mib,
                    "shuffle_pages": args.shuffle_pages,
                    "against": args.against,
                    "cases": results,
                }
            )
        )
        return 0
    print(
        f"one layer, {args.dtype}, {args.threads} thread(s), page size {args.page_size}"
        f"{', pages shuffled' if args.shuffle_pages else ''}"
        f"{f', {args.cold_mib} MiB read before each call' if args.cold_mib else ''}, median of {args.repeats}"
        f"{f'; @against: {args.against}, x: this / against (median of each repeat ratio)' if other else ''}"
    )
    columns = [c for m in modes for c in ((m, f"{m}@against") if other is not None and m != "torch" else (m,))]
    width = max([16] + [len(c) + 7 for c in columns])
    print(
        f"{'case':<24}"
        + "".join(f"{c + ' (ms)':>{width}}{'GFLOP/s':>9}" for c in columns)
        + "".join(f"{m + ' x':>12}" for m in modes if other is not None and m != "torch")
    )
    for name, r in results.items():
        print(
            f"{name:<24}"
            + "".join(f"{r[c]['ms']:>{width}.2f}{r[c]['gflops']:>9.1f}" for c in columns)
            + "".join(f"{r[m]['vs_against']:>12.3f}" for m in modes if other is not None and m != "torch")
        )
    return 0

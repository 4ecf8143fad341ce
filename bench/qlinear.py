"""Quantized linear layers (csrc/quant.cpp, csrc/quant_int8.cpp) per weight shape, as a decode
step meets them: ms per call and GB/s of weight blocks read.

Each shape ``NxK`` is a random weight of ``--qtype`` blocks (gguf's quantizer, or radixserve's for
the K-quants), copied until the copies fill ``--mib`` MiB so that each call reads its weight from
memory, as a decode step does; ``--rows`` are the rows of x (a decode batch); ``--impl`` is
``int8`` (activations quantized per 32 values, the decode path where the CPU has AVX-512 VNNI) or
``fp32``. The default shapes are a Llama-2-7B layer's: fused q/k/v, o, fused gate/up, down.

``--against DIR`` builds another checkout's quant kernels (DIR is its csrc/, say from ``git
worktree add /tmp/base HEAD~1``) under a namespace of their own and times them next to these,
call by call in one process; each line adds the median over repeats of each repeat's own ratio
(against / this: above 1, this checkout is faster). On these VMs, whose speed drifts by tens of
percent from minute to minute, only such ratios tell a few percent apart.

``--model GGUF`` times a model's own quantized linear layers instead (``--shapes`` and ``--qtype``
unused): the engine loads the file as ``serve`` would (its weights mapped, q/k row maps and all),
and each timed pass calls every one of its quantized layers once, in the order a decode step
does, at ``--rows`` rows, so that a pass reads all of its quantized weights, as a batch-1 step
does; GB/s counts them all. With ``--against``, passes alternate between the builds.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

HELP = "quantized linear kernels per weight shape (ms, GB/s), optionally against another checkout's build"

LLAMA2_7B = "12288x4096,4096x4096,22016x4096,4096x11008"
QTYPE_IDS = {"q4_0": 2, "q4_1": 3, "q8_0": 8, "q4_k": 12, "q6_k": 14}
SOURCES = ("quant.cpp", "quant_int8.cpp")


def add_arguments(parser) -> None:
    parser.add_argument("--shapes", default=LLAMA2_7B, help="weights NxK, comma-separated (default: a Llama-2-7B layer's)")
    parser.add_argument("--qtype", default="q4_0", choices=sorted(QTYPE_IDS))
    parser.add_argument("--rows", default="1", help="rows of x per call, comma-separated (decode batch sizes)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--impl", default="int8", choices=["int8", "fp32"], help="int8 activations (the decode path) or fp32")
    parser.add_argument("--repeats", type=int, default=40, help="timed calls per shape and build")
    parser.add_argument("--mib", type=int, default=256, help="MiB of weight copies each shape rotates over")
    parser.add_argument("--against", metavar="DIR", default=None, help="another checkout's csrc/: time its quant kernels next to these, alternating")
    parser.add_argument(
        "--model", metavar="GGUF", default=None, help="time passes over this GGUF model's own quantized layers, in step order, instead of --shapes"
    )
    parser.add_argument("--json", action="store_true")


def build_against(csrc: str | Path):
    """``torch.ops`` namespace of another checkout's quant kernels, built into the kernel cache
    under a name of its own (its TORCH_LIBRARY renamed in a staged copy) so that they load next to
    this checkout's."""
    import torch
    from torch.utils import cpp_extension

    from radixserve.kernels import build

    csrc = Path(csrc)
    missing = [s for s in SOURCES if not (csrc / s).is_file()]
    if missing:
        raise SystemExit(f"--against {csrc}: no {', '.join(missing)} there (give another checkout's csrc/)")
    tag = build._sources_tag(csrc)
    name = f"radixserve_quant_{tag}"
    directory = build.build_dir().parent / f"against-quant-{tag}"
    staged = directory / "src"
    staged.mkdir(parents=True, exist_ok=True)
    for path in csrc.glob("*"):
        if path.suffix not in (".h", ".cpp"):
            continue
        text = path.read_text()
        if path.name == "quant.cpp" and "RADIXSERVE_QUANT_NS" not in text:  # (older: no namespace macro)
            if "TORCH_LIBRARY(radixserve_quant," not in text:
                raise SystemExit(f"--against {csrc}: its quant.cpp registers no radixserve_quant ops")
            text = text.replace("TORCH_LIBRARY(radixserve_quant,", f"TORCH_LIBRARY({name},")
        target = staged / path.name
        if not target.exists() or target.read_text() != text:  # (unchanged copies keep ninja's build)
            target.write_text(text)
    print(f"  loading {csrc}'s quant kernels from {directory} (the first time: a minute or two to build)", flush=True, file=sys.stderr)
    cpp_extension.load(
        name=name,
        sources=[str(staged / s) for s in SOURCES],
        build_directory=str(directory),
        extra_cflags=[*build.CFLAGS, f"-DRADIXSERVE_QUANT_NS={name}"],
        extra_ldflags=["-fopenmp"],
        verbose=False,
        is_python_module=False,
    )
    return getattr(torch.ops, name)


def _weight(n: int, k: int, qtype: str, seed: int):
    import numpy as np
    import torch

    from radixserve.testing_gguf import quantize

    rng = np.random.default_rng(seed)
    return torch.from_numpy(quantize(rng.standard_normal((n, k), dtype=np.float32), QTYPE_IDS[qtype]))


def run(args) -> int:
    import torch

    from radixserve.kernels import quant

    torch.set_num_threads(args.threads)
    ops = quant.ops()
    if ops is None:
        raise SystemExit("the CPU kernels are unavailable here (see the log above)")
    impl = 4 if args.impl == "int8" else 0
    if impl == 4 and not ops.has_int8():
        raise SystemExit("--impl int8: this build has no int8 kernels (AVX-512 VNNI and VBMI); use --impl fp32")
    try:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        raise SystemExit(f"--shapes must be NxK[,NxK...] and --rows M[,M...]; got {args.shapes!r} and {args.rows!r}") from None
    if any(len(s) != 2 or min(s) < 1 for s in shapes) or min(rows) < 1:
        raise SystemExit("--shapes: each N and K at least 1; --rows: each at least 1")
    builds = [("this", ops)] + ([("against", build_against(args.against))] if args.against else [])
    no_map = [torch.empty(0, dtype=torch.int32)]
    qt = QTYPE_IDS[args.qtype]
    results = []
    if not args.json and not args.model:
        print(
            f"{args.qtype} weights, {args.impl} activations, {args.threads} thread(s); each shape's copies fill {args.mib} MiB; "
            f"median of {args.repeats} calls{'; against / this above 1: this checkout is faster' if args.against else ''}",
            flush=True,
        )
    if args.model:
        results.extend(model_passes(args, builds, rows, impl))
    for n, k in [] if args.model else shapes:
        first = _weight(n, k, args.qtype, seed=n * 31 + k)
        copies = [first] + [first.clone() for _ in range(max(2, args.mib * 2**20 // first.numel() - 1))]
        for m in rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            ref = builds[0][1].qlinear(x, [first], [qt], no_map, None, impl)
            for label, b in builds[1:]:  # (the same arithmetic: a build that differs is not comparable)
                torch.testing.assert_close(b.qlinear(x, [first], [qt], no_map, None, impl), ref, rtol=1e-5, atol=1e-4, msg=f"{label} differs")
            times: dict[str, list[float]] = {label: [] for label, _ in builds}
            for r in range(args.repeats):
                for i, (label, b) in enumerate(builds):
                    w = copies[(r * len(builds) + i) % len(copies)]  # (each call its own copy: none finds the last one's in L3)
                    start = time.perf_counter()
                    b.qlinear(x, [w], [qt], no_map, None, impl)
                    times[label].append(time.perf_counter() - start)
            results.append(summarize({"shape": f"{n}x{k}", "rows": m, "bytes": first.numel()}, times, f"{n:>6} x {k:<6} rows {m:>3}", args.json))
    if args.json:
        print(json.dumps({"qtype": args.qtype, "impl": args.impl, "threads": args.threads, "against": args.against, "results": results}))
    return 0


def model_passes(args, builds, rows: list[int], impl: int) -> list[dict]:
    """``--model``: passes over the model's quantized layers, per rows of x and build; each call is
    timed on its own too, and summed per kind of layer (the name's last part: qkv_proj, down_proj, ...)."""
    import torch

    from radixserve import Engine
    from radixserve.kernels.quant import QuantLinear

    engine = Engine(args.model, kv_cache_tokens=256, max_running=1)
    named = [(name.rsplit(".", 1)[-1], m) for name, m in engine.loaded.model.named_modules() if isinstance(m, QuantLinear)]
    if not named:
        raise SystemExit(f"--model {args.model}: no layer is kept quantized (see the engine's log)")
    layers = [m for _, m in named]
    kinds = list(dict.fromkeys(kind for kind, _ in named))
    kind_bytes = {kind: sum(m.nbytes for k, m in named if k == kind) for kind in kinds}
    nbytes = sum(kind_bytes.values())
    if not args.json:
        print(
            f"{Path(args.model).name}: {len(layers)} quantized layers, {nbytes / 1e6:,.1f} MB, {args.impl} activations, "
            f"{args.threads} thread(s); median of {args.repeats} passes{'; against / this above 1: this checkout is faster' if args.against else ''}",
            flush=True,
        )
    out = []
    for m in rows:
        g = torch.Generator().manual_seed(m)
        xs = [torch.randn(m, layer.in_features, generator=g) for layer in layers]
        for label, b in builds[1:]:  # (the same arithmetic: a build that differs is not comparable)
            for layer, x in zip(layers[:8], xs, strict=False):
                ref = builds[0][1].qlinear(x, *layer._args, None, impl)
                torch.testing.assert_close(b.qlinear(x, *layer._args, None, impl), ref, rtol=1e-5, atol=1e-4, msg=f"{label} differs")
        times: dict[tuple[str, str], list[float]] = {(label, kind): [] for label, _ in builds for kind in ["pass", *kinds]}
        for _ in range(args.repeats):
            for label, b in builds:
                per_kind = dict.fromkeys(kinds, 0.0)
                start = time.perf_counter()
                for (kind, layer), x in zip(named, xs, strict=True):
                    t0 = time.perf_counter()
                    b.qlinear(x, *layer._args, None, impl)
                    per_kind[kind] += time.perf_counter() - t0
                times[(label, "pass")].append(time.perf_counter() - start)
                for kind, t in per_kind.items():
                    times[(label, kind)].append(t)
        for kind in ["pass", *kinds]:
            count = len(layers) if kind == "pass" else sum(k == kind for k, _ in named)
            size = nbytes if kind == "pass" else kind_bytes[kind]
            row = {"model": str(args.model), "rows": m, "kind": kind, "layers": count, "bytes": size}
            name = f"pass, rows {m}" if kind == "pass" else f"  {kind} x{count}"
            out.append(summarize(row, {label: times[(label, kind)] for label, _ in builds}, f"{name:<22}", args.json))
    return out


def summarize(row: dict, times: dict[str, list[float]], name: str, quiet: bool) -> dict:
    """``row`` with each build's median ms and GB/s of ``row["bytes"]`` (``times``: seconds per
    repeat, by build label) and, with an "against" build, the median of the repeats' ratios; prints
    its line unless ``quiet``."""
    for label, ts in times.items():
        med = statistics.median(ts)
        row[label] = {"ms": med * 1e3, "gb_s": row["bytes"] / med / 1e9}
    if "against" in times:
        row["against_over_this"] = statistics.median(a / t for a, t in zip(times["against"], times["this"], strict=True))
    if not quiet:
        text = f"  {name}: {row['this']['ms']:8.3f} ms {row['this']['gb_s']:6.1f} GB/s"
        if "against" in times:
            text += f" | against {row['against']['ms']:8.3f} ms {row['against']['gb_s']:6.1f} GB/s | against / this x{row['against_over_this']:.2f}"
        print(text, flush=True)
    return row

"""Which GEMM multiplies a CPU batch that the small-M kernel (:mod:`radixserve.kernels.linear`) does
not take: MKL's packed fp32 GEMM, oneDNN over a prepacked weight, or csrc/linear.cpp's AMX GEMM.

Contract: :func:`gemm_backend` names the backend of a dtype, decided once per process (and
logged); :func:`packed_row_range` says which batch sizes take a packed copy of a weight;
:func:`packed_ops` is ``torch.ops.radixserve_linear`` where packing is on
(``RADIXSERVE_PACKED_LINEAR``, :func:`packed_policy`), else None. ``RADIXSERVE_CPU_GEMM`` =
``mkl`` or ``onednn`` chooses; ``auto`` times both on the model's own shapes (:func:`set_probe_shapes`).
The row limits below and the measurements behind them: docs/KERNELS.md ("Which GEMM").
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from radixserve.kernels import build

log = logging.getLogger("radixserve")

MAX_ROWS = 32  # most rows of bf16 on AMX tiles sent to the small-M kernel
MAX_ROWS_VECTOR = 4  # most rows of fp16 (and bf16 without AMX) sent to it
MAX_ROWS_FP32 = 4  # most rows of fp32 sent to it where oneDNN is the fp32 GEMM, without AVX-512
MAX_ROWS_FP32_AVX512 = 2  # the same, with AVX-512
PACKED_MIN_ROWS = 16  # fewest fp32 rows sent to MKL's packed GEMM (fewer: F.linear, bit for bit)
PACKED_MAX_ROWS = 2048  # most fp32 rows sent to it (more: F.linear)
PROBE_ROWS = (16, 17, 64)  # rows at which the "exact" policy compares a packed copy with F.linear
GEMM_PROBE_ROWS = (8, 64, 512)  # rows of the products that choose between MKL and oneDNN
GEMM_PROBE_SHAPES = ((1024, 1024),)  # weight shapes (out, in) timed where no model named its own
GEMM_PROBE_SECONDS = 1.0  # seconds the probe aims to spend per dtype (never under 3 rounds)
GEMM_PROBE_MAX_ELEMENTS = 1 << 21  # most elements of one probed weight (fewer output rows, same K)
ONEDNN_FP32_MIN_ROWS = 1  # fewest fp32 rows sent to oneDNN where it is the backend
ONEDNN_MAX_ROWS = 128  # most bf16 rows sent to oneDNN on AMX (only shapes the AMX GEMM refuses)
POLICIES = ("off", "exact", "all")

_state: dict[object, object] = {}


def packed_policy() -> str:
    """``RADIXSERVE_PACKED_LINEAR`` as one of :data:`POLICIES` (read once per process)."""
    if "policy" not in _state:
        raw = os.environ.get("RADIXSERVE_PACKED_LINEAR", "all").strip().lower()
        policy = {"0": "off", "off": "off", "false": "off", "no": "off", "1": "all", "": "all", "exact": "exact", "all": "all"}.get(raw)
        if policy is None:
            log.warning("RADIXSERVE_PACKED_LINEAR=%r is not one of 0, exact, all; using all", raw)
            policy = "all"
        _state["policy"] = policy
    return _state["policy"]  # type: ignore[return-value]


def packed_ops():
    """``torch.ops.radixserve_linear`` when the packed paths are on (the extension is built with
    ``pack_fp32`` and ``RADIXSERVE_PACKED_LINEAR`` is not 0), else None."""
    if "packed" not in _state:
        ns = None
        if packed_policy() == "off":
            log.info("RADIXSERVE_PACKED_LINEAR=0: fp32 linear layers use F.linear (no packed weights)")
        else:
            ns = build.ops("radixserve_linear", "pack_fp32")
        _state["packed"] = ns
    return _state["packed"]


def onednn_rows(m: int) -> int:
    """The row count oneDNN is called with for ``m`` rows: ``m`` up to 64, then ``m`` rounded up to
    a multiple of 16 (to 256) or of 32. oneDNN compiles and keeps a kernel per row count and weight
    shape, about 0.6 MiB each; called with every row count a server meets, a worker grew by 15
    MiB a minute without end (bench/RESULTS.md section 43). Rounded, a weight has at most 132 up to
    2,048 rows, and a prefill chunk pays at most 31 padding rows (about 1.5% of the time on average;
    multiples of 64 cost 3%)."""
    if m <= 64:
        return m
    step = 16 if m <= 256 else 32
    return -(-m // step) * step


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's product of ``x`` with a weight prepacked by ``_reorder_linear_weight`` (rows padded
    to :func:`onednn_rows`; the padding's rows are dropped from the result)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = x.numel() // x.shape[-1] if x.dim() > 1 else 1
    padded = onednn_rows(m)
    if padded == m:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    rows = x.reshape(m, x.shape[-1])
    y = torch.ops.mkldnn._linear_pointwise(F.pad(rows, (0, 0, 0, padded - m)), packed, bias, "none", [], "")
    return y[:m].view(*x.shape[:-1], y.shape[-1])


def has_onednn_ops(dtype: torch.dtype = torch.float32) -> bool:
    """torch has oneDNN's prepacked linear ops, and for bf16 this CPU runs them (oneDNN's bf16
    needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only CPU has fp32 only)."""
    mk = getattr(torch.ops, "mkldnn", None)
    if not (torch.backends.mkldnn.is_available() and hasattr(mk, "_reorder_linear_weight") and hasattr(mk, "_linear_pointwise")):
        return False
    return dtype != torch.bfloat16 or bool(getattr(mk, "_is_mkldnn_bf16_supported", lambda: True)())


def set_probe_shapes(shapes: set[tuple[int, int]]) -> None:
    """Have :func:`gemm_backend` time these weight shapes (out, in), each cut to at most
    :data:`GEMM_PROBE_MAX_ELEMENTS` with its K kept, rather than :data:`GEMM_PROBE_SHAPES`.
    Effective until a dtype's backend is chosen (once per process)."""
    cut = {(min(n, max(64, GEMM_PROBE_MAX_ELEMENTS // k // 64 * 64)), k) for n, k in shapes}
    if cut:
        _state["probe_shapes"] = tuple(sorted(cut))


def probed_shapes() -> tuple[tuple[int, int], ...]:
    return _state.get("probe_shapes") or GEMM_PROBE_SHAPES  # type: ignore[return-value]


def measure(dtype: torch.dtype, candidates: tuple[str, ...], reps: int = 9) -> dict[str, float]:
    """GFLOP/s of each candidate backend ("mkl", "widen" or "onednn") on products of
    :data:`GEMM_PROBE_ROWS` rows with each shape of :func:`probed_shapes` in ``dtype``, each run as
    the engine runs it. The candidates take turns and each keeps its best time; at most ``reps``
    timed rounds, fewer where a round is long (:data:`GEMM_PROBE_SECONDS`)."""
    ops = packed_ops()
    g = torch.Generator().manual_seed(0)
    shapes = probed_shapes()
    flops = 2.0 * sum(GEMM_PROBE_ROWS) * sum(n * k for n, k in shapes)
    products: dict[str, list[Callable[[], torch.Tensor]]] = {name: [] for name in candidates}
    with torch.no_grad():
        for n, k in shapes:
            w = torch.randn(n, k, generator=g).to(dtype)
            xs = [torch.randn(rows, k, generator=g).to(dtype) for rows in GEMM_PROBE_ROWS]
            for name, fns in products.items():
                if name == "onednn":
                    od = torch.ops.mkldnn._reorder_linear_weight(w)
                    fns += [functools.partial(onednn_linear, x, od, None) for x in xs]
                    continue
                packed = ops.pack_fp32(w.float())
                fns += [
                    functools.partial(F.linear, x, w)
                    if name == "mkl" and x.shape[0] < PACKED_MIN_ROWS
                    else functools.partial(lambda x, p, n, k: ops.packed_linear(x.float(), p, n, k, None).to(dtype), x, packed, n, k)
                    for x in xs
                ]
        best = dict.fromkeys(products, float("inf"))
        rep, rounds = 0, reps + 2  # (the first two rounds warm up)
        while rep < rounds:
            start = time.perf_counter()
            for name, fns in products.items():
                t0 = time.perf_counter()
                for fn in fns:
                    fn()
                if rep >= 2:
                    best[name] = min(best[name], time.perf_counter() - t0)
            if rep == 1:  # a warm round's time sets how many timed rounds fit the budget
                rounds = 2 + max(3, min(reps, int(GEMM_PROBE_SECONDS / max(time.perf_counter() - start, 1e-9))))
            rep += 1
    return {name: flops / t / 1e9 for name, t in best.items()}


def gemm_backend(dtype: torch.dtype) -> str:
    """Which GEMM runs the CPU batches of ``dtype`` that the small-M kernel does not take (decided
    once per process, logged): ``"mkl"`` (fp32: MKL's packed GEMM, :data:`PACKED_MIN_ROWS` to
    :data:`PACKED_MAX_ROWS` rows), ``"widen"`` (bf16 without AMX: the same on the widened weight,
    from :data:`MAX_ROWS_VECTOR` + 1 rows), ``"onednn"`` (oneDNN over a prepacked weight: fp32 from
    one row, bf16 without AMX from :data:`MAX_ROWS_VECTOR` + 1 rows), ``"amx"`` (bf16 with AMX: the
    AMX GEMM over a packed copy, or for shapes it refuses oneDNN prepacked for :data:`MAX_ROWS` + 1
    to :data:`ONEDNN_MAX_ROWS` rows) or ``"none"`` (``F.linear``: no extension, packing off, fp16).
    ``RADIXSERVE_CPU_GEMM`` = ``mkl`` or ``onednn`` chooses (bf16 on AMX is always ``"amx"``);
    ``auto`` takes the faster of the two by :func:`measure` (a tie within 1.1x keeps MKL)."""
    key = ("gemm", dtype)
    if key not in _state:
        _state[key] = _choose_backend(dtype)
    return _state[key]  # type: ignore[return-value]


def _choose_backend(dtype: torch.dtype) -> str:
    if dtype not in (torch.float32, torch.bfloat16):
        return "none"
    raw = os.environ.get("RADIXSERVE_CPU_GEMM", "auto").strip().lower() or "auto"
    if raw not in ("auto", "mkl", "onednn"):
        log.warning("RADIXSERVE_CPU_GEMM=%r is not one of auto, mkl, onednn; using auto", raw)
        raw = "auto"
    if raw == "mkl" and dtype == torch.float32:
        return "mkl"  # (without loading the extension: fp32 batches of few rows never need it)
    ops = packed_ops()
    if ops is None:
        return "none"
    onednn = has_onednn_ops(dtype)
    if dtype == torch.bfloat16 and ops.supports_amx():
        return "amx" if onednn else "none"
    native = "mkl" if dtype == torch.float32 else "widen"
    if not onednn:
        if raw == "onednn":
            log.warning(
                "RADIXSERVE_CPU_GEMM=onednn: oneDNN's %s GEMM does not run with this torch on this CPU; using MKL%s",
                str(dtype).removeprefix("torch."),
                " (widened to fp32)" if native == "widen" else "",
            )
        return native
    if raw == "mkl":
        return native
    if raw == "onednn":
        return "onednn"
    rates = measure(dtype, (native, "onednn"))
    choice = "onednn" if rates["onednn"] > 1.1 * rates[native] else native
    log.info(
        "%s GEMM on this CPU (%s rows; %s; %d threads): oneDNN %.0f GFLOP/s, MKL%s %.0f GFLOP/s; using %s (RADIXSERVE_CPU_GEMM=mkl or onednn chooses)",
        str(dtype).removeprefix("torch."),
        ", ".join(map(str, GEMM_PROBE_ROWS)),
        ", ".join(f"{n} x {k}" for n, k in probed_shapes()),
        torch.get_num_threads(),
        rates["onednn"],
        " (widened to fp32)" if native == "widen" else "",
        rates[native],
        "oneDNN" if choice == "onednn" else "MKL",
    )
    return choice


def amx_shape(weight: torch.Tensor) -> bool:
    """Whether ``weight`` (bf16, on a CPU whose backend is ``"amx"``) takes the AMX GEMM: both sizes
    multiples of 32 and the extension built with it."""
    if weight.dim() != 2 or weight.shape[0] % 32 or weight.shape[1] % 32:
        return False
    if "amx_gemm" not in _state:  # (asked once: this runs on every product)
        ops = packed_ops()
        _state["amx_gemm"] = ops is not None and bool(ops.supports_amx_gemm())
    return bool(_state["amx_gemm"])


def amx_first(weight: torch.Tensor) -> bool:
    """Whether ``weight``'s batches of every size, the small-M kernel's too, go to the AMX GEMM: a
    CPU bf16 weight of :func:`amx_shape` where the backend is ``"amx"``."""
    # (is_cpu first: a CUDA model never loads, let alone builds, the CPU extension)
    return weight.is_cpu and weight.dtype == torch.bfloat16 and gemm_backend(torch.bfloat16) == "amx" and amx_shape(weight)


def packed_row_range(dtype: torch.dtype, weight: torch.Tensor | None = None) -> tuple[int, int]:
    """Rows of a batch of ``dtype`` that take the packed copy, inclusive (see :func:`gemm_backend`);
    with ``weight``, for that weight's shape (bf16 on AMX: the AMX GEMM's range, every batch, or
    oneDNN's)."""
    backend = gemm_backend(dtype)
    if backend == "amx" and weight is not None and amx_shape(weight):
        return 1, 1 << 62
    if backend == "mkl":
        return PACKED_MIN_ROWS, PACKED_MAX_ROWS
    if backend == "onednn" and dtype == torch.float32:
        return ONEDNN_FP32_MIN_ROWS, 1 << 62
    if backend in ("onednn", "widen"):
        return MAX_ROWS_VECTOR + 1, 1 << 62
    if backend == "amx":
        return MAX_ROWS + 1, ONEDNN_MAX_ROWS
    return 1, 0

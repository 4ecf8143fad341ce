"""Linear layers that use the small-M kernel of ``csrc/linear.cpp`` for decode batches.

torch's bf16 ``F.linear`` with a handful of rows is no faster than fp32 (it does not stream the
weights at memory bandwidth), and a decode step is nothing but such products. :class:`Linear` is
an ``nn.Linear`` (same parameters, same ``state_dict``, so Hugging Face checkpoints load as
before) whose forward sends ``[..., K]`` inputs with at most :func:`max_rows` rows to the kernel
when the weight is bf16, fp16 or fp32, on the CPU, and the extension is built; everything else
(prefill-sized batches, where the GEMMs below win; autograd; no extension) goes to the GEMM paths
below or ``F.linear``. :func:`logits` is the same for the tied output embedding, with float32
logits written by the kernel directly. The kernel has AMX, AVX-512 and AVX2 paths (the last for
CPUs without AVX-512, e.g. older AMD EPYCs: bf16 widened to fp32 lanes; and for fp32, 1-2 rows
with AVX-512 and 1-4 without, where oneDNN is the fp32 GEMM and the kernel beats it: see
:data:`MAX_ROWS_FP32`; with MKL, fp32 keeps ``F.linear`` there).

fp32 weights on the CPU take MKL's packed GEMM instead for batches of :data:`PACKED_MIN_ROWS` to
:data:`PACKED_MAX_ROWS` rows: torch's fp32 ``F.linear`` re-packs the whole weight on every call,
which at tens of rows costs as much as the product. Each :class:`Linear` (and the model's output
embedding, through :class:`PackedWeight`) keeps MKL's packed copy of its weight
(``torch.ops.radixserve_linear.pack_fp32``), built at first use and rebuilt whenever the weight
changes: it is keyed on the weight tensor itself, its storage and its version counter, so
``param.copy_(...)`` (the loader), ``param.data = ...`` and new parameters (tensor-parallel
sharding) all repack. Only writes through ``param.data`` bypass the version counter: after
those call :meth:`PackedWeight.clear` (or write through the parameter under ``torch.no_grad``).
The packed copy is not a parameter or buffer (``state_dict`` is unchanged). It is about as large
as the weight in resident memory, so it doubles the weight memory of an fp32 model (logged
once); MKL also reserves about 7.6 MiB of address space per packed weight that it never touches.
All copies together stay within half the memory available when the first one was made
(:func:`_reserve`); weights past that budget keep ``F.linear``.

Bit-equality with ``F.linear``: only where MKL's packed kernels add the K products in the same
order as sgemm's, which depends on the shape, the row count and the thread count. Measured here
(2 threads; weights packed for 256 rows): below 16 rows never; at 16-2048 rows the bench model's
K = 512 weights always, but its down_proj (K = 1408) and every real-model shape tried (K >= 896)
never, by a few ulps (~5e-7 of the largest output). ``RADIXSERVE_PACKED_LINEAR`` (read once per
process) chooses:

- ``all`` (the default; also ``1``): every fp32 weight uses its packed copy (at
  :data:`PACKED_MIN_ROWS` to :data:`PACKED_MAX_ROWS` rows), accepting last-bit differences from
  ``F.linear`` for some shapes. fp32 results already differ from transformers' in the last bits
  wherever the batch differs (MKL's small-M path, the attention kernels); what the correctness
  tests hold fixed is the greedy tokens, and those still equal transformers'.
- ``exact``: each weight's packed copy is checked against ``F.linear``
  at :data:`PROBE_ROWS` rows when it is made (it is remade when the thread count changes); a
  weight whose results differ keeps ``F.linear`` (the copy is dropped), so fp32 results do not
  change (as far as that check can tell: it cannot try every row count). On real models (K >=
  896) this keeps every weight on ``F.linear``: the speed-up needs ``all``.
- ``0`` (or ``off``): no packed copies; every fp32 product is ``F.linear``.

Which GEMM runs the larger batches is chosen once per process by :func:`gemm_backend`: MKL
dispatches to its AVX-512 kernels only on Intel CPUs, so on an AMD EPYC with AVX-512 oneDNN's
fp32 GEMM is 2-4x faster than MKL's and its native bf16 GEMM (vdpbf16ps) faster again, while on
Intel MKL's fp32 is as fast. ``auto`` (``RADIXSERVE_CPU_GEMM``, the default) times both on
8-, 64- and 512-row products of the model's own linear shapes when :func:`prepack` runs at load (of
a 1024 x 1024 weight where no model named them first; at most about a second) and logs the rates
and the choice; ``mkl`` or ``onednn`` chooses. With oneDNN, every fp32 batch (from one row) and every bf16 batch
the kernel does not take uses a copy of the weight prepacked for oneDNN
(``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, the ops torch.compile's CPU
freezing uses); ``F.linear`` would re-layout the weight on every call.

bf16 weights on a CPU without AMX where MKL wins take the same packed fp32 GEMM for every batch of
more than :data:`MAX_ROWS_VECTOR` rows (fewer go to the bf16 vector kernel): the weight is widened
to fp32 once (exactly) and packed, the rows are widened per call, and the fp32 sums are rounded to
bf16: the arithmetic of a bf16 GEMM with fp32 accumulation, as oneDNN's, in another summation
order. The packed copy costs twice the bf16 weight memory.

With AMX, bf16 batches of every size run csrc/linear.cpp's AMX GEMM over a copy of the weight
packed into AMX tiles (``pack_amx`` / ``amx_linear``; weights whose two sizes are multiples of 32,
every Llama-family projection and output embedding in practice): oneDNN's bf16 GEMM has slow regimes on these shapes (about 1,000 GFLOP/s on a K = 1408
down_proj at 512-1,088 rows), and at decode sizes the AMX GEMM took 0.48-0.86x of oneDNN's
prepacked time and 0.46-0.84x of the small-M kernel's (``python -m bench roofline --dtype bfloat16
--gemv``; bench/RESULTS.md section 27); the MLP's ``[gate; up]`` projection takes it with
SiLU-and-mul in its epilogue (:func:`linear_silu_and_mul`). Other shapes keep the kernel up to :data:`MAX_ROWS` rows,
oneDNN's prepacked copy to :data:`ONEDNN_MAX_ROWS` and ``F.linear`` beyond. Either copy is as
large as the weight.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model import fused
from radixserve.model.checks import available_memory

log = logging.getLogger("radixserve")

# Most rows sent to the kernel, from `python -m bench roofline --gemv` (the bench model's shapes,
# weights from memory, 1 thread): bf16 on AMX tiles is 1.4-2.4x faster than oneDNN at 1-16 rows
# and 1.06-1.24x at 32; the AMX path stops at 32 rows (beyond, the vector path is 4-5x slower).
# fp16 (fp32 FMAs; also the bf16 path of CPUs without AMX) is compute-bound: 1.06-1.75x faster
# at 1-4 rows, slower from 8. bf16 on vdpbf16ps (AVX512-BF16 without AMX) reads W one row at a
# time at all of its 1-4 rows, 1.1-2.7x faster than 4-column tiles at 3-4 rows on an AMD EPYC
# Zen 4 (bench/RESULTS.md section 24); it is compute-bound by 8 rows in that order too.
MAX_ROWS = 32
MAX_ROWS_VECTOR = 4
# fp32 (8-lane FMA tiles, bound by reading W) against oneDNN's prepacked fp32 GEMM, the bench
# model's shapes with weights from memory, 2 threads (bench/RESULTS.md section 20): on an AVX-512
# AMD EPYC (Zen 4) 1.5-2.4x faster at 1-2 rows (W read one row at a time), 0.7-1.6x at 4 rows
# (`python -m bench roofline --gemv --gemv-rows 1,2,4`); on an AVX2-only one (Zen 1) 1.3-2.1x
# faster at 2-4 rows (0.9-1.1x on the output embedding; a scratch timing, before the one-row order).
MAX_ROWS_FP32 = 4
MAX_ROWS_FP32_AVX512 = 2

# Fewest rows sent to MKL's packed fp32 GEMM. Below 16 rows F.linear's sgemm takes another MKL
# path whose sums differ from the packed kernels' in the last bits (~4e-5 relative at 4 rows, on
# every shape tried), and fp32 output is compared token for token with transformers' greedy
# output by the correctness tests, so those batches (decode steps of up to 15 requests) stay on
# F.linear, although packing would be faster there too (bench model, 2 threads, M=4: 0.18 ms ->
# 0.10 ms). From 16 rows on, some shapes are bit-identical and others not (module docstring).
PACKED_MIN_ROWS = 16
# Most rows sent to it (the default step budget): sgemm's own packing of W is amortized over many
# rows, but not quite. At 2 threads with the bench model's shapes and weights packed for 256 rows,
# the packed path was 1.10-1.22x faster at 256 rows and 1.00-1.08x at 512 with one weight in the
# caches (0.96-1.04x at 1024, 0.94-1.00x at 2048). As the engine runs them, a model's 8 layers of
# weights in turn (90 MiB, out of the caches), the packed GEMM took 0.91x F.linear's time at 512
# rows, 0.94x at 690, 0.96x at 900, 0.97x at 1,100, 0.98x at 1,400 and 1.00x at 2,048 (medians of
# 77-295 alternating pairs); `python -m bench layers --tokens 512,690,1100,2048` (one layer, its
# weights in the caches): F.linear's layer 1.06x, 1.04x, 1.04x and 0.98x the packed one's time
# (bench/RESULTS.md section 37). Larger batches keep F.linear.
PACKED_MAX_ROWS = 2048
# Row counts at which the "exact" policy compares a new packed copy with F.linear (random inputs:
# a different summation order shows in some of the outputs). With weights packed for 256 rows
# (pack_fp32's default) a shape agreed at all of 16-2048 rows or at none here; 17 is there because
# other packings disagreed at odd row counts only.
PROBE_ROWS = (16, 17, 64)
# Rows of the products gemm_backend() times to choose between MKL and oneDNN: a small decode batch
# (below MKL's packed range, where fp32 stays on F.linear; above the bf16 kernel's), a fleet's and
# a prefill chunk's. Without the 512 rows, the bench model's shapes on an Intel Xeon with AMX timed
# oneDNN 1.06-1.14x faster (MKL's F.linear at 8 rows is slow), while prefill-heavy work ran 10%
# slower on oneDNN (bench/RESULTS.md section 31); with them, 1.00-1.05x: inside the margin, MKL
# stays (in five of six loads there; the sixth measured MKL slow and took oneDNN).
GEMM_PROBE_ROWS = (8, 64, 512)
# The weight shapes (out, in) it times where no model named its own (probe_shapes). A square probe
# can tie where the model's shapes do not: on an Intel Xeon with AMX (bench/RESULTS.md section 31)
# MKL and oneDNN were within 1.1x of each other at 1024 x 1024, so the choice flipped from load
# to load, while on the bench model's K = 512 shapes oneDNN took 1.04-1.16x MKL's time from 64
# rows on.
GEMM_PROBE_SHAPES = ((1024, 1024),)
# Seconds the probe aims to spend per dtype (fewer repetitions on a large model, never under 3).
GEMM_PROBE_SECONDS = 1.0
# Most elements of one probed weight: a larger model's shapes keep their K (the inner size, which
# sets the GEMMs' blocking) with fewer output rows, so the probe's memory and time stay small
# (the bench model's largest, 2816 x 512, is whole).
GEMM_PROBE_MAX_ELEMENTS = 1 << 21
# Fewest rows of an fp32 batch sent to oneDNN where it is the backend: on the AMD EPYC (Zen 5) of
# bench/RESULTS.md section 18 it was faster than F.linear (MKL) from one row in a scratch timing of
# the bench model's shapes (1.0-3.7x at 1 row, the most on a 49152-row output embedding; 2.2-4x
# from 8 to 2048 rows), and `python -m bench roofline` steps at batch 1 run it.
ONEDNN_FP32_MIN_ROWS = 1
# Most rows of a bf16 batch sent to oneDNN with a prepacked weight (torch.ops.mkldnn's
# _reorder_linear_weight / _linear_pointwise, the ops torch.compile's CPU freezing uses) on a CPU
# with AMX; fewer than MAX_ROWS + 1 go to the kernel. F.linear hands oneDNN the plain weight every
# call: 2 threads, the bench model's five shapes, F.linear time / prepacked time at 33 / 64 / 128
# rows: 1.39-1.86 / 1.25-2.02 / 1.17-1.73; from 256 rows some shapes lose (0.69-0.81 at 256-320).
# (Only for weights the AMX GEMM cannot take: see _amx_shape.)
ONEDNN_MAX_ROWS = 128
POLICIES = ("off", "exact", "all")

_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_state: dict[object, object] = {}


def kernel():
    """``torch.ops.radixserve_linear.linear`` or None when the extension is unavailable."""
    if "op" not in _state:
        from radixserve.attention import cpu_ext

        op, limits = None, {}
        ns = cpu_ext.ops("radixserve_linear", "linear")
        if ns is not None:
            op = ns.linear
            if ns.supports_bf16():
                limits[torch.bfloat16] = MAX_ROWS if ns.supports_amx() else MAX_ROWS_VECTOR
            if ns.supports_fp16():
                limits[torch.float16] = MAX_ROWS_VECTOR
            # fp32: decided at the first fp32 batch (_limit), not to time fp32 GEMMs for a bf16 model
        _state["limits"] = limits
        _state["op"] = op
    return _state["op"]


def max_rows(dtype: torch.dtype) -> int:
    """Most rows :func:`linear` sends to the kernel for ``dtype`` (0: never)."""
    if dtype not in _KERNEL_DTYPES or kernel() is None:
        return 0
    return _limit(dtype)


def _limit(dtype: torch.dtype) -> int:
    """The kernel's row limit for ``dtype`` (after :func:`kernel`), decided once. :func:`kernel`
    sets bf16's and fp16's; fp32 goes to the kernel only where oneDNN is the fp32 GEMM it was
    measured against (:data:`MAX_ROWS_FP32`); with MKL it keeps ``F.linear`` below
    :data:`PACKED_MIN_ROWS` rows, as before the kernel had an fp32 path."""
    limit = _state["limits"].get(dtype)  # type: ignore[attr-defined]
    if limit is not None:
        return limit
    limit = 0
    if dtype == torch.float32 and _state["op"] is not None and gemm_backend(dtype) == "onednn":
        if torch.ops.radixserve_linear.supports_fp32():
            avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
            limit = MAX_ROWS_FP32_AVX512 if avx512 else MAX_ROWS_FP32
    _state["limits"][dtype] = limit  # type: ignore[index]
    return limit


def _usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # cheapest tests first: this runs for every layer of every step (about 2 us in all)
    if weight.dtype not in _KERNEL_DTYPES or x.dtype != weight.dtype or not (x.is_cpu and weight.is_cpu):
        return False  # (a CUDA model never loads, let alone builds, the CPU extension)
    if _state.get("op") is None and kernel() is None:
        return False
    rows = x.numel()
    if rows == 0 or rows > _limit(weight.dtype) * x.shape[-1]:
        return False
    if weight.dim() != 2 or weight.stride(-1) != 1:
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))  # no backward


def packed_policy() -> str:
    """``RADIXSERVE_PACKED_LINEAR`` as one of :data:`POLICIES` (read once per process)."""
    if "policy" not in _state:
        raw = os.environ.get("RADIXSERVE_PACKED_LINEAR", "all").strip().lower()
        policy = {"0": "off", "off": "off", "false": "off", "no": "off",
                  "1": "all", "": "all", "exact": "exact", "all": "all"}.get(raw)
        if policy is None:
            log.warning("RADIXSERVE_PACKED_LINEAR=%r is not one of 0, exact, all; using all", raw)
            policy = "all"
        _state["policy"] = policy
    return _state["policy"]  # type: ignore[return-value]


def packed_ops():
    """``torch.ops.radixserve_linear`` when the packed fp32 path is on (the extension is built with
    ``pack_fp32`` and ``RADIXSERVE_PACKED_LINEAR`` is not 0), else None."""
    if "packed" not in _state:
        ns = None
        if packed_policy() == "off":
            log.info("RADIXSERVE_PACKED_LINEAR=0: fp32 linear layers use F.linear (no packed weights)")
        else:
            from radixserve.attention import cpu_ext

            ns = cpu_ext.ops("radixserve_linear", "pack_fp32")
        _state["packed"] = ns
    return _state["packed"]


def _bit_identical(weight: torch.Tensor, packed: torch.Tensor, ops) -> bool:
    """Whether the packed copy's products equal F.linear's bit for bit at :data:`PROBE_ROWS` rows."""
    n, k = weight.shape
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in ((1, 4, *PROBE_ROWS) if packed.is_mkldnn else PROBE_ROWS):  # (oneDNN runs from 1 row)
            x = torch.randn(m, k, generator=g)
            y = _onednn_linear(x, packed, None) if packed.is_mkldnn else ops.packed_linear(x, packed, n, k, None)
            if not torch.equal(y, F.linear(x, weight)):
                return False
    return True


def _reserve(nbytes: int) -> bool:
    """Take ``nbytes`` from the budget of packed copies: half the memory that was available when
    the first copy was made, so packing never takes the memory a large model needs (the copies
    double an fp32 model's weights and triple a widened bf16 one's). Past it, weights stay on
    F.linear, logged once."""
    budget = _state.get("pack_budget")
    if budget is None:
        budget = available_memory() // 2
    if nbytes > budget:  # type: ignore[operator]
        if not _state.get("budget_logged"):
            _state["budget_logged"] = True
            log.warning("packed weight copies: the budget (half the memory available at the first one) is spent; "
                        "the remaining linear layers use F.linear (RADIXSERVE_PACKED_LINEAR=0 turns packing off)")
        _state["pack_budget"] = budget
        return False
    _state["pack_budget"] = budget - nbytes  # type: ignore[operator]
    return True


def _release(nbytes: int) -> None:
    if "pack_budget" in _state:
        _state["pack_budget"] += nbytes  # type: ignore[operator]


class PackedWeight:
    """The packed copy of one weight for its GEMM backend (MKL's packed fp32, oneDNN's prepacked
    layout, or the AMX GEMM's tiles; :func:`gemm_backend`), rebuilt when the weight or the backend
    changes.

    Not a tensor attribute of the module (so not in ``state_dict``, ``parameters()`` or what
    ``Module.to`` moves). :meth:`get` returns the packed tensor for ``weight`` (None: use
    ``F.linear``), packing it when the cached copy was made from another tensor, another storage
    or shape, or before the weight's last in-place write (its ``_version``). Copies and pickles
    start empty."""

    def __init__(self) -> None:
        # (weakref to the weight, key, packed or None): replaced whole, so a concurrent reader
        # never pairs one weight's key with another's packed copy
        self._entry: tuple | None = None

    def clear(self) -> None:
        """Drop the packed copy (its memory); the next :meth:`get` repacks."""
        self._entry = None

    @staticmethod
    def _key(weight: torch.Tensor) -> tuple:
        # the thread count too: MKL's summation order can depend on it, and MKL's docs advise
        # packing and computing with the same number of threads
        return (weight.data_ptr(), weight._version, tuple(weight.shape), weight.stride(), torch.get_num_threads())

    def get(self, weight: torch.Tensor, ops) -> torch.Tensor | None:
        exact = packed_policy() == "exact"
        entry = self._entry
        backend = gemm_backend(weight.dtype)
        key = (*self._key(weight), backend)
        if entry is not None and entry[0]() is weight and entry[1] == key:
            return entry[2]
        self._entry = None  # free the stale copy before packing the new one
        amx = backend == "amx" and _amx_shape(weight)
        onednn = backend in ("onednn", "amx") and not amx
        widened = backend == "widen"
        # (MKL's packed copy is about the fp32 weight's size, oneDNN's and the AMX GEMM's the weight's own)
        nbytes = (weight.element_size() if onednn or amx else 4) * weight.numel()
        if not _reserve(nbytes):
            self._entry = (weakref.ref(weight), key, None)
            return None
        if amx:
            packed = ops.pack_amx(weight.detach())
        elif onednn:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        else:
            packed = ops.pack_fp32(weight.detach().float() if widened else weight.detach())
        weakref.finalize(packed, _release, nbytes)  # back to the budget when the copy is freed
        if exact and weight.dtype == torch.float32 and not _bit_identical(weight, packed, ops):
            packed = None
            shapes: set = _state.setdefault("inexact_shapes", set())  # type: ignore[assignment]
            if tuple(weight.shape) not in shapes:
                shapes.add(tuple(weight.shape))
                log.info("%s linear %dx%d: the packed GEMM is not bit-identical to F.linear at this shape; "
                         "it keeps F.linear (RADIXSERVE_PACKED_LINEAR=all packs it anyway)",
                         str(weight.dtype).removeprefix("torch."), *weight.shape)
        elif amx:
            if not _state.get("amx_logged"):
                _state["amx_logged"] = True
                log.info("bf16 linear layers: keeping AMX-packed copies of the weights for batches of every size "
                         "(as much memory again as the weights); RADIXSERVE_PACKED_LINEAR=0 turns this off")
        elif onednn:
            if not _state.get(("onednn_logged", weight.dtype)):
                _state[("onednn_logged", weight.dtype)] = True
                lo, hi = packed_row_range(weight.dtype)
                log.info("%s linear layers: keeping oneDNN-prepacked copies of the weights for batches of %d%s rows "
                         "(as much memory again as the weights); RADIXSERVE_PACKED_LINEAR=0 turns this off",
                         str(weight.dtype).removeprefix("torch."), lo, f"-{hi}" if hi < 1 << 40 else " or more")
        elif widened:
            if not _state.get("widened_logged"):
                _state["widened_logged"] = True
                log.info("bf16 linear layers (no AMX on this CPU): keeping fp32 MKL-packed copies of the weights for "
                         "batches of more than %d rows (twice the bf16 weight memory); RADIXSERVE_PACKED_LINEAR=0 "
                         "turns this off", MAX_ROWS_VECTOR)
        elif not _state.get("packed_logged"):
            _state["packed_logged"] = True
            log.info("fp32 linear layers: keeping MKL-packed copies of the weights for batches of %d-%d rows, "
                     "about as large as the weights (up to twice the fp32 weight memory); "
                     "RADIXSERVE_PACKED_LINEAR=0 turns this off", PACKED_MIN_ROWS, PACKED_MAX_ROWS)
        self._entry = (weakref.ref(weight), key, packed)
        return packed

    def __deepcopy__(self, memo) -> PackedWeight:
        return PackedWeight()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._entry = None


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's product of ``x`` with a weight prepacked by ``_reorder_linear_weight``."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _has_onednn_ops(dtype: torch.dtype = torch.float32) -> bool:
    """torch has oneDNN's prepacked linear ops, and for bf16 this CPU runs them (oneDNN's bf16
    needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only CPU has fp32 only)."""
    mk = getattr(torch.ops, "mkldnn", None)
    if not (torch.backends.mkldnn.is_available() and hasattr(mk, "_reorder_linear_weight")
            and hasattr(mk, "_linear_pointwise")):
        return False
    return dtype != torch.bfloat16 or bool(getattr(mk, "_is_mkldnn_bf16_supported", lambda: True)())


def probe_shapes(model: nn.Module) -> None:
    """Have :func:`gemm_backend` time ``model``'s own linear shapes (its :class:`Linear` weights,
    one of each shape, at most :data:`GEMM_PROBE_MAX_ELEMENTS`; the output embedding is left out:
    only sampled rows run it) rather than :data:`GEMM_PROBE_SHAPES`. Effective until a dtype's
    backend is chosen (once per process)."""
    shapes = {(min(n, max(64, GEMM_PROBE_MAX_ELEMENTS // k // 64 * 64)), k) for n, k in
              (tuple(m.weight.shape) for m in model.modules() if isinstance(m, Linear) and m.weight.dim() == 2)}
    if shapes:
        _state["probe_shapes"] = tuple(sorted(shapes))


def _probed_shapes() -> tuple[tuple[int, int], ...]:
    return _state.get("probe_shapes") or GEMM_PROBE_SHAPES  # type: ignore[return-value]


def _measure(dtype: torch.dtype, candidates: tuple[str, ...], reps: int = 9) -> dict[str, float]:
    """GFLOP/s of each candidate backend on products of :data:`GEMM_PROBE_ROWS` rows with each
    weight shape of :func:`probe_shapes` (or :data:`GEMM_PROBE_SHAPES`) in ``dtype``, each run as
    the engine runs it: "mkl" (fp32: ``F.linear`` below :data:`PACKED_MIN_ROWS` rows, MKL's packed
    GEMM from there), "widen" (bf16 rows widened to the packed fp32 GEMM, the sums rounded back)
    or "onednn" (oneDNN over a prepacked weight). The candidates take turns and each keeps its
    best time, so a burst of load on a shared machine slows one repetition of both rather than all
    of one; at most ``reps`` timed rounds, fewer where a round is long (:data:`GEMM_PROBE_SECONDS`)."""
    ops = packed_ops()
    g = torch.Generator().manual_seed(0)
    shapes = _probed_shapes()
    flops = 2.0 * sum(GEMM_PROBE_ROWS) * sum(n * k for n, k in shapes)
    products: dict[str, list[Callable[[], torch.Tensor]]] = {name: [] for name in candidates}
    with torch.no_grad():
        for n, k in shapes:
            w = torch.randn(n, k, generator=g).to(dtype)
            xs = [torch.randn(rows, k, generator=g).to(dtype) for rows in GEMM_PROBE_ROWS]
            for name, fns in products.items():
                if name == "onednn":
                    od = torch.ops.mkldnn._reorder_linear_weight(w)
                    fns += [functools.partial(_onednn_linear, x, od, None) for x in xs]
                    continue
                packed = ops.pack_fp32(w.float())
                fns += [functools.partial(F.linear, x, w) if name == "mkl" and x.shape[0] < PACKED_MIN_ROWS
                        else functools.partial(lambda x, p, n, k: ops.packed_linear(x.float(), p, n, k, None).to(dtype),
                                               x, packed, n, k)
                        for x in xs]
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
    """Which GEMM runs the batches of ``dtype`` that do not go to the small-M kernel, on this CPU
    (decided once per process, logged): ``"mkl"`` (fp32: MKL's packed GEMM, :data:`PACKED_MIN_ROWS`
    to :data:`PACKED_MAX_ROWS` rows), ``"widen"`` (bf16 without AMX: the same, on the widened weight,
    from :data:`MAX_ROWS_VECTOR` + 1 rows), ``"onednn"`` (oneDNN over a prepacked weight: fp32 from
    one row, bf16 without AMX from :data:`MAX_ROWS_VECTOR` + 1 rows), ``"amx"`` (bf16 with AMX: the
    AMX GEMM over a packed copy from :data:`MAX_ROWS` + 1 rows, or for shapes it does not take
    oneDNN prepacked for :data:`MAX_ROWS` + 1 to :data:`ONEDNN_MAX_ROWS` rows) or ``"none"``
    (``F.linear`` for all of them: no extension, packing off, fp16).

    ``RADIXSERVE_CPU_GEMM`` = ``mkl`` or ``onednn`` chooses (bf16 on AMX is always ``"amx"``);
    ``auto`` (the default) measures both (:func:`_measure`) and takes the faster: MKL dispatches
    to AVX-512 only on Intel CPUs, so on an AMD EPYC with AVX-512 oneDNN's fp32 GEMM is 2-4x faster
    than MKL's, and its native bf16 GEMM (vdpbf16ps) another 1.5-2x (``python -m bench floor``); on
    an AVX2-only EPYC MKL's fp32 F.linear at a few rows is 2-4x slower than oneDNN's; on other CPUs
    MKL's fp32 is as fast and stays (a tie keeps MKL)."""
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
    onednn = _has_onednn_ops(dtype)
    if dtype == torch.bfloat16 and ops.supports_amx():
        return "amx" if onednn else "none"
    native = "mkl" if dtype == torch.float32 else "widen"
    if not onednn:
        if raw == "onednn":
            log.warning("RADIXSERVE_CPU_GEMM=onednn: oneDNN's %s GEMM does not run with this torch on this CPU; "
                        "using MKL%s", str(dtype).removeprefix("torch."), " (widened to fp32)" if native == "widen" else "")
        return native
    if raw == "mkl":
        return native
    if raw == "onednn":
        return "onednn"
    rates = _measure(dtype, (native, "onednn"))
    choice = "onednn" if rates["onednn"] > 1.1 * rates[native] else native
    log.info("%s GEMM on this CPU (%s rows; %s; %d threads): oneDNN %.0f GFLOP/s, MKL%s %.0f GFLOP/s; "
             "using %s (RADIXSERVE_CPU_GEMM=mkl or onednn chooses)", str(dtype).removeprefix("torch."),
             ", ".join(map(str, GEMM_PROBE_ROWS)), ", ".join(f"{n} x {k}" for n, k in _probed_shapes()),
             torch.get_num_threads(), rates["onednn"],
             " (widened to fp32)" if native == "widen" else "", rates[native],
             "oneDNN" if choice == "onednn" else "MKL")
    return choice


def _amx_shape(weight: torch.Tensor) -> bool:
    """Whether ``weight`` (bf16, on a CPU whose backend is ``"amx"``) takes the AMX GEMM: both sizes
    multiples of 32 and the extension built with it."""
    if weight.dim() != 2 or weight.shape[0] % 32 or weight.shape[1] % 32:
        return False
    if "amx_gemm" not in _state:  # (asked once: this runs on every product)
        ops = packed_ops()
        _state["amx_gemm"] = ops is not None and bool(ops.supports_amx_gemm())
    return bool(_state["amx_gemm"])


def _amx_first(weight: torch.Tensor) -> bool:
    """Whether ``weight``'s batches of every size go to the AMX GEMM, the small-M kernel's rows
    too: a bf16 weight of :func:`_amx_shape` where the backend is ``"amx"``. Reading its packed
    tiles, the GEMM streams the weights faster than the kernel reads their rows: 0.46-0.84x of
    the kernel's time at 1-32 rows on every bench-model shape (2 threads, weights from memory;
    ``python -m bench roofline --dtype bfloat16 --gemv``, bench/RESULTS.md section 27)."""
    # (is_cpu first: a CUDA model never loads, let alone builds, the CPU extension)
    return weight.is_cpu and weight.dtype == torch.bfloat16 and gemm_backend(torch.bfloat16) == "amx" and \
        _amx_shape(weight)


def packed_row_range(dtype: torch.dtype, weight: torch.Tensor | None = None) -> tuple[int, int]:
    """Rows of a batch of ``dtype`` that take the packed copy, inclusive (see :func:`gemm_backend`);
    with ``weight``, for that weight's shape (bf16 on AMX: the AMX GEMM's range, every batch, or
    oneDNN's)."""
    backend = gemm_backend(dtype)
    if backend == "amx" and weight is not None and _amx_shape(weight):
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


def _packable(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can have a packed copy (before looking at any batch): an fp32 weight (or a
    bf16 one where bf16 runs widened) on the CPU, a 2-D row-major non-inference tensor."""
    if not weight.is_cpu or weight.dim() != 2 or weight.stride(-1) != 1 or weight.is_inference():
        return False
    if weight.dtype not in (torch.float32, torch.bfloat16) or packed_ops() is None:
        return False
    return gemm_backend(weight.dtype) != "none"


def prepack(model: nn.Module) -> int:
    """Make the packed copy of every weight that will use one, now (at load) rather than at the
    first batch that needs it: packing the bench model's output embedding alone takes ~110 ms,
    which a served step (and whichever requests were in it) would otherwise pay. Covers every
    :class:`Linear` and, for a model with an ``output_packed`` cache, its ``output_embedding``.
    Packs for the current thread count (set it first: a later change repacks at first use).
    Returns the number of weights packed; 0 when packing is off or nothing qualifies."""
    probe_shapes(model)  # (before _packable: it asks for the backend, which may time them)
    pairs = [(m.weight, m.packed) for m in model.modules() if isinstance(m, Linear)]
    cache = getattr(model, "output_packed", None)
    if isinstance(cache, PackedWeight) and model.output_embedding is not None:
        pairs.append((model.output_embedding, cache))  # type: ignore[arg-type]
    packable = [(w, c) for w, c in pairs if _packable(w)]
    if not packable:
        return 0
    ops = packed_ops()
    t0 = time.perf_counter()
    done = sum(c.get(w, ops) is not None for w, c in packable)
    log.info("packed %d of %d linear weights in %.2f s (GEMM backends: %s)", done, len(packable),
             time.perf_counter() - t0, ", ".join(sorted({f"{str(w.dtype).removeprefix('torch.')} {gemm_backend(w.dtype)}"
                                                         for w, _ in packable})))
    return done


def _packed_usable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    # cheapest tests first; fp32 batches below PACKED_MIN_ROWS never load the extension while
    # MKL is the backend
    if x.dtype != weight.dtype or not x.is_cpu:
        return False
    k = x.shape[-1] if x.dim() else 0
    if k == 0 or weight.dim() != 2 or weight.shape[1] != k:
        return False
    if torch.is_grad_enabled() and x.requires_grad:
        return False  # no backward through the packed op
    return _packed_rows(x.numel() // k, weight, bias)


def _packed_rows(rows: int, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a batch of ``rows`` rows of the weight's dtype (and device, not requiring grad)
    takes ``weight``'s packed copy in :func:`linear`: the checks that need only the batch's
    shape, so that :func:`prepacked_weight` makes no tensor to ask."""
    if not weight.is_cpu or weight.dtype not in (torch.float32, torch.bfloat16) or rows <= 0:
        return False
    if weight.dtype == torch.float32:
        if rows < PACKED_MIN_ROWS and gemm_backend(torch.float32) != "onednn":
            return False
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_cpu):
            return False  # (F.linear refuses or converts it, as before)
    else:
        if bias is not None and (bias.dtype not in (torch.float32, torch.bfloat16) or not bias.is_cpu):
            return False
    lo, hi = packed_row_range(weight.dtype, weight)
    if not lo <= rows <= hi:
        return False
    if weight.dim() != 2 or weight.stride(-1) != 1 or weight.is_inference():
        return False  # (an inference tensor has no version counter to key the packed copy on)
    if torch.is_grad_enabled() and weight.requires_grad:
        return False  # no backward through the packed op
    return packed_ops() is not None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as 2-D rows of its last dimension, that dimension contiguous (what the native ops take)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   packed: PackedWeight, fp32_out: bool = False) -> torch.Tensor | None:
    """The packed product, or None when this weight keeps F.linear (not bit-identical). With
    ``fp32_out``, float32: the AMX GEMM's unrounded sums, the other GEMMs' results cast."""
    ops = packed_ops()
    buf = packed.get(weight, ops)
    if buf is None:
        return None
    n, k = weight.shape
    if not buf.is_mkldnn and buf.dim() == 4:  # the AMX GEMM's packed tiles (pack_amx)
        return ops.amx_linear(_rows(x), buf, bias, fp32_out).view(*x.shape[:-1], n)
    y = _other_packed_linear(x, weight, bias, buf, ops)
    return y.float() if fp32_out else y


def _other_packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, buf: torch.Tensor,
                         ops) -> torch.Tensor:
    """oneDNN's product over its prepacked copy, or MKL's over its packed fp32 one."""
    n, k = weight.shape
    if buf.is_mkldnn:  # oneDNN over the prepacked weight
        return _onednn_linear(x, buf, None if bias is None else bias.to(weight.dtype))
    if weight.dtype == torch.bfloat16:  # widened: fp32 rows in, fp32 sums rounded to bf16 out
        fb = None if bias is None else bias.float()
        return ops.packed_linear(x.reshape(-1, k).float(), buf, n, k, fb).view(*x.shape[:-1], n).to(x.dtype)
    if x.dim() == 2 and x.stride(-1) == 1:
        return ops.packed_linear(x, buf, n, k, bias)
    return ops.packed_linear(_rows(x), buf, n, k, bias).view(*x.shape[:-1], n)


def prepacked_weight(rows: int, weight: torch.Tensor, bias: torch.Tensor | None,
                     packed: PackedWeight) -> torch.Tensor | None:
    """The prepacked copy of ``weight`` (oneDNN's, or the AMX GEMM's 4-D tiles) that :func:`linear`
    multiplies a batch of ``rows`` rows (of the weight's dtype) by, or None when it would take
    another path for that batch (the small-M kernel, MKL, F.linear). For callers that run the same
    products natively (csrc/decode.cpp), so that they stay bit-identical to :func:`linear`."""
    if not _packed_rows(rows, weight, bias) or (rows <= max_rows(weight.dtype) and not _amx_first(weight)):
        return None
    buf = packed.get(weight, packed_ops())
    return buf if buf is not None and (buf.is_mkldnn or buf.dim() == 4) else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           fp32_out: bool = False, packed: PackedWeight | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (cast to float32 when ``fp32_out``) through the small-M kernel
    when it applies. With ``fp32_out`` the kernel writes its fp32 sums without a bf16 rounding.
    With ``packed`` (the cache of ``weight``'s packed copy), fp32 batches of
    :data:`PACKED_MIN_ROWS` to :data:`PACKED_MAX_ROWS` rows run MKL's packed GEMM (see the module
    docstring)."""
    if packed is not None and _amx_first(weight) and _packed_usable(x, weight, bias):
        y = _packed_linear(x, weight, bias, packed, fp32_out)  # (None: no memory for the copy; the kernel then)
        if y is not None:
            return y
    if _usable(x, weight):
        op = _state["op"]
        if x.dim() == 2 and x.stride(-1) == 1:  # the decode case: no reshaping
            return op(x, weight, bias, fp32_out)  # type: ignore[operator]
        return op(_rows(x), weight, bias, fp32_out).view(*x.shape[:-1], weight.shape[0])  # type: ignore[operator]
    if packed is not None and _packed_usable(x, weight, bias):
        y = _packed_linear(x, weight, bias, packed, fp32_out)
        if y is not None:
            return y
    y = F.linear(x, weight, bias)
    return y.float() if fp32_out else y


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                        packed: PackedWeight | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``linear(x, weight, bias)`` for a ``[gate; up]`` weight (the model's
    ``gate_up_proj``). Where :func:`linear` would take the AMX GEMM's packed copy (bf16 on AMX;
    csrc/decode.cpp decides alike from :func:`prepacked_weight`), the GEMM applies the activation
    to its fp32 sums as they leave the tiles (``amx_linear_silu``): no ``[rows, 2 * inter]``
    product written and read back, no separate pass, no bf16 rounding of gate and up. Elsewhere
    the product, then :func:`radixserve.model.fused.silu_and_mul`."""
    if packed is not None and _amx_first(weight) and _packed_usable(x, weight, bias):  # (as linear's first branch)
        buf = packed.get(weight, packed_ops())
        if buf is not None and not buf.is_mkldnn and buf.dim() == 4:
            return packed_ops().amx_linear_silu(_rows(x), buf, bias).view(*x.shape[:-1], weight.shape[0] // 2)
    return fused.silu_and_mul(linear(x, weight, bias, packed=packed))


def logits(x: torch.Tensor, output_embedding: torch.Tensor, packed: PackedWeight | None = None) -> torch.Tensor:
    """Float32 logits ``x @ output_embedding.T`` (the tied or untied lm_head); ``packed``: the
    cache of the embedding's packed fp32 copy (the caller's, kept as long as the model).

    Rounded to the model's dtype first, whichever path runs: F.linear rounds bf16 logits, so the
    kernel's unrounded fp32 sums would make greedy ties break differently with the batch size."""
    return linear(x, output_embedding, packed=packed).float()


class Linear(nn.Linear):
    """``nn.Linear`` whose forward uses :func:`linear`: the kernel for small bf16/fp16 batches,
    the packed GEMM of :func:`gemm_backend` (over a packed copy of the weight, :attr:`packed`) for
    larger ones."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.packed = PackedWeight()  # a plain attribute: not a parameter, buffer or submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, packed=self.packed)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of this ``[gate; up]`` projection (:func:`linear_silu_and_mul`)."""
        return linear_silu_and_mul(x, self.weight, self.bias, packed=self.packed)

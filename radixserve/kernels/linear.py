"""Linear layers on the CPU kernels: csrc/linear.cpp's small-M kernel for decode-sized batches,
the packed GEMM of :func:`radixserve.kernels.gemm.gemm_backend` for larger ones, ``F.linear``
for everything else.

Contract: :func:`linear` returns ``F.linear(x, weight, bias)`` (float32 with ``fp32_out``) of any
device, dtype or shape. It sends CPU bf16/fp16/fp32 batches of at most :func:`max_rows` rows to
the kernel, and with a :class:`~radixserve.kernels.packed.PackedWeight` the batches in
:func:`~radixserve.kernels.gemm.packed_row_range` to the weight's packed copy (bf16 on AMX: every
batch, where the weight's shape allows); results may differ from ``F.linear``'s in the last bits
(the order of the sums), never more. Nothing here runs backward: a batch or weight that requires
grad takes ``F.linear``. :class:`Linear` is an ``nn.Linear`` (same parameters and ``state_dict``)
whose forward is :func:`linear`. Row limits and timings: docs/KERNELS.md.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.kernels import build, gemm, layers
from radixserve.kernels.packed import PackedWeight

log = logging.getLogger("radixserve")

_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_state: dict[object, object] = {}


def kernel():
    """``torch.ops.radixserve_linear.linear`` or None when the extension is unavailable."""
    if "op" not in _state:
        op, limits = None, {}
        ns = build.ops("radixserve_linear", "linear")
        if ns is not None:
            op = ns.linear
            if ns.supports_bf16():
                limits[torch.bfloat16] = gemm.MAX_ROWS if ns.supports_amx() else gemm.MAX_ROWS_VECTOR
            if ns.supports_fp16():
                limits[torch.float16] = gemm.MAX_ROWS_VECTOR
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
    """The kernel's row limit for ``dtype`` (after :func:`kernel`), decided once: fp32 goes to the
    kernel only where oneDNN is the fp32 GEMM it was measured against."""
    limit = _state["limits"].get(dtype)  # type: ignore[attr-defined]
    if limit is not None:
        return limit
    limit = 0
    if dtype == torch.float32 and _state["op"] is not None and gemm.gemm_backend(dtype) == "onednn":
        if torch.ops.radixserve_linear.supports_fp32():
            avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
            limit = gemm.MAX_ROWS_FP32_AVX512 if avx512 else gemm.MAX_ROWS_FP32
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


def _packable(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can have a packed copy (before looking at any batch): a 2-D row-major
    fp32 or bf16 CPU weight, not an inference tensor, whose dtype has a GEMM backend."""
    if not weight.is_cpu or weight.dim() != 2 or weight.stride(-1) != 1 or weight.is_inference():
        return False
    if weight.dtype not in (torch.float32, torch.bfloat16) or gemm.packed_ops() is None:
        return False
    return gemm.gemm_backend(weight.dtype) != "none"


def probe_shapes(model: nn.Module) -> None:
    """Have :func:`~radixserve.kernels.gemm.gemm_backend` time ``model``'s own :class:`Linear`
    shapes (the output embedding left out: only sampled rows run it)."""
    gemm.set_probe_shapes({(m.weight.shape[0], m.weight.shape[1]) for m in model.modules() if isinstance(m, Linear) and m.weight.dim() == 2})


def prepack(model: nn.Module) -> int:
    """Make the packed copy of every weight that will use one now, at load, rather than in the
    first batch that needs it: every :class:`Linear` and, for a model with an ``output_packed``
    cache, its ``output_embedding``. Packs for the current thread count (a later change repacks
    at first use). Returns the number of weights packed."""
    probe_shapes(model)  # (before _packable: it asks for the backend, which may time them)
    pairs = [(m.weight, m.packed) for m in model.modules() if isinstance(m, Linear)]
    cache = getattr(model, "output_packed", None)
    if isinstance(cache, PackedWeight) and model.output_embedding is not None:
        pairs.append((model.output_embedding, cache))  # type: ignore[arg-type]
    packable = [(w, c) for w, c in pairs if _packable(w)]
    if not packable:
        return 0
    ops = gemm.packed_ops()
    t0 = time.perf_counter()
    done = sum(c.get(w, ops) is not None for w, c in packable)
    log.info(
        "packed %d of %d linear weights in %.2f s (GEMM backends: %s)",
        done,
        len(packable),
        time.perf_counter() - t0,
        ", ".join(sorted({f"{str(w.dtype).removeprefix('torch.')} {gemm.gemm_backend(w.dtype)}" for w, _ in packable})),
    )
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
    """Whether a batch of ``rows`` rows of the weight's dtype takes ``weight``'s packed copy in
    :func:`linear`: the checks that need only the batch's shape."""
    if not weight.is_cpu or weight.dtype not in (torch.float32, torch.bfloat16) or rows <= 0:
        return False
    if weight.dtype == torch.float32:
        if rows < gemm.PACKED_MIN_ROWS and gemm.gemm_backend(torch.float32) != "onednn":
            return False
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_cpu):
            return False  # (F.linear refuses or converts it, as before)
    else:
        if bias is not None and (bias.dtype not in (torch.float32, torch.bfloat16) or not bias.is_cpu):
            return False
    lo, hi = gemm.packed_row_range(weight.dtype, weight)
    if not lo <= rows <= hi:
        return False
    if weight.dim() != 2 or weight.stride(-1) != 1 or weight.is_inference():
        return False  # (an inference tensor has no version counter to key the packed copy on)
    if torch.is_grad_enabled() and weight.requires_grad:
        return False  # no backward through the packed op
    return gemm.packed_ops() is not None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as 2-D rows of its last dimension, that dimension contiguous (what the native ops take)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight, fp32_out: bool = False) -> torch.Tensor | None:
    """The packed product, or None when this weight keeps F.linear. With ``fp32_out``, float32:
    the AMX GEMM's unrounded sums, the other GEMMs' results cast."""
    ops = gemm.packed_ops()
    buf = packed.get(weight, ops)
    if buf is None:
        return None
    n, k = weight.shape
    if not buf.is_mkldnn and buf.dim() == 4:  # the AMX GEMM's packed tiles (pack_amx)
        return ops.amx_linear(_rows(x), buf, bias, fp32_out).view(*x.shape[:-1], n)
    if buf.is_mkldnn:  # oneDNN over the prepacked weight
        y = gemm.onednn_linear(x, buf, None if bias is None else bias.to(weight.dtype))
    elif weight.dtype == torch.bfloat16:  # widened: fp32 rows in, fp32 sums rounded to bf16 out
        fb = None if bias is None else bias.float()
        y = ops.packed_linear(x.reshape(-1, k).float(), buf, n, k, fb).view(*x.shape[:-1], n).to(x.dtype)
    elif x.dim() == 2 and x.stride(-1) == 1:
        y = ops.packed_linear(x, buf, n, k, bias)
    else:
        y = ops.packed_linear(_rows(x), buf, n, k, bias).view(*x.shape[:-1], n)
    return y.float() if fp32_out else y


def prepacked_weight(rows: int, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight) -> torch.Tensor | None:
    """The prepacked copy of ``weight`` (oneDNN's, or the AMX GEMM's 4-D tiles) that :func:`linear`
    multiplies a batch of ``rows`` rows (of the weight's dtype) by, or None when it would take
    another path for that batch (the small-M kernel, MKL, F.linear). For callers that run the same
    products natively (csrc/decode.cpp), so that they stay bit-identical to :func:`linear`."""
    if not _packed_rows(rows, weight, bias) or (rows <= max_rows(weight.dtype) and not gemm.amx_first(weight)):
        return None
    buf = packed.get(weight, gemm.packed_ops())
    return buf if buf is not None and (buf.is_mkldnn or buf.dim() == 4) else None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, fp32_out: bool = False, packed: PackedWeight | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (cast to float32 when ``fp32_out``; the kernel then writes its
    fp32 sums without a rounding to the dtype) on the path of the module docstring; ``packed``:
    the cache of ``weight``'s packed copy (without it, no packed GEMM)."""
    if packed is not None and gemm.amx_first(weight) and _packed_usable(x, weight, bias):
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


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, packed: PackedWeight | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``linear(x, weight, bias)`` for a ``[gate; up]`` weight. Where
    :func:`linear` would take the AMX GEMM's packed copy, the GEMM applies the activation to its
    fp32 sums as they leave the tiles (``amx_linear_silu``: no bf16 rounding of gate and up);
    elsewhere the product, then :func:`radixserve.kernels.layers.silu_and_mul`."""
    if packed is not None and gemm.amx_first(weight) and _packed_usable(x, weight, bias):  # (as linear's first branch)
        buf = packed.get(weight, gemm.packed_ops())
        if buf is not None and not buf.is_mkldnn and buf.dim() == 4:
            return gemm.packed_ops().amx_linear_silu(_rows(x), buf, bias).view(*x.shape[:-1], weight.shape[0] // 2)
    return layers.silu_and_mul(linear(x, weight, bias, packed=packed))


def logits(x: torch.Tensor, output_embedding: torch.Tensor, packed: PackedWeight | None = None) -> torch.Tensor:
    """Float32 logits ``x @ output_embedding.T`` (the tied or untied lm_head); ``packed``: the
    cache of the embedding's packed copy (the caller's, kept as long as the model). Rounded to the
    model's dtype first, whichever path runs, as F.linear rounds bf16 logits: the kernel's
    unrounded sums would make greedy ties break differently with the batch size."""
    return linear(x, output_embedding, packed=packed).float()


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`linear` over a packed copy of its weight
    (:attr:`packed`, a plain attribute: not a parameter, buffer or submodule)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.packed = PackedWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, packed=self.packed)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of this ``[gate; up]`` projection (:func:`linear_silu_and_mul`)."""
        return linear_silu_and_mul(x, self.weight, self.bias, packed=self.packed)

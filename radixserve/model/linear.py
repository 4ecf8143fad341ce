"""Linear layers that use the small-M bf16/fp16 kernel of ``csrc/linear.cpp`` for decode batches.

torch's bf16 ``F.linear`` with a handful of rows is no faster than fp32 (it does not stream the
weights at memory bandwidth), and a decode step is nothing but such products. :class:`Linear` is
an ``nn.Linear`` (same parameters, same ``state_dict``, so Hugging Face checkpoints load as
before) whose forward sends ``[..., K]`` inputs with at most :func:`max_rows` rows to the kernel
when the weight is bf16 (or fp16), on the CPU, and the extension is built; everything else
(fp32, which MKL already runs at the bandwidth floor; prefill-sized batches, where oneDNN's
GEMM wins; autograd; no extension) goes to ``F.linear``. :func:`logits` is the same for the
tied output embedding, with float32 logits written by the kernel directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Most rows sent to the kernel, from `python -m bench roofline --gemv` (the bench model's shapes,
# weights from memory, 1 thread): bf16 on AMX tiles is 1.4-2.4x faster than oneDNN at 1-16 rows
# and 1.06-1.24x at 32; the AMX path stops at 32 rows (beyond, the vector path is 4-5x slower).
# fp16 (fp32 FMAs; also the bf16 path of CPUs without AMX) is compute-bound: 1.06-1.75x faster
# at 1-4 rows, slower from 8.
MAX_ROWS = 32
MAX_ROWS_VECTOR = 4

_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_state: dict[str, object] = {}


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
        _state["limits"] = limits
        _state["op"] = op
    return _state["op"]


def max_rows(dtype: torch.dtype) -> int:
    """Most rows :func:`linear` sends to the kernel for ``dtype`` (0: never)."""
    if dtype not in _KERNEL_DTYPES or kernel() is None:
        return 0
    return _state["limits"].get(dtype, 0)  # type: ignore[attr-defined]


def _usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # cheapest tests first: this runs for every layer of every step (about 2 us in all)
    if weight.dtype not in _KERNEL_DTYPES or x.dtype != weight.dtype or not (x.is_cpu and weight.is_cpu):
        return False  # (a CUDA model never loads, let alone builds, the CPU extension)
    if _state.get("op") is None and kernel() is None:
        return False
    rows = x.numel()
    if rows == 0 or rows > _state["limits"].get(weight.dtype, 0) * x.shape[-1]:  # type: ignore[attr-defined]
        return False
    if weight.dim() != 2 or weight.stride(-1) != 1:
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))  # no backward


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           fp32_out: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (cast to float32 when ``fp32_out``) through the small-M kernel
    when it applies. With ``fp32_out`` the kernel writes its fp32 sums without a bf16 rounding."""
    if _usable(x, weight):
        op = _state["op"]
        if x.dim() == 2 and x.stride(-1) == 1:  # the decode case: no reshaping
            return op(x, weight, bias, fp32_out)  # type: ignore[operator]
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        return op(rows, weight, bias, fp32_out).view(*x.shape[:-1], weight.shape[0])  # type: ignore[operator]
    y = F.linear(x, weight, bias)
    return y.float() if fp32_out else y


def logits(x: torch.Tensor, output_embedding: torch.Tensor) -> torch.Tensor:
    """Float32 logits ``x @ output_embedding.T`` (the tied or untied lm_head).

    Rounded to the model's dtype first, whichever path runs: F.linear rounds bf16 logits, so the
    kernel's unrounded fp32 sums would make greedy ties break differently with the batch size."""
    return linear(x, output_embedding).float()


class Linear(nn.Linear):
    """``nn.Linear`` whose forward uses :func:`linear` (the kernel for small bf16/fp16 batches)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

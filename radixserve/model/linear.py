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

        op = None
        if cpu_ext.load() is not None and hasattr(torch.ops, "radixserve_linear"):
            ns = torch.ops.radixserve_linear
            op = ns.linear
            _state["amx"] = bool(ns.supports_amx())
            _state["dtypes"] = tuple(d for d, ok in ((torch.bfloat16, ns.supports_bf16()),
                                                     (torch.float16, ns.supports_fp16())) if ok)
        _state["op"] = op
    return _state["op"]


def max_rows(dtype: torch.dtype) -> int:
    """Most rows :func:`linear` sends to the kernel for ``dtype`` (0: never)."""
    if dtype not in _KERNEL_DTYPES or kernel() is None or dtype not in _state["dtypes"]:  # type: ignore[operator]
        return 0
    return MAX_ROWS if dtype == torch.bfloat16 and _state["amx"] else MAX_ROWS_VECTOR


def _usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if weight.dtype not in _KERNEL_DTYPES or x.dtype != weight.dtype or x.device.type != "cpu":
        return False
    if weight.device.type != "cpu" or x.dim() == 0 or weight.dim() != 2 or weight.stride(-1) != 1:
        return False
    if x.numel() == 0 or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return False  # (the op has no backward)
    return x.numel() <= max_rows(weight.dtype) * x.shape[-1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           fp32_out: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (cast to float32 when ``fp32_out``) through the small-M kernel
    when it applies. With ``fp32_out`` the kernel writes its fp32 sums without a bf16 rounding."""
    if _usable(x, weight):
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        y = kernel()(rows, weight, bias, fp32_out)
        return y.view(*x.shape[:-1], weight.shape[0])
    y = F.linear(x, weight, bias)
    return y.float() if fp32_out else y


def logits(x: torch.Tensor, output_embedding: torch.Tensor) -> torch.Tensor:
    """Float32 logits ``x @ output_embedding.T`` (the tied or untied lm_head)."""
    return linear(x, output_embedding, fp32_out=True)


class Linear(nn.Linear):
    """``nn.Linear`` whose forward uses :func:`linear` (the kernel for small bf16/fp16 batches)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

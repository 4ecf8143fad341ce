"""The decoder layer's elementwise ops: csrc/layers.cpp's kernels (``torch.ops.radixserve_layers``)
for fp32/bf16 CPU tensors when the extension is built, the equivalent torch ops otherwise.

Contract: each op's result equals its ``*_reference`` torch version, which rounds like Hugging
Face's modules and is what the kernels are tested against:

- :func:`add_rms_norm`: ``x += residual`` (in place), then ``rmsnorm(x) * weight``, normalised in
  fp32, cast to the dtype, then multiplied by the weight (HF's ``LlamaRMSNorm``);
- :func:`rope_`: neox-style RoPE applied in place to ``q`` and ``k`` from half-width cos/sin;
- :func:`silu_and_mul`: ``silu(gate) * up`` of a fused ``[gate | up]`` projection;
- :func:`argmax`: each row's first maximum (the greedy sampler's), for fp32 logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.kernels import build

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_ops: list = []  # [torch.ops.radixserve_layers or None], resolved on first use


def kernels():
    """``torch.ops.radixserve_layers`` when the extension is built, else None (cached)."""
    if not _ops:
        _ops.append(build.ops("radixserve_layers", "add_rms_norm"))
    return _ops[0]


def _use_kernel(x: torch.Tensor):
    if not x.is_cpu or x.dtype not in _KERNEL_DTYPES:
        return None  # (a CUDA model never loads, let alone builds, the CPU extension)
    return _ops[0] if _ops else kernels()


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as ``[rows, cols]`` without a copy, or None when its layout does not allow it."""
    if x.dim() == 2:
        return x if x.stride(-1) == 1 else None
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return None


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += residual`` in place (when given), then return ``rmsnorm(x) * weight`` (a new tensor)."""
    ops = _use_kernel(x)
    if ops is None or weight.dtype != x.dtype:
        return add_rms_norm_reference(x, residual, weight, eps)
    if x.dim() == 2 and x.stride(1) == 1 and (residual is None or residual.dim() == 2 and residual.stride(1) == 1):
        out = torch.empty(x.shape, dtype=x.dtype)  # the decoder's case, with the least Python
        ops.add_rms_norm.default(x, residual, weight, eps, out)
        return out
    x2 = _rows(x)
    if x2 is None and residual is None:
        x2 = x.reshape(-1, x.shape[-1])  # a copy of a strided x (q/k of Qwen3's qk-norm): x is only read
    r2 = _rows(residual) if residual is not None and x2 is not None else None
    if x2 is None or (residual is not None and r2 is None):
        return add_rms_norm_reference(x, residual, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    ops.add_rms_norm.default(x2, r2, weight.contiguous(), eps, out.view(-1, x.shape[-1]))
    return out


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if residual is not None:
        x.add_(residual)
    dtype = x.dtype
    h = x.float()
    scale = h.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    h = (h * scale).to(dtype)  # a new tensor: scale it by the weight in place
    return h.mul_(weight)


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hk, D]`` in place by ``cos``/``sin [T, D/2]`` (q's dtype)."""
    ops = _use_kernel(q)
    if ops is not None and q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1:
        ops.rope.default(q, k, cos, sin)
        return
    rope_reference_(q, k, cos, sin)


def rope_reference_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """``x * cos + rotate_half(x) * sin`` half by half: with ``x = [x1, x2]``, first half
    ``x1*c - x2*s``, second ``x2*c + x1*s`` -- Hugging Face's products and sums, bit for bit."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for x in (q, k):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        lo = x1 * cos
        lo.sub_(x2 * sin)
        x2.mul_(cos).add_(x1 * sin)
        x1.copy_(lo)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dimension (a new tensor)."""
    ops = _use_kernel(gate_up)
    g2 = _rows(gate_up) if ops is not None else None
    if g2 is None:
        return silu_and_mul_reference(gate_up)
    inter = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype)
    ops.silu_and_mul.default(g2, out.view(-1, inter))
    return out


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :inter]).mul_(gate_up[..., inter:])


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.max(dim=-1).indices`` of 2-D fp32 logits (first maximum; first NaN where a row has
    one), the rows split over the threads (torch's runs on one)."""
    ops = _use_kernel(logits)
    if ops is None or logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1 or not logits.shape[1]:
        return logits.max(dim=-1).indices
    return ops.argmax_rows.default(logits)

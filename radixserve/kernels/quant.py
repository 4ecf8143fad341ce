"""Weights kept in a GGUF file's quantized blocks, multiplied by the kernels of csrc/quant.cpp.

A :class:`QuantTensor` is a 2-D weight ``[N, K]`` as the file stores it: ``N`` rows of blocks of
one ggml type (:data:`QTYPES`), typically a view of the memory-mapped file, so a 4-bit model
costs its file's size in memory rather than 4-8x that as fp32. :class:`QuantLinear` is the linear
layer over one or more of them (a fused projection's q, k and v may each have their own type);
:class:`QuantEmbedding` looks rows up in one. Both return the activations' dtype. By default they
compute in fp32: each weight is rounded to fp32 once, as gguf's ``dequantize`` does, so their
results are those of the dequantized model up to the order of the sums; :func:`set_compute` makes
them quantize the activations to int8 instead (``EngineConfig.quant_compute``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn

from radixserve.kernels import build, layers
from radixserve.model.gguf import BLOCKS, QTYPES

IMPL_FP32, IMPL_INT8 = 0, 4  # qlinear's impl: fp32; int8 activations (for the types with int8 kernels)
# Whether the rows being multiplied are decode tokens (each its sequence's one new token), the only
# rows int8 activations serve: a prompt's rows (a sink token's massive activations among them) stay
# fp32. Set by CausalLM.forward around each batch (decode_rows).
_DECODE_ROWS: ContextVar[bool] = ContextVar("radixserve_quant_decode_rows", default=False)


@contextmanager
def decode_rows(on: bool) -> Iterator[None]:
    """Within: the rows multiplied are decode tokens (``on``), which a layer set to int8 takes in
    int8; else fp32 (:func:`set_compute`)."""
    token = _DECODE_ROWS.set(on)
    try:
        yield
    finally:
        _DECODE_ROWS.reset(token)


def int8_rows() -> bool:
    """Whether the rows multiplied now are decode tokens (:func:`decode_rows`)."""
    return _DECODE_ROWS.get()


_NO_MAP = torch.empty(0, dtype=torch.int32)
_ALL_ROWS = torch.empty(0, dtype=torch.long)
_state: dict[str, object] = {}


def ops():
    """``torch.ops.radixserve_quant`` when the CPU extension is built, else None."""
    if "ops" not in _state:
        _state["ops"] = build.ops("radixserve_quant", "qlinear")
    return _state["ops"]


@dataclass(frozen=True, eq=False)
class QuantTensor:
    """A weight ``[N, K]`` in ggml blocks: ``data`` is uint8 ``[rows, K / block * bytes]`` (the
    file's rows, usually a view of the mapped file); ``row_map`` (int32 ``[N]``, or None for in
    order) names the data row that row ``n`` of the weight is, which undoes llama.cpp's q/k row
    permutation without a copy."""

    data: torch.Tensor
    qtype: int
    shape: tuple[int, int]
    row_map: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.qtype not in QTYPES:
            raise ValueError(f"GGUF type id {self.qtype} is not one of {sorted(QTYPES)}")
        block, size = BLOCKS[self.qtype]
        if k % block or self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] != k // block * size:
            raise ValueError(f"{QTYPES[self.qtype]} data {tuple(self.data.shape)} {self.data.dtype} does not hold a [{n}, {k}] weight")
        if (self.data.shape[0] if self.row_map is None else self.row_map.numel()) != n:
            raise ValueError(f"a [{n}, {k}] weight needs {n} rows")
        if self.row_map is not None:  # (checked here once: the kernels read it unchecked at every call)
            m = self.row_map
            if m.dtype != torch.int32 or m.dim() != 1 or not m.is_contiguous() or (n and not 0 <= int(m.min()) <= int(m.max()) < self.data.shape[0]):
                raise ValueError(f"row_map must be a contiguous int32 vector of rows in [0, {self.data.shape[0]})")

    @property
    def type_name(self) -> str:
        return QTYPES[self.qtype]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 rows (all, or those listed), equal to gguf's ``dequantize`` bit for bit."""
        idx = _ALL_ROWS if rows is None and self.row_map is None else (torch.arange(self.shape[0]) if rows is None else rows).to(torch.long)
        if self.row_map is not None:
            idx = self.row_map.to(torch.long)[idx]
        return ops().dequantize(self.data, self.qtype, self.shape[1], idx)


class QuantLinear(nn.Module):
    """``y = x W^T (+ b)`` with ``W`` the rows of ``parts`` one after the other, all of one ``K``."""

    def __init__(self, parts: Sequence[QuantTensor], bias: torch.Tensor | None = None):
        super().__init__()
        ks = {p.shape[1] for p in parts}
        if len(ks) != 1:
            raise ValueError(f"parts of one linear layer must share K, got {sorted(ks)}")
        self.parts = list(parts)
        self.in_features = ks.pop()
        self.out_features = sum(p.shape[0] for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.impl = IMPL_FP32  # (set_compute)
        self._args = ([p.data for p in parts], [p.qtype for p in parts], [_NO_MAP if p.row_map is None else p.row_map for p in parts])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or rows.stride(-1) != 1:
            rows = rows.float().contiguous()
        y = ops().qlinear(rows, *self._args, self.bias, self.impl if _DECODE_ROWS.get() else IMPL_FP32)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of this ``[gate; up]`` projection."""
        return layers.silu_and_mul(self(x))

    def extra_repr(self) -> str:
        types = "+".join(p.type_name for p in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, {types}, bias={self.bias is not None}"


def has_int8() -> bool:
    """Whether this CPU's build of the extension has the int8 kernels (AVX-512 VNNI and VBMI)."""
    o = ops()
    return o is not None and bool(o.has_int8())


def set_compute(model: nn.Module, mode: str) -> str | None:
    """Sets how ``model``'s :class:`QuantLinear` layers compute: ``mode`` is
    ``config.quant_compute`` (``auto``, ``int8`` or ``fp32``). Returns the mode taken, or None when
    no weight is quantized; raises ValueError for ``int8`` where the build lacks it."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not layers:
        return None
    if mode == "int8" and not has_int8():
        raise ValueError("quant_compute=int8 needs a CPU with AVX-512 VNNI and VBMI (and the extension built for it); this one has neither: use fp32 or auto")
    taken = "int8" if mode == "int8" or (mode == "auto" and has_int8()) else "fp32"
    for m in layers:
        m.impl = IMPL_INT8 if taken == "int8" else IMPL_FP32
    return taken


class QuantEmbedding(nn.Module):
    """Token embeddings looked up in a quantized table, returned in ``dtype``."""

    def __init__(self, weight: QuantTensor, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight_q = weight
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.weight_q.dequantize(ids.reshape(-1))
        return out.to(self.dtype).view(*ids.shape, self.embedding_dim)

    def _apply(self, fn, recurse=True):  # model.to(dtype=...) sets the dtype the rows come out in
        probe = fn(torch.empty(0, dtype=self.dtype))
        if probe.is_floating_point():
            self.dtype = probe.dtype
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.weight_q.type_name}"

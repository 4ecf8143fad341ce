"""A decode batch's decoder layers in one native call (``decode_layers``, csrc/decode.cpp).

Contract: :class:`FusedDecode` runs every decoder layer of a decode batch in one call over the
same operators in the same order as the layer-by-layer path, so its results are bit-identical to
it (tests/kernels/test_fused_decode.py). It returns None, and the caller then runs the layers one by one,
where the model (:func:`unsupported`), the batch (not every sequence on the decode kernel,
``AttentionBackend.decode_kernel_args``; a KV pool of another dtype) or the row count (some linear
layer on neither the small-M kernel nor a prepacked copy) does not qualify. It knows the model
only through :class:`DecodeModel`: the layers as :class:`DecodeLayer` descriptions and the RoPE
tables. ``RADIXSERVE_FUSED_DECODE=0`` turns it off. Why it pays: docs/KERNELS.md ("Fused decode").
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch
from torch import nn

from radixserve.kernels import attention, layers, quant
from radixserve.kernels import linear as lin
from radixserve.kernels.quant import QuantLinear

if TYPE_CHECKING:
    from radixserve.attention.base import AttentionBackend

log = logging.getLogger("radixserve")

ENV = "RADIXSERVE_FUSED_DECODE"
_DTYPES = (torch.float32, torch.bfloat16)
_DENSE = torch.tensor([0])  # DecodeWeights' quant entry of a dense weight: no parts
_NO_MAP = torch.empty(0, dtype=torch.int32)  # a quantized part read in order


@dataclass(frozen=True)
class DecodeLayer:
    """One Llama-family decoder layer as ``decode_layers`` runs it: ``x += pending``, RMSNorm,
    ``qkv`` (rows ``[q; k; v]``), RoPE, attention, ``o``, ``x +=``, RMSNorm, ``gate_up`` (rows
    ``[gate; up]``), SiLU-and-mul, ``down``. Each linear layer is a
    :class:`~radixserve.kernels.linear.Linear` or a :class:`~radixserve.kernels.quant.QuantLinear`."""

    module: nn.Module  # the whole layer: its parameters and forward hooks are checked
    input_norm: torch.Tensor  # the first RMSNorm's weight
    post_norm: torch.Tensor  # the second's
    eps: tuple[float, float]  # the two norms' eps
    linears: tuple[nn.Module, nn.Module, nn.Module, nn.Module]  # qkv, o, gate_up, down
    num_heads: int
    num_kv_heads: int
    head_dim: int


class DecodeModel(Protocol):
    """What :class:`FusedDecode` needs of a model."""

    def decode_layers(self) -> list[DecodeLayer] | str:
        """The decoder layers in order, or why they cannot run fused."""
        ...

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Half-width cos/sin ``[T, D/2]`` of ``positions`` in ``dtype``, as the layers rotate by."""
        ...


def enabled() -> bool:
    """``RADIXSERVE_FUSED_DECODE`` is not 0/off/false/no (read as each model is made)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


class FusedDecode:
    """One model's fused decode path: the parameter list ``decode_layers`` takes, built at the
    first batch that could use it. ``enabled`` switches it for this model (default:
    :func:`enabled`); ``batches`` counts the batches it ran."""

    def __init__(self, ops: attention.AttentionOps | None = None) -> None:
        """``ops``: the attention module's ops to run (default: this checkout's,
        :func:`radixserve.kernels.attention.ops`); ``python -m bench roofline --against`` passes
        another build's."""
        self.enabled = enabled()
        self._given_ops = ops
        self._params: list[torch.Tensor] | bool | None = None  # None: not checked yet
        # decode_layers' weights argument (its DecodeWeights): the parameters and the quantized
        # weights, with int8 activations where their types have kernels, and with fp32 ones (for
        # batches whose rows are not all decodes)
        self._weights: object | None = None
        self._weights_fp32: object | None = None
        self._shape: tuple[int, int, int, float] = (0, 0, 0, 0.0)  # heads, KV heads, head_dim, eps
        self._ops: attention.AttentionOps | None = None  # (radixserve.kernels.attention.ops)
        self.batches = 0  # batches whose layers ran in one call
        # each layer's qkv, o, gate_up and down: (weight, bias, packed-copy cache), None for a quantized one
        self._linears: list[tuple[torch.Tensor, torch.Tensor | None, lin.PackedWeight] | None] = []
        self._not_prepacked: set[int] = set()  # row counts some linear layer runs on neither path
        self._none = torch.empty(0)  # a weight on the small-M kernel (decode.cpp reads empty as that)

    def __deepcopy__(self, memo) -> FusedDecode:
        return FusedDecode()  # (a copy of the model has parameters of its own: check and build again)

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()  # type: ignore[misc]

    def __call__(self, model: DecodeModel, x: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend) -> torch.Tensor | None:
        """Run every decoder layer on ``x`` (the embeddings, updated in place as the residual
        stream) and return the last layer's MLP output; None when this batch or model does not
        qualify (the caller then runs the layers one by one)."""
        if self._params is False or not self.enabled:
            return None
        args = backend.decode_kernel_args()
        rows = x.shape[0]
        if args is None or rows == 0 or args.k_caches[0].dtype != x.dtype:
            return None
        if self._params is None:
            self._params = self._build(model, x.dtype)
            if self._params is False:
                return None
        packed = self._prepacked(rows, x.dtype)
        if packed is None:
            return None
        heads, kv_heads, head_dim, eps = self._shape
        cos, sin = model.rope_tables(positions, x.dtype)
        self.batches += 1
        assert self._ops is not None  # (set by _build)
        return self._ops.decode_layers(
            self._weights if quant.int8_rows() else self._weights_fp32,
            x,
            packed,
            args.k_caches,
            args.v_caches,
            cos,
            sin,
            args.slots,
            args.qo_indptr,
            args.kv_indptr,
            args.kv_indices,
            args.kv_last_page_len,
            heads,
            kv_heads,
            head_dim,
            eps,
            args.scale,
            list(args.prefix),
        )

    def _prepacked(self, rows: int, dtype: torch.dtype) -> list[torch.Tensor] | None:
        """Each layer's qkv, o, gate_up and down weights as :func:`radixserve.kernels.linear.linear`
        multiplies a batch of ``rows`` rows of ``dtype`` by them: the prepacked copy (oneDNN's or
        the AMX GEMM's) where it takes one, an empty tensor where it takes the small-M kernel (at
        most :func:`radixserve.kernels.linear.max_rows` rows) or the weight is quantized; None when
        some weight takes neither (the row counts found so are remembered)."""
        if rows in self._not_prepacked:
            return None
        if not any(self._linears):  # (every weight quantized: the common GGUF case, at each step)
            return []
        out = []
        for linear in self._linears:
            if linear is None:  # quantized: quant.cpp's qlinear at any row count
                out.append(self._none)
                continue
            weight, bias, cache = linear
            buf = lin.prepacked_weight(rows, weight, bias, cache)
            if buf is None and rows > lin.max_rows(dtype):
                self._not_prepacked.add(rows)
                return None
            out.append(self._none if buf is None else buf)
        return out if any(t is not self._none for t in out) else []  # (empty: every weight on the kernel or quantized)

    def _build(self, model: DecodeModel, dtype: torch.dtype) -> list[torch.Tensor] | bool:
        why = unsupported(model, dtype)
        if why is not None:
            log.info("fused decode layers off for this model: %s", why)
            return False
        self._ops = ops = self._given_ops or attention.ops()
        assert ops is not None  # (unsupported checked)
        none = torch.empty(0, dtype=dtype)  # an absent bias (decode.cpp reads an empty tensor as none)
        params: list[torch.Tensor] = []
        # DecodeWeights' quant argument (empty: every weight dense), and the same with every layer's impl fp32
        quant_int8: list[torch.Tensor] = []
        quant_fp32: list[torch.Tensor] = []
        described = model.decode_layers()
        assert not isinstance(described, str)  # (unsupported said so)
        for layer in described:
            weights: list[torch.Tensor | None] = []
            for m in layer.linears:
                if isinstance(m, QuantLinear):
                    self._linears.append(None)
                    quant_int8 += [torch.tensor([len(m.parts), m.impl, *(p.qtype for p in m.parts)])]
                    quant_fp32 += [torch.tensor([len(m.parts), quant.IMPL_FP32, *(p.qtype for p in m.parts)])]
                    for p in m.parts:
                        quant_int8 += [p.data, _NO_MAP if p.row_map is None else p.row_map]
                        quant_fp32 += quant_int8[-2:]
                    weights.append(None)
                else:
                    assert isinstance(m, lin.Linear)
                    self._linears.append((m.weight, m.bias, m.packed))
                    quant_int8.append(_DENSE)
                    quant_fp32.append(_DENSE)
                    weights.append(m.weight)
            bias = [cast("torch.Tensor | None", m.bias) for m in layer.linears]
            for t in (layer.input_norm, weights[0], bias[0], weights[1], bias[1], layer.post_norm, weights[2], bias[2], weights[3], bias[3]):
                params.append(none if t is None else t)  # (the parameters themselves, as the layers read them)
        if all(q is _DENSE for q in quant_int8):
            quant_int8 = quant_fp32 = []
        self._weights = ops.decode_weights(params, quant_int8)
        self._weights_fp32 = ops.decode_weights(params, quant_fp32) if quant_fp32 else self._weights
        first = described[0]
        self._shape = (first.num_heads, first.num_kv_heads, first.head_dim, float(first.eps[0]))
        if quant_int8 and not any(self._linears):
            log.info("decode batches run their decoder layers in one native call, quantized weights at every row count (%s=0 turns this off)", ENV)
        else:
            log.info(
                "decode batches run their decoder layers in one native call: up to %d rows, and beyond where "
                "every linear layer runs oneDNN (%s=0 turns this off)",
                lin.max_rows(dtype),
                ENV,
            )
        return params


def unsupported(model: DecodeModel, dtype: torch.dtype) -> str | None:
    """Why ``model`` cannot take the fused path, or None when it can."""
    if dtype not in _DTYPES:
        return f"dtype {dtype} is not float32 or bfloat16"
    if attention.ops() is None or lin.kernel() is None or layers.kernels() is None:
        return "the CPU extension is not built"
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return "global forward hooks are registered"
    described = model.decode_layers()
    if isinstance(described, str):
        return described
    if not described:
        return "the model has no layers"
    eps = described[0].eps[0]
    dense = False  # some linear layer's weight is a dense tensor
    for layer in described:
        for module in layer.module.modules():
            if module._forward_hooks or module._forward_pre_hooks:
                return "a layer has forward hooks (tensor parallelism)"
        if layer.eps != (eps, eps):
            return "the layers' norms differ"
        for m in layer.linears:
            if type(m) not in (lin.Linear, QuantLinear):
                return f"a linear layer is a {type(m).__name__}"
            dense |= type(m) is lin.Linear
        for t in [p for p in layer.module.parameters()]:
            if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
                return "a parameter is not a contiguous CPU tensor of the model's dtype"
    if dense and lin.max_rows(dtype) < 1:  # (last: it may time the GEMMs, which a quantized model never runs)
        return "the small-M linear kernel does not take this dtype here"
    return None

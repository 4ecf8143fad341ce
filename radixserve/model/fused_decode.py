"""A decode batch's decoder layers in one native call (``decode_layers`` in csrc/decode.cpp).

A decode step of a few rows spends little time in its kernels: at batch 1 the linear kernel
reads a layer's weights in about a third of a millisecond, and the norms, RoPE, KV store and
attention take microseconds each. The Python around them (module calls, argument checks,
views: about a dozen calls per layer) cost about a millisecond per step of the bench model,
a third of its bandwidth floor (``python -m bench roofline``). ``decode_layers`` runs the layer
loop in C++ over the same operators in the same order, so its results are bit-identical to the
layer-by-layer path (tests/test_fused_decode.py).

It runs when all of these hold, and the layers run one by one otherwise:

- the model (checked once per model): a Llama-family decoder without QK norm, on the CPU, in
  float32 or bfloat16, with the extension built, no forward hooks (tensor parallelism adds its
  all-reduce as one) and plain 2-D weights;
- linear layers whose weights stay in GGUF blocks (:class:`radixserve.model.quant.QuantLinear`)
  run csrc/quant.cpp's ``qlinear`` inside the same call, at any row count;
- the batch: every sequence on the csrc/ decode kernel (``AttentionBackend.decode_kernel_args``:
  the CPU backend with no many-row chunk, and either no cascade group or every row a decode with
  the grouped ones first, in row order: then each layer also attends to the groups' shared
  prefixes and merges the two for those rows, as the backend does), the KV pool in the model's
  dtype, and a row count at which each linear layer takes a path ``decode_layers`` runs, as it
  would layer by layer: the small-M kernel (at most :func:`radixserve.model.linear.max_rows`
  rows), or the GEMM over the weight's prepacked copy (oneDNN's for larger decode batches, or the
  AMX GEMM's, which bf16 weights on AMX take at every row count:
  :func:`radixserve.model.linear.prepacked_weight`).

``RADIXSERVE_FUSED_DECODE=0`` turns it off (``python -m bench roofline`` compares the two, step by
step).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from radixserve.model import fused
from radixserve.model import linear as lin
from radixserve.model import quant
from radixserve.model.quant import QuantLinear

if TYPE_CHECKING:
    from radixserve.model.llama import CausalLM, DecoderLayer, ForwardBatch

log = logging.getLogger("radixserve")

ENV = "RADIXSERVE_FUSED_DECODE"
_DTYPES = (torch.float32, torch.bfloat16)
_DENSE = torch.tensor([0])  # decode_layers' quant entry of a dense weight: no parts
_NO_MAP = torch.empty(0, dtype=torch.int32)  # a quantized part read in order


def enabled() -> bool:
    """``RADIXSERVE_FUSED_DECODE`` is not 0/off/false/no (read as each model is made)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


class FusedDecode:
    """One model's fused decode path: the parameter list ``decode_layers`` takes, built at the
    first batch that could use it. ``enabled`` switches it for this model (default:
    :func:`enabled`); ``batches`` counts the batches it ran."""

    def __init__(self) -> None:
        self.enabled = enabled()
        self._params: list[torch.Tensor] | bool | None = None  # None: not checked yet
        self._shape: tuple[int, int, int, float] = (0, 0, 0, 0.0)  # heads, KV heads, head_dim, eps
        self._ext: Any = None  # the extension module (radixserve.attention.cpu_ext.load)
        self.batches = 0  # batches whose layers ran in one call
        # each layer's qkv, o, gate_up and down: (weight, bias, packed-copy cache), None for a quantized one
        self._linears: list[tuple[torch.Tensor, torch.Tensor | None, lin.PackedWeight] | None] = []
        self._quant: list[torch.Tensor] = []  # decode_layers' quant argument (empty: every weight dense)
        self._quant_fp32: list[torch.Tensor] = []  # the same with every layer's impl fp32 (rows not all decodes)
        self._not_prepacked: set[int] = set()  # row counts some linear layer runs on neither path
        self._none = torch.empty(0)  # a weight on the small-M kernel (decode.cpp reads empty as that)

    def __deepcopy__(self, memo) -> FusedDecode:
        return FusedDecode()  # (a copy of the model has parameters of its own: check and build again)

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()  # type: ignore[misc]

    def __call__(self, model: CausalLM, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        """Run every decoder layer on ``x`` (the embeddings, updated in place as the residual
        stream) and return the last layer's MLP output; None when this batch or model does not
        qualify (the caller then runs the layers one by one)."""
        if self._params is False or not self.enabled:
            return None
        args = batch.attention.decode_kernel_args()
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
        cos, sin = model.model.rotary.tables(batch.positions, x.dtype)
        self.batches += 1
        return self._ext.decode_layers(
            x, self._params, packed, args.k_caches, args.v_caches, cos, sin, args.slots, args.qo_indptr,
            args.kv_indptr, args.kv_indices, args.kv_last_page_len, heads, kv_heads, head_dim, eps, args.scale,
            list(args.prefix), self._quant if quant.int8_rows() else self._quant_fp32)

    def _prepacked(self, rows: int, dtype: torch.dtype) -> list[torch.Tensor] | None:
        """Each layer's qkv, o, gate_up and down weights as :func:`radixserve.model.linear.linear`
        multiplies a batch of ``rows`` rows of ``dtype`` by them: the prepacked copy (oneDNN's or
        the AMX GEMM's) where it takes one, an empty tensor where it takes the small-M kernel (at
        most :func:`radixserve.model.linear.max_rows` rows) or the weight is quantized; None when
        some weight takes neither (the row counts found so are remembered)."""
        if rows in self._not_prepacked:
            return None
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
        return out

    def _build(self, model: CausalLM, dtype: torch.dtype) -> list[torch.Tensor] | bool:
        why = unsupported(model, dtype)
        if why is not None:
            log.info("fused decode layers off for this model: %s", why)
            return False
        from radixserve.attention import cpu_ext

        self._ext = cpu_ext.load()
        none = torch.empty(0, dtype=dtype)  # an absent bias (decode.cpp reads an empty tensor as none)
        params: list[torch.Tensor] = []
        for layer in _layers(model):
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            weights: list[torch.Tensor | None] = []
            for m in linears:
                if isinstance(m, QuantLinear):
                    self._linears.append(None)
                    self._quant += [torch.tensor([len(m.parts), m.impl, *(p.qtype for p in m.parts)])]
                    self._quant_fp32 += [torch.tensor([len(m.parts), quant.IMPL_FP32, *(p.qtype for p in m.parts)])]
                    for p in m.parts:
                        self._quant += [p.data, _NO_MAP if p.row_map is None else p.row_map]
                        self._quant_fp32 += self._quant[-2:]
                    weights.append(None)
                else:
                    self._linears.append((m.weight, m.bias, m.packed))
                    self._quant.append(_DENSE)
                    self._quant_fp32.append(_DENSE)
                    weights.append(m.weight)
            for t in (layer.input_layernorm.weight, weights[0], attn.qkv_proj.bias, weights[1], attn.o_proj.bias,
                      layer.post_attention_layernorm.weight, weights[2], mlp.gate_up_proj.bias, weights[3],
                      mlp.down_proj.bias):
                params.append(none if t is None else t)  # (the parameters themselves, as the layers read them)
        if all(q is _DENSE for q in self._quant):
            self._quant = self._quant_fp32 = []
        first = _layers(model)[0]
        self._shape = (first.self_attn.num_heads, first.self_attn.num_kv_heads, first.self_attn.head_dim,
                       float(first.input_layernorm.eps))
        if self._quant and all(m is None for m in self._linears):
            log.info("decode batches run their decoder layers in one native call, quantized weights at every row "
                     "count (%s=0 turns this off)", ENV)
        else:
            log.info("decode batches run their decoder layers in one native call: up to %d rows, and beyond where "
                     "every linear layer runs oneDNN (%s=0 turns this off)", lin.max_rows(dtype), ENV)
        return params


def _layers(model: CausalLM) -> list[DecoderLayer]:
    return cast("list[DecoderLayer]", list(model.model.layers))


def unsupported(model: CausalLM, dtype: torch.dtype) -> str | None:
    """Why ``model`` cannot take the fused path, or None when it can."""
    from radixserve.attention import cpu_ext
    from radixserve.model.llama import Linear, RMSNorm

    if dtype not in _DTYPES:
        return f"dtype {dtype} is not float32 or bfloat16"
    ext = cpu_ext.load()
    if ext is None or not hasattr(ext, "decode_layers") or lin.kernel() is None or fused.kernels() is None:
        return "the CPU extension is not built"
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return "global forward hooks are registered"
    layers = _layers(model)
    if not layers:
        return "the model has no layers"
    eps = layers[0].input_layernorm.eps
    dense = False  # some linear layer's weight is a dense tensor
    for layer in layers:
        if layer.self_attn.qk_norm:
            return "QK norm is not fused"
        for module in layer.modules():
            if module._forward_hooks or module._forward_pre_hooks:
                return "a layer has forward hooks (tensor parallelism)"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if type(norm) is not RMSNorm or norm.eps != eps:
                return "the layers' norms differ"
        linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        for m in linears:
            if type(m) not in (Linear, QuantLinear):
                return f"a linear layer is a {type(m).__name__}"
            dense |= type(m) is Linear
        for t in [p for p in layer.parameters()]:
            if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
                return "a parameter is not a contiguous CPU tensor of the model's dtype"
    if dense and lin.max_rows(dtype) < 1:  # (last: it may time the GEMMs, which a quantized model never runs)
        return "the small-M linear kernel does not take this dtype here"
    return None

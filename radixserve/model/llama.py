"""Llama-family decoders (Llama, Qwen2, Qwen3, Mistral) over paged attention.

Parameter names equal Hugging Face's except for the fused ``qkv_proj`` and ``gate_up_proj``,
whose row blocks the checkpoint's ``q/k/v_proj`` and ``gate/up_proj`` load into
(:meth:`CausalLM.checkpoint_tensors`). RMSNorm (fused with the residual add), RoPE and SiLU-and-mul
run as :mod:`radixserve.kernels.layers` ops. The model sees no scheduler: it gets token ids, positions and a planned attention backend, and returns logits
for the rows asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from radixserve.attention.base import AttentionBackend
from radixserve.kernels import quant
from radixserve.kernels.fused_decode import DecodeLayer, FusedDecode
from radixserve.kernels.layers import add_rms_norm, rope_
from radixserve.kernels.linear import Linear, PackedWeight, logits
from radixserve.kernels.quant import QuantLinear


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attention: AttentionBackend  # already planned for this batch
    logits_rows: torch.Tensor  # [n] rows of the batch whose next-token logits are wanted


@dataclass(frozen=True)
class ArchSpec:
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool


def _llama(config) -> ArchSpec:
    bias = bool(getattr(config, "attention_bias", False))
    return ArchSpec(qkv_bias=bias, o_bias=bias, qk_norm=False)


ARCHITECTURES = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": lambda config: ArchSpec(qkv_bias=False, o_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": lambda config: ArchSpec(qkv_bias=True, o_bias=False, qk_norm=False),
    "Qwen3ForCausalLM": lambda config: ArchSpec(**{**_llama(config).__dict__, "qk_norm": True}),
}
"""Supported ``architectures[0]`` values and how each shapes the attention block."""


def arch_spec(config) -> ArchSpec:
    return ARCHITECTURES[config.architectures[0]](config)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``rmsnorm(x) * weight``; with ``residual``, ``x += residual`` in place first (fused)."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE with cos/sin cached for every position; scaling via transformers' rope init."""

    def __init__(self, config, head_dim: int, max_positions: int):
        super().__init__()
        self.config, self.head_dim, self.max_positions = config, head_dim, max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)  # filled by build()
        self._batch: tuple | None = None  # (positions, dtype, cos, sin) of the last batch

    def build(self, device: torch.device | str | None = None) -> None:
        """Compute the fp32 cos/sin tables (the loader calls it once the weights are in place)."""
        params = getattr(self.config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(self.config, "rope_theta", 10000.0))
            exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim
            inv_freq, scaling = 1.0 / (base**exponent), 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](self.config, torch.device("cpu"))
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float), inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scaling).to(device)
        self.sin = (emb.sin() * scaling).to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hk, D]`` in place (one fused call for both)."""
        cos, sin = self.tables(positions, q.dtype)
        rope_(q, k, cos, sin)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Half-width cos/sin ``[T, D/2]`` for ``positions``, gathered once per batch.

        Every layer gets the same positions tensor, so the gather runs for the first layer only.
        The two halves of each table are equal (``emb = cat(freqs, freqs)``), so half suffices.
        Cast to the activations' dtype first, as transformers does.
        """
        cached = self._batch
        if cached is not None and cached[0] is positions and cached[1] == dtype:
            return cached[2], cached[3]
        half = self.head_dim // 2
        cos = self.cos[positions, :half].to(dtype)
        sin = self.sin[positions, :half].to(dtype)
        self._batch = (positions, dtype, cos, sin)
        return cos, sin


class Attention(nn.Module):
    """Self-attention with one fused ``qkv_proj`` (rows ``[q; k; v]``, bias too where the arch
    has it); the checkpoint's ``q_proj/k_proj/v_proj`` load into its row blocks
    (:meth:`CausalLM.checkpoint_tensors`)."""

    def __init__(self, config, layer: int, spec: ArchSpec, rope: RotaryEmbedding):
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        hidden = config.hidden_size
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = Linear(hidden, qkv, bias=spec.qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.rope = [rope]  # shared; a list keeps it out of this module's parameters/buffers

    def qkv_sizes(self) -> list[int]:
        """Row counts of the q, k and v blocks of ``qkv_proj`` (this rank's heads under TP)."""
        kv = self.num_kv_heads * self.head_dim
        return [self.num_heads * self.head_dim, kv, kv]

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes(), dim=-1)  # views of one GEMM's output
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        self.rope[0](batch.positions, q, k)  # in place
        if q.device.type != "cpu":
            q = q.contiguous()  # GPU backends get the dense q they always had
        out = batch.attention.forward(q, k, v, self.layer)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU MLP with one fused ``gate_up_proj`` (rows ``[gate; up]``)."""

    def __init__(self, config):
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer: int, spec: ArchSpec, rope: RotaryEmbedding):
        super().__init__()
        self.self_attn = Attention(config, layer, spec, rope)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, batch: ForwardBatch) -> torch.Tensor:
        """Run the layer on the residual stream ``x`` (updated in place) and return the MLP's
        output, which the next norm adds into ``x`` (``pending``) fused with its normalisation."""
        x_norm = self.input_layernorm(x, pending)  # x += pending; norm(x)
        x_norm = self.post_attention_layernorm(x, self.self_attn(x_norm, batch))
        return self.mlp(x_norm)


class Backbone(nn.Module):
    def __init__(self, config, max_positions: int):
        super().__init__()
        spec = arch_spec(config)
        self.rotary = RotaryEmbedding(config, head_dim_of(config), max_positions)
        self.embed_tokens: nn.Module = nn.Embedding(config.vocab_size, config.hidden_size)  # or a QuantEmbedding
        self.layers = nn.ModuleList(DecoderLayer(config, i, spec, self.rotary) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config, max_positions: int):
        super().__init__()
        self.config = config
        self.model = Backbone(config, max_positions)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        # the packed copy of output_embedding (tied or not; radixserve.kernels.packed), not a parameter
        self.output_packed = PackedWeight()
        # the output head over a quantized embedding table (tied weights of a GGUF; gguf_weights.py)
        self.quant_head: QuantLinear | None = None
        self.fused_decode = FusedDecode()  # the decode batches' layers in one native call, where they qualify

    @property
    def output_embedding(self) -> torch.Tensor | None:
        """The output head's dense weight (tied or not); None where it is quantized."""
        head = self.model.embed_tokens if self.tie_word_embeddings else self.lm_head
        return getattr(head, "weight", None)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits ``[len(batch.logits_rows), vocab]``."""
        # every row samples: decode tokens, which quantized layers may take in int8 (quant.decode_rows)
        with quant.decode_rows(len(batch.logits_rows) == len(batch.input_ids)):
            x = self.model.embed_tokens(batch.input_ids)  # a new tensor: the layers add into it in place
            pending = self.fused_decode(self, x, batch.positions, batch.attention)  # None: the layers one by one
            if pending is None:
                for layer in self.model.layers:
                    pending = layer(x, pending, batch)
            rows = batch.logits_rows
            x = self.model.norm(x[rows], pending[rows] if pending is not None else None)
            head = self.quant_head if self.tie_word_embeddings else self.lm_head
            if isinstance(head, QuantLinear):
                return head(x).float()
            return logits(x, cast(torch.Tensor, self.output_embedding), self.output_packed)

    def decode_layers(self) -> list[DecodeLayer] | str:
        """The decoder layers as the fused decode runs them (:class:`DecodeLayer`), or why it cannot."""
        described = []
        for layer in cast("list[DecoderLayer]", list(self.model.layers)):
            attn, mlp = layer.self_attn, layer.mlp
            if attn.qk_norm:
                return "QK norm is not fused"
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(type(norm) is not RMSNorm for norm in norms):
                return "the layers' norms differ"
            described.append(
                DecodeLayer(
                    layer,
                    norms[0].weight,
                    norms[1].weight,
                    (norms[0].eps, norms[1].eps),
                    (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj),
                    attn.num_heads,
                    attn.num_kv_heads,
                    attn.head_dim,
                )
            )
        return described

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers' half-width cos/sin for ``positions`` (:meth:`RotaryEmbedding.tables`)."""
        return self.model.rotary.tables(positions, dtype)

    def weight_bytes(self) -> int:
        """Bytes of the weights a decode step reads: every dense parameter and every quantized
        linear layer's blocks (the output head's too; a quantized embedding table is only looked up)."""
        dense = sum(p.numel() * p.element_size() for p in self.parameters())
        return dense + sum(m.nbytes for m in self.modules() if isinstance(m, QuantLinear))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor a Hugging Face checkpoint stores, by its name, as a view of our parameters.

        The same as ``named_parameters()`` except for the fused projections: ``q_proj/k_proj/v_proj``
        are row blocks of ``qkv_proj`` and ``gate_proj/up_proj`` of ``gate_up_proj`` (weights and
        biases), so copying a checkpoint tensor into its view fills the fused parameter.
        """
        views: dict[str, torch.Tensor] = {}
        for name, param in self.named_parameters():
            prefix, _, leaf = name.rpartition(".")
            module, _, proj = prefix.rpartition(".")
            if proj == "qkv_proj":
                blocks = dict(zip(("q_proj", "k_proj", "v_proj"), cast(Attention, self.get_submodule(module)).qkv_sizes()))
            elif proj == "gate_up_proj":
                inter = param.shape[0] // 2
                blocks = {"gate_proj": inter, "up_proj": inter}
            else:
                views[name] = param
                continue
            start = 0
            for part, rows in blocks.items():
                views[f"{module}.{part}.{leaf}"] = param.detach().narrow(0, start, rows)
                start += rows
        return views


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

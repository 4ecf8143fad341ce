"""Llama-family decoders (Llama, Qwen2, Qwen3, Mistral) over paged attention.

Parameter names equal Hugging Face's, so checkpoints load without a name map. The model sees
no scheduler: it gets token ids, positions and a planned attention backend, and returns logits
for the rows asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from radixserve.attention.base import AttentionBackend
from radixserve.model.linear import Linear, logits


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        scale = x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        x = (x * scale).to(dtype)  # a new tensor: scale it by the weight in place
        return x.mul_(self.weight)


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

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self._tables(positions, q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype):
        """Half-width cos/sin ``[T, 1, D/2]`` for ``positions``, gathered once per batch.

        Every layer gets the same positions tensor, so the gather runs for the first layer only.
        The two halves of each table are equal (``emb = cat(freqs, freqs)``), so half suffices.
        """
        cached = self._batch
        if cached is not None and cached[0] is positions and cached[1] == dtype:
            return cached[2], cached[3]
        half = self.head_dim // 2
        cos = self.cos[positions, :half].unsqueeze(1).to(dtype)
        sin = self.sin[positions, :half].unsqueeze(1).to(dtype)
        self._batch = (positions, dtype, cos, sin)
        return cos, sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` computed half by half, without the concatenation.

    With ``x = [x1, x2]``: first half ``x1*c - x2*s``, second half ``x2*c + x1*s`` -- the same
    products and sums as Hugging Face's formula, so the result is bit-identical.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty_like(x)
    lo, hi = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=lo)
    lo.sub_(x2 * sin)
    torch.mul(x2, cos, out=hi)
    hi.add_(x1 * sin)
    return out


class Attention(nn.Module):
    def __init__(self, config, layer: int, spec: ArchSpec, rope: RotaryEmbedding):
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        hidden = config.hidden_size
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=spec.qkv_bias)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.rope = [rope]  # shared; a list keeps it out of this module's parameters/buffers

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q = self.q_proj(x).view(-1, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope[0](batch.positions, q, k)
        out = batch.attention.forward(q, k, v, self.layer)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = F.silu(self.gate_proj(x), inplace=True)  # in place: no temporaries beyond gate/up
        return self.down_proj(gate.mul_(self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer: int, spec: ArchSpec, rope: RotaryEmbedding):
        super().__init__()
        self.self_attn = Attention(config, layer, spec, rope)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # The residual is added in place: x is this forward's own activation, never a caller's.
        x = x.add_(self.self_attn(self.input_layernorm(x), batch))
        return x.add_(self.mlp(self.post_attention_layernorm(x)))


class Backbone(nn.Module):
    def __init__(self, config, max_positions: int):
        super().__init__()
        spec = arch_spec(config)
        self.rotary = RotaryEmbedding(config, head_dim_of(config), max_positions)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, spec, self.rotary) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config, max_positions: int):
        super().__init__()
        self.config = config
        self.model = Backbone(config, max_positions)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def output_embedding(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits ``[len(batch.logits_rows), vocab]``."""
        x = self.model.embed_tokens(batch.input_ids)
        for layer in self.model.layers:
            x = layer(x, batch)
        x = self.model.norm(x[batch.logits_rows])
        return logits(x, self.output_embedding)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

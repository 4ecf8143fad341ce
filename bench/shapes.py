"""A model's shape from its config: the config itself (a directory's config.json or a GGUF's
metadata) and its per-token FLOP counts (for `bench floor`, `bench peers --breakdown` and
`bench cascade`)."""

from __future__ import annotations

import json
from pathlib import Path


def model_config(model: str) -> dict:
    """The Hugging Face config of a model directory, or of a GGUF file (from its metadata)."""
    from radixserve.model.gguf import _reader, gguf_config, is_gguf

    if is_gguf(model):
        return gguf_config(_reader(Path(model).expanduser()))
    return json.loads((Path(model) / "config.json").read_text())


class Shape:
    """Per-token FLOP counts of one model config."""

    def __init__(self, cfg: dict):
        hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads  # (absent: multi-head attention)
        self.head_dim = cfg.get("head_dim") or hidden // heads
        inter = cfg["intermediate_size"]
        q, kv = heads * self.head_dim, kv_heads * self.head_dim
        # (in, out) of every linear map of one layer: q, k, v, o, gate, up, down.
        self.linears = [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden), (hidden, inter), (hidden, inter), (inter, hidden)]
        self.layers, self.heads = layers, heads
        self.vocab, self.hidden = cfg["vocab_size"], hidden

    def linear_flops(self, tokens: int) -> int:
        return 2 * tokens * self.layers * sum(i * o for i, o in self.linears)

    def attention_flops(self, visible_keys: int) -> int:
        """QK^T and PV over ``visible_keys`` (summed over the query tokens), every layer and head."""
        return 4 * visible_keys * self.head_dim * self.heads * self.layers

    def lm_head_flops(self, rows: int) -> int:
        return 2 * rows * self.hidden * self.vocab

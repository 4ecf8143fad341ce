"""GGUF files for tests and benchmarks, written locally with gguf's own ``GGUFWriter``.

- :func:`quantize` encodes fp32 rows in any type csrc/quant.cpp multiplies: gguf's ``quantize``
  for Q8_0/Q4_0/Q4_1/Q5_0/Q5_1, and here, for the K-quants gguf cannot write (Q4_K, Q5_K, Q6_K), a
  plain min/max quantizer in ggml's block layouts (llama.cpp searches for better scales; the
  layout, which is what the kernels read, is the same).
- :func:`write_gguf` writes a Hugging Face checkpoint as llama.cpp's converter lays it out (q/k
  rows permuted for llama-arch models), each tensor in the type a callback picks.

Nothing here is used by the serving path itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

__all__ = ["K_QUANTS", "permute_qk", "quantize", "write_gguf", "write_synthetic_gguf"]

#: ggml type ids of the K-quants quantized here (gguf's quantize lacks them).
K_QUANTS = {12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _pack_scales_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per block -> ggml's 12 packed bytes (Q4_K/Q5_K)."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    return out


def _quantize_k45(x: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits 4) or Q5_K (bits 5) blocks of 256 values: 8 sub-blocks with a scale and a min."""
    top = (1 << bits) - 1
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale, mn = (sub.max(-1) - lo) / top, -lo
    d = np.where(scale.max(-1) > 0, scale.max(-1) / 63, 1.0).astype(np.float32)
    dmin = np.where(mn.max(-1) > 0, mn.max(-1) / 63, 1.0).astype(np.float32)
    d16, dmin16 = _fp16(d), _fp16(dmin)
    sc = np.clip(np.rint(scale / d16.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(mn / dmin16.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    eff = d16.astype(np.float32)[:, None] * sc
    q = np.where(eff[..., None] > 0, np.rint((sub + (dmin16.astype(np.float32)[:, None] * m)[..., None]) / np.where(eff > 0, eff, 1)[..., None]), 0)
    q = np.clip(q, 0, top).astype(np.uint8)  # [blocks, 8, 32]
    low = q & 0xF
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)  # chunk c: sub-blocks 2c (low), 2c+1 (high)
    parts = [d16.view(np.uint8).reshape(-1, 2), dmin16.view(np.uint8).reshape(-1, 2), _pack_scales_k4(sc, m)]
    if bits == 5:
        qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)  # bit j: sub-block j
        parts.append(qh)
    return np.concatenate([*parts, qs], axis=1)


def _quantize_q6k(x: np.ndarray) -> np.ndarray:
    """Q6_K blocks of 256 values: 16 sub-blocks of 16 with int8 scales, 6-bit levels around 32."""
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = np.where(scale.max(-1) > 0, scale.max(-1) / 127, 1.0).astype(np.float32)
    d16 = _fp16(d)
    sc = np.clip(np.rint(scale / d16.astype(np.float32)[:, None]), -128, 127).astype(np.int8)
    eff = d16.astype(np.float32)[:, None] * sc
    q = np.where(eff[..., None] != 0, np.rint(sub / np.where(eff != 0, eff, 1)[..., None]), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)  # [blocks, half, value]
    r = np.arange(128)
    ql = np.zeros((q.shape[0], 2, 64), dtype=np.uint8)
    qh = np.zeros((q.shape[0], 2, 32), dtype=np.uint8)
    for shift in (0, 4):  # values r < 64: low nibbles; r >= 64: high nibbles
        sel = r // 64 == shift // 4
        ql[:, :, r[sel] % 64] |= (q[:, :, sel] & 0xF) << shift
    for t in range(4):  # values of each 32 -> 2-bit fields 2t of qh
        sel = r // 32 == t
        qh[:, :, r[sel] % 32] |= (q[:, :, sel] >> 4) << (2 * t)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d16.view(np.uint8).reshape(-1, 2)], axis=1)


def quantize(x: np.ndarray, qtype: int) -> np.ndarray:
    """fp32 ``x [N, K]`` as uint8 blocks ``[N, K / block * bytes]`` of ggml type ``qtype``."""
    import gguf

    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype not in K_QUANTS:
        return gguf.quantize(x, gguf.GGMLQuantizationType(qtype))
    if x.shape[-1] % 256:
        raise ValueError(f"{K_QUANTS[qtype]} needs rows of a multiple of 256 values, not {x.shape[-1]}")
    blocks = x.reshape(-1, 256)
    raw = _quantize_q6k(blocks) if qtype == 14 else _quantize_k45(blocks, 4 if qtype == 12 else 5)
    return raw.reshape(x.shape[0], -1)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (halves -> pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def gguf_name(hf_name: str) -> str:
    """The GGUF tensor name of a Hugging Face parameter name."""
    if hf_name in _NAMES:
        return _NAMES[hf_name]
    layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
    stem, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_BLOCK[stem]}.{kind}"


def _writer(path: Path, arch: str, cfg: dict, tok, tokenizer_json: dict):
    """A GGUFWriter for ``path`` with the model's metadata and tokenizer already added."""
    import gguf

    vocab = sorted(tokenizer_json["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = tokenizer_json.get("added_tokens", [])
    special = {t["content"] for t in added if t.get("special", True)}
    tokens = [t for t, _ in vocab]
    for token in added:
        if token["id"] >= len(tokens):
            tokens.append(token["content"])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"synthetic {arch}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_add_bos_token(True)
    w.add_chat_template(tok.chat_template)
    return w


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gguf(path: str | Path, hf_dir: str | Path, arch: str = "llama", qtype_of: Callable[[str], int | None] = lambda name: None) -> Path:
    """Write the checkpoint in ``hf_dir`` as a GGUF at ``path``, the way llama.cpp's converter lays
    it out (q/k rows permuted for ``arch`` llama); ``qtype_of(gguf_name)`` picks each 2-D tensor's
    ggml type (None: F32, as the checkpoint's values)."""
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    hf_dir, path = Path(hf_dir), Path(path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    w = _writer(path, arch, cfg, AutoTokenizer.from_pretrained(hf_dir), json.loads((hf_dir / "tokenizer.json").read_text()))
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        gname = gguf_name(name)
        data = t.astype(np.float32)
        if arch == "llama" and (".attn_q." in gname or ".attn_k." in gname):
            data = permute_qk(data, heads if ".attn_q." in gname else kv)
        qtype = qtype_of(gname) if data.ndim == 2 else None
        if qtype is None:
            w.add_tensor(gname, np.ascontiguousarray(data))
        else:
            w.add_tensor(gname, quantize(data, qtype), raw_dtype=gguf.GGMLQuantizationType(qtype))
    _finish(w)
    return path


def write_synthetic_gguf(path: str | Path, cfg: dict, qtype_of: Callable[[str], int], arch: str = "llama", seed: int = 0, std: float = 0.02) -> Path:
    """A GGUF of a model shaped by ``cfg`` (a Hugging Face config dict) with random weights, each
    2-D tensor quantized in the type ``qtype_of(gguf_name)`` picks (norms: F32 ones). One layer's
    tensors are drawn and quantized, and every layer repeats them, so writing a 7B-shaped file takes
    a minute or two and the memory of one layer. The tokenizer is the built-in stand-in's."""
    import gguf

    from radixserve.model.builtin import build_tokenizer

    path = Path(path)
    rng = np.random.default_rng(seed)
    tok = build_tokenizer(cfg["vocab_size"], model_max_length=cfg["max_position_embeddings"])
    w = _writer(path, arch, cfg, tok, json.loads(tok.backend_tokenizer.to_str()))
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {
        "attn_q": (q, h),
        "attn_k": (kv, h),
        "attn_v": (kv, h),
        "attn_output": (h, q),
        "ffn_gate": (inter, h),
        "ffn_up": (inter, h),
        "ffn_down": (h, inter),
    }

    def blocks(name: str, shape: tuple[int, int]):
        qtype = qtype_of(name)
        x = rng.standard_normal(shape, dtype=np.float32) * std
        return quantize(x, qtype), gguf.GGMLQuantizationType(qtype)

    layer = {stem: blocks(f"blk.0.{stem}.weight", shape) for stem, shape in shapes.items()}
    ones = np.ones(h, dtype=np.float32)
    data, qtype = blocks("token_embd.weight", (v, h))
    w.add_tensor("token_embd.weight", data, raw_dtype=qtype)
    for i in range(cfg["num_hidden_layers"]):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        for stem, (data, qtype) in layer.items():
            w.add_tensor(f"blk.{i}.{stem}.weight", data, raw_dtype=qtype)
    w.add_tensor("output_norm.weight", ones)
    if not cfg.get("tie_word_embeddings"):
        data, qtype = blocks("output.weight", (v, h))
        w.add_tensor("output.weight", data, raw_dtype=qtype)
    _finish(w)
    return path

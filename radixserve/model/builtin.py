"""Built-in stand-in model: a small random-weight Llama plus a locally built tokenizer.

radixserve must run with no model downloaded. On first use :func:`default_model_path`
deterministically builds a small Llama-architecture model with random weights and a
byte-level BPE tokenizer trained on a tiny embedded corpus (:mod:`~radixserve.model.builtin_tokenizer`), saves it in ordinary
Hugging Face format (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` with a chat template, ``generation_config.json``) under a cache
directory, and returns that directory. The engine then loads it through the same path
as any real checkpoint (AutoConfig / AutoTokenizer / safetensors).

The model produces no meaningful text; it exists so that the whole serving stack
(tokenizer, chat template, prefix cache, paged KV, sampling, stop tokens) can be run
and tested anywhere, offline.

Nothing here touches the network: tokenizers are built from in-memory objects and
models from configs.

:func:`radixserve.testing.make_tiny_model_dir` builds tiny random checkpoints of each
supported architecture for tests (also importable from here).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from radixserve.model.builtin_tokenizer import (  # noqa: F401  (re-exported: part of this module's API)
    ASSISTANT,
    BOS,
    CHAT_TEMPLATE,
    CORPUS,
    END,
    EOS,
    PAD,
    SPECIAL_TOKENS,
    SYSTEM,
    USER,
    build_tokenizer,
)

logger = logging.getLogger("radixserve")

__all__ = [
    "BUILTIN_VERSION",
    "BUILTIN_VOCAB_SIZE",
    "BUILTIN_SEED",
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "build_tokenizer",
    "builtin_config",
    "save_model_dir",
    "default_cache_dir",
    "default_model_path",
]

#: Bump when anything that changes the produced files changes (corpus, config, init).
BUILTIN_VERSION = "builtin-llama-v1"
BUILTIN_VOCAB_SIZE = 4096
BUILTIN_SEED = 0

_MAX_POSITIONS = 4096


# --------------------------------------------------------------------------------------
# small compatibility helpers (transformers 4.45 .. 5.x)
# --------------------------------------------------------------------------------------


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def dtype_kwargs(dtype: Any) -> dict[str, Any]:
    """``dtype=`` on transformers 5, ``torch_dtype=`` on 4.x (configs and from_config)."""
    return {"dtype": dtype} if _transformers_major() >= 5 else {"torch_dtype": dtype}


# --------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------


def builtin_config(vocab_size: int = BUILTIN_VOCAB_SIZE, *, bos_token_id: int = 0, eos_token_id: int = 1, pad_token_id: int | None = 2, **overrides):
    """LlamaConfig of the built-in stand-in model (~4.3M parameters, fp32).

    hidden 256, 4 layers, 4 heads / 2 KV heads (head_dim 64), intermediate 704, 4096
    positions, rope_theta 10000, tied embeddings. ``overrides`` replace any field.
    """
    from transformers import LlamaConfig

    kw: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        hidden_act="silu",
        max_position_embeddings=_MAX_POSITIONS,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        architectures=["LlamaForCausalLM"],
        **dtype_kwargs("float32"),
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


# --------------------------------------------------------------------------------------
# saving
# --------------------------------------------------------------------------------------


def _reinit_weights(model, seed: int) -> None:
    """Re-initialise every parameter from one seeded generator, in name order.

    Matrices (and embeddings): N(0, 0.02); norm weights: 1; biases: 0. Independent of
    how a given transformers version initialises modules, so the bytes depend only on
    the config, the seed and torch's CPU normal_ kernel.
    """
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "bias":
                p.zero_()
            elif p.ndim == 1:  # RMSNorm weights (input/post-attn/final norm, q/k norm)
                p.fill_(1.0)
            else:
                p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen).to(p.dtype))


def _config_dtype(config):
    """The dtype a config declares (``dtype`` on v5, ``torch_dtype`` on v4), fp32 if none."""
    import torch

    dt = getattr(config, "dtype", None) if _transformers_major() >= 5 else None
    dt = dt or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dt, str):
        dt = getattr(torch, dt)
    return dt


@contextlib.contextmanager
def _quiet_progress_bars():
    """Hide transformers' "Writing model shards" bar while saving, then restore."""
    try:
        from transformers.utils import logging as hf_logging

        was_enabled = hf_logging.is_progress_bar_enabled()
    except Exception:  # pragma: no cover - very old/new transformers
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def _add_legacy_rope_keys(path: Path) -> None:
    """transformers 5 writes only ``rope_parameters``; also write ``rope_theta`` and
    ``rope_scaling`` so transformers 4.x and hand-written loaders read the same RoPE.
    transformers 5 reads the file back identically."""
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rp = cfg.get("rope_parameters")
    if not isinstance(rp, dict) or "rope_theta" not in rp:
        return
    cfg.setdefault("rope_theta", rp["rope_theta"])
    if rp.get("rope_type", "default") != "default" and "rope_scaling" not in cfg:
        cfg["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _patch_tokenizer_config(path: Path, tokenizer) -> None:
    """Make ``tokenizer_config.json`` readable by transformers 4.x as well as 5.x.

    transformers 5 saves the chat template only as ``chat_template.jinja`` and names the
    class ``TokenizersBackend`` (unknown to 4.x). Also put the template in
    ``tokenizer_config.json`` and name the class ``PreTrainedTokenizerFast`` (an alias of
    ``TokenizersBackend`` in 5.x). Record that there is no unk token."""
    template = getattr(tokenizer, "chat_template", None)
    tc_path = path / "tokenizer_config.json"
    if not tc_path.is_file():
        return
    tc = json.loads(tc_path.read_text())
    if template:
        tc["chat_template"] = template
    if tc.get("tokenizer_class") in (None, "TokenizersBackend"):
        tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    if getattr(tokenizer, "unk_token", None) is None:
        # Explicitly none. transformers 5 loads model_type "qwen2" dirs with Qwen2Tokenizer
        # whatever tokenizer_class says, and that class would otherwise add an
        # "<|endoftext|>" unk token at id vocab_size, one past the model's vocab.
        tc["unk_token"] = None
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def save_model_dir(path: str | os.PathLike, config, *, seed: int, tokenizer=None, generation_config: dict[str, Any] | None = None) -> Path:
    """Create a random-weight model from ``config`` and save it (and ``tokenizer``) at ``path``.

    Deterministic for a fixed torch version: weights come from ``seed`` alone (see
    :func:`_reinit_weights`). The directory is built next to the target and renamed into
    place, so concurrent callers never observe a half-written directory. If ``path``
    already holds a ``config.json`` it is returned untouched.

    ``generation_config``: extra fields for ``generation_config.json`` (e.g. a list of
    ``eos_token_id``).
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if _is_model_dir(path):
        return path
    save_dtype = _config_dtype(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, **dtype_kwargs(torch.float32))
        model = model.to(torch.float32)
        _reinit_weights(model, seed)
        if save_dtype != torch.float32:
            model = model.to(save_dtype)
        if generation_config:
            for k, v in generation_config.items():
                setattr(model.generation_config, k, v)
        save_kwargs: dict[str, Any] = {}
        if _transformers_major() < 5:
            save_kwargs["safe_serialization"] = True  # v5: always safetensors, kwarg ignored
        with _quiet_progress_bars():
            model.save_pretrained(tmp, **save_kwargs)
        _add_legacy_rope_keys(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
            _patch_tokenizer_config(tmp, tokenizer)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        try:
            os.rename(tmp, path)
        except OSError:
            if _is_model_dir(path):  # another process won the race
                shutil.rmtree(tmp, ignore_errors=True)
                return path
            # A stale non-model directory sits at the target: move it aside, retry once.
            stale = Path(tempfile.mkdtemp(prefix=f".{path.name}.stale-", dir=path.parent))
            os.rename(path, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if _is_model_dir(path):
            return path
        raise
    return path


# --------------------------------------------------------------------------------------
# the default (built-in) model
# --------------------------------------------------------------------------------------


def default_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir`` if given, else ``$RADIXSERVE_CACHE``, else ``~/.cache/radixserve``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("RADIXSERVE_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "radixserve"


def build_builtin_model_dir(path: str | os.PathLike, vocab_size: int = BUILTIN_VOCAB_SIZE, config=None, *, seed: int = BUILTIN_SEED) -> Path:
    """Build (if absent) a stand-in model with :func:`build_tokenizer` at ``path``.

    ``config`` defaults to :func:`builtin_config`; its vocab/special ids are taken from
    the tokenizer.
    """
    path = Path(path)
    if _is_model_dir(path):
        return path
    tokenizer = build_tokenizer(vocab_size, model_max_length=(config.max_position_embeddings if config is not None else _MAX_POSITIONS))
    ids = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if config is None:
        config = builtin_config(vocab_size, **ids)
    else:
        config.vocab_size = vocab_size
        for k, v in ids.items():
            setattr(config, k, v)
    end_id = tokenizer.convert_tokens_to_ids(END)
    gen = {**ids, "eos_token_id": [ids["eos_token_id"], end_id]}
    return save_model_dir(path, config, seed=seed, tokenizer=tokenizer, generation_config=gen)


def default_model_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the built-in stand-in model, creating it on first use (~1 s)."""
    path = default_cache_dir(cache_dir) / BUILTIN_VERSION
    if _is_model_dir(path):
        return path
    logger.info("creating the built-in stand-in model (random weights, no meaningful output) at %s", path)
    t0 = time.perf_counter()
    build_builtin_model_dir(path, BUILTIN_VOCAB_SIZE, seed=BUILTIN_SEED)
    logger.info("built-in stand-in model ready in %.1fs", time.perf_counter() - t0)
    return path

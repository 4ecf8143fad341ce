"""Checks of a model before anything is built from it: the numbers of its config (a damaged or
hand-edited config.json or GGUF header fails naming the field, not with a ZeroDivisionError deep
in the model code) and memory (a context or KV pool larger than the memory available fails at
once, naming what to lower, instead of each worker swapping or being killed)."""

from __future__ import annotations

import os

from radixserve.errors import ModelLoadError

#: Fields every Llama-family config needs, and those it may leave to their defaults.
REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
OPTIONAL_FIELDS = ("num_key_value_heads", "head_dim", "max_position_embeddings")


def check_config_values(cfg: dict, where: str, names: dict[str, str] | None = None) -> None:
    """Raise :class:`ModelLoadError` unless ``cfg``'s shape fields are positive integers that fit
    together (``names``: how ``where`` spells them, e.g. GGUF keys)."""
    names = names or {}

    def bad(key: str, why: str) -> ModelLoadError:
        return ModelLoadError(f"{where}: {names.get(key, key)} {why}; the model file is damaged or incomplete")

    for key in REQUIRED_FIELDS + OPTIONAL_FIELDS:
        value = cfg.get(key)
        if value is None and key in OPTIONAL_FIELDS:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad(key, "is missing" if value is None else f"is {value!r}, not a positive integer")
    heads = cfg["num_attention_heads"]
    if heads % (cfg.get("num_key_value_heads") or heads):
        raise bad("num_attention_heads", f"({heads}) is not a multiple of the KV heads ({cfg['num_key_value_heads']})")
    if not cfg.get("head_dim") and cfg["hidden_size"] % heads:
        raise bad("hidden_size", f"({cfg['hidden_size']}) is not a multiple of the attention heads ({heads})")
    if (cfg.get("head_dim") or cfg["hidden_size"] // heads) % 2:
        raise bad("head_dim", "is odd (RoPE rotates pairs of dimensions)")


def available_memory() -> int:
    """Bytes of memory available now (MemAvailable; MemFree where /proc/meminfo is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def rope_table_bytes(positions: int, head_dim: int) -> int:
    """Peak bytes of building the RoPE tables (``RotaryEmbedding.build``): cos and sin, float32,
    one row per position, and as much again for the temporaries they are computed from."""
    return 2 * (2 * positions * head_dim * 4)


def check_memory(what: str, nbytes: int, remedy: str) -> None:
    """Raise :class:`ModelLoadError` when ``what`` needs more than the memory available now."""
    free = available_memory()
    if nbytes > free:
        raise ModelLoadError(f"{what} need {nbytes / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB of memory available; {remedy}")

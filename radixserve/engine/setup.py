"""Building an engine's parts from a loaded model and its config: the KV pool (sized from a token
count or a memory budget), the model runner (one process, or tensor parallel ranks), and the
settings line logged at start-up."""

from __future__ import annotations

import torch

from radixserve.config import EngineConfig
from radixserve.engine.model_runner import ModelRunner
from radixserve.engine.tensor_parallel import TensorParallelRunner
from radixserve.errors import BadRequestError
from radixserve.kv.pool import KVPool
from radixserve.model.checks import check_memory
from radixserve.model.llama import head_dim_of
from radixserve.model.parallel import check_divisible


def weights_mode(config: EngineConfig) -> str:
    """``config.weights``, with ``auto`` meaning ``dequantize`` under tensor parallelism (which
    shards dense weights only); ``quantized`` with it is refused."""
    if config.tensor_parallel > 1:
        if config.weights == "quantized":
            raise BadRequestError("weights", "tensor parallelism shards dense weights: use weights=dequantize (--weights dequantize) or tensor_parallel=1")
        return "dequantize"
    return config.weights


def quant_compute(loaded, config: EngineConfig) -> str | None:
    """Applies ``config.quant_compute`` to the loaded model's quantized layers; returns the mode
    taken (None: no weight is quantized)."""
    from radixserve.kernels import quant

    try:
        return quant.set_compute(loaded.model, config.quant_compute)
    except ValueError as exc:
        raise BadRequestError("quant_compute", str(exc)) from None


def make_pool(loaded, config: EngineConfig, device: torch.device) -> KVPool:
    """This rank's KV pool: ``kv_cache_tokens``, else ``kv_memory_gb`` (on CUDA: 85% of the free
    memory; on the CPU: 1 GiB) worth of tokens."""
    cfg = loaded.config
    tp = config.tensor_parallel
    if tp > 1:
        check_divisible(cfg, tp)
    num_kv_heads, head_dim = cfg.num_key_value_heads // tp, head_dim_of(cfg)  # this rank's KV heads
    per_token = KVPool.bytes_per_token(cfg.num_hidden_layers, num_kv_heads, head_dim, loaded.dtype, config.kv_dtype)
    tokens = config.kv_cache_tokens
    if tokens is None:
        budget = config.kv_memory_gb
        if budget is None and device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = 0.85 * free / 2**30
        tokens = int((budget or 1.0) * 2**30 // per_token)
    if device.type == "cpu":
        check_memory(f"the KV pages of {tokens} tokens", tokens * per_token, "lower --kv-cache-tokens")
    return KVPool(
        num_layers=cfg.num_hidden_layers,
        num_pages=-(-tokens // config.page_size),
        page_size=config.page_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=loaded.dtype,
        device=device,
        kv_dtype=config.kv_dtype,
    )


def make_runner(loaded, pool: KVPool, device: torch.device, config: EngineConfig) -> ModelRunner | TensorParallelRunner:
    if config.tensor_parallel > 1:  # shards loaded.model and starts the follower ranks
        return TensorParallelRunner(loaded, pool, device, config.attention, config.tensor_parallel)
    return ModelRunner(loaded.model, pool, device, config.attention)


def cascade_threshold(config: EngineConfig, runner) -> int | None:
    """Shared-prefix tokens (group size x prefix) from which decodes run as a cascade group;
    ``auto``: the attention backend's own threshold (None: no cascade)."""
    threshold = config.cascade_min_shared_tokens
    return runner.attention.cascade_min_shared_tokens if threshold == "auto" else threshold


def describe(loaded, config: EngineConfig, runner, pool: KVPool, max_model_len: int, quant_compute: str | None = None) -> dict:
    """The settings an engine runs with (logged at start-up; :meth:`Engine.info`)."""
    dtype = str(loaded.dtype).removeprefix("torch.")
    return {
        "model": str(loaded.path),
        "arch": loaded.config.architectures[0],
        "dtype": dtype,
        "quant_compute": quant_compute,
        "device": config.device,
        "attention": type(runner.attention).__name__,
        "kv_capacity_tokens": pool.capacity_tokens,
        "kv_pages": pool.num_pages,
        "page_size": pool.page_size,
        "kv_dtype": config.kv_dtype or dtype,
        "max_running": config.max_running,
        "max_batched_tokens": config.max_batched_tokens,
        "max_model_len": max_model_len,
        "prefix_cache": config.enable_prefix_cache,
        "tensor_parallel": config.tensor_parallel,
    }


def ready_line(info: dict) -> str:
    return (
        "engine ready: model={model} arch={arch} dtype={dtype}{quant} device={device} attention={attention} | KV capacity "
        "{kv_capacity_tokens} tokens ({kv_pages} pages x {page_size}, kv={kv_dtype}) | max_running={max_running} "
        "max_batched_tokens={max_batched_tokens} max_model_len={max_model_len} prefix_cache={cache} "
        "tensor_parallel={tensor_parallel}"
    ).format(**info, cache="on" if info["prefix_cache"] else "off", quant=f" quant_compute={info['quant_compute']}" if info.get("quant_compute") else "")

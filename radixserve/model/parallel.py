"""Tensor parallelism, the model side: attention heads and MLP columns split over N ranks
(torch.distributed, gloo). The ranks themselves (rank 0 in the engine, followers in spawned
processes) are run by :mod:`radixserve.engine.tensor_parallel`. The math:

- column-parallel ``qkv_proj/gate_up_proj``: rank r keeps share r/N of each row block (its q
  heads, then its KV heads of k and of v; its gate columns, then the same up columns);
- row-parallel ``o_proj/down_proj``: rank r keeps the matching input columns; their partial
  outputs are summed with ``all_reduce`` (a forward hook), the bias added on rank 0 only;
- embedding, norms and lm_head stay whole on every rank (small at these sizes).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from radixserve.errors import BadRequestError

COLLECTIVE_TIMEOUT = timedelta(seconds=300)


def check_divisible(config, world: int) -> None:
    """Refuse a split that does not divide heads, KV heads and MLP columns evenly."""
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
    }
    bad = {name: value for name, value in sizes.items() if value % world}
    if bad:
        what = ", ".join(f"{name}={value}" for name, value in bad.items())
        raise BadRequestError(
            "tensor_parallel", f"{what} of this model not divisible by tensor_parallel={world}; choose a tensor_parallel that divides {', '.join(bad)}"
        )


def make_group(store_path: str, rank: int, world: int) -> dist.ProcessGroupGloo:
    store = dist.FileStore(store_path, world)
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stubs lack the (private) Gloo options
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = COLLECTIVE_TIMEOUT
    return dist.ProcessGroupGloo(store, rank, world, opts)


def _keep_rows(linear: nn.Linear, blocks: list[int], rank: int, world: int) -> None:
    """Keep rank ``rank``'s share of every row block (``blocks``: row counts, summing to out_features)."""
    keep, start = [], 0
    for rows in blocks:
        n = rows // world
        keep.append(torch.arange(start + rank * n, start + (rank + 1) * n))
        start += rows
    index = torch.cat(keep)
    linear.weight = nn.Parameter(linear.weight.data.index_select(0, index), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data.index_select(0, index), requires_grad=False)
    linear.out_features = len(index)


def _keep_cols(linear: nn.Linear, rank: int, world: int) -> None:
    n = linear.in_features // world
    linear.weight = nn.Parameter(linear.weight.data[:, rank * n : (rank + 1) * n].clone(), requires_grad=False)
    if linear.bias is not None and rank != 0:
        linear.register_parameter("bias", None)  # the sum over ranks must add it once (what `bias = None` does)
    linear.in_features = n


def shard_model(model, rank: int, world: int) -> list[nn.Linear]:
    """Cut ``model`` (a :class:`~radixserve.model.llama.CausalLM`) down to rank ``rank``'s shard, in
    place; returns the row-parallel layers, whose outputs :func:`attach_all_reduce` must sum."""
    check_divisible(model.config, world)
    row_parallel = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        _keep_rows(attn.qkv_proj, attn.qkv_sizes(), rank, world)
        _keep_rows(mlp.gate_up_proj, [mlp.intermediate_size] * 2, rank, world)
        for linear in (attn.o_proj, mlp.down_proj):
            _keep_cols(linear, rank, world)
            row_parallel.append(linear)
        attn.num_heads //= world
        attn.num_kv_heads //= world
        mlp.intermediate_size //= world
    return row_parallel


def attach_all_reduce(linears: list[nn.Linear], group) -> None:
    def all_reduce(module, args, out):
        group.allreduce([out]).wait()
        return out

    for linear in linears:
        linear.register_forward_hook(all_reduce)

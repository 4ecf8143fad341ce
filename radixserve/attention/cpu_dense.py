"""Prefill and extend chunks on the CPU through torch's flash-attention kernel (the many-row path).

A chunk of many new tokens is GEMM-shaped work. torch's CPU flash attention
(``aten::_scaled_dot_product_flash_attention_for_cpu``: blocked, vectorised, returns the
log-sum-exp) runs it several times faster than the csrc/ decode kernel's sgemm-tiled path; the
csrc/ GEMM prefill kernel (``csrc/prefill.cpp``) beats both (``python -m bench kernels``) and is
:class:`~radixserve.attention.cpu_backend.CpuAttention`'s default. This flash path runs where
``dense_path`` is "flash" (bf16 on a CPU without AMX): every ungrouped sequence with at least
``dense_min_tokens`` new tokens comes here, one call per part:

* the chunk against its own new tokens: causal (on a square the top-left and bottom-right
  masks agree), straight from the layer's q/k/v, each KV head repeated for its query heads;
* the chunk against its cached prefix (an extend): the prefix K/V gathered from the pool once
  per layer, not causal (every new token sees the whole prefix), GQA folded into the query
  rows (the G query heads of a KV head become G x T rows of one head, so K/V are not
  repeated); the two states are merged by LSE.

Dtypes: a bf16 pool's parts run in bf16, where torch's flash kernel uses bf16 GEMMs (AMX):
~2.3x faster than fp32 on big parts (4096 x 2048 keys: 80 vs 185 ms; causal 2048: 52 vs 120 ms,
one thread) and ~2x on small ones once the fp32 path's widening of the prefix is counted (17-64
tokens over 2,200 gathered keys: 3.3-6.2 vs 8.9-12.3 ms). fp16 runs in fp32. Softmax and
accumulation are fp32 either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import torch

from radixserve.attention.metadata import AttentionMetadata

LOG2E = 1.4426950408889634
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


Slots: TypeAlias = "torch.Tensor | slice"


def _slots(slots: torch.Tensor) -> Slots:
    """The pool slots of a prefix, as a slice when they are one contiguous range (in any order:
    a prefix is attended without a mask, so only the set of its keys matters), which reads the
    K/V in place instead of gathering them. Slots of one sequence are distinct."""
    lo, hi = int(slots.min()), int(slots.max())
    return slice(lo, hi + 1) if hi - lo + 1 == len(slots) else slots


def _read(cache: torch.Tensor, slots: Slots) -> torch.Tensor:
    return cache[slots] if isinstance(slots, slice) else cache.index_select(0, slots)


@dataclass(frozen=True)
class DenseSeq:
    rows: tuple[int, int]  # [first, end) rows of the batch's q/k/v
    prefix_slots: Slots | None  # pool slots of the cached prefix (see _slots); None: fresh prefill


def plan_dense(meta: AttentionMetadata, seqs: list[int]) -> list[DenseSeq]:
    qo, kv = meta.qo_indptr.tolist(), meta.kv_indptr.tolist()
    page = meta.page_size
    offsets = torch.arange(page, dtype=torch.long)
    out = []
    for i in seqs:
        prefix = meta.kv_lens[i] - meta.qo_lens[i]
        slots = None
        if prefix > 0:
            pages = meta.kv_indices[kv[i] : kv[i] + -(-prefix // page)].long()
            slots = _slots((pages[:, None] * page + offsets).reshape(-1)[:prefix])
        out.append(DenseSeq((qo[i], qo[i + 1]), slots))
    return out


def _compute(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype its flash call runs in (see the module docstring)."""
    return x if x.dtype in (torch.float32, torch.bfloat16) else x.float()


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # [T, H, D] -> [1, H, T, D]


def attend_prefix(qs: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, slots: Slots, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries ``[T, Hq, D]`` against the K/V at pool ``slots``, every query seeing every key:
    (output ``[T, Hq, D]``, base-2 LSE ``[T, Hq]`` fp32). GQA is folded into the query rows."""
    t, heads, dim = qs.shape
    kv_heads = k_slots.shape[1]
    group = heads // kv_heads
    qs = _compute(qs)
    kp = _read(k_slots, slots).to(qs.dtype)  # [P, Hkv, D]
    vp = _read(v_slots, slots).to(qs.dtype)
    folded = qs.view(t, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(1, kv_heads, t * group, dim)
    out, lse = _flash(folded, _heads_first(kp), _heads_first(vp), 0.0, False, scale=scale)
    out = out[0].view(kv_heads, t, group, dim).permute(1, 0, 2, 3).reshape(t, heads, dim)
    return out, lse[0].view(kv_heads, t, group).permute(1, 0, 2).reshape(t, heads).mul_(LOG2E)


def attend_dense(
    seq: DenseSeq, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, scale: float, merge_state
) -> torch.Tensor:
    """Output rows ``[T, Hq, D]`` (q's dtype) of one sequence; ``merge_state`` is the kernels' merge."""
    first, end = seq.rows
    qs = q[first:end]
    t, heads, dim = qs.shape
    own_q = _compute(qs)
    ks, vs = k[first:end].to(own_q.dtype), v[first:end].to(own_q.dtype)
    kv_heads = ks.shape[1]
    group = heads // kv_heads
    if group > 1:
        ks = ks[:, :, None].expand(t, kv_heads, group, dim).reshape(t, heads, dim)
        vs = vs[:, :, None].expand(t, kv_heads, group, dim).reshape(t, heads, dim)
    own, own_lse = _flash(_heads_first(own_q), _heads_first(ks), _heads_first(vs), 0.0, True, scale=scale)
    own = own[0].transpose(0, 1).to(q.dtype)  # [T, H, D]
    if seq.prefix_slots is None:
        return own
    pre, pre_lse = attend_prefix(qs, k_slots, v_slots, seq.prefix_slots, scale)
    return merge_state(pre.to(q.dtype), pre_lse, own.contiguous(), own_lse[0].transpose(0, 1).mul(LOG2E))


def plan_prefixes(meta: AttentionMetadata) -> list[tuple[int, int, Slots | None]]:
    """Cascade level 0 per group: (first, end) of its rows among the grouped queries, and the
    pool slots of its shared prefix (see _slots; None when empty)."""
    c = meta.cascade
    if c is None:  # no cascade groups
        return []
    page = meta.page_size
    offsets = torch.arange(page, dtype=torch.long)
    qo, kv, last = c.prefix_qo_indptr.tolist(), c.prefix_kv_indptr.tolist(), c.prefix_kv_last_page_len.tolist()
    out = []
    for j in range(len(qo) - 1):
        pages = c.prefix_kv_indices[kv[j] : kv[j + 1]].long()
        n = 0 if len(pages) == 0 else (len(pages) - 1) * page + last[j]
        slots = _slots((pages[:, None] * page + offsets).reshape(-1)[:n]) if n else None
        out.append((qo[j], qo[j + 1], slots))
    return out

"""Shared-prefix (cascade) decode attention in torch.

Decode queries that share a cached prefix attend to it once, as one multi-query (GEMM-shaped)
computation per group, then each attends to its own suffix; the two partial results merge by
log-sum-exp. LSEs are base 2, as FlashInfer returns them, so partial states are interchangeable
with ``flashinfer.cascade.merge_state``.
"""

from __future__ import annotations

import math

import torch

LOG2E = 1.0 / math.log(2.0)


def attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention returning ``(out, lse_base2)``.

    q: [..., Hkv, G, D] (G query rows per KV head: heads of a group, times queries);
    k, v: [..., Hkv, L, D]; mask (True = attend): broadcastable to [..., Hkv, G, L].
    Returns out [..., Hkv, G, D] and lse [..., Hkv, G]; a row that attends to nothing gets
    out 0 and lse -inf, so merging it is a no-op.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - safe.unsqueeze(-1))
    return torch.matmul(probs, v), lse * LOG2E


def merge_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Combine two attention results over disjoint KV sets (base-2 LSEs; out [..., D])."""
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa = torch.exp2(lse_a - m).unsqueeze(-1)
    wb = torch.exp2(lse_b - m).unsqueeze(-1)
    return (out_a * wa + out_b * wb) / (wa + wb)


def to_gqa(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[n, Hq, D] -> [Hkv, n * group, D] with the group's heads adjacent per query."""
    n, hq, d = q.shape
    group = hq // num_kv_heads
    return q.view(n, num_kv_heads, group, d).permute(1, 0, 2, 3).reshape(num_kv_heads, n * group, d)


def from_gqa(x: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`to_gqa` for outputs [Hkv, n * group, D] (or LSEs [Hkv, n * group])."""
    hkv = x.shape[0]
    if x.dim() == 2:
        return x.view(hkv, n, -1).permute(1, 0, 2).reshape(n, -1)
    d = x.shape[-1]
    return x.view(hkv, n, -1, d).permute(1, 0, 2, 3).reshape(n, -1, d)

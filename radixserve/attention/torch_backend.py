"""Reference attention backend in plain torch: the CPU path and the oracle for GPU backends."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.attention.base import AttentionBackend
from radixserve.attention.cascade import attend_with_lse, from_gqa, merge_states, to_gqa
from radixserve.attention.metadata import AttentionMetadata
from radixserve.kv.pool import KVPool, SlotView


class TorchAttention(AttentionBackend):
    """Decode tokens are attended in one padded, masked SDPA call; prefill chunks one by one;
    cascade groups (decodes and extend chunks sharing a cached prefix) attend to the prefix once
    per group and to their own suffixes (each token its causal part), merged by log-sum-exp.

    ``plan`` turns the shared page metadata into gather indices and masks once per batch; every
    layer then reuses them.
    """

    cascade_extends = True  # (the oracle of the CPU kernels, which take extends in groups)

    def __init__(self, pool: KVPool, scale: float):
        self.pool = pool
        self.scale = scale
        self._meta: AttentionMetadata | None = None

    def plan(self, metadata: AttentionMetadata) -> None:
        self._meta = metadata
        page_size = metadata.page_size
        device = metadata.kv_indices.device
        qo_indptr = metadata.qo_indptr.tolist()
        kv_indptr = metadata.kv_indptr.tolist()
        offsets = torch.arange(page_size, device=device)

        def slots(i: int) -> torch.Tensor:
            pages = metadata.kv_indices[kv_indptr[i] : kv_indptr[i + 1]].long()
            return (pages[:, None] * page_size + offsets).flatten()[: metadata.kv_lens[i]]

        grouped: set[int] = set()
        self._groups = []
        if metadata.cascade is not None:
            cascade_rows: list[int] = []
            suffixes: list[torch.Tensor] = []
            visible: list[int] = []
            for first, count, prefix in metadata.cascade.groups:
                members = range(first, first + count)
                grouped.update(members)
                start = len(cascade_rows)
                for i in members:
                    qo_len, suffix = metadata.qo_lens[i], slots(i)[prefix:]
                    cascade_rows += range(qo_indptr[i], qo_indptr[i + 1])
                    suffixes += [suffix] * qo_len
                    # bottom-right causal within the suffix: token t of n sees len - n + t + 1 keys
                    visible += range(len(suffix) - qo_len + 1, len(suffix) + 1)
                local = torch.arange(start, len(cascade_rows), device=device)
                self._groups.append((local, slots(first)[:prefix]))
            self._cascade_rows = torch.tensor(cascade_rows, dtype=torch.long, device=device)
            self._suffix_slots, self._suffix_mask = _padded(suffixes, device, visible)

        decode = [i for i, n in enumerate(metadata.qo_lens) if n == 1 and i not in grouped]
        self._decode_rows = torch.tensor([qo_indptr[i] for i in decode], dtype=torch.long, device=device)
        if decode:
            self._decode_slots, self._decode_mask = _padded([slots(i) for i in decode], device)

        self._prefills = []
        for i, (qo_len, kv_len) in enumerate(zip(metadata.qo_lens, metadata.kv_lens)):
            if qo_len == 1 or i in grouped:
                continue
            mask = None
            if qo_len != kv_len:  # bottom-right causal: query r sees kv positions <= r + kv_len - qo_len
                q_pos = torch.arange(qo_len, device=device)[:, None] + (kv_len - qo_len)
                mask = torch.arange(kv_len, device=device)[None, :] <= q_pos
            self._prefills.append((qo_indptr[i], qo_indptr[i + 1], slots(i), mask))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        meta = self._meta
        assert meta is not None, "plan() must be called before forward()"
        k_cache, v_cache = self.pool.k_slots(layer), self.pool.v_slots(layer)
        k_cache[meta.out_slots] = k
        v_cache[meta.out_slots] = v
        out = torch.empty_like(q)
        if len(self._decode_rows):
            qd = q[self._decode_rows].unsqueeze(2)  # [B, Hq, 1, D]
            kd = _gather(k_cache, self._decode_slots).transpose(1, 2)  # [B, Hkv, L, D]
            vd = _gather(v_cache, self._decode_slots).transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=self._decode_mask, scale=self.scale, enable_gqa=True)
            out[self._decode_rows] = od.squeeze(2)
        if self._groups:
            out[self._cascade_rows] = self._cascade(q[self._cascade_rows], k_cache, v_cache)
        for start, end, slots, mask in self._prefills:
            # 4-D inputs: on CPU, 3-D ones fall back to torch's slow unfused attention.
            qp = q[start:end].transpose(0, 1)[None]  # [1, Hq, n, D]
            kp = _gather(k_cache, slots).transpose(0, 1)[None]  # [1, Hkv, L, D]
            vp = _gather(v_cache, slots).transpose(0, 1)[None]
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True)
            out[start:end] = op[0].transpose(0, 1)
        return out

    def _cascade(self, q: torch.Tensor, k_cache: SlotView, v_cache: SlotView) -> torch.Tensor:
        n, num_heads, head_dim = q.shape
        num_kv = k_cache.shape[1]
        group = num_heads // num_kv
        # Level 1: every grouped query against its own suffix (padded, masked).
        qs = q.view(n, num_kv, group, head_dim)
        ks = _gather(k_cache, self._suffix_slots).transpose(1, 2)  # [n, Hkv, L, D]
        vs = _gather(v_cache, self._suffix_slots).transpose(1, 2)
        out_s, lse_s = attend_with_lse(qs, ks, vs, self.scale, self._suffix_mask)
        out_s, lse_s = out_s.reshape(n, num_heads, head_dim), lse_s.reshape(n, num_heads)
        # Level 0: each group's queries against its shared prefix, once, as one GEMM.
        out = torch.empty_like(q)
        for local, prefix_slots in self._groups:
            kp = _gather(k_cache, prefix_slots).transpose(0, 1)  # [Hkv, P, D]
            vp = _gather(v_cache, prefix_slots).transpose(0, 1)
            out_p, lse_p = attend_with_lse(to_gqa(q[local], num_kv), kp, vp, self.scale)
            m = len(local)
            out[local] = merge_states(from_gqa(out_p, m), from_gqa(lse_p, m), out_s[local], lse_s[local])
        return out


def _padded(slot_lists: list[torch.Tensor], device, visible: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot lists padded into one [n, max_len] gather table, and the mask [n, 1, 1, max_len] of
    each row's first ``visible[row]`` slots (default: all of its list)."""
    max_len = max(len(s) for s in slot_lists)
    table = torch.zeros(len(slot_lists), max_len, dtype=torch.long, device=device)
    for row, s in enumerate(slot_lists):
        table[row, : len(s)] = s
    lens = torch.tensor(visible if visible is not None else [len(s) for s in slot_lists], device=device)
    return table, (torch.arange(max_len, device=device) < lens[:, None])[:, None, None, :]


def _gather(cache: SlotView, slots: torch.Tensor) -> torch.Tensor:
    """``cache[slots]`` for a 1-D or 2-D slot tensor; index_select is several times faster on CPU."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])

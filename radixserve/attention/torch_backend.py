"""Reference attention backend in plain torch: the CPU path and the oracle for GPU backends."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.attention.base import AttentionBackend
from radixserve.attention.metadata import AttentionMetadata
from radixserve.kv.pool import KVPool


class TorchAttention(AttentionBackend):
    """Decode tokens are attended in one padded, masked SDPA call; prefill chunks one by one.

    ``plan`` turns the shared page metadata into gather indices and masks once per batch; every
    layer then reuses them.
    """

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

        decode = [i for i, n in enumerate(metadata.qo_lens) if n == 1]
        self._decode_rows = torch.tensor([qo_indptr[i] for i in decode], dtype=torch.long, device=device)
        if decode:
            max_len = max(metadata.kv_lens[i] for i in decode)
            table = torch.zeros(len(decode), max_len, dtype=torch.long, device=device)
            for row, i in enumerate(decode):
                table[row, : metadata.kv_lens[i]] = slots(i)
            lens = torch.tensor([metadata.kv_lens[i] for i in decode], device=device)
            self._decode_slots = table
            self._decode_mask = (torch.arange(max_len, device=device) < lens[:, None])[:, None, None, :]

        self._prefills = []
        for i, (qo_len, kv_len) in enumerate(zip(metadata.qo_lens, metadata.kv_lens)):
            if qo_len == 1:
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
            kd = k_cache[self._decode_slots].transpose(1, 2)  # [B, Hkv, L, D]
            vd = v_cache[self._decode_slots].transpose(1, 2)
            od = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=self._decode_mask, scale=self.scale, enable_gqa=True
            )
            out[self._decode_rows] = od.squeeze(2)
        for start, end, slots, mask in self._prefills:
            qp = q[start:end].transpose(0, 1)  # [Hq, n, D]
            kp = k_cache[slots].transpose(0, 1)  # [Hkv, L, D]
            vp = v_cache[slots].transpose(0, 1)
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True
            )
            out[start:end] = op.transpose(0, 1)
        return out

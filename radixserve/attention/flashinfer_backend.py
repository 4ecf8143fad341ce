"""FlashInfer paged attention on NVIDIA GPUs, over the same metadata as the torch backend.

* pure-decode batches: ``BatchDecodeWithPagedKVCacheWrapper``;
* any batch with prefill chunks: ``BatchPrefillWithPagedKVCacheWrapper`` (causal, aligned
  bottom-right, so new tokens attend to their cached prefix), decode rows included;
* cascade groups: the shared prefix through the prefill wrapper (the group's queries as one
  multi-query batch, non-causal), suffixes through the decode wrapper, both with LSE, then
  ``flashinfer.cascade.merge_state``.

Plans are made once per batch with keyword arguments only (the positional order differs between
FlashInfer releases) and explicit q/kv dtypes. Not exercised on CPU machines: bench/device_check.py
compares it with the torch backend on a GPU.
"""

from __future__ import annotations

import torch

from radixserve.attention.base import AttentionBackend
from radixserve.attention.metadata import AttentionMetadata
from radixserve.kv.pool import KVPool

WORKSPACE_BYTES = 256 << 20


def available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


class FlashInferAttention(AttentionBackend):
    def __init__(self, pool: KVPool, scale: float, *, num_qo_heads: int):
        import flashinfer

        self.fi = flashinfer
        self.pool = pool
        self.scale = scale
        k0 = pool.k[0]
        self.device = k0.device
        self.dtype = k0.dtype
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = k0.shape[2]
        self.head_dim = k0.shape[3]
        self.page_size = pool.page_size
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        tensor_cores = num_qo_heads // self.num_kv_heads >= 4
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD", use_tensor_cores=tensor_cores)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD")
        # Cascade levels get wrappers of their own: one plan per wrapper per batch.
        self.prefix = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD")
        self.suffix = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD", use_tensor_cores=tensor_cores)
        self._meta: AttentionMetadata | None = None

    def _common(self) -> dict:
        return dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale)

    def plan(self, metadata: AttentionMetadata) -> None:
        self._meta = metadata
        dims = dict(num_kv_heads=self.num_kv_heads, page_size=self.page_size)
        cascade = metadata.cascade
        grouped: list[int] = []
        if cascade is not None:
            for first, count, _ in cascade.groups:
                grouped += range(first, first + count)
        flat = [i for i in range(metadata.num_seqs) if i not in set(grouped)]
        self._flat_rows = self._rows(metadata, flat)
        self._flat_mode = None
        if flat:
            sub = _subset(metadata, flat)
            if all(metadata.qo_lens[i] == 1 for i in flat):
                self.decode.plan(
                    indptr=sub["kv_indptr"],
                    indices=sub["kv_indices"],
                    last_page_len=sub["kv_last_page_len"],
                    num_qo_heads=self.num_qo_heads,
                    head_dim=self.head_dim,
                    pos_encoding_mode="NONE",
                    **dims,
                    **self._common(),
                )
                self._flat_mode = self.decode
            else:
                self.prefill.plan(
                    qo_indptr=sub["qo_indptr"],
                    paged_kv_indptr=sub["kv_indptr"],
                    paged_kv_indices=sub["kv_indices"],
                    paged_kv_last_page_len=sub["kv_last_page_len"],
                    num_qo_heads=self.num_qo_heads,
                    head_dim_qk=self.head_dim,
                    causal=True,
                    **dims,
                    **self._common(),
                )
                self._flat_mode = self.prefill
        self._group_rows = self._rows(metadata, grouped)
        if grouped and cascade is not None:  # grouped rows come from cascade groups
            self.prefix.plan(
                qo_indptr=cascade.prefix_qo_indptr.cpu(),
                paged_kv_indptr=cascade.prefix_kv_indptr.cpu(),
                paged_kv_indices=cascade.prefix_kv_indices.to(self.device),
                paged_kv_last_page_len=cascade.prefix_kv_last_page_len.cpu(),
                num_qo_heads=self.num_qo_heads,
                head_dim_qk=self.head_dim,
                causal=False,
                **dims,
                **self._common(),
            )
            self.suffix.plan(
                indptr=cascade.suffix_kv_indptr.cpu(),
                indices=cascade.suffix_kv_indices.to(self.device),
                last_page_len=cascade.suffix_kv_last_page_len.cpu(),
                num_qo_heads=self.num_qo_heads,
                head_dim=self.head_dim,
                pos_encoding_mode="NONE",
                **dims,
                **self._common(),
            )

    def _rows(self, metadata: AttentionMetadata, seqs: list[int]) -> torch.Tensor:
        qo = metadata.qo_indptr.tolist()
        rows = [r for i in seqs for r in range(qo[i], qo[i + 1])]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        meta = self._meta
        assert meta is not None, "plan() must be called before forward()"
        self.pool.k_slots(layer)[meta.out_slots] = k
        self.pool.v_slots(layer)[meta.out_slots] = v
        cache = (self.pool.k[layer], self.pool.v[layer])
        if self._flat_mode is not None and not len(self._group_rows):
            return self._flat_mode.run(q, cache)
        out = torch.empty_like(q)
        if self._flat_mode is not None:
            out[self._flat_rows] = self._flat_mode.run(q[self._flat_rows], cache)
        if len(self._group_rows):
            qg = q[self._group_rows]
            out_p, lse_p = self.prefix.run(qg, cache, return_lse=True)
            out_s, lse_s = self.suffix.run(qg, cache, return_lse=True)
            out[self._group_rows] = self.fi.cascade.merge_state(out_p, lse_p, out_s, lse_s)[0]
        return out


def _subset(metadata: AttentionMetadata, seqs: list[int]) -> dict[str, torch.Tensor]:
    """The flat metadata of some sequences only (indptrs on the CPU, as plan() wants them)."""
    qo = metadata.qo_indptr.tolist()
    kv = metadata.kv_indptr.tolist()
    last = metadata.kv_last_page_len.tolist()
    indices = metadata.kv_indices
    qo_indptr, kv_indptr, parts, lasts = [0], [0], [], []
    for i in seqs:
        qo_indptr.append(qo_indptr[-1] + qo[i + 1] - qo[i])
        kv_indptr.append(kv_indptr[-1] + kv[i + 1] - kv[i])
        parts.append(indices[kv[i] : kv[i + 1]])
        lasts.append(last[i])
    return dict(
        qo_indptr=torch.tensor(qo_indptr, dtype=torch.int32),
        kv_indptr=torch.tensor(kv_indptr, dtype=torch.int32),
        kv_indices=torch.cat(parts) if parts else indices[:0],
        kv_last_page_len=torch.tensor(lasts, dtype=torch.int32),
    )

"""Batch attention metadata in FlashInfer's paged format, built once per batch on the CPU.

For a batch of B sequences (all int32):

* ``qo_indptr[B+1]``: cumulative counts of new (query) tokens;
* ``kv_indptr[B+1]``: cumulative counts of KV pages;
* ``kv_indices[kv_indptr[-1]]``: the page ids of each sequence, in order;
* ``kv_last_page_len[B]``: tokens used in each sequence's last page, in ``[1, page_size]``.

A sequence's KV length is ``(pages - 1) * page_size + last_page_len`` and covers its cached
prefix plus its new tokens; the new tokens are its *last* ``qo_len`` KV positions (the causal
mask is aligned bottom-right). Every backend consumes exactly this.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    page_size: int
    out_slots: torch.Tensor
    """int64 KV slot (``page * page_size + offset``) of every new token, where its K/V is written."""
    qo_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.qo_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])


def build_metadata(
    page_tables: Sequence[Sequence[int]],
    kv_lens: Sequence[int],
    qo_lens: Sequence[int],
    page_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata for sequences whose ``qo_lens[i]`` new tokens end at KV length ``kv_lens[i]``.

    ``page_tables[i]`` must hold at least ``ceil(kv_lens[i] / page_size)`` pages; extra pages
    are ignored.
    """
    assert len(page_tables) == len(kv_lens) == len(qo_lens)
    indices: list[int] = []
    kv_indptr = [0]
    last_page_len: list[int] = []
    slots: list[torch.Tensor] = []
    for table, kv_len, qo_len in zip(page_tables, kv_lens, qo_lens):
        assert 1 <= qo_len <= kv_len, (qo_len, kv_len)
        num_pages = -(-kv_len // page_size)
        assert len(table) >= num_pages, f"page table has {len(table)} pages, needs {num_pages}"
        indices.extend(table[:num_pages])
        kv_indptr.append(len(indices))
        last_page_len.append(kv_len - (num_pages - 1) * page_size)
        slots.append(_slots_of(table, kv_len - qo_len, kv_len, page_size))
    qo_indptr = torch.tensor([0, *accumulate(qo_lens)], dtype=torch.int32)
    return AttentionMetadata(
        qo_indptr=qo_indptr.to(device),
        kv_indptr=torch.tensor(kv_indptr, dtype=torch.int32, device=device),
        kv_indices=torch.tensor(indices, dtype=torch.int32, device=device),
        kv_last_page_len=torch.tensor(last_page_len, dtype=torch.int32, device=device),
        page_size=page_size,
        out_slots=torch.cat(slots).to(device),
        qo_lens=tuple(qo_lens),
        kv_lens=tuple(kv_lens),
    )


def _slots_of(table: Sequence[int], start: int, end: int, page_size: int) -> torch.Tensor:
    """KV slots of token positions ``[start, end)`` of a sequence with this page table."""
    positions = torch.arange(start, end)
    if page_size == 1:
        return torch.tensor(table[start:end], dtype=torch.int64)
    pages = torch.tensor(table[start // page_size : -(-end // page_size)], dtype=torch.int64)
    return pages[positions // page_size - start // page_size] * page_size + positions % page_size

"""Batch attention metadata in FlashInfer's paged format, built once per batch on the CPU.

For a batch of B sequences (all int32):

* ``qo_indptr[B+1]``: cumulative counts of new (query) tokens;
* ``kv_indptr[B+1]``: cumulative counts of KV pages;
* ``kv_indices[kv_indptr[-1]]``: the page ids of each sequence, in order;
* ``kv_last_page_len[B]``: tokens used in each sequence's last page, in ``[1, page_size]``.

A sequence's KV length is ``(pages - 1) * page_size + last_page_len`` and covers its cached
prefix plus its new tokens; the new tokens are its *last* ``qo_len`` KV positions (the causal
mask is aligned bottom-right). Every backend consumes exactly this.

Optionally, runs of sequences that share a cached prefix form *cascade groups*: level 0 holds
each group's shared prefix once (FlashInfer's multi-level cascade format, one entry per group;
every new token of the group attends to all of it), level 1 each grouped sequence's own suffix
(its new tokens bottom-right causal, as in the flat format). Members are decodes, or on backends
with ``cascade_extends`` also extend chunks whose new tokens all follow the shared prefix.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate, chain, islice

import numpy as np
import torch


@dataclass(frozen=True)
class CascadeMetadata:
    groups: tuple[tuple[int, int, int], ...]
    """(first sequence, number of sequences, shared prefix tokens) per group."""
    prefix_qo_indptr: torch.Tensor  # [G+1] query rows per group (its members' new tokens)
    prefix_kv_indptr: torch.Tensor  # [G+1]
    prefix_kv_indices: torch.Tensor  # shared prefix pages, once per group
    prefix_kv_last_page_len: torch.Tensor  # [G]
    suffix_qo_indptr: torch.Tensor  # [S+1] query rows of the S grouped sequences, in batch order
    suffix_kv_indptr: torch.Tensor  # [S+1]
    suffix_kv_indices: torch.Tensor
    suffix_kv_last_page_len: torch.Tensor  # [S]

    @property
    def decodes_only(self) -> bool:
        """Whether every grouped sequence has one new token."""
        return int(self.suffix_qo_indptr[-1]) == len(self.suffix_qo_indptr) - 1


@dataclass(frozen=True)
class AttentionMetadata:
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_last_page_len: torch.Tensor
    page_size: int
    out_slots: torch.Tensor
    """int64 KV slot (``page * page_size + offset``) of every new token, where its K/V is written."""
    qo_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    cascade: CascadeMetadata | None = None
    page_tables: tuple[Sequence[int], ...] = field(default=(), repr=False, compare=False)
    """Each sequence's page table, of which the first ``kv_indptr[i+1] - kv_indptr[i]`` pages are
    its ``kv_indices`` (the tables themselves, not copies: they are read during the step)."""

    @cached_property
    def kv_indices(self) -> torch.Tensor:
        """Every sequence's pages, concatenated (int32), made at first use: at page size 1 it lists
        every token of every context (~140k ids, ~2 ms for 64 agents over 2,200 tokens), and a
        batch whose sequences are all in cascade groups never reads it on the CPU backend."""
        ptr = self.kv_indptr.tolist()
        pages = (islice(table, ptr[i + 1] - ptr[i]) for i, table in enumerate(self.page_tables))
        return _int32(chain.from_iterable(pages), ptr[-1]).to(self.kv_indptr.device)

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
    groups: Sequence[tuple[int, int, int]] = (),
) -> AttentionMetadata:
    """Metadata for sequences whose ``qo_lens[i]`` new tokens end at KV length ``kv_lens[i]``.

    ``page_tables[i]`` must hold at least ``ceil(kv_lens[i] / page_size)`` pages; extra pages
    are ignored. ``groups`` lists cascade groups as (first sequence, count, prefix tokens): the
    sequences are consecutive, their page tables agree on the first ``prefix / page_size`` pages
    (``prefix`` a multiple of ``page_size``; 0 is allowed and attends to nothing at level 0), and
    each one's new tokens follow the prefix (``kv_len - qo_len >= prefix``).
    """
    assert len(page_tables) == len(kv_lens) == len(qo_lens)
    kv_indptr = [0]
    last_page_len: list[int] = []
    slots: list[int] = []
    for table, kv_len, qo_len in zip(page_tables, kv_lens, qo_lens):
        assert 1 <= qo_len <= kv_len, (qo_len, kv_len)
        num_pages = -(-kv_len // page_size)
        assert len(table) >= num_pages, f"page table has {len(table)} pages, needs {num_pages}"
        kv_indptr.append(kv_indptr[-1] + num_pages)
        last_page_len.append(kv_len - (num_pages - 1) * page_size)
        _extend_slots(slots, table, kv_len - qo_len, kv_len, page_size)
    qo_indptr = torch.tensor([0, *accumulate(qo_lens)], dtype=torch.int32)
    cascade = _cascade(page_tables, kv_lens, qo_lens, page_size, groups, device) if groups else None
    return AttentionMetadata(
        cascade=cascade,
        qo_indptr=qo_indptr.to(device),
        kv_indptr=torch.tensor(kv_indptr, dtype=torch.int32, device=device),
        page_tables=tuple(page_tables),
        kv_last_page_len=torch.tensor(last_page_len, dtype=torch.int32, device=device),
        page_size=page_size,
        out_slots=torch.tensor(slots, dtype=torch.int64, device=device),
        qo_lens=tuple(qo_lens),
        kv_lens=tuple(kv_lens),
    )


def _int32(values: Iterable[int], count: int) -> torch.Tensor:
    """An int32 tensor of ``count`` ints, about 3x faster than torch.tensor on a long list (a
    decode batch at page size 1 lists every token of every context: ~140k ids for 64 x 2200)."""
    return torch.from_numpy(np.fromiter(values, dtype=np.int32, count=count))


def _extend_slots(out: list[int], table: Sequence[int], start: int, end: int, page_size: int) -> None:
    """Append the KV slots of token positions ``[start, end)`` of a sequence with this page table,
    a page's run at a time (plain ints: a few torch ops per sequence cost ~25 us each, most of a
    64-decode step's metadata)."""
    if page_size == 1:
        out.extend(table[start:end])
        return
    pos = start
    while pos < end:
        offset = pos % page_size
        n = min(page_size - offset, end - pos)
        base = table[pos // page_size] * page_size + offset
        out.extend(range(base, base + n))
        pos += n


def _cascade(page_tables, kv_lens, qo_lens, page_size, groups, device) -> CascadeMetadata:
    prefix_indices: list[int] = []
    prefix_indptr, prefix_qo, prefix_last = [0], [0], []
    suffix_indices: list[int] = []
    suffix_qo, suffix_indptr, suffix_last = [0], [0], []
    for first, count, prefix in groups:
        assert prefix >= 0 and prefix % page_size == 0, (prefix, page_size)
        shared = page_tables[first][: prefix // page_size]
        prefix_indices.extend(shared)
        prefix_indptr.append(len(prefix_indices))
        prefix_qo.append(prefix_qo[-1] + sum(qo_lens[first : first + count]))
        prefix_last.append(page_size)
        for i in range(first, first + count):
            assert kv_lens[i] - qo_lens[i] >= prefix, "a cascade group's new tokens must follow its shared prefix"
            # (members share their tree path, so their pages: CacheManager.check verifies page
            # tables against tree paths; comparing whole prefixes here cost ~1 ms a step at 64 x 2048)
            assert not shared or page_tables[i][len(shared) - 1] == shared[-1], "group members must share pages"
            num_pages = -(-kv_lens[i] // page_size)
            suffix_indices.extend(page_tables[i][prefix // page_size : num_pages])
            suffix_qo.append(suffix_qo[-1] + qo_lens[i])
            suffix_indptr.append(len(suffix_indices))
            suffix_last.append(kv_lens[i] - (num_pages - 1) * page_size)

    def i32(values: list[int]):
        return _int32(values, len(values)).to(device)

    return CascadeMetadata(
        groups=tuple(tuple(g) for g in groups),
        prefix_qo_indptr=i32(prefix_qo),
        prefix_kv_indptr=i32(prefix_indptr),
        prefix_kv_indices=i32(prefix_indices),
        prefix_kv_last_page_len=i32(prefix_last),
        suffix_qo_indptr=i32(suffix_qo),
        suffix_kv_indptr=i32(suffix_indptr),
        suffix_kv_indices=i32(suffix_indices),
        suffix_kv_last_page_len=i32(suffix_last),
    )

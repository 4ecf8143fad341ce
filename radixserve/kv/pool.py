"""The paged KV pool: per-layer K/V tensors and a free list of pages."""

from __future__ import annotations

import logging

import torch

from radixserve.errors import BadRequestError

log = logging.getLogger("radixserve")


class KVPool:
    """``num_pages`` pages of ``page_size`` token slots in every layer.

    Layer ``l`` keeps ``k[l]`` and ``v[l]`` of shape ``[num_pages, page_size, kv_heads, head_dim]``
    (FlashInfer's NHD layout). Slot ``page * page_size + offset`` addresses one token. Pages are
    handed out by :meth:`alloc` and returned by :meth:`free`; the pool never decides what to keep.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        if num_pages < 1:
            raise BadRequestError("kv_cache_tokens", f"the KV pool needs at least one page of {page_size} tokens")
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # Pop from the end: low page ids first, which keeps a fresh pool's tables readable.
        self._free = list(range(num_pages - 1, -1, -1))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` free pages, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)

    def k_slots(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K cache viewed as ``[slots, kv_heads, head_dim]``."""
        return self.k[layer].view(-1, *self.k[layer].shape[2:])

    def v_slots(self, layer: int) -> torch.Tensor:
        return self.v[layer].view(-1, *self.v[layer].shape[2:])

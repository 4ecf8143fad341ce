"""The paged KV pool: per-layer K/V tensors and a free list of pages."""

from __future__ import annotations

import heapq
import logging
import math
import mmap
from typing import Protocol

import torch

from radixserve.errors import BadRequestError, InvariantError

log = logging.getLogger("radixserve")


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed tensor. On the CPU it lies in an anonymous mapping of its own (page-aligned), whose
    pages the kernel commits on first write: a pool costs the memory of the pages used so far,
    not its capacity (``torch.zeros`` writes every byte at once, so each CPU engine held its whole
    pool, 1 GiB by default, from the start)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # The tensor keeps the mapping alive; the mapping is unmapped when the tensor is freed.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


class KVPool:
    """``num_pages`` pages of ``page_size`` token slots in every layer.

    Layer ``l`` keeps ``k[l]`` and ``v[l]`` of shape ``[num_pages, page_size, kv_heads, head_dim]``
    (FlashInfer's NHD layout). Slot ``page * page_size + offset`` addresses one token. Pages are
    handed out by :meth:`alloc` and returned by :meth:`free`; the pool never decides what to keep.

    ``kv_dtype="int8"`` stores K and V as int8 with one float32 scale per token and head beside
    them (``k_scale[l]`` / ``v_scale[l]``, ``[num_pages, page_size, kv_heads]``): symmetric,
    ``scale = max|x| / 127`` over head_dim, so each element is off by at most ``scale / 2``.
    :meth:`k_slots` / :meth:`v_slots` then return :class:`QuantizedSlots`, which quantize on store
    and dequantize (to ``dtype``) on read, so an attention backend that stores with
    ``cache[slots] = x`` and reads with ``cache.index_select(0, slots)`` works unchanged.
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
        kv_dtype: str | None = None,
    ):
        if num_pages < 1:
            raise BadRequestError("kv_cache_tokens", f"the KV pool needs at least one page of {page_size} tokens")
        self.num_pages = num_pages
        self.page_size = page_size
        if kv_dtype not in (None, "int8"):
            raise BadRequestError("kv_dtype", f"must be None (the model's dtype) or int8, got {kv_dtype!r}")
        self.dtype, self.kv_dtype = dtype, kv_dtype
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        store = torch.int8 if kv_dtype == "int8" else dtype
        self.k = [zeros(shape, store, device) for _ in range(num_layers)]
        self.v = [zeros(shape, store, device) for _ in range(num_layers)]
        if kv_dtype == "int8":
            self.k_scale = [zeros(shape[:3], torch.float32, device) for _ in range(num_layers)]
            self.v_scale = [zeros(shape[:3], torch.float32, device) for _ in range(num_layers)]
        # A min-heap of the free page ids: the lowest are handed out first (see alloc).
        self._free = list(range(num_pages))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_dtype: str | None = None) -> int:
        """K and V bytes of one token over all layers (int8: plus its float32 scales)."""
        if kv_dtype == "int8":
            return 2 * num_layers * num_kv_heads * (head_dim + 4)
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def quantized(self) -> bool:
        return self.kv_dtype is not None

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free(self) -> int:
        return len(self._free)

    def commit(self, pages: int | None = None) -> None:
        """Write the first ``pages`` pages now (default: all), the ones :meth:`alloc` hands out
        first: on the CPU they then hold memory from the start, as a
        server's do once it has been through its pool, instead of each faulting at its first write
        (on a 2-core Zen 4 VM, about 3 us a layer of a SmolLM2 decode step while a context grows
        into fresh pages; bench/RESULTS.md section 47). The benchmarks call it to time the steady
        state, as llama.cpp's cleared KV buffer has it from the start. It zeroes every slot, so
        only a pool with no page handed out may take it."""
        if len(self._free) != self.num_pages:
            raise InvariantError(f"KVPool.commit: {self.num_pages - len(self._free)} pages are in use; it would zero them")
        for t in [*self.k, *self.v, *getattr(self, "k_scale", ()), *getattr(self, "v_scale", ())]:
            t[:pages].zero_()

    def alloc(self, n: int) -> list[int] | None:
        """``n`` free pages, or None (and nothing taken) when fewer are free.

        The lowest free ids, in ascending order: from a fresh pool (or a freed run) one run, and a
        sequence's later pages continue it where nothing took the next ids; the CPU kernels read a
        sequence whose pages are one ascending run of slots in place instead of gathering its K/V
        (csrc/prefill.cpp). Once requests have come and gone, the free ids are scattered; taking
        the lowest keeps a sequence's pages in ascending order with gaps, where handing them out
        in the order they were freed left them in no order at all: a bf16 decode step of 64
        agents over a 2,048-token shared prefix and a scattered pool took 40.0-40.6 ms that way
        and 35.7-36.9 ms this way on a 2-core Zen 4 (``python -m bench roofline --dtype bfloat16
        --threads 2 --batch 64 --shared-prefix 2048 --fragment``, bench/RESULTS.md section 28)."""
        if n > len(self._free):
            return None
        return [heapq.heappop(self._free) for _ in range(n)]

    def free_page_ids(self) -> list[int]:
        """The free pages (a copy, for integrity checks)."""
        return list(self._free)

    def free(self, pages: list[int]) -> None:
        for page in pages:
            heapq.heappush(self._free, page)

    def k_slots(self, layer: int) -> torch.Tensor | QuantizedSlots:
        """Layer ``layer``'s K cache viewed as ``[slots, kv_heads, head_dim]``."""
        if self.quantized:
            return QuantizedSlots(self.k[layer], self.k_scale[layer], self.dtype)
        return self.k[layer].view(-1, *self.k[layer].shape[2:])

    def v_slots(self, layer: int) -> torch.Tensor | QuantizedSlots:
        if self.quantized:
            return QuantizedSlots(self.v[layer], self.v_scale[layer], self.dtype)
        return self.v[layer].view(-1, *self.v[layer].shape[2:])


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last dim: ``(q, scale)`` with ``x ~= q * scale[..., None]`` and
    ``|x - q * scale| <= scale / 2`` elementwise; ``scale = max|x| / 127`` (1 where x is all 0)."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(x / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[..., None]).to(dtype)


class SlotView(Protocol):
    """What the torch attention backend reads and writes of one layer's K or V slots
    (``[slots, kv_heads, head_dim]``): a tensor view, or :class:`QuantizedSlots`."""

    @property
    def shape(self) -> torch.Size: ...
    def __setitem__(self, slots: torch.Tensor, x: torch.Tensor, /) -> None: ...
    def index_select(self, dim: int, slots: torch.Tensor, /) -> torch.Tensor: ...


class QuantizedSlots:
    """One layer's int8 K (or V) cache seen as ``[slots, kv_heads, head_dim]`` of ``dtype``:
    ``view[slots] = x`` quantizes and stores, ``view.index_select(0, slots)`` gathers and
    dequantizes. The subset of tensor behaviour the torch attention backend uses."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self.data = data.view(-1, *data.shape[2:])
        self.scale = scale.view(-1, scale.shape[2])
        self.dtype = dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def __setitem__(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        q, scale = quantize_int8(x)
        self.data[slots] = q
        self.scale[slots] = scale

    def index_select(self, dim: int, slots: torch.Tensor) -> torch.Tensor:
        if dim != 0:
            raise InvariantError("QuantizedSlots gathers whole slots (dim 0)")
        return dequantize_int8(self.data.index_select(0, slots), self.scale.index_select(0, slots), self.dtype)

"""The contract every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from radixserve.attention.metadata import AttentionMetadata


class DecodeKernelArgs(NamedTuple):
    """A planned batch's attention on the csrc/ decode kernel: every layer's K/V cache, the new
    tokens' slots and the batch's FlashInfer-format metadata, and the softmax scale. ``prefix``:
    empty, or for a batch of decodes whose first rows are in cascade groups (in row order), the
    groups' shared-prefix metadata (qo_indptr, kv_indptr, kv_indices, kv_last_page_len); the four
    above are then each member's own suffix, followed by the whole context of each decode in no
    group (rows after the grouped ones)."""

    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    slots: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    scale: float
    prefix: tuple[torch.Tensor, ...] = ()


class AttentionBackend(ABC):
    """Paged attention over a KV pool, driven by :class:`AttentionMetadata`.

    ``plan`` is called once per batch, before the first layer; ``forward`` once per layer. The
    backend writes the new tokens' K/V into the pool at ``metadata.out_slots`` before attending,
    so a sequence attends to its cached prefix and its own new tokens (causal, bottom-right).
    """

    cascade_min_shared_tokens: int = 16384
    """Where cascade (shared-prefix) decode starts to pay on this backend, as group size x shared
    prefix tokens: the engine's default (``cascade_min_shared_tokens="auto"``). 16384 is the torch
    backend's break-even in ``python -m bench cascade --backend torch`` (8 x 2048: 1.48x; 4 x 1024: 0.80x)."""

    cascade_extends: bool = False
    """Whether cascade groups may hold extend chunks (several new tokens after the shared prefix)
    as well as decodes. Where true, a step's extends over a common cached prefix (agents' next
    turns under one system prompt) attend to it in one GEMM-shaped level-0 call per group."""

    @abstractmethod
    def plan(self, metadata: AttentionMetadata) -> None: ...

    def decode_kernel_args(self) -> DecodeKernelArgs | None:
        """What csrc/decode.cpp needs to run the planned batch's attention itself (the whole decode
        step's layers in one native call, :mod:`radixserve.kernels.fused_decode`), or None where this
        backend or this batch cannot (the default)."""
        return None

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] for the new tokens. Returns [T, Hq, D]."""

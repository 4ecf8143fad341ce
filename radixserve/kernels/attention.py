"""The paged attention ops of csrc/attention.cpp, prefill.cpp and decode.cpp
(``torch.ops.radixserve_attention``).

Contract: :func:`ops` returns them as one :class:`AttentionOps` (each op's ``.default`` overload,
the cheapest to call), or None when the extension is unavailable. Every op takes FlashInfer's
paged metadata (int32 ``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``kv_last_page_len``) over
one layer's cache ``[pages, page_size, kv_heads, head_dim]``; attention returns ``(out, lse)``
with ``out [T, Hq, D]`` in q's dtype and ``lse [T, Hq]`` float32 in base 2; a bad argument raises
RuntimeError naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixserve.kernels import build

NAMESPACE = "radixserve_attention"

Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class AttentionOps:
    """The ops of one build of the attention kernels."""

    paged_attention: Callable[..., Pair]
    """(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, scale, causal):
    the decode kernel, any rows (bottom-right causal mask where ``causal``)."""
    prefill_attention: Callable[..., Pair]
    """The same arguments and results through GEMMs, for many-row chunks; ``bf16_gemm``:
    ``auto``, ``brgemm`` (AMX), ``dpbf16`` (AVX512-BF16) or ``fp32`` (widened)."""
    merge_state: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    """(out_a, lse_a, out_b, lse_b): the output over both KV sets, by base-2 LSE."""
    store_kv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
    """(k_cache, v_cache, slots, k, v): rows ``[T, Hkv, D]`` into int64 flat slots, in place."""
    decode_layers: Callable[..., torch.Tensor]
    """A decode batch's decoder layers in one call (:mod:`radixserve.kernels.fused_decode`)."""
    decode_weights: Callable[[list[torch.Tensor], list[torch.Tensor]], object]
    """(params, quant): the layers' weights as ``decode_layers`` takes them, checked and taken
    apart once (the custom class ``DecodeWeights``)."""
    bf16_brgemm: Callable[[], bool]
    """Whether ``prefill_attention`` runs bf16 on brgemm (AMX) on this CPU."""
    bf16_dpbf16: Callable[[], bool]
    """Whether it can run bf16 on vdpbf16ps (AVX512-BF16)."""


_cache: dict[str, AttentionOps] = {}


def ops(namespace: str = NAMESPACE) -> AttentionOps | None:
    """The attention ops of this checkout's extension (or of ``namespace``: another build loaded
    next to it), or None when it is unavailable."""
    if build.load() is None:  # (asked every time: a build that failed is remembered there)
        return None
    found = _cache.get(namespace)
    if found is None:
        ns = build.ops(namespace, "paged_attention") if namespace == NAMESPACE else _loaded(namespace)
        if ns is None:
            return None
        fields = {name: getattr(ns, name).default for name in AttentionOps.__dataclass_fields__ if name != "decode_weights"}
        # decode_layers takes a custom class, and torch's overload of such an op walks every
        # argument (the 2 x layers KV caches too) for torch.export's fake objects before each call:
        # about 30 us of a SmolLM2 step. The engine never passes one: the op itself, then.
        fields["decode_layers"] = getattr(fields["decode_layers"], "_op", fields["decode_layers"])
        found = _cache[namespace] = AttentionOps(**fields, decode_weights=getattr(torch.classes, namespace).DecodeWeights)
    return found


def _loaded(namespace: str):
    try:
        ns = getattr(torch.ops, namespace)
        ns.paged_attention  # noqa: B018 (the lookup raises where the library is not loaded)
    except (AttributeError, RuntimeError):
        return None
    return ns

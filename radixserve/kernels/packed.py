"""The packed copy of a weight for its GEMM backend (:func:`radixserve.kernels.gemm.gemm_backend`):
MKL's packed fp32 (of the widened weight for bf16 without AMX), oneDNN's prepacked layout, or the
AMX GEMM's tiles.

Contract: :meth:`PackedWeight.get` returns the copy for a weight (None: the weight keeps
``F.linear``), packing it again whenever the weight changes: the copy is keyed on the weight
tensor, its storage, shape, version counter and the thread count, so ``param.copy_(...)``,
``param.data = ...`` and new parameters all repack; only writes through ``param.data`` bypass
the version counter (call :meth:`PackedWeight.clear` after those). All copies together stay
within half the memory available when the first was made; past it, weights keep ``F.linear``.
With ``RADIXSERVE_PACKED_LINEAR=exact`` an fp32 copy whose products differ from ``F.linear``'s
is dropped. Memory and bit-equality measurements: docs/KERNELS.md ("Packed weights").
"""

from __future__ import annotations

import logging
import weakref

import torch
import torch.nn.functional as F

from radixserve.kernels import gemm
from radixserve.model.checks import available_memory

log = logging.getLogger("radixserve")

_state: dict[object, object] = {}


def _bit_identical(weight: torch.Tensor, packed: torch.Tensor, ops) -> bool:
    """Whether the packed copy's products equal F.linear's bit for bit at :data:`gemm.PROBE_ROWS` rows."""
    n, k = weight.shape
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in (1, 4, *gemm.PROBE_ROWS) if packed.is_mkldnn else gemm.PROBE_ROWS:  # (oneDNN runs from 1 row)
            x = torch.randn(m, k, generator=g)
            y = gemm.onednn_linear(x, packed, None) if packed.is_mkldnn else ops.packed_linear(x, packed, n, k, None)
            if not torch.equal(y, F.linear(x, weight)):
                return False
    return True


def _reserve(nbytes: int) -> bool:
    """Take ``nbytes`` from the budget of packed copies (half the memory available when the first
    copy was made); False, logged once, when it is spent."""
    budget = _state.get("pack_budget")
    if budget is None:
        budget = available_memory() // 2
    if nbytes > budget:  # type: ignore[operator]
        if not _state.get("budget_logged"):
            _state["budget_logged"] = True
            log.warning(
                "packed weight copies: the budget (half the memory available at the first one) is spent; "
                "the remaining linear layers use F.linear (RADIXSERVE_PACKED_LINEAR=0 turns packing off)"
            )
        _state["pack_budget"] = budget
        return False
    _state["pack_budget"] = budget - nbytes  # type: ignore[operator]
    return True


def _release(nbytes: int) -> None:
    if "pack_budget" in _state:
        _state["pack_budget"] += nbytes  # type: ignore[operator]


def _log_once(key: object, message: str, *args: object) -> None:
    if not _state.get(key):
        _state[key] = True
        log.info(message, *args)


class PackedWeight:
    """The packed copy of one weight, rebuilt when the weight or the backend changes (see the
    module docstring). Not a tensor attribute of the module (so not in ``state_dict``,
    ``parameters()`` or what ``Module.to`` moves); copies and pickles start empty."""

    def __init__(self) -> None:
        # (weakref to the weight, key, packed or None): replaced whole, so a concurrent reader
        # never pairs one weight's key with another's packed copy
        self._entry: tuple | None = None

    def clear(self) -> None:
        """Drop the packed copy (its memory); the next :meth:`get` repacks."""
        self._entry = None

    @staticmethod
    def _key(weight: torch.Tensor) -> tuple:
        # the thread count too: MKL's summation order can depend on it, and MKL's docs advise
        # packing and computing with the same number of threads
        return (weight.data_ptr(), weight._version, tuple(weight.shape), weight.stride(), torch.get_num_threads())

    def get(self, weight: torch.Tensor, ops) -> torch.Tensor | None:
        """The packed copy of ``weight`` (packed now if the cached one is stale), or None."""
        exact = gemm.packed_policy() == "exact"
        entry = self._entry
        backend = gemm.gemm_backend(weight.dtype)
        key = (*self._key(weight), backend)
        if entry is not None and entry[0]() is weight and entry[1] == key:
            return entry[2]
        self._entry = None  # free the stale copy before packing the new one
        amx = backend == "amx" and gemm.amx_shape(weight)
        onednn = backend in ("onednn", "amx") and not amx
        widened = backend == "widen"
        # (MKL's packed copy is about the fp32 weight's size, oneDNN's and the AMX GEMM's the weight's own)
        nbytes = (weight.element_size() if onednn or amx else 4) * weight.numel()
        if not _reserve(nbytes):
            self._entry = (weakref.ref(weight), key, None)
            return None
        if amx:
            packed = ops.pack_amx(weight.detach())
        elif onednn:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        else:
            packed = ops.pack_fp32(weight.detach().float() if widened else weight.detach())
        weakref.finalize(packed, _release, nbytes)  # back to the budget when the copy is freed
        if exact and weight.dtype == torch.float32 and not _bit_identical(weight, packed, ops):
            packed = None
            shapes: set = _state.setdefault("inexact_shapes", set())  # type: ignore[assignment]
            if tuple(weight.shape) not in shapes:
                shapes.add(tuple(weight.shape))
                log.info(
                    "%s linear %dx%d: the packed GEMM is not bit-identical to F.linear at this shape; "
                    "it keeps F.linear (RADIXSERVE_PACKED_LINEAR=all packs it anyway)",
                    str(weight.dtype).removeprefix("torch."),
                    *weight.shape,
                )
        elif amx:
            _log_once(
                "amx_logged",
                "bf16 linear layers: keeping AMX-packed copies of the weights for batches of every "
                "size (as much memory again as the weights); RADIXSERVE_PACKED_LINEAR=0 turns this off",
            )
        elif onednn:
            lo, hi = gemm.packed_row_range(weight.dtype)
            _log_once(
                ("onednn_logged", weight.dtype),
                "%s linear layers: keeping oneDNN-prepacked copies of the "
                "weights for batches of %d%s rows (as much memory again as the weights); "
                "RADIXSERVE_PACKED_LINEAR=0 turns this off",
                str(weight.dtype).removeprefix("torch."),
                lo,
                f"-{hi}" if hi < 1 << 40 else " or more",
            )
        elif widened:
            _log_once(
                "widened_logged",
                "bf16 linear layers (no AMX on this CPU): keeping fp32 MKL-packed copies of "
                "the weights for batches of more than %d rows (twice the bf16 weight memory); "
                "RADIXSERVE_PACKED_LINEAR=0 turns this off",
                gemm.MAX_ROWS_VECTOR,
            )
        else:
            _log_once(
                "packed_logged",
                "fp32 linear layers: keeping MKL-packed copies of the weights for batches of "
                "%d-%d rows, about as large as the weights (up to twice the fp32 weight memory); "
                "RADIXSERVE_PACKED_LINEAR=0 turns this off",
                gemm.PACKED_MIN_ROWS,
                gemm.PACKED_MAX_ROWS,
            )
        self._entry = (weakref.ref(weight), key, packed)
        return packed

    def __deepcopy__(self, memo) -> PackedWeight:
        return PackedWeight()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._entry = None

"""One forward pass over a scheduled batch: build inputs and attention metadata, return a
:class:`ForwardOutput` (the sampling rows' logits, and the scoring rows' logprobs)."""

from __future__ import annotations

import atexit
import gc
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from radixserve.attention.base import AttentionBackend
from radixserve.attention.metadata import build_metadata
from radixserve.attention.torch_backend import TorchAttention
from radixserve.engine.scheduler import ScheduledItem
from radixserve.errors import BadRequestError
from radixserve.kernels.linear import prepack
from radixserve.kv.pool import KVPool
from radixserve.model.llama import Attention, CausalLM, ForwardBatch, head_dim_of

log = logging.getLogger("radixserve")


@dataclass(frozen=True)
class ForwardOutput:
    """One forward pass: ``logits`` ``[k, vocab]`` (float32) for the ``k`` items that sample, in
    item order; ``scores``: per scoring item, ``(request, first scored position, [logprob, ...])``."""

    logits: torch.Tensor
    scores: tuple[tuple[Any, int, list[float]], ...] = ()


@dataclass
class _Inputs:
    """The flat token batch of a forward pass and the rows whose logits it needs."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)  # sampling rows first, then scoring rows
    num_sample: int = 0
    score_targets: list[int] = field(default_factory=list)  # the token each scoring row scores
    score_spans: list[tuple[Any, int, int]] = field(default_factory=list)  # (req, first position, count)


def gather_inputs(items: Sequence[ScheduledItem]) -> _Inputs:
    """Concatenate the items' new tokens; sampling items need their last row's logits, scoring
    items the rows of their scored positions."""
    out = _Inputs()
    score_rows: list[int] = []
    for item in items:
        end = item.start + item.num_tokens
        base = len(out.ids)
        out.ids.extend(item.req.tokens[item.start : end])
        out.positions.extend(range(item.start, end))
        if item.samples:
            out.logits_rows.append(len(out.ids) - 1)
        scored = item.score_positions
        if scored:
            out.score_spans.append((item.req, scored.start + 1, len(scored)))
            score_rows.extend(base + p - item.start for p in scored)
            out.score_targets.extend(item.req.tokens[scored.start + 1 : scored.stop + 1])
    out.num_sample = len(out.logits_rows)
    out.logits_rows += score_rows
    return out


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, device: torch.device, attention: str = "auto"):
        self.model = model
        self.pool = pool
        self.device = device
        self.attention = make_attention(attention, model, pool, device)
        if device.type == "cpu":
            prepack(model)  # MKL-packed weight copies now, not inside the first large batch
        _freeze_gc_once()

    def forward(self, items: Sequence[ScheduledItem], groups: Sequence[tuple[int, int, int]] = ()) -> ForwardOutput:
        """Run ``items`` (a scheduled batch); ``groups``: its cascade groups (first item, count,
        shared prefix tokens) of decode items. Scoring items' rows become next-token logprobs."""
        inputs = gather_inputs(items)
        metadata = build_metadata(
            [item.req.kv.pages for item in items],
            [item.start + item.num_tokens for item in items],
            [item.num_tokens for item in items],
            self.pool.page_size,
            self.device,
            groups,
        )
        self.attention.plan(metadata)
        batch = ForwardBatch(
            input_ids=torch.tensor(inputs.ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(inputs.positions, dtype=torch.long, device=self.device),
            attention=self.attention,
            logits_rows=torch.tensor(inputs.logits_rows, dtype=torch.long, device=self.device),
        )
        logits = self.model(batch)
        if not inputs.score_spans:
            return ForwardOutput(logits)
        return ForwardOutput(logits[: inputs.num_sample], _scores(logits[inputs.num_sample :], inputs))


def _scores(logits: torch.Tensor, inputs: _Inputs) -> tuple[tuple[Any, int, list[float]], ...]:
    """The logprob of each scored token, split per scoring item."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(inputs.score_targets, dtype=torch.long, device=lp.device)
    values = lp.gather(1, target[:, None])[:, 0].tolist()
    scores, offset = [], 0
    for req, first, n in inputs.score_spans:
        scores.append((req, first, values[offset : offset + n]))
        offset += n
    return tuple(scores)


_gc_frozen = False


def _freeze_gc_once() -> None:
    """The first model of a process (weights, config, tokenizer) lives as long as the process:
    move it out of the collector's generations so GC passes during the step loop stay short.
    Once per process: freezing again at every Engine would keep each one's garbage for good.

    At exit the frozen objects go back to the collector (``gc.unfreeze``), so the interpreter's
    shutdown frees them as usual. Left frozen, they are never freed, and extension modules that
    count their objects complain: with triton installed (xgrammar pulls it in, and ``import
    torch`` imports it), every process that ran an engine ended with some 30 lines of "nanobind:
    leaked ..." on stderr, the last thing ``radixserve demo`` printed."""
    global _gc_frozen
    if not _gc_frozen:
        _gc_frozen = True
        gc.collect()
        gc.freeze()
        atexit.register(gc.unfreeze)


def make_attention(name: str, model: CausalLM, pool: KVPool, device: torch.device) -> AttentionBackend:
    """``auto``: FlashInfer on CUDA when it imports; on the CPU the C++ kernels of ``csrc/`` when
    they build and support the pool (dtype, head_dim), else the torch backend (the oracle)."""
    from radixserve.attention import cpu_backend, flashinfer_backend
    from radixserve.kernels import attention as attention_ops

    scale = head_dim_of(model.config) ** -0.5
    if pool.quantized:  # int8 KV: only the torch backend dequantizes on read
        if name not in ("auto", "torch"):
            raise BadRequestError("attention", f"kv_dtype={pool.kv_dtype} needs the torch attention backend, not {name}")
        name = "torch"
    # this rank's query heads under tensor parallel (nn.ModuleList items are typed as plain Modules)
    heads = cast(Attention, model.model.layers[0].self_attn).num_heads
    if name == "auto":
        if device.type == "cuda":
            name = "flashinfer" if flashinfer_backend.available() else "torch"
        elif device.type == "cpu":
            reason = cpu_backend.supports(pool, heads)
            if reason is None and attention_ops.ops() is not None:
                name = "cpu"
            else:
                if reason is not None:
                    log.info("CPU attention kernels not used: %s; using the torch backend", reason)
                name = "torch"
    if name == "flashinfer":
        if device.type != "cuda" or not flashinfer_backend.available():
            raise BadRequestError("attention", "flashinfer needs a CUDA device and the flashinfer package (pip install 'radixserve[gpu]')")
        return flashinfer_backend.FlashInferAttention(pool, scale, num_qo_heads=heads)
    if name == "cpu":
        reason = cpu_backend.supports(pool, heads)
        if reason is not None:
            raise BadRequestError("attention", f"the cpu backend cannot serve this model: {reason}")
        ext = attention_ops.ops()
        if ext is None:
            raise BadRequestError("attention", "the CPU attention kernels failed to build (see the warning above); use attention='torch'")
        return cpu_backend.CpuAttention(pool, scale, ext)
    return TorchAttention(pool, scale)

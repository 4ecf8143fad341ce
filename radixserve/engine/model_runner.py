"""One forward pass over a scheduled batch: build inputs and attention metadata, return logits."""

from __future__ import annotations

import gc
import logging

import torch

from radixserve.attention.base import AttentionBackend
from radixserve.attention.metadata import build_metadata
from radixserve.attention.torch_backend import TorchAttention
from radixserve.errors import BadRequestError
from radixserve.engine.scheduler import ScheduledItem
from radixserve.kv.pool import KVPool
from radixserve.model.llama import CausalLM, ForwardBatch, head_dim_of

log = logging.getLogger("radixserve")


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, device: torch.device, attention: str = "auto"):
        self.model = model
        self.pool = pool
        self.device = device
        self.attention = make_attention(attention, model, pool, device)
        self.scores: list[tuple] = []
        _freeze_gc_once()

    def forward(self, items: list[ScheduledItem], groups: list[tuple[int, int, int]] = ()) -> torch.Tensor:
        """Logits ``[k, vocab]`` (float32) for the ``k`` items that sample, in item order.
        ``groups``: cascade groups (first item, count, shared prefix tokens) of decode items.
        Scoring items' rows are turned into next-token logprobs here: :attr:`scores` holds
        ``(request, first scored position, [logprob, ...])`` for this batch."""
        ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        score_rows: list[int] = []
        score_targets: list[int] = []
        score_spans: list[tuple] = []
        for item in items:
            end = item.start + item.num_tokens
            base = len(ids)
            ids.extend(item.req.tokens[item.start : end])
            positions.extend(range(item.start, end))
            if item.samples:
                logits_rows.append(len(ids) - 1)
            scored = item.score_positions
            if scored:
                score_spans.append((item.req, scored.start + 1, len(scored)))
                score_rows.extend(base + p - item.start for p in scored)
                score_targets.extend(item.req.tokens[scored.start + 1 : scored.stop + 1])
        num_sample = len(logits_rows)
        logits_rows += score_rows
        metadata = build_metadata(
            [item.req.pages for item in items],
            [item.start + item.num_tokens for item in items],
            [item.num_tokens for item in items],
            self.pool.page_size,
            self.device,
            groups,
        )
        self.attention.plan(metadata)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            attention=self.attention,
            logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=self.device),
        )
        logits = self.model(batch)
        self.scores = []
        if score_rows:
            lp = torch.log_softmax(logits[num_sample:].float(), dim=-1)
            target = torch.tensor(score_targets, dtype=torch.long, device=lp.device)
            values = lp.gather(1, target[:, None])[:, 0].tolist()
            offset = 0
            for req, first, n in score_spans:
                self.scores.append((req, first, values[offset : offset + n]))
                offset += n
            logits = logits[:num_sample]
        return logits


_gc_frozen = False


def _freeze_gc_once() -> None:
    """The first model of a process (weights, config, tokenizer) lives as long as the process:
    move it out of the collector's generations so GC passes during the step loop stay short.
    Once per process: freezing again at every Engine would keep each one's garbage for good."""
    global _gc_frozen
    if not _gc_frozen:
        _gc_frozen = True
        gc.collect()
        gc.freeze()


def make_attention(name: str, model: CausalLM, pool: KVPool, device: torch.device) -> AttentionBackend:
    """``auto``: FlashInfer on CUDA when it imports; on the CPU the C++ kernels of ``csrc/`` when
    they build and support the pool (dtype, head_dim), else the torch backend (the oracle)."""
    from radixserve.attention import cpu_backend, cpu_ext, flashinfer_backend

    scale = head_dim_of(model.config) ** -0.5
    if pool.quantized:  # int8 KV: only the torch backend dequantizes on read
        if name not in ("auto", "torch"):
            raise BadRequestError("attention", f"kv_dtype={pool.kv_dtype} needs the torch attention backend, not {name}")
        name = "torch"
    heads = model.model.layers[0].self_attn.num_heads  # this rank's query heads under tensor parallel
    if name == "auto":
        if device.type == "cuda":
            name = "flashinfer" if flashinfer_backend.available() else "torch"
        elif device.type == "cpu":
            reason = cpu_backend.supports(pool, heads)
            if reason is None and cpu_ext.load() is not None:
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
        ext = cpu_ext.load()
        if ext is None:
            raise BadRequestError("attention", "the CPU attention kernels failed to build (see the warning above); use attention='torch'")
        return cpu_backend.CpuAttention(pool, scale, ext)
    return TorchAttention(pool, scale)

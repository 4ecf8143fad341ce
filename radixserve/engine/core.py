"""The engine's step machine: the parts (KV pool, cache manager, scheduler, model runner,
sampler, output processor, engine thread) and one step over them.

One step (:meth:`EngineCore.step`): apply the inbox's commands, let the scheduler pick a
:class:`~radixserve.engine.scheduler.Batch`, run it through the model runner (a
:class:`~radixserve.engine.model_runner.ForwardOutput`), then record progress, sample, and let
the :class:`~radixserve.engine.output.OutputProcessor` turn tokens into chunks. The user-facing
calls are on :class:`~radixserve.engine.engine.Engine`, built on this class."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable

import torch

from radixserve.config import EngineConfig
from radixserve.engine import setup
from radixserve.engine.cache_manager import CacheManager
from radixserve.engine.commands import AbortRequest, AddRequest, Command, Unpin
from radixserve.engine.output import OutputProcessor
from radixserve.engine.request import Request, StreamChunk
from radixserve.engine.sampler import Sampler
from radixserve.engine.scheduler import Batch, Scheduler
from radixserve.engine.structured import GrammarCache
from radixserve.engine.tensor_parallel import TensorParallelRunner
from radixserve.engine.thread import EngineThread
from radixserve.model.loader import load_model

log = logging.getLogger("radixserve")


class EngineCore:
    """Everything one model serves with, and the step that drives it (no public request API:
    see :class:`~radixserve.engine.engine.Engine`)."""

    def __init__(self, config: EngineConfig):
        config.validate()
        self.config = config
        self.device = torch.device(config.device)
        self.loaded = loaded = load_model(
            config.model, device=self.device, dtype=config.dtype, max_model_len=config.max_model_len, weights=setup.weights_mode(config)
        )
        self.tokenizer, self.max_model_len, self.vocab_size = loaded.tokenizer, loaded.max_model_len, loaded.vocab_size
        quant_compute = setup.quant_compute(loaded, config)
        self.pool = setup.make_pool(loaded, config, self.device)
        self.cache = CacheManager(self.pool, enable_prefix_cache=config.enable_prefix_cache, eviction=config.eviction)
        self.runner = setup.make_runner(loaded, self.pool, self.device, config)
        self.scheduler = Scheduler(
            config, self.cache, cascade_min_shared_tokens=setup.cascade_threshold(config, self.runner), cascade_extends=self.runner.attention.cascade_extends
        )
        self.sampler = Sampler(config.seed, self.device)
        self.grammars = GrammarCache(self.tokenizer, self.vocab_size, sorted(loaded.eos_token_ids))
        self.output = OutputProcessor(self.tokenizer, loaded.eos_token_ids, self.max_model_len, self.scheduler.finish)
        self.pin_budget_tokens = config.pin_budget_tokens or self.pool.capacity_tokens // 4
        self.thread = EngineThread(self.step, self._apply, lambda: self.scheduler.has_work, self._on_step_error)
        self._counters = dict(requests=0, prompt_tokens=0, generated_tokens=0, steps=0, cascade_steps=0, errors=0)
        self._info = setup.describe(loaded, config, self.runner, self.pool, self.max_model_len, quant_compute)
        log.info("%s", setup.ready_line(self._info))

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> list[StreamChunk]:
        """Run one scheduler iteration; returns the chunks it produced (final ones carry output)."""
        self.thread.drain()
        batch = self.scheduler.schedule()
        chunks = [self._fail_unfittable(req) for req in batch.failed]
        if not batch.items:
            if self.config.debug_checks and not self.scheduler.has_work:
                self.scheduler.check()
            return chunks
        self._counters["cascade_steps"] += bool(batch.groups)
        out = self.runner.forward(batch.items, batch.groups)
        self._counters["steps"] += 1
        now = time.monotonic()
        chunks += self._advance(batch, out.scores, now)
        chunks += self._sample(batch, out.logits, now)
        if self.config.debug_checks:
            self.scheduler.check()
        return chunks

    def _fail_unfittable(self, req: Request) -> StreamChunk:
        log.warning("request %s needs more KV than the whole pool (%d tokens); ending it", req.input.rid, self.pool.capacity_tokens)
        return self.output.finish(req, "length")

    def _advance(self, batch: Batch, scores, now: float) -> list[StreamChunk]:
        """Count the computed tokens, commit finished prefill chunks to the cache (later
        requests can hit them now), store scores; a scoring request ends after its prefill."""
        chunks = []
        for item in batch.items:
            item.req.kv.computed += item.num_tokens
            if item.num_tokens > 1:
                self.cache.commit(item.req)
        for req, first, values in scores:
            req.out.score_logprobs[first - req.decode.score_from : first - req.decode.score_from + len(values)] = values
        for item in batch.items:
            req = item.req
            if req.scoring and req.kv.computed == req.num_tokens:  # prefill done: scored, no sampling
                req.life.first_token_at = now
                chunks.append(self.output.finish(req, "stop"))
        return chunks

    def _sample(self, batch: Batch, logits: torch.Tensor, now: float) -> list[StreamChunk]:
        """Sample the next token of every item that reached its sequence's end."""
        sampling = [item.req for item in batch.items if item.samples]
        tokens, logprobs = self.sampler(logits, sampling)
        chunks = []
        for req, token, logprob in zip(sampling, tokens, logprobs):
            if token is None:  # sampling this row failed: this request fails, its batch-mates go on
                self._counters["errors"] += 1
                chunks.append(self.output.finish(req, "error"))
                continue
            self._counters["generated_tokens"] += 1
            chunk = self.output.on_token(req, token, logprob, now)
            if chunk is not None:
                chunks.append(chunk)
        return chunks

    def drain_inbox(self) -> None:
        """Apply every queued command now (what :meth:`step` does first); for driving the engine
        without its thread, e.g. to inspect the queue after :meth:`add_request`."""
        self.thread.drain()

    def _apply(self, command: Command) -> None:
        """One inbox command, in arrival order."""
        if isinstance(command, AddRequest):
            req = command.req
            self.output.register(req, command.on_chunk)
            self._counters["requests"] += 1
            self._counters["prompt_tokens"] += len(req.input.prompt_ids)
            self.scheduler.add(req)
        elif isinstance(command, AbortRequest):
            live = self.output.live(command.request_id)
            if live is not None:
                self.output.finish(live, "abort")
        elif isinstance(command, Unpin):
            command.reply(self.cache.unpin(command.namespace, command.prompt_ids))
        else:
            command.fn()

    def start(self) -> None:
        """Run the scheduler loop in a background thread (idempotent)."""
        self.thread.start()

    def shutdown(self) -> None:
        """Stop the background loop; requests still in it end with finish_reason 'abort'."""
        self.thread.stop()
        for req in list(self.output.requests.values()):
            self.output.finish(req, "abort")
        if isinstance(self.runner, TensorParallelRunner):
            self.runner.close()

    def _on_step_error(self) -> None:
        """A step raised (logged by the thread): fail the requests in flight, never leave one
        without a final message."""
        self._counters["errors"] += 1
        for req in list(self.scheduler.running):
            self.output.finish(req, "error")

    # -- visibility ----------------------------------------------------------------------------
    def info(self) -> dict:
        """The settings this engine runs with: model, arch, dtype, device, attention backend, KV
        capacity and layout, batching limits (what the start-up log line says)."""
        return dict(self._info)

    def on_cache_event(self, callback: Callable[[tuple], None] | None) -> None:
        """Send every change of the prefix cache to ``callback`` (on the engine thread):
        ``("insert", namespace, path_tokens)`` when a new leaf is cached, ``("evict", namespace,
        path_tokens, node_len)`` per evicted node (see :class:`~radixserve.kv.radix.RadixCache`).
        None unsubscribes; without a prefix cache there are no events."""
        self.cache.tree.on_event = callback

    def cache_leaves(self) -> list[tuple[Hashable, list[int]]]:
        """The whole prefix cache as ``(namespace, tokens root to leaf)`` per leaf (a snapshot
        for a router's mirror); call it on the engine thread (:meth:`call_soon`)."""
        return list(self.cache.tree.leaf_paths())

    def stats(self) -> dict[str, int | float]:
        page = self.pool.page_size
        cache = self.cache
        used_pages = self.pool.num_pages - self.pool.num_free
        return {
            **self._counters,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.preemptions,
            "kv_total_tokens": self.pool.capacity_tokens,
            "kv_used_tokens": used_pages * page,
            "kv_evictable_tokens": cache.evictable_pages * page,
            "kv_locked_tokens": cache.locked_pages * page,
            "kv_pinned_tokens": cache.pinned_tokens,
            "evictions": cache.tree.evictions * page,
            "prefix_query_tokens": cache.query_tokens,
            "prefix_hit_tokens": cache.hit_tokens,
            "prefix_alignment_waste_tokens": cache.alignment_waste_tokens,
        }

"""Continuous batching: every step builds one batch of decode tokens and prefill chunks under a
token budget, admitting waiting requests (longest cached prefix first) and preempting the newest
running ones when KV runs out."""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from dataclasses import dataclass

from radixserve.config import EngineConfig
from radixserve.engine.cache_manager import CacheManager
from radixserve.engine.request import Request, Status
from radixserve.kv.radix import RadixCache

log = logging.getLogger("radixserve")


@dataclass(frozen=True)
class ScheduledItem:
    req: Request
    start: int  # first token position computed in this step
    num_tokens: int

    @property
    def samples(self) -> bool:
        """This chunk reaches the end of the sequence, so its last row's logits give a token
        (never for a scoring request: it ends after its prefill)."""
        return self.start + self.num_tokens == self.req.num_tokens and self.req.decode.score_from is None

    @property
    def score_positions(self) -> range:
        """Positions of this chunk whose logits score the next token (scoring requests only)."""
        req = self.req
        if req.decode.score_from is None:
            return range(0)
        return range(max(self.start, req.decode.score_from - 1), min(self.start + self.num_tokens, req.num_tokens - 1))


@dataclass(frozen=True)
class Batch:
    """One step's work. ``items``: decode tokens and prefill chunks, decodes that share a long
    cached prefix placed next to each other; ``groups``: those cascade groups as (first item,
    count, shared prefix tokens); ``failed``: requests to end without running (no KV ever fits)."""

    items: tuple[ScheduledItem, ...] = ()
    groups: tuple[tuple[int, int, int], ...] = ()
    failed: tuple[Request, ...] = ()


class _NullFreer:
    def free(self, pages: list[int]) -> None:
        pass


class Scheduler:
    def __init__(self, config: EngineConfig, cache: CacheManager, *, cascade_min_shared_tokens: int | None = None, cascade_extends: bool = False):
        self.config = config
        self.cache = cache
        self.cascade_min_shared_tokens = cascade_min_shared_tokens  # None: no cascade groups
        self.cascade_extends = cascade_extends  # groups may hold extend chunks, not only decodes
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.chunk = config.max_prefill_chunk or config.max_batched_tokens
        self.preemptions = 0
        self._admitted = 0
        self._arrivals = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        req.life.arrival_seq = self._arrivals
        self._arrivals += 1
        self.waiting.append(req)

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> Batch:
        """The next batch (empty when there is nothing to run)."""
        items, failed = self._pick()
        if not items:
            return Batch(failed=tuple(failed))
        ordered, groups = self._cascade_groups(items)
        return Batch(tuple(ordered), tuple(groups), tuple(failed))

    def _pick(self) -> tuple[list[ScheduledItem], list[Request]]:
        """The next batch's items, and requests that had to be finished without running."""
        budget = self.config.max_batched_tokens
        items: list[ScheduledItem] = []
        failed: list[Request] = []

        # Running requests: decodes first, then unfinished prefills; victims come from the end.
        order = sorted(self.running, key=lambda r: (r.prefilling, r.life.admit_seq))
        i = 0
        while i < len(order) and budget > 0:
            req = order[i]
            placed = True
            n = min(req.pending, budget, self.chunk)
            while not self.cache.allocate(req, n):
                if len(order) > i + 1:
                    self._preempt(order.pop())
                    continue
                if len(self.running) == 1 and not items:
                    failed.append(req)  # alone, with all cache evicted, and still no room
                else:
                    self._preempt(req)
                    order.pop(i)
                placed = False
                break
            if not placed:
                break
            items.append(ScheduledItem(req, req.kv.computed, n))
            budget -= n
            i += 1

        # Static batching (for comparisons): a new batch only once the last one has fully drained.
        static_busy = self.config.batching == "static" and bool(self.running)
        if self.waiting and budget > 0 and len(self.running) < self.config.max_running and not failed and not static_busy:
            items.extend(self._admit(budget))
        return items, failed

    def _cascade_groups(self, items: list[ScheduledItem]) -> tuple[list[ScheduledItem], list[tuple[int, int, int]]]:
        """Put decodes (and, where the backend takes them, extend chunks) that share a long cached
        prefix next to each other, as cascade groups. A request's locked tree node is part of what
        it has computed, so its new tokens always follow the prefix its group shares."""
        threshold = self.cascade_min_shared_tokens
        if threshold is None:
            return items, []
        members = [item.req for item in items if item.num_tokens == 1 or self.cascade_extends]
        found = self.cache.shared_prefix_groups(members, threshold) if len(members) > 1 else []
        if not found:
            return items, []
        by_req = {id(item.req): item for item in items}
        ordered: list[ScheduledItem] = []
        groups: list[tuple[int, int, int]] = []
        for members, prefix in found:
            groups.append((len(ordered), len(members), prefix))
            ordered += [by_req.pop(id(req)) for req in members]
        return ordered + [item for item in items if id(item.req) in by_req], groups

    def admission_order(self) -> list[Request]:
        """The waiting requests in the order admission would try them now (for benchmarks)."""
        return self._admission_order()

    def _admit(self, budget: int) -> list[ScheduledItem]:
        items = self._admit_in_order(budget)
        self._count_overtakes([item.req.life.arrival_seq for item in items])
        return items

    def _count_overtakes(self, admitted: list[int]) -> None:
        """Aging: each waiting request counts the later arrivals admitted ahead of it."""
        if not admitted or self.config.schedule_policy == "fcfs":
            return
        admitted.sort()
        for req in self.waiting:
            req.life.overtaken += len(admitted) - bisect.bisect_right(admitted, req.life.arrival_seq)

    def _admit_in_order(self, budget: int) -> list[ScheduledItem]:
        items: list[ScheduledItem] = []
        in_flight = self._in_flight_prefills()
        for req in self._admission_order():
            if budget <= 0 or len(self.running) >= self.config.max_running:
                break
            if in_flight is not None and self._duplicates_in_flight(req, in_flight):
                continue  # wait a step: it will hit what the in-flight request inserts
            self.cache.match(req)
            n = min(req.pending, budget, self.chunk)
            headroom = len(self.running) + 1  # one page per running request for its next decode
            if not self.cache.allocate(req, n) or self.cache.available_pages < headroom:
                self.cache.release(req)
                break
            self.waiting.remove(req)
            self.cache.record_admission(req)
            req.life.status = Status.RUNNING
            req.life.admit_seq = self._admitted
            self._admitted += 1
            if req.life.first_scheduled is None:
                req.life.first_scheduled = time.monotonic()
            self.running.append(req)
            items.append(ScheduledItem(req, req.kv.computed, n))
            budget -= n
            if in_flight is not None:
                in_flight.insert(req.tokens, list(range(req.num_tokens)), req.input.namespace)
        return items

    def _admission_order(self) -> list[Request]:
        if self.config.schedule_policy == "fcfs" or not self.cache.tree.enabled or len(self.waiting) == 1:
            return list(self.waiting)
        # Longest cached prefix first; a request overtaken by max_overtakes later arrivals goes
        # first, in arrival order, so no request waits forever (counted in admissions, not
        # seconds, so the bound means the same on a slow CPU and a fast GPU).
        bound = self.config.max_overtakes
        aged = [r for r in self.waiting if r.life.overtaken >= bound]
        fresh = [r for r in self.waiting if r.life.overtaken < bound]
        fresh.sort(key=lambda r: (-self.cache.peek(r), r.life.arrival_seq))
        return sorted(aged, key=lambda r: r.life.arrival_seq) + fresh

    def _in_flight_prefills(self) -> RadixCache | None:
        """A scratch token tree of what running requests are prefilling right now (for dedup)."""
        if not self.cache.tree.enabled or self.config.dedup_min_tokens <= 0:
            return None
        if len(self.waiting) < 2 and not any(r.prefilling for r in self.running):
            return None
        tree = RadixCache(1, _NullFreer())
        for req in self.running:
            if req.prefilling:
                tree.insert(req.tokens, list(range(req.num_tokens)), req.input.namespace)
        return tree

    def _duplicates_in_flight(self, req: Request, in_flight: RadixCache) -> bool:
        shared = in_flight.peek(req.tokens, req.input.namespace, max_len=req.match_limit)
        return shared - self.cache.peek(req) >= self.config.dedup_min_tokens

    def _preempt(self, req: Request) -> None:
        """Free ``req``'s KV (keeping what it computed in the cache) and requeue it at the front."""
        self.cache.release(req)
        self.running.remove(req)
        req.life.status = Status.WAITING
        req.life.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)
        log.debug("preempted %s (%d tokens)", req.input.rid, req.num_tokens)

    # -- after the forward pass ----------------------------------------------------------------
    def finish(self, req: Request, reason: str) -> None:
        req.life.status = Status.FINISHED
        req.out.finish_reason = reason
        req.life.finished_at = time.monotonic()
        if req in self.running:
            self.cache.release(req, finished=True)
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def check(self) -> None:
        self.cache.check(self.running)

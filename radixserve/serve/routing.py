"""Routing policies and the router's per-worker mirror of each worker's prefix cache.

The mirror (:class:`CacheIndex`) is a :class:`~radixserve.kv.radix.RadixCache` with a dummy page
freer, fed by the worker's own cache events: ``insert`` adds the leaf's whole path, ``evict``
removes the evicted node (and anything the mirror holds below it). Requests routed to a worker
but not finished yet are kept apart as *pending* prefixes, so a burst of same-prefix requests
follows the first one before the worker's events arrive; a pending prefix is dropped when its
request ends (by then the worker's insert events have arrived: they are sent before the final).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from radixserve.kv.radix import RadixCache, RadixNode

POLICIES = ("cache_aware", "round_robin", "least_load")


class _NoFree:
    def free(self, pages: list[int]) -> None:
        pass


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token lists (bisection on C-speed slice compares)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1  # answer in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class CacheIndex:
    """Token-level mirror of one worker's radix cache (from its events) plus pending prefixes."""

    def __init__(self) -> None:
        self.tree = RadixCache(1, _NoFree())
        self.pending: dict[str, tuple[Hashable, list[int]]] = {}

    @property
    def tokens(self) -> int:
        return self.tree.total_pages

    def insert(self, namespace: Hashable, tokens: list[int]) -> None:
        if tokens:
            self.tree.insert(tokens, [0] * len(tokens), namespace)

    def evict(self, namespace: Hashable, tokens: list[int], length: int) -> None:
        """Forget ``tokens[len - length:]`` (the evicted node) and whatever hangs below it."""
        start = len(tokens) - length
        if length <= 0 or start < 0:
            return
        self.tree.drop_subtree(tokens, start, namespace)  # the mirror never locks: all of it can go

    def add_pending(self, work_id: str, namespace: Hashable, tokens: list[int]) -> None:
        self.pending[work_id] = (namespace, tokens)

    def drop_pending(self, work_id: str) -> None:
        self.pending.pop(work_id, None)

    def match(self, namespace: Hashable, tokens: list[int]) -> int:
        """Longest prefix of ``tokens`` this worker holds (or is about to hold)."""
        best = self.tree.peek(tokens, namespace)
        for ns, pending in self.pending.values():
            if ns == namespace and len(pending) > best:
                best = max(best, common_prefix_len(tokens, pending))
        return best

    def clear(self) -> None:
        self.tree = RadixCache(1, _NoFree())
        self.pending.clear()


@dataclass
class Candidate:
    """What a policy sees of one worker."""

    name: str
    load: int  # requests in flight on it (router's count)
    index: CacheIndex = field(default_factory=CacheIndex)


@dataclass
class Decision:
    worker: str
    reason: str  # cache_hit | load_balance | least_load | round_robin
    matched: int = 0


class Policy:
    """Picks one worker among candidates (all alive and under their in-flight cap)."""

    name = "base"

    def choose(self, candidates: list[Candidate], tokens: list[int], namespace: Hashable) -> Decision:
        raise NotImplementedError


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates, tokens, namespace):
        return Decision(candidates[next(self._counter) % len(candidates)].name, "round_robin")


class LeastLoad(Policy):
    name = "least_load"

    def choose(self, candidates, tokens, namespace):
        return Decision(min(candidates, key=lambda c: c.load).name, "least_load")


class CacheAware(Policy):
    """SGLang's rule over the workers' real caches: when loads are imbalanced past both
    thresholds (``max - min > balance_abs`` and ``max > balance_rel * min``) send to the least
    loaded; else to the longest cached prefix if it covers at least ``cache_threshold`` of the
    prompt; else to the least loaded (ties: the smallest cache)."""

    name = "cache_aware"

    def __init__(self, *, balance_abs: int = 16, balance_rel: float = 1.5, cache_threshold: float = 0.3):
        self.balance_abs, self.balance_rel, self.cache_threshold = balance_abs, balance_rel, cache_threshold

    def choose(self, candidates, tokens, namespace):
        loads = [c.load for c in candidates]
        lo, hi = min(loads), max(loads)
        least = min(candidates, key=lambda c: (c.load, c.index.tokens))
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            return Decision(least.name, "load_balance")
        scored = [(c.index.match(namespace, tokens), -c.load, c) for c in candidates]
        matched, _, best = max(scored, key=lambda s: (s[0], s[1]))
        if matched and matched >= self.cache_threshold * len(tokens):
            return Decision(best.name, "cache_hit", matched)
        return Decision(least.name, "least_load", matched)


def make_policy(name: str, **options) -> Policy:
    if name == "cache_aware":
        return CacheAware(**options)
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    raise ValueError(f"unknown policy {name!r}; choose one of {POLICIES}")


__all__ = ["CacheIndex", "Candidate", "Decision", "Policy", "make_policy", "POLICIES", "RadixNode"]

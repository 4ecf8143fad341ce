"""Cache policies, bounds and routers for the simulator.

Every policy serves the requests one at a time (each finishes before the next starts) and
returns Σ hit tokens. Radix policies drive the engine's own ``radixserve.kv.radix.RadixCache``
(page_size 1: one page per unit) with a simulated clock: match, lock, allocate (evicting through
the tree), insert, unlock, exactly the engine's order of calls.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from bench.sim.workloads import Request, Workload
from radixserve.kv.radix import RadixCache

NEVER = 1 << 60  # next use of a unit no later request needs


def lcp(a: list[int], b: list[int]) -> int:
    """Longest common prefix of two lists (slice compares: C speed)."""
    hi = min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    lo = 0  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


# -- bounds ------------------------------------------------------------------------------------
def ideal(w: Workload, order: list[int] | None = None) -> int:
    """Infinite cache: a request hits the longest prefix of anything stored before it (arrival
    order), capped so the last prompt token is computed."""
    paths, U = w.paths(), w.unit_tokens
    seen: set[int] = set()
    hit = 0
    for i in order if order is not None else range(len(w.requests)):
        r, p = w.requests[i], paths[i]
        n, h = r.access_units(U), 0
        while h < n and p[h] in seen:
            h += 1
        hit += r.hit_tokens(h, U)
        seen.update(p)
    return hit


def belady(w: Workload, capacity: int) -> int:
    """Belady (MIN) over the tree of units at ``capacity`` units: after each request, keep the
    units whose next use (next request whose hit-worthy prefix contains them) is soonest; evict
    the furthest next use first, ties: deepest. The request's own units may be dropped at once
    (bypass). A unit's next use is never earlier than its parent's, so the cache stays a
    root-closed subtree and every cached unit of a request's path is a prefix hit. This is the
    exact optimum of *unit-count* hits (classic MIN with bypass; all units cost the same); the
    token-weighted rate it reports weights units by tokens (partial last blocks, the len-1 cap),
    for which it is the reference bound, not a proven optimum."""
    paths, U, reqs = w.paths(), w.unit_tokens, w.requests
    # next access of each stored unit of request j, after j
    last: dict[int, int] = {}
    nxt: list[list[int]] = [None] * len(reqs)  # type: ignore[list-item]
    for j in range(len(reqs) - 1, -1, -1):
        p = paths[j]
        nxt[j] = [last.get(x, NEVER) for x in p]
        for x in p[: reqs[j].access_units(U)]:
            last[x] = j
    cached: dict[int, int] = {}  # unit -> next use
    heap: list[tuple[int, int, int]] = []
    hit = 0
    for j, r in enumerate(reqs):
        p, n, h = paths[j], r.access_units(U), 0
        while h < n and p[h] in cached:
            h += 1
        hit += r.hit_tokens(h, U)
        for d, (x, nu) in enumerate(zip(p, nxt[j])):
            if nu == NEVER:  # never used again: worthless, dropped at once (so are its children)
                cached.pop(x, None)
                continue
            cached[x] = nu
            heapq.heappush(heap, (-nu, -d, x))
        while len(cached) > capacity:
            key, _, x = heapq.heappop(heap)
            if cached.get(x) == -key:
                del cached[x]
        if len(heap) > 4 * capacity + 1024:  # drop stale entries
            heap = [e for e in heap if cached.get(e[2]) == -e[0]]
            heapq.heapify(heap)
    return hit


# -- radix tree (the engine's RadixCache) ------------------------------------------------------
class _Pool:
    """The page allocator: ``capacity`` page ids; evicted pages come back through ``free``."""

    def __init__(self, capacity: int) -> None:
        self.free_pages = list(range(capacity - 1, -1, -1))

    def free(self, pages: list[int]) -> None:
        self.free_pages += pages

    def alloc(self, n: int) -> list[int]:
        out = self.free_pages[-n:] if n else []
        del self.free_pages[len(self.free_pages) - n :]
        return out


class RadixWorker:
    """One engine's prefix cache: a RadixCache of ``capacity`` pages (units)."""

    def __init__(self, capacity: int, unit_tokens: int, eviction: str = "lru") -> None:
        self.now = 0
        self.pool = _Pool(capacity)
        self.cache = RadixCache(1, self.pool, eviction=eviction, clock=lambda: self.now)
        self.U = unit_tokens
        self.hit = 0
        self.assigned_tokens = 0
        self.served = 0

    def peek(self, r: Request) -> int:
        return self.cache.peek(r.units, max_len=r.access_units(self.U))

    def serve(self, r: Request) -> int:
        self.now += 1
        self.served += 1
        self.assigned_tokens += r.prompt_tokens
        cache, pool = self.cache, self.pool
        m = cache.match(r.units, max_len=r.access_units(self.U))
        h = m.length
        cache.lock(m.node)
        need = len(r.stored) - h
        if len(pool.free_pages) < need:
            cache.evict(need - len(pool.free_pages))
        new = pool.alloc(min(need, len(pool.free_pages)))  # a request larger than the cache: keep a prefix
        if new:
            already = cache.insert(r.stored[: h + len(new)], m.pages + new)
            if already > h:  # our copies of units the tree already had (e.g. an output seen before)
                pool.free(new[: already - h])
        cache.unlock(m.node)
        got = r.hit_tokens(h, self.U)
        self.hit += got
        return got


def radix(w: Workload, capacity: int, eviction: str = "lru") -> int:
    worker = RadixWorker(capacity, w.unit_tokens, eviction)
    for r in w.requests:
        worker.serve(r)
    return worker.hit


def radix_lpm(w: Workload, capacity: int, window: int, eviction: str = "lru", order: list[int] | None = None) -> int:
    """Longest-prefix-first: of the next ``window`` waiting requests (arrival order; ``window`` 0:
    the requests with the same arrival time as the first waiting one) whose previous turn is
    done, serve the one with the longest cached prefix (``peek``, re-ranked after every request);
    ties go to the earliest arrival. The service order is appended to ``order`` if
    given (reordering can beat arrival-order bounds; ``ideal(w, order)`` bounds this policy)."""
    worker = RadixWorker(capacity, w.unit_tokens, eviction)
    reqs = w.requests
    done = [False] * len(reqs)
    waiting: list[int] = []
    nxt = 0
    while nxt < len(reqs) or waiting:
        if window > 0:
            while len(waiting) < window and nxt < len(reqs):
                waiting.append(nxt)
                nxt += 1
        elif not waiting:  # window 0: the requests that arrived at the same time
            t = reqs[nxt].t
            while nxt < len(reqs) and reqs[nxt].t == t:
                waiting.append(nxt)
                nxt += 1
        best, best_len = None, -1
        for i in waiting:
            if reqs[i].after >= 0 and not done[reqs[i].after]:
                continue
            n = worker.peek(reqs[i])
            if n > best_len:
                best, best_len = i, n
        waiting.remove(best)
        worker.serve(reqs[best])
        done[best] = True
        if order is not None:
            order.append(best)
    return worker.hit


# -- vLLM-style block hashing ------------------------------------------------------------------
def block_hash(w: Workload, capacity_tokens: int, block: int) -> int:
    """vLLM prefix caching: a chain hash per full ``block``-token block (the block's id is its
    whole prefix, exactly what a hash chain encodes), LRU over blocks with a finished request's
    blocks queued tail first (vLLM frees in reverse order, so the tail goes first). A hit is the
    longest run of leading cached full blocks, at most ``(L - 1) // block`` blocks.

    Units are grouped (block a multiple of the unit) or split (unit a multiple of block: a unit's
    sub-blocks are always touched together and evicted tail first, so each entry is a unit with
    its number of cached leading sub-blocks)."""
    U, paths = w.unit_tokens, w.paths()
    if block >= U:
        if block % U:
            raise ValueError(f"block {block} is not a multiple of the unit ({U} tokens)")
        g, s = block // U, 1
    else:
        if U % block:
            raise ValueError(f"unit ({U} tokens) is not a multiple of block {block}")
        g, s = 1, U // block
    cap = capacity_tokens // block
    lru: OrderedDict[int, int] = OrderedDict()  # entry id -> cached leading sub-blocks
    used = hit = 0
    for r, p in zip(w.requests, paths):
        # entries of the stored sequence: (id, full sub-blocks in it)
        entries = []
        if g > 1:
            for b in range(len(p) // g):
                if (b + 1) * block > r.stored_tokens:
                    break
                entries.append((p[(b + 1) * g - 1], 1))
        else:
            for k, x in enumerate(p):
                f = min(s, (r.stored_tokens - k * U) // block)
                if f <= 0:
                    break
                entries.append((x, f))
        limit = (r.prompt_tokens - 1) // block
        got = 0
        for x, f in entries:
            if got >= limit:
                break
            m = lru.get(x, 0)
            got += min(m, f)
            if m < f:
                break
        hit += min(got, limit) * block
        for x, f in reversed(entries):
            used += f - lru.get(x, 0)
            lru[x] = f
            lru.move_to_end(x)
        while used > cap:
            x, m = next(iter(lru.items()))
            take = min(m, used - cap)
            used -= take
            if take == m:
                del lru[x]
            else:
                lru[x] = m - take
    return hit


# -- llama.cpp slots ---------------------------------------------------------------------------
def slots(w: Workload, capacity: int, n_slots: int) -> int:
    """llama.cpp ``-np N``: each slot keeps its last sequence (prompt + output, at most
    capacity // N units: the context is split between slots); a request takes the slot with the
    longest common prefix (> 0), else the least recently used slot, and reuses that prefix."""
    U = w.unit_tokens
    per = max(1, capacity // n_slots)
    seqs: list[list[int]] = [[] for _ in range(n_slots)]
    used = [0] * n_slots
    hit = 0
    for t, r in enumerate(w.requests, 1):
        n = r.access_units(U)
        units = r.units[:n]
        best, best_len = None, 0
        for i, s in enumerate(seqs):
            k = lcp(units, s)
            if k > best_len or (k == best_len and best is not None and k > 0 and used[i] < used[best]):
                best, best_len = i, k
        if best is None:
            best = min(range(n_slots), key=used.__getitem__)
        hit += r.hit_tokens(best_len, U)
        seqs[best] = r.stored[:per]
        used[best] = t
    return hit


# -- routing over N workers --------------------------------------------------------------------
ROUTINGS = ("round_robin", "least_load", "cache_aware_approx", "cache_aware_exact")


class _NullFreer:
    def free(self, pages):
        pass


def route(
    w: Workload, workers: int, capacity: int, policy: str, *, cache_threshold: float = 0.5, balance_abs: int = 0, balance_rel: float = 1.5
) -> tuple[int, list[int]]:
    """Serve ``w`` with ``workers`` radix-LRU workers of ``capacity`` units each.

    Load is the prompt tokens assigned so far (requests run one at a time here, so nothing is
    ever outstanding). ``least_load``: the least loaded worker. ``cache_aware_*`` follow SGLang's
    router: if loads are imbalanced (max - min > balance_abs and max > balance_rel * min) take
    the least loaded; else the worker with the longest match if match / prompt units >
    cache_threshold; else the worker with the smallest tree. ``approx`` matches against a
    router-side radix tree per worker of the prompts routed there (never evicted: no feedback);
    ``exact`` peeks each worker's actual RadixCache. Returns (hit tokens, requests per worker)."""
    ws = [RadixWorker(capacity, w.unit_tokens) for _ in range(workers)]
    trees = [RadixCache(1, _NullFreer()) for _ in range(workers)] if policy == "cache_aware_approx" else None
    for k, r in enumerate(w.requests):
        loads = [x.assigned_tokens for x in ws]
        if policy == "round_robin":
            i = k % workers
        elif policy == "least_load":
            i = min(range(workers), key=loads.__getitem__)
        elif policy in ("cache_aware_approx", "cache_aware_exact"):
            hi, lo = max(loads), min(loads)
            if hi - lo > balance_abs and hi > balance_rel * lo:
                i = loads.index(lo)
            else:
                if trees is not None:
                    n = r.access_units(w.unit_tokens)
                    matches = [t.peek(r.units, max_len=n) for t in trees]
                    sizes = [t.total_pages for t in trees]
                else:
                    matches = [x.peek(r) for x in ws]
                    sizes = [x.cache.total_pages for x in ws]
                best = max(matches)
                if r.units and best / len(r.units) > cache_threshold:
                    i = min((j for j in range(workers) if matches[j] == best), key=loads.__getitem__)
                else:
                    i = min(range(workers), key=lambda j: (sizes[j], loads[j]))
            if trees is not None:
                trees[i].insert(r.units, [0] * len(r.units))
        else:
            raise ValueError(f"unknown routing {policy!r}; choose from {ROUTINGS}")
        ws[i].serve(r)
    return sum(x.hit for x in ws), [x.served for x in ws]

"""KV ownership for requests: prefix matching, page allocation, insertion into the radix tree.

Invariants (checked by :meth:`CacheManager.check`):

* free pages + pages held by the tree + pages owned by running requests == total pages;
* ``req.kv.pages[: req.kv.cached_len // page_size]`` are the tree's canonical pages for that prefix,
  kept from eviction by the lock on ``req.kv.node``; the rest of ``req.kv.pages`` are the request's own;
* so a running request's page table points only at pages it owns or holds locked through the tree.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable

from radixserve.engine.request import Request
from radixserve.errors import InvariantError
from radixserve.kv.pool import KVPool
from radixserve.kv.prefix_cache import NoPrefixCache, PrefixCache, RadixNode
from radixserve.kv.radix import RadixCache

log = logging.getLogger("radixserve")


class CacheManager:
    def __init__(self, pool: KVPool, *, enable_prefix_cache: bool, eviction: str = "lru"):
        self.pool = pool
        self.page_size = pool.page_size
        self.tree: PrefixCache = RadixCache(pool.page_size, pool, eviction=eviction) if enable_prefix_cache else NoPrefixCache()
        self.query_tokens = 0
        self.hit_tokens = 0
        self.alignment_waste_tokens = 0
        self.pins: dict[tuple[Hashable, tuple[int, ...]], RadixNode] = {}

    # -- derived state -------------------------------------------------------------------------
    @property
    def available_pages(self) -> int:
        """Pages that an allocation can get: free now, or freed by evicting unlocked cache."""
        return self.pool.num_free + self.tree.evictable_pages

    @property
    def evictable_pages(self) -> int:
        return self.tree.evictable_pages

    @property
    def locked_pages(self) -> int:
        return self.tree.protected_pages

    @property
    def pinned_tokens(self) -> int:
        return sum(len(key) for _, key in self.pins)

    # -- matching ------------------------------------------------------------------------------
    def peek(self, req: Request) -> int:
        """Cached prefix length of ``req``, without touching the tree (for ordering the queue)."""
        return self.tree.peek(req.tokens, req.input.namespace, max_len=req.match_limit)

    def match(self, req: Request) -> None:
        """Attach the longest cached prefix to ``req`` and lock it. The last token is never
        matched: its logits are needed (nor, for a scoring request, any scored position)."""
        if req.kv.pages or req.kv.node is not None:
            raise InvariantError(f"match of {req.input.rid}, which still holds KV")
        if req.decode.score_from is not None:  # scoring: every scored row is (re)computed from here on
            req.out.score_logprobs = [None] * (req.num_tokens - req.decode.score_from)
        m = self.tree.match(req.tokens, req.input.namespace, max_len=req.match_limit)
        self.tree.lock(m.node)
        req.kv.node, req.kv.pages = m.node, list(m.pages)
        req.kv.cached_len = req.kv.computed = m.length

    def record_admission(self, req: Request) -> None:
        """Count the prefix query and hit of a first admission (a retry after preemption
        recomputes or re-reads its own KV: that is never a hit)."""
        if req.kv.cached_tokens is None:
            req.kv.cached_tokens = req.kv.cached_len
            self.query_tokens += len(req.input.prompt_ids)
            self.hit_tokens += req.kv.cached_len

    # -- allocation ----------------------------------------------------------------------------
    def allocate(self, req: Request, num_new: int) -> bool:
        """Make ``req.kv.pages`` cover ``req.kv.computed + num_new`` tokens, evicting cache if needed.
        All or nothing: on False nothing was taken."""
        need = -(-(req.kv.computed + num_new) // self.page_size) - len(req.kv.pages)
        if need <= 0:
            return True
        if self.pool.num_free < need:
            self.tree.evict(need - self.pool.num_free)
        pages = self.pool.alloc(need)
        if pages is None:
            return False
        req.kv.pages.extend(pages)
        return True

    # -- insertion and release -----------------------------------------------------------------
    def commit(self, req: Request) -> None:
        """Insert ``req``'s computed full pages into the tree, free its duplicates, and rewrite its
        page table to the tree's canonical pages (moving its lock down to the new node)."""
        aligned = req.kv.computed // self.page_size * self.page_size
        if aligned <= req.kv.cached_len:
            return
        m = self.tree.cache_prefix(
            req.tokens[:aligned], req.kv.pages[: aligned // self.page_size], req.input.namespace, held=req.kv.node, held_len=req.kv.cached_len
        )
        if m.length:
            req.kv.pages[: len(m.pages)] = m.pages
            req.kv.node, req.kv.cached_len = m.node, m.length

    def release(self, req: Request, *, finished: bool = False) -> None:
        """Give back everything ``req`` holds; its computed KV stays cached in the tree (so a
        preempted request's retry, or the next turn of a conversation, hits it)."""
        self.commit(req)
        if self.tree.enabled:
            self.alignment_waste_tokens += req.kv.computed - req.kv.cached_len
        if finished and req.decode.pin:
            self._pin(req)
        self.tree.unlock(req.kv.node)
        self.pool.free(req.kv.pages[req.kv.cached_len // self.page_size :])
        req.kv.pages, req.kv.node, req.kv.cached_len, req.kv.computed = [], None, 0, 0

    # -- pinning -------------------------------------------------------------------------------
    def _pin(self, req: Request) -> None:
        if not self.tree.enabled:
            raise InvariantError(f"pin of {req.input.rid} without a prefix cache")
        aligned = len(req.input.prompt_ids) // self.page_size * self.page_size
        key = (req.input.namespace, tuple(req.input.prompt_ids[:aligned]))
        if aligned and key not in self.pins:
            m = self.tree.match(key[1], req.input.namespace)
            self.tree.lock(m.node)
            self.pins[key] = m.node

    def unpin(self, namespace: Hashable, prompt_ids: Iterable[int]) -> bool:
        prompt_ids = list(prompt_ids)
        aligned = len(prompt_ids) // self.page_size * self.page_size
        node = self.pins.pop((namespace, tuple(prompt_ids[:aligned])), None)
        if node is None:
            return False
        self.tree.unlock(node)
        return True

    # -- shared prefixes -----------------------------------------------------------------------
    def shared_prefix_groups(self, reqs: Iterable[Request], min_tokens: int) -> list[tuple[list[Request], int]]:
        """Group requests by the longest cached prefix they share, read off the radix tree: those
        locked below the same top-level node share every node down to where their paths part.
        Keeps groups whose size x shared length reaches ``min_tokens``."""
        by_top: dict[int, list[tuple[Request, list]]] = {}
        for req in reqs:
            path = []
            node = req.kv.node
            while node is not None and node is not self.tree.root:
                path.append(node)
                node = node.parent
            if path:
                path.reverse()
                by_top.setdefault(id(path[0]), []).append((req, path))
        groups = []
        for members in by_top.values():
            if len(members) < 2:
                continue
            first = members[0][1]
            depth = min(len(path) for _, path in members)
            length = d = 0
            while d < depth and all(path[d] is first[d] for _, path in members):
                length += len(first[d].key)
                d += 1
            if len(members) * length >= min_tokens:
                groups.append(([req for req, _ in members], length))
        return groups

    # -- integrity -----------------------------------------------------------------------------
    def check(self, running: Iterable[Request]) -> None:
        """Raise :class:`InvariantError` unless every page is held exactly once (free, by the
        tree, or by one running request) and every page table points at pages its request owns
        or holds locked through the tree."""
        owned: list[int] = []
        for req in running:
            self._check_page_table(req)
            owned.extend(req.kv.pages[req.kv.cached_len // self.page_size :])
        tree_pages = self.tree.all_pages()
        free = self.pool.free_page_ids()
        total = len(free) + len(tree_pages) + len(owned)
        if total != self.pool.num_pages:
            raise InvariantError(
                f"KV accounting broken: free {len(free)} + cached {len(tree_pages)} + running {len(owned)} = {total} != total {self.pool.num_pages}"
            )
        if len(set(free) | set(tree_pages) | set(owned)) != total:
            raise InvariantError("a KV page is held twice")
        self.tree.check_integrity()

    def _check_page_table(self, req: Request) -> None:
        problem = self._page_table_problem(req)
        if problem:
            raise InvariantError(f"request {req.input.rid}: {problem}")

    def _page_table_problem(self, req: Request) -> str | None:
        """``req.kv.pages`` covers every computed token, and its cached prefix is exactly the pages
        of the tree path that ``req`` holds locked (``req.kv.node``)."""
        if len(req.kv.pages) * self.page_size < req.kv.computed:
            return f"page table covers {len(req.kv.pages)} pages, fewer than its {req.kv.computed} computed tokens"
        node = req.kv.node
        if node is None or req.kv.cached_len % self.page_size:
            return f"cached prefix of {req.kv.cached_len} tokens without a page-aligned tree node"
        if node is not self.tree.root and node.lock_ref <= 0:
            return f"holds no lock on its cached prefix {node!r}"
        path = self.tree.path_pages(node)
        if path is None:
            return f"its cached prefix node was evicted {node!r}"
        shared = req.kv.cached_len // self.page_size
        if path != req.kv.pages[:shared]:
            return f"page table's cached prefix {req.kv.pages[:shared]} is not its locked tree path {path}"
        return None

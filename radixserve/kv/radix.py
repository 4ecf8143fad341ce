"""Token-level radix tree over cached KV pages.

The tree maps token prefixes to the KV pages that hold them. Every edge (node) carries a run of
whole pages: ``len(node.key) == len(node.pages) * page_size``. Matches, inserts and splits happen
only at page boundaries, so a match is the longest cached prefix rounded down to a page. With
``page_size == 1`` a page id is simply a KV slot.

Ownership contract (the engine relies on it):

* Pages inside the tree belong to the tree. Unlocked ones may be freed at any time by ``evict``
  through the ``PageFreer`` given at construction.
* A caller that uses matched pages must ``lock`` the returned node *before* anything can evict
  (any allocation) and ``unlock`` it when done. Locking a node protects its whole root path.
* ``insert`` takes ownership of the pages past the already-cached prefix; the caller keeps (and
  must free) its duplicates of the cached prefix, then re-``match`` to use the canonical pages.

Namespaces (tenant id, LoRA id, cache salt: any hashable, ``None`` by default) are part of the
child key at the root, so two namespaces never share a node.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Hashable, Iterator, Sequence

from radixserve.errors import InvariantError
from radixserve.kv.prefix_cache import MatchResult, PageFreer, PrefixCache, RadixNode

__all__ = ["EVICTION_POLICIES", "MatchResult", "PageFreer", "RadixCache", "RadixNode"]


# Eviction priority: the leaf with the smallest value goes first.
EVICTION_POLICIES: dict[str, Callable[[RadixNode], tuple]] = {
    "lru": lambda n: (n.last_access,),
    "lfu": lambda n: (n.hit_count, n.last_access),
}


class RadixCache(PrefixCache):
    """Radix tree of token prefixes -> KV pages, with locking and leaf eviction.

    Invariants (checked by ``check_integrity``): ``evictable_pages`` counts pages of nodes with
    ``lock_ref == 0``, ``protected_pages`` those with ``lock_ref > 0``; a node's ``lock_ref`` is
    at least the sum of its children's; every page id is held by at most one node.
    """

    enabled = True

    def __init__(
        self,
        page_size: int,
        freer: PageFreer,
        *,
        eviction: str = "lru",
        clock: Callable[[], float] = time.monotonic,
        on_event: Callable[..., None] | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {eviction!r}; choose one of {sorted(EVICTION_POLICIES)}")
        self.page_size = page_size
        self.freer = freer
        self.eviction = eviction
        self._priority = EVICTION_POLICIES[eviction]
        self.clock = clock
        self.root = RadixNode(key=[], pages=[], lock_ref=1)  # the root is never evicted
        self._evictable = 0
        self._protected = 0
        self.evictions = 0  # pages evicted over the cache's lifetime
        # Cache events for a router mirroring this tree (read at call time, so it can be set
        # after construction): ``("insert", namespace, path_tokens)`` when insert creates a
        # leaf (path_tokens: root to the leaf's end), ``("evict", namespace, path_tokens,
        # node_len)`` per evicted node. Called on the thread that mutates the tree.
        self.on_event = on_event

    # ------------------------------------------------------------------ derived state
    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def protected_pages(self) -> int:
        return self._protected

    @property
    def total_pages(self) -> int:
        return self._evictable + self._protected

    # ------------------------------------------------------------------ match / insert
    def match(self, tokens: Sequence[int], namespace: Hashable = None, *, split: bool = True, max_len: int | None = None) -> MatchResult:
        """Longest cached prefix of ``tokens[:max_len]``, rounded down to a whole page.

        ``split=True``: if the match ends inside a node, that node is split at the match so
        ``result.node`` ends exactly at ``result.length``; the matched nodes are touched
        (``last_access`` = now, ``hit_count`` += 1). Lock ``result.node`` before allocating.

        ``split=False`` mutates nothing (for peeking at waiting requests). ``length`` and
        ``pages`` are the same as with ``split=True``, but when the match ends inside a node,
        ``result.node`` is that node's parent (the deepest *fully* matched node), which ends
        before ``length``: do not lock it on behalf of ``pages``.
        """
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        limit = len(tokens) if max_len is None else max(0, min(max_len, len(tokens)))
        path, length, partial = self._walk(tokens, limit - limit % self.page_size, namespace, split)
        if split and path:
            now = self.clock()
            for node in path:
                node.last_access = now
                node.hit_count += 1
        pages: list[int] = []
        for node in path:  # extend per node, not per page: C speed
            pages += node.pages
        pages += partial
        return MatchResult(pages, length, path[-1] if path else self.root)

    def peek(self, tokens: Sequence[int], namespace: Hashable = None, *, max_len: int | None = None) -> int:
        """``match(tokens, namespace, split=False, max_len=max_len).length`` without building
        the page list (about half the cost): for ranking many waiting requests each step."""
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        limit = len(tokens) if max_len is None else max(0, min(max_len, len(tokens)))
        return self._walk(tokens, limit - limit % self.page_size, namespace, split=False)[1]

    def insert(self, tokens: Sequence[int], pages: Sequence[int], namespace: Hashable = None) -> int:
        """Cache ``tokens`` backed by ``pages`` (``len(pages) * page_size == len(tokens)``).

        Returns how many leading tokens were already cached (a multiple of ``page_size``). The
        tree takes ownership of ``pages[already // page_size:]``. The caller keeps
        ``pages[:already // page_size]``: it must free those that differ from the tree's
        canonical pages and re-``match`` to get the canonical ones.
        """
        P = self.page_size
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        if len(tokens) % P or len(pages) * P != len(tokens):
            raise ValueError(f"insert needs whole pages: {len(tokens)} tokens, {len(pages)} pages, page_size {P}")
        path, already, _ = self._walk(tokens, len(tokens), namespace, split=True)
        now = self.clock()
        for node in path:
            node.last_access = now
        if already < len(tokens):
            parent = path[-1] if path else self.root
            leaf = RadixNode(key=tokens[already:], pages=list(pages[already // P :]), parent=parent, last_access=now, namespace=namespace)
            parent.children[self._child_key(leaf)] = leaf
            self._evictable += len(leaf.pages)
            if self.on_event is not None:
                self.on_event(("insert", namespace, list(tokens)))
        return already

    def cache_prefix(self, tokens: Sequence[int], pages: list[int], namespace: Hashable, *, held: RadixNode, held_len: int) -> MatchResult:
        """``insert``, then free the caller's duplicates of what was already cached, re-``match``
        for the canonical pages and move the caller's lock from ``held`` to the new entry."""
        P = self.page_size
        already = self.insert(tokens, pages, namespace)
        self.freer.free(pages[held_len // P : already // P])
        m = self.match(tokens, namespace)
        if m.length != len(tokens):
            raise InvariantError(f"re-match after insert found {m.length} of {len(tokens)} tokens")
        self.lock(m.node)
        self.unlock(held)
        return m

    def _walk(self, tokens: list[int], limit: int, namespace: Hashable, split: bool) -> tuple[list[RadixNode], int, list[int]]:
        """Walk ``tokens[:limit]`` (``limit`` page-aligned) from the root.

        Returns (fully matched nodes root-first, matched tokens, pages matched inside the node
        where the match stops). With ``split`` that node is split and appended to the path instead,
        so the third item is always empty.
        """
        P = self.page_size
        node, path, pos = self.root, [], 0
        child_key: Hashable = (namespace, tuple(tokens[:P]))
        while pos < limit:
            child = node.children.get(child_key)
            if child is None:
                break
            key = child.key
            end = pos + len(key)
            if end <= limit and tokens[pos:end] == key:  # fast path: whole node matches (C speed)
                path.append(child)
                node, pos = child, end
                child_key = tuple(tokens[pos : pos + P])
                continue
            # The match ends inside `child`. Its first page matched (the dict key); bisect on
            # whole pages with slice compares (C speed) for the longest equal run.
            lo, hi = 1, min(len(key), limit - pos) // P
            if tokens[pos : pos + hi * P] == key[: hi * P]:  # common: a full hit capped by max_len
                lo = hi
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if tokens[pos : pos + mid * P] == key[: mid * P]:
                    lo = mid
                else:
                    hi = mid - 1
            i = lo * P  # P <= i < len(key)
            if not split:
                return path, pos + i, child.pages[: i // P]
            path.append(self._split(child, i))
            return path, pos + i, []
        return path, pos, []

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut ``node`` after ``at`` tokens; returns the new upper node. ``node`` keeps the tail,
        so a node a caller holds still ends at the same depth."""
        P = self.page_size
        parent = node.parent
        if parent is None:
            raise InvariantError("split of the root")
        upper = RadixNode(
            key=node.key[:at],
            pages=node.pages[: at // P],
            parent=parent,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
            hit_count=node.hit_count,
            namespace=node.namespace,
        )
        parent.children[self._child_key(upper)] = upper  # same key as `node` had
        node.key, node.pages, node.parent = node.key[at:], node.pages[at // P :], upper
        upper.children[self._child_key(node)] = node
        return upper

    def _child_key(self, node: RadixNode) -> Hashable:
        first_page = tuple(node.key[: self.page_size])
        return (node.namespace, first_page) if node.parent is self.root else first_page

    # ------------------------------------------------------------------ locking
    def lock(self, node: RadixNode) -> None:
        """Protect ``node`` and its ancestors from eviction (reference counted)."""
        self._check_attached(node)
        cur: RadixNode | None = node
        while cur is not None and cur is not self.root:  # attached: the parents end at the root
            if cur.lock_ref == 0:
                self._evictable -= len(cur.pages)
                self._protected += len(cur.pages)
            cur.lock_ref += 1
            cur = cur.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one ``lock(node)``. Raises ``RuntimeError`` if ``node`` is not locked."""
        self._check_attached(node)
        if node is not self.root and node.lock_ref <= 0:
            raise RuntimeError(f"unlock of an unlocked node {node!r}")
        cur: RadixNode | None = node
        while cur is not None and cur is not self.root:
            cur.lock_ref -= 1
            if cur.lock_ref == 0:
                self._protected -= len(cur.pages)
                self._evictable += len(cur.pages)
            cur = cur.parent

    def _check_attached(self, node: RadixNode) -> None:
        if node is not self.root and node.parent is None:
            raise RuntimeError(f"{node!r} was evicted; lock the node a fresh match returned")

    # ------------------------------------------------------------------ eviction
    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` pages (or all evictable ones) via ``freer.free``.

        Removes whole unlocked leaves in policy order; a parent left as an unlocked childless node
        becomes a candidate. May free more than asked (whole nodes). Never touches locked nodes
        or the root. Returns the number of pages freed.
        """
        if num_pages <= 0 or self._evictable == 0:
            return 0
        tie = itertools.count()
        heap = [(self._priority(n), next(tie), n) for n in self._nodes() if n.is_leaf and n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        on_event = self.on_event
        while len(freed) < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            if on_event is not None:
                on_event(("evict", node.namespace, self._path_tokens(node), len(node.key)))
            del parent.children[self._child_key(node)]
            node.parent = None  # detached: lock() on a stale handle now raises
            freed += node.pages
            if parent is not self.root and parent.is_leaf and parent.lock_ref == 0:
                heapq.heappush(heap, (self._priority(parent), next(tie), parent))
        self._evictable -= len(freed)
        self.evictions += len(freed)
        if freed:
            self.freer.free(freed)
        return len(freed)

    def reset(self) -> None:
        """Evict every unlocked node (locked paths stay: they are in use)."""
        self.evict(self._evictable)

    # ------------------------------------------------------------------ inspection
    def _path_tokens(self, node: RadixNode) -> list[int]:
        """Tokens from the root to the end of ``node`` (``node`` still attached)."""
        return [t for n in self._root_path(node)[0] for t in n.key]

    def path_pages(self, node: RadixNode) -> list[int] | None:
        """Pages from the root to the end of ``node``; None when ``node`` is no longer attached."""
        nodes, attached = self._root_path(node)
        return [p for n in nodes for p in n.pages] if attached else None

    def _root_path(self, node: RadixNode) -> tuple[list[RadixNode], bool]:
        """The nodes from the root's child down to ``node``, and whether the walk reached the root
        (False: ``node`` hangs off a detached subtree)."""
        nodes: list[RadixNode] = []
        cur: RadixNode | None = node
        while cur is not None and cur is not self.root:
            nodes.append(cur)
            cur = cur.parent
        nodes.reverse()
        return nodes, cur is self.root

    def _nodes(self):
        """Every non-root node, depth first."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_pages(self) -> list[int]:
        """Every page the tree holds (for the engine's page accounting)."""
        pages: list[int] = []
        for node in self._nodes():
            pages += node.pages
        return pages

    def leaf_paths(self) -> Iterator[tuple[Hashable, list[int]]]:
        """``(namespace, tokens root to leaf)`` for every leaf: the whole tree as insert events
        (a worker's snapshot for the router's mirror)."""
        for node in self._nodes():
            if node.is_leaf:
                yield node.namespace, self._path_tokens(node)

    def drop_subtree(self, tokens: Sequence[int], start: int, namespace: Hashable = None) -> int:
        """Remove the node that begins at ``tokens[start]`` below the cached path
        ``tokens[:start]`` (``start`` page-aligned), and everything under it; their pages go back
        through the freer. For a mirror replaying another tree's ``evict`` events. Nothing
        happens when that path or node is not cached. Returns the number of pages removed."""
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        if start < 0 or start >= len(tokens) or start % self.page_size:
            return 0
        parent = self.root
        if start:
            m = self.match(tokens[:start], namespace)  # splits so that a node ends at `start`
            if m.length < start:
                return 0  # the part above is not cached: nothing below it either
            parent = m.node
        first = tuple(tokens[start : start + self.page_size])
        child = parent.children.get((namespace, first) if parent is self.root else first)
        if child is None:
            return 0
        if child.lock_ref:
            raise RuntimeError(f"drop_subtree of a locked node {child!r}")
        del parent.children[self._child_key(child)]
        pages: list[int] = []
        stack = [child]
        while stack:  # unlocked node: its whole subtree is unlocked (lock_ref >= children's)
            node = stack.pop()
            pages += node.pages
            stack.extend(node.children.values())
            node.parent = None
        self._evictable -= len(pages)
        if pages:
            self.freer.free(pages)
        return len(pages)

    def check_integrity(self) -> None:
        """Recompute everything from the tree; raise :class:`InvariantError` on any inconsistency."""
        root = self.root
        if root.lock_ref != 1 or root.key or root.pages:
            raise InvariantError("root was modified")
        evictable = protected = 0
        seen: set[int] = set()
        for node in self._nodes():
            problem = self._node_problem(node)
            if problem:
                raise InvariantError(f"{node!r}: {problem}")
            if node.lock_ref == 0:
                evictable += len(node.pages)
            else:
                protected += len(node.pages)
            dup = seen.intersection(node.pages)
            if dup or len(set(node.pages)) != len(node.pages):
                raise InvariantError(f"pages held twice in the tree: {sorted(dup) or node.pages}")
            seen.update(node.pages)
        if evictable != self._evictable:
            raise InvariantError(f"evictable {self._evictable} != recount {evictable}")
        if protected != self._protected:
            raise InvariantError(f"protected {self._protected} != recount {protected}")

    def _node_problem(self, node: RadixNode) -> str | None:
        """What is wrong with one node on its own (None: nothing)."""
        P, parent = self.page_size, node.parent
        if parent is None or parent.children.get(self._child_key(node)) is not node:
            return "not filed under its parent by its first page"
        if not node.key or len(node.key) % P:
            return "key not whole pages"
        if len(node.pages) * P != len(node.key):
            return "pages do not cover the key"
        if parent is not self.root and node.namespace != parent.namespace:
            return "namespace differs from its parent's"
        child_locks = sum(c.lock_ref for c in node.children.values())
        if not node.lock_ref >= child_locks >= 0:
            return f"lock_ref below its children's total {child_locks}"
        return None

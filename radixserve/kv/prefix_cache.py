"""What the engine needs of a prefix cache, and the cache that keeps nothing.

:class:`PrefixCache` is the interface :class:`~radixserve.engine.cache_manager.CacheManager`
drives; :class:`~radixserve.kv.radix.RadixCache` implements it over a radix tree, and
:class:`NoPrefixCache` (``enable_prefix_cache=False``) implements it by caching nothing: every
match is empty, locks are free, and a request's pages stay its own until it releases them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol


class PageFreer(Protocol):
    """Whatever owns the page pool (the KV allocator): takes evicted pages back."""

    def free(self, pages: list[int]) -> None: ...


@dataclass(eq=False, slots=True)
class RadixNode:
    """One edge of the tree: ``key`` tokens backed by ``pages`` (internal; identity-hashed)."""

    key: list[int]
    pages: list[int]
    children: dict = field(default_factory=dict)
    parent: RadixNode | None = None
    lock_ref: int = 0
    last_access: float = 0.0
    hit_count: int = 0
    namespace: Hashable = None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return f"RadixNode(tokens={len(self.key)}, pages={len(self.pages)}, children={len(self.children)}, lock_ref={self.lock_ref}, ns={self.namespace!r})"


class MatchResult(NamedTuple):
    pages: list[int]  # page ids of the matched prefix, root to node order
    length: int  # matched tokens == len(pages) * page_size
    node: RadixNode  # deepest node on the match (root when nothing matched); see RadixCache.match


class PrefixCache(ABC):
    """Token prefixes -> KV pages, with reference-counted locks against eviction.

    Contract: pages a cache holds are its own; a caller using matched pages ``lock``\\ s the
    returned node before anything can evict and ``unlock``\\ s it when done. Namespaces (tenant,
    LoRA, cache salt) never share an entry.
    """

    enabled: bool  # False: nothing is ever cached (callers skip work that only pays off on hits)
    root: RadixNode
    evictions: int  # pages evicted over the cache's lifetime
    on_event: Callable[..., None] | None  # cache events for a router's mirror (see RadixCache)

    @property
    @abstractmethod
    def evictable_pages(self) -> int: ...

    @property
    @abstractmethod
    def protected_pages(self) -> int: ...

    @abstractmethod
    def peek(self, tokens: Sequence[int], namespace: Hashable = None, *, max_len: int | None = None) -> int:
        """Cached prefix length of ``tokens[:max_len]``, changing nothing."""

    @abstractmethod
    def match(self, tokens: Sequence[int], namespace: Hashable = None, *, split: bool = True, max_len: int | None = None) -> MatchResult:
        """The longest cached prefix of ``tokens[:max_len]`` (whole pages); lock its node to use it."""

    @abstractmethod
    def cache_prefix(self, tokens: Sequence[int], pages: list[int], namespace: Hashable, *, held: RadixNode, held_len: int) -> MatchResult:
        """Cache ``tokens`` (whole pages) whose KV lies in ``pages``, for a caller whose first
        ``held_len`` tokens are the cache's own pages under ``held`` (locked). Frees the caller's
        duplicates of pages the cache already had, moves the caller's lock from ``held`` to the
        returned entry and returns it: the canonical pages of as much of ``tokens`` as the cache
        keeps (none, for a cache that keeps nothing)."""

    @abstractmethod
    def lock(self, node: RadixNode) -> None: ...

    @abstractmethod
    def unlock(self, node: RadixNode) -> None: ...

    @abstractmethod
    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` unlocked pages (or all there are); returns how many."""

    @abstractmethod
    def path_pages(self, node: RadixNode) -> list[int] | None:
        """Pages from the root to the end of ``node``; None when ``node`` was evicted."""

    @abstractmethod
    def all_pages(self) -> list[int]: ...

    @abstractmethod
    def leaf_paths(self) -> Iterator[tuple[Hashable, list[int]]]: ...

    @abstractmethod
    def check_integrity(self) -> None: ...


class NoPrefixCache(PrefixCache):
    """The prefix cache switched off: it holds no pages, every match is empty (the root)."""

    enabled = False

    def __init__(self) -> None:
        self.root = RadixNode(key=[], pages=[], lock_ref=1)
        self.evictions = 0
        self.on_event = None

    @property
    def evictable_pages(self) -> int:
        return 0

    @property
    def protected_pages(self) -> int:
        return 0

    def peek(self, tokens: Sequence[int], namespace: Hashable = None, *, max_len: int | None = None) -> int:
        return 0

    def match(self, tokens: Sequence[int], namespace: Hashable = None, *, split: bool = True, max_len: int | None = None) -> MatchResult:
        return MatchResult([], 0, self.root)

    def cache_prefix(self, tokens: Sequence[int], pages: list[int], namespace: Hashable, *, held: RadixNode, held_len: int) -> MatchResult:
        return MatchResult([], 0, held)

    def lock(self, node: RadixNode) -> None:
        pass

    def unlock(self, node: RadixNode) -> None:
        pass

    def evict(self, num_pages: int) -> int:
        return 0

    def path_pages(self, node: RadixNode) -> list[int] | None:
        return [] if node is self.root else None

    def all_pages(self) -> list[int]:
        return []

    def leaf_paths(self) -> Iterator[tuple[Hashable, list[int]]]:
        return iter(())

    def check_integrity(self) -> None:
        pass

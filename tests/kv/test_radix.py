"""Radix cache: unit tests for each contract, and a stateful model of the engine as its caller."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.errors import InvariantError
from radixserve.kv.radix import EVICTION_POLICIES, MatchResult, RadixCache, RadixNode


class Pool:
    """Fake KV allocator: ``n`` pages and a free list. ``free`` rejects double frees."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.free_list = list(range(n))
        self.freed: list[int] = []  # every page freed through the tree, in order

    def alloc(self, k: int) -> list[int]:
        assert k <= len(self.free_list)
        out, self.free_list = self.free_list[len(self.free_list) - k :], self.free_list[: len(self.free_list) - k]
        return out

    def free(self, pages: list[int]) -> None:
        self.give_back(pages)
        self.freed += pages

    def give_back(self, pages: list[int]) -> None:
        """The caller's own frees (not through the tree)."""
        free = set(self.free_list)
        for p in pages:
            assert 0 <= p < self.n, f"page {p} out of range"
            assert p not in free, f"page {p} freed twice"
            free.add(p)
        self.free_list += pages


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(page_size: int = 1, eviction: str = "lru") -> tuple[RadixCache, Pool, Clock]:
    pool, clock = Pool(1000), Clock()
    pool.alloc(1000)  # unit tests hand the tree page ids directly: none of them is free
    return RadixCache(page_size, pool, eviction=eviction, clock=clock), pool, clock


def path_pages(tree: RadixCache, node: RadixNode) -> list[int]:
    """Pages from the root down to ``node``, by parent pointers (independent of match)."""
    chunks = []
    while node is not tree.root:
        chunks.append(node.pages)
        node = node.parent
    return [p for chunk in reversed(chunks) for p in chunk]


def snapshot(tree: RadixCache) -> list[tuple]:
    out, stack = [], [tree.root]
    while stack:
        n = stack.pop()
        out.append((id(n), id(n.parent), tuple(n.key), tuple(n.pages), n.lock_ref, n.last_access, n.hit_count, tuple(n.children)))
        stack.extend(n.children.values())
    return out


# ---------------------------------------------------------------------------- unit tests
def test_match_splits_node_at_the_match():
    tree, _, clock = make()
    assert tree.insert([1, 2, 3, 4], [10, 11, 12, 13]) == 0
    clock.now = 5.0
    res = tree.match([1, 2, 9])
    assert res == MatchResult([10, 11], 2, res.node)
    assert res.node.key == [1, 2] and res.node.pages == [10, 11]
    (tail,) = res.node.children.values()
    assert tail.key == [3, 4] and tail.pages == [12, 13] and tail.parent is res.node
    assert res.node.last_access == 5.0 and res.node.hit_count == 1 and tail.hit_count == 0
    assert tree.total_pages == 4 and len(tree.root.children) == 1
    tree.check_integrity()
    full = tree.match([1, 2, 3, 4, 5])
    assert full.pages == [10, 11, 12, 13] and full.length == 4 and full.node is tail


def test_match_without_split_mutates_nothing():
    tree, _, clock = make()
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    (node,) = tree.root.children.values()
    before = snapshot(tree)
    clock.now = 7.0
    res = tree.match([1, 2, 9], split=False)
    assert res.length == 2 and res.pages == [10, 11]
    assert res.node is tree.root  # the partially matched node's parent
    assert tree.peek([1, 2, 9]) == 2 and tree.peek([1, 2, 3, 4], max_len=3) == 3
    assert tree.peek([1, 2, 3], namespace="other") == 0
    assert snapshot(tree) == before
    whole = tree.match([1, 2, 3, 4, 5], split=False)
    assert whole.node is node and whole.length == 4 and snapshot(tree) == before


def test_match_on_empty_tree_and_max_len():
    tree, _, _ = make()
    assert tree.match([1, 2, 3]) == MatchResult([], 0, tree.root)
    tree.insert([1, 2, 3], [7, 8, 9])
    assert tree.match([1, 2, 3], max_len=2).pages == [7, 8]
    assert tree.match([1, 2, 3], max_len=0).length == 0
    assert tree.match((1, 2, 3)).length == 3  # any sequence, not only lists
    tree.check_integrity()


def test_insert_returns_already_present_and_rematch_is_canonical():
    tree, pool, _ = make()
    assert tree.insert([1, 2, 3, 4], [10, 11, 12, 13]) == 0
    mine = [20, 21, 22, 23, 24, 25]
    already = tree.insert([1, 2, 3, 4, 5, 6], mine)
    assert already == 4
    assert tree.total_pages == 6  # took only pages[4:]
    assert tree.match([1, 2, 3, 4, 5, 6]).pages == [10, 11, 12, 13, 24, 25]
    assert tree.insert([1, 2, 9, 9], [30, 31, 32, 33]) == 2  # ends inside a node: split
    assert tree.match([1, 2, 9, 9]).pages == [10, 11, 32, 33]
    assert tree.insert([1, 2], [40, 41]) == 2 and tree.total_pages == 8
    assert sorted(tree.all_pages()) == [10, 11, 12, 13, 24, 25, 32, 33]
    tree.check_integrity()
    tree.reset()
    assert sorted(pool.freed) == [10, 11, 12, 13, 24, 25, 32, 33] and tree.total_pages == 0


def test_namespaces_never_share():
    tree, _, _ = make()
    tree.insert([1, 2, 3], [10, 11, 12], namespace="a")
    assert tree.match([1, 2, 3], namespace="b").length == 0
    assert tree.match([1, 2, 3]).length == 0
    assert tree.match([1, 2, 3], namespace="a").pages == [10, 11, 12]
    assert tree.insert([1, 2, 3], [20, 21, 22], namespace="b") == 0
    assert tree.insert([1, 2], [30, 31]) == 0
    assert tree.match([1, 2, 3], namespace="b").pages == [20, 21, 22]
    assert tree.match([1, 2, 9], namespace="a").node.namespace == "a"
    assert len(tree.root.children) == 3 and tree.total_pages == 8
    tree.check_integrity()


def test_page_size_alignment():
    tree, _, _ = make(page_size=4)
    a = list(range(12))
    b = a[:10] + [99, 98]
    assert tree.insert(a, [0, 1, 2]) == 0
    res = tree.match(b)
    assert res.length == 8 and res.pages == [0, 1]  # 10 common tokens -> 8
    assert len(res.node.key) == 8 and tree.match(b, split=False).length == 8
    assert tree.match(a, max_len=7).length == 4 and tree.match(a[:3]).length == 0
    assert tree.match([0, 1, 2, 3, 0, 0, 0, 0]).length == 4  # mismatch in the 2nd page
    assert tree.insert(b, [5, 6, 7]) == 8 and tree.match(b).pages == [0, 1, 7]
    tree.check_integrity()
    with pytest.raises(ValueError):
        tree.insert(a[:10], [0, 1])
    with pytest.raises(ValueError):
        tree.insert(a[:8], [0])


def test_evict_lru_first():
    tree, pool, clock = make()
    for t, (tokens, pages) in enumerate([([1, 1], [10, 11]), ([2, 2], [20, 21]), ([3, 3], [30, 31])]):
        clock.now = float(t)
        tree.insert(tokens, pages)
    clock.now = 10.0
    tree.match([1, 1])  # touch: [1, 1] is now the most recent
    assert tree.evict(1) == 2 and pool.freed == [20, 21]
    assert tree.evict(1) == 2 and pool.freed == [20, 21, 30, 31]
    assert tree.evictions == 4 and tree.evictable_pages == 2
    assert tree.match([1, 1]).length == 2 and tree.match([2, 2]).length == 0
    tree.check_integrity()


def test_evict_lfu_prefers_fewest_hits():
    tree, pool, clock = make(eviction="lfu")
    tree.insert([1], [10])
    tree.insert([2], [20])
    clock.now = 1.0
    tree.match([2])
    tree.match([2])
    clock.now = 2.0
    tree.match([1])  # more recent, fewer hits: LFU evicts it, LRU would not
    assert tree.evict(1) == 1 and pool.freed == [10]
    with pytest.raises(ValueError):
        RadixCache(1, pool, eviction="nope")


def test_evict_whole_leaves_then_parents_never_locked():
    tree, pool, clock = make()
    tree.insert([1, 2, 3], [10, 11, 12])
    clock.now = 1.0
    tree.insert([1, 2, 4], [20, 21, 22])  # splits [1, 2] off; [3] and [4] are leaves
    clock.now = 2.0
    tree.insert([5, 6], [50, 51])
    locked = tree.match([1, 2, 4]).node
    tree.lock(locked)
    assert tree.protected_pages == 3 and tree.evictable_pages == 3
    assert tree.evict(100) == 3  # asks too much: frees all that is evictable, not more
    assert sorted(pool.freed) == [12, 50, 51]
    assert tree.evict(1) == 0 and tree.evictable_pages == 0
    tree.unlock(locked)
    assert tree.evict(1) == 1 and pool.freed[-1] == 22  # the leaf first, never the parent
    assert tree.evict(1) == 2 and sorted(pool.freed) == [10, 11, 12, 22, 50, 51]
    assert tree.total_pages == 0 and tree.root.children == {}
    tree.check_integrity()
    with pytest.raises(RuntimeError):
        tree.lock(locked)  # a stale handle to an evicted node


def test_evict_skips_a_locked_parent_left_childless():
    tree, pool, _ = make()
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    node = tree.match([1, 2]).node  # split: locked [1, 2] | unlocked [3, 4]
    tree.lock(node)
    assert tree.evict(100) == 2 and pool.freed == [12, 13]
    assert tree.match([1, 2, 3]).node is node and tree.protected_pages == 2
    tree.check_integrity()


def test_lock_unlock_move_sizes():
    tree, _, _ = make()
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    node = tree.match([1, 2]).node  # split: [1, 2] | [3, 4]
    tree.lock(node)
    assert (tree.protected_pages, tree.evictable_pages) == (2, 2)
    tree.lock(node)
    leaf = tree.match([1, 2, 3, 4]).node
    tree.lock(leaf)
    assert (tree.protected_pages, tree.evictable_pages) == (4, 0) and node.lock_ref == 3
    tree.unlock(node)
    tree.unlock(node)
    assert (tree.protected_pages, tree.evictable_pages) == (4, 0)
    tree.unlock(leaf)
    assert (tree.protected_pages, tree.evictable_pages) == (0, 4)
    with pytest.raises(RuntimeError):
        tree.unlock(leaf)
    tree.lock(tree.root)  # the root is always locked: a no-op
    tree.unlock(tree.root)
    tree.check_integrity()


def test_split_of_a_locked_node_keeps_the_lock_on_its_whole_path():
    tree, _, _ = make()
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    node = tree.match([1, 2, 3, 4]).node
    tree.lock(node)
    upper = tree.match([1, 2, 9]).node  # splits the locked node
    assert upper.lock_ref == 1 and node.parent is upper and tree.protected_pages == 4
    assert path_pages(tree, node) == [10, 11, 12, 13]  # the held node still ends at 4 tokens
    tree.check_integrity()
    tree.unlock(node)
    assert upper.lock_ref == 0 and tree.evictable_pages == 4
    tree.check_integrity()


def test_check_integrity_catches_corruption():
    tree, _, _ = make()
    tree.insert([1, 2], [10, 11])
    tree.insert([3, 4], [20, 21])
    tree.check_integrity()
    tree._evictable += 1
    with pytest.raises(InvariantError, match="evictable"):
        tree.check_integrity()
    tree._evictable -= 1
    tree.match([3, 4]).node.pages[0] = 10
    with pytest.raises(InvariantError, match="twice"):
        tree.check_integrity()


def test_leaf_paths_list_every_leaf_with_its_namespace():
    tree, _, _ = make(page_size=2)
    tree.insert([1, 2, 3, 4], [10, 11])
    tree.insert([1, 2, 5, 6], [10, 12])  # shares the first page: splits, two leaves
    tree.insert([1, 2], [20], namespace="t")
    assert sorted(tree.leaf_paths(), key=repr) == sorted([(None, [1, 2, 3, 4]), (None, [1, 2, 5, 6]), ("t", [1, 2])], key=repr)


def test_drop_subtree_removes_the_node_and_everything_below_it():
    tree, pool, _ = make(page_size=2)
    tree.insert([1, 2, 3, 4, 7, 8], [10, 11, 13])
    tree.insert([1, 2, 5, 6], [10, 12])
    assert tree.drop_subtree([1, 2, 3, 4, 7, 8], 2) == 2  # [3, 4] and the [7, 8] below it
    assert sorted(pool.freed) == [11, 13]
    assert tree.peek([1, 2, 3, 4]) == 2 and tree.peek([1, 2, 5, 6]) == 4
    assert tree.evictable_pages == 2
    tree.check_integrity()
    assert tree.drop_subtree([9, 9], 0) == 0  # not cached: nothing happens
    assert tree.drop_subtree([1, 2, 9, 9, 5, 6], 4) == 0  # the path above is not cached
    tree.lock(tree.match([1, 2, 5, 6]).node)
    with pytest.raises(RuntimeError, match="locked"):
        tree.drop_subtree([1, 2, 5, 6], 0)
    tree.check_integrity()


def test_path_pages_follows_parents_and_is_none_once_evicted():
    tree, _, _ = make()
    tree.insert([1, 2, 3], [10, 11, 12])
    node = tree.match([1, 2, 3]).node
    assert tree.path_pages(node) == [10, 11, 12] and tree.path_pages(tree.root) == []
    tree.evict(3)
    assert tree.path_pages(node) is None


# ---------------------------------------------------------------------------- stateful model
PRIORITY = {"lru": lambda n: (n.last_access,), "lfu": lambda n: (n.hit_count, n.last_access)}
assert set(PRIORITY) <= set(EVICTION_POLICIES)


@dataclass
class Req:
    tokens: list[int]
    ns: object
    table: list[int]  # one page per page of tokens (the last may be partial)
    prefix: int  # leading tokens backed by the tree and locked through `node`
    node: RadixNode

    def owned(self, P: int) -> list[int]:
        return self.table[self.prefix // P :]

    def locked(self, P: int) -> list[int]:
        return self.table[: self.prefix // P]


# Prompts share prefixes the way agent calls do: a few system prompts, cut anywhere, plus a tail.
BASES = [list(range(10, 22)), list(range(10, 16)) + list(range(30, 36)), list(range(40, 52))]
tokens_st = st.builds(lambda b, cut, tail: BASES[b][:cut] + tail, st.integers(0, 2), st.integers(0, 12), st.lists(st.integers(0, 2), max_size=5)).filter(bool)
ns_st = st.sampled_from([None, "tenant"])


class RadixMachine(RuleBasedStateMachine):
    """The engine as a caller: admit (match, lock, allocate, maybe evict), checkpoint a chunk
    (insert, free duplicates, re-match, move the lock), finish, abort, and pressure eviction."""

    N = 40

    @initialize(page_size=st.sampled_from([1, 2, 3]), eviction=st.sampled_from(sorted(PRIORITY)))
    def setup(self, page_size, eviction):
        self.P, self.eviction = page_size, eviction
        self.pool, self.clock = Pool(self.N), Clock()
        self.tree = RadixCache(page_size, self.pool, eviction=eviction, clock=self.clock)
        self.reqs: list[Req] = []

    # -- helpers -------------------------------------------------------------------------
    def oracle(self, tokens, ns, limit):
        """Longest cached prefix by brute force over every node's full root path."""
        best, pages, stack = 0, [], [(c, c.key, c.pages) for c in self.tree.root.children.values()]
        while stack:
            node, key, pgs = stack.pop()
            if node.namespace == ns:
                n = 0
                while n < min(len(key), limit) and key[n] == tokens[n]:
                    n += 1
                n -= n % self.P
                if n > best:
                    best, pages = n, pgs[: n // self.P]
            stack.extend((c, key + c.key, pgs + c.pages) for c in node.children.values())
        return best, pages

    def evict(self, n):
        before, mark = self.tree.evictable_pages, len(self.pool.freed)
        locked = {p for r in self.reqs for p in r.locked(self.P)}
        freed = self.tree.evict(n)
        new = self.pool.freed[mark:]
        assert freed == len(new)
        assert not locked & set(new), "evict freed pages of a locked path"
        assert freed >= min(n, before) and (before >= n or freed == before)
        return freed

    def clamp(self, i):
        return self.reqs[i % len(self.reqs)]

    def checkpoint(self, r: Req, k: int):
        """Insert r.tokens[:k] (k page-aligned, >= r.prefix) the way the engine must."""
        P = self.P
        self.clock.now += 1
        already = self.tree.insert(r.tokens[:k], r.table[: k // P], r.ns)
        assert r.prefix <= already <= k and already % P == 0
        self.pool.give_back(r.table[r.prefix // P : already // P])  # our duplicates
        res = self.tree.match(r.tokens, r.ns, max_len=k)
        assert res.length == k
        assert res.pages[: r.prefix // P] == r.table[: r.prefix // P]
        assert res.pages[already // P :] == r.table[already // P : k // P]  # the tree took ours
        self.tree.lock(res.node)
        self.tree.unlock(r.node)
        r.table[: k // P], r.prefix, r.node = res.pages, k, res.node

    def release(self, r: Req):
        self.tree.unlock(r.node)
        self.pool.give_back(r.owned(self.P))
        self.reqs.remove(r)

    # -- rules ---------------------------------------------------------------------------
    @rule(tokens=tokens_st, ns=ns_st)
    def admit(self, tokens, ns):
        limit = len(tokens) - 1  # the last prompt token is always computed
        self.clock.now += 1
        want = self.oracle(tokens, ns, limit - limit % self.P)
        before = snapshot(self.tree)
        peek = self.tree.match(tokens, ns, split=False, max_len=limit)
        assert self.tree.peek(tokens, ns, max_len=limit) == want[0]
        assert snapshot(self.tree) == before and (peek.length, peek.pages) == want
        res = self.tree.match(tokens, ns, max_len=limit)
        assert (res.length, res.pages) == want and path_pages(self.tree, res.node) == res.pages
        self.tree.lock(res.node)
        need = -(-len(tokens) // self.P) - len(res.pages)
        if need > len(self.pool.free_list):
            self.evict(need - len(self.pool.free_list))
        if need > len(self.pool.free_list):  # out of KV: reject
            self.tree.unlock(res.node)
            return
        self.reqs.append(Req(list(tokens), ns, res.pages + self.pool.alloc(need), res.length, res.node))

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 99), j=st.integers(0, 99))
    def insert_chunk(self, i, j):
        r = self.clamp(i)
        lo, hi = r.prefix // self.P, len(r.tokens) // self.P
        self.checkpoint(r, (lo + j % (hi - lo + 1)) * self.P)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 99))
    def finish(self, i):
        r = self.clamp(i)
        self.checkpoint(r, len(r.tokens) - len(r.tokens) % self.P)
        self.release(r)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 99))
    def abort(self, i):
        self.release(self.clamp(i))

    @rule(n=st.integers(0, 12))
    def pressure(self, n):
        self.evict(n)

    @rule()
    def evict_one_page_follows_policy(self):
        key = PRIORITY[self.eviction]
        stack, leaves = list(self.tree.root.children.values()), []
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children and node.lock_ref == 0:
                leaves.append(node)
        mark = len(self.pool.freed)
        if self.evict(1):
            (victim,) = [n for n in leaves if n.pages == self.pool.freed[mark:]]
            assert key(victim) == min(key(n) for n in leaves)

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def accounting(self):
        tree, P = self.tree, self.P
        tree.check_integrity()
        owned = [p for r in self.reqs for p in r.owned(P)]
        assert len(self.pool.free_list) + tree.total_pages + len(owned) == self.N
        assert sorted(self.pool.free_list + tree.all_pages() + owned) == list(range(self.N))
        assert tree.evictable_pages + tree.protected_pages == tree.total_pages
        locked = {p for r in self.reqs for p in r.locked(P)}
        assert tree.protected_pages == len(locked)
        expected = Counter()
        for r in self.reqs:
            assert path_pages(tree, r.node) == r.locked(P), "a held node moved"
            node = r.node
            while node is not tree.root:
                expected[node] += 1
                node = node.parent
        stack = list(tree.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            assert node.lock_ref == expected[node]


RadixMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
TestRadixMachine = RadixMachine.TestCase

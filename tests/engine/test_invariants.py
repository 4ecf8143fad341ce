"""The engine's integrity check (debug_checks): KV accounting, the radix tree, and every running
request's page table (it points only at pages the request owns or holds locked through the tree)."""

from __future__ import annotations

import pytest

from radixserve import Engine, SamplingParams
from radixserve.errors import InvariantError

from conftest import random_prompts

pytestmark = pytest.mark.timeout(120)

LONG = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)


def _running_with_cached_prefix(llama_dir, page_size: int = 1):
    """An engine with one running request whose first pages come from the radix tree."""
    engine = Engine(llama_dir, kv_cache_tokens=4096, page_size=page_size, debug_checks=True)
    system = random_prompts((64,), seed=11)[0]
    engine.generate([system + [5, 6, 7, 8]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    req = engine.make_request(system + [9, 10, 11, 12], LONG)
    engine.add_request(req)
    for _ in range(3):  # prefill of the tail, then decodes
        engine.step()
    assert not req.finished and req.kv.cached_len >= 64 - page_size
    engine.scheduler.check()  # sound before the corruption
    return engine, req


def test_cached_prefix_pointing_at_a_free_page_is_caught(llama_dir):
    engine, req = _running_with_cached_prefix(llama_dir)
    free = engine.pool.free_page_ids()
    req.kv.pages[0] = free[0]  # the accounting still balances: only the page-table check sees it
    with pytest.raises(InvariantError, match="locked tree path"):
        engine.scheduler.check()


def test_cached_prefix_pointing_at_another_tree_node_is_caught(llama_dir):
    engine, req = _running_with_cached_prefix(llama_dir, page_size=4)
    other = engine.make_request(random_prompts((40,), seed=12)[0], SamplingParams(max_tokens=1, temperature=0.0))
    engine.add_request(other)
    while not other.finished:
        engine.step()
    mine = set(engine.cache.tree.path_pages(req.kv.node))
    foreign = next(p for p in engine.cache.tree.all_pages() if p not in mine)
    req.kv.pages[1] = foreign  # a tree page, but one on no path this request holds locked
    with pytest.raises(InvariantError, match="locked tree path"):
        engine.scheduler.check()


def test_unlocked_cached_prefix_is_caught(llama_dir):
    engine, req = _running_with_cached_prefix(llama_dir)
    engine.cache.tree.unlock(req.kv.node)  # the pages are right, but eviction could take them now
    with pytest.raises(InvariantError, match="no lock"):
        engine.scheduler.check()
    engine.cache.tree.lock(req.kv.node)
    engine.scheduler.check()


def test_page_table_shorter_than_the_computed_tokens_is_caught(llama_dir):
    engine, req = _running_with_cached_prefix(llama_dir)
    engine.pool.free([req.kv.pages.pop()])  # accounting balances (the page went back to the pool)
    with pytest.raises(InvariantError, match="fewer than"):
        engine.scheduler.check()


def test_invariant_error_is_an_internal_error_raised_by_the_tree_check():
    from radixserve.errors import InternalError

    assert issubclass(InvariantError, InternalError) and InvariantError("x").code == "internal"
    from radixserve.kv.radix import RadixCache

    class Freer:
        def free(self, pages):
            pass

    tree = RadixCache(1, Freer())
    tree.insert([1, 2], [10, 11])
    tree.root.lock_ref = 2
    with pytest.raises(InvariantError, match="root"):
        tree.check_integrity()


def test_scattered_free_pages_come_back_lowest_first():
    # after requests came and went the free pages are scattered; handing out the lowest ids keeps
    # a sequence's pages ascending (the decode kernel reads them ~10% faster than in no order)
    import random

    import torch

    from radixserve.kv.pool import KVPool

    pool = KVPool(num_layers=1, num_pages=64, page_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32, device="cpu")
    pages = pool.alloc(64)
    random.Random(0).shuffle(pages)
    freed = pages[:32]
    pool.free(freed)  # in no order
    assert pool.alloc(8) == sorted(freed)[:8]
    assert pool.alloc(8) == sorted(freed)[8:16]
    assert pool.num_free == 16 and sorted(pool.free_page_ids()) == sorted(freed)[16:]
    assert pool.alloc(17) is None and pool.num_free == 16  # too many: nothing taken


def test_fresh_pages_come_in_ascending_runs():
    # the CPU kernels read a sequence's K/V in place only when its pages are one ascending run
    import torch

    from radixserve.kv.pool import KVPool

    pool = KVPool(num_layers=1, num_pages=64, page_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32, device="cpu")
    first = pool.alloc(10)
    assert first == list(range(10))
    assert first + pool.alloc(1) + pool.alloc(3) == list(range(14))  # a growing sequence continues its run
    pool.free(first)  # a freed run comes back in order
    assert pool.alloc(10) == first


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_a_cpu_pool_costs_the_memory_of_the_pages_written(kv_dtype):
    """Issue 49 item 7: every CPU engine held its whole KV pool (1 GiB by default) from the start,
    torch.zeros having written it; the test suite's engines and test servers added up to 9 GB. The
    pool's pages now reach memory when first written, and read back as zeros before that."""
    import psutil
    import torch

    from radixserve.kv.pool import KVPool

    me = psutil.Process()
    before = me.memory_info().rss
    pool = KVPool(
        num_layers=4, num_pages=16384, page_size=4, num_kv_heads=4, head_dim=256, dtype=torch.float32, device="cpu", kv_dtype=kv_dtype
    )  # 512 MiB of K and V as float32
    assert me.memory_info().rss - before < 64 << 20
    slots = torch.arange(40, 48)
    assert pool.k_slots(3).index_select(0, slots).abs().sum() == 0  # fresh pages read as zeros
    pool.k_slots(3)[slots] = torch.ones(8, 4, 256)
    assert torch.equal(pool.k_slots(3).index_select(0, slots), torch.ones(8, 4, 256))
    assert pool.k[3].data_ptr() % 64 == 0 and pool.v[0].is_contiguous()
    assert me.memory_info().rss - before < 64 << 20


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_pool_commit_writes_the_first_pages_of_a_pool_in_no_use(kv_dtype):
    """KVPool.commit (the benchmarks' steady state): the first ``pages`` pages of every tensor
    reach memory (and are zero), the rest stay uncommitted; a pool with pages handed out refuses."""
    import psutil
    import torch

    from radixserve.errors import InvariantError
    from radixserve.kv.pool import KVPool

    me = psutil.Process()
    pool = KVPool(
        num_layers=2, num_pages=8192, page_size=4, num_kv_heads=4, head_dim=256, dtype=torch.float32, device="cpu", kv_dtype=kv_dtype
    )  # 128 MiB of K and V per layer as float32 (half that as int8)
    before = me.memory_info().rss
    pool.commit(1024)  # an eighth
    grown = me.memory_info().rss - before
    per_page = sum(t[0].numel() * t.element_size() for t in [*pool.k, *pool.v, *getattr(pool, "k_scale", ()), *getattr(pool, "v_scale", ())])
    assert 0.9 * 1024 * per_page <= grown < 1024 * per_page + (48 << 20)
    assert pool.k[1][:1024].abs().sum() == 0 and pool.v[0][1023].abs().sum() == 0
    pages = pool.alloc(2)
    with pytest.raises(InvariantError, match="2 pages are in use"):
        pool.commit()
    pool.free(pages)
    pool.commit()
    assert me.memory_info().rss - before >= 0.9 * 8192 * per_page

"""cache_aware routing over the workers' real caches (2 worker processes, small KV pools)."""

from __future__ import annotations

import time

import pytest

from radixserve.client import Client

from conftest import random_prompts
from serve_cluster import Cluster

pytestmark = pytest.mark.timeout(300)

GREEDY = dict(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(llama_dir):
    c = Cluster(llama_dir, 2, "--policy", "cache_aware", kv_cache_tokens=600)
    yield c
    c.stop()


def _settle(c: Client, seconds: float = 1.2) -> dict:
    time.sleep(seconds)  # a heartbeat (0.5 s) carries the engines' latest stats
    return c.stats()


def test_same_prefix_goes_to_the_worker_that_holds_it_and_evictions_are_forgotten(cluster):
    prefix = random_prompts([300], seed=21)[0]
    tail_a, tail_b, tail_c = random_prompts([10, 10, 10], seed=22)
    with Client(cluster.address, timeout=60) as c:
        a = c.generate(prefix + tail_a, **GREEDY)
        assert a.usage.cached_tokens == 0
        b = c.generate(prefix + tail_b, **GREEDY)
        assert b.worker == a.worker
        assert b.usage.cached_tokens >= 300
        other = next(w for w in c.stats()["workers"] if w != a.worker)

        # the router's mirror of each worker's cache, probed with the prefix
        stats = _settle(c)
        probe = c.stats(probe=prefix)["probe"]
        assert probe[a.worker] == 300 and probe[other] == 0
        assert stats["workers"][a.worker]["engine"]["prefix_hit_tokens"] >= 300
        assert stats["workers"][other]["engine"]["prefix_hit_tokens"] == 0

        # namespaces never share: the same prefix in another tenant misses
        t = c.generate(prefix + tail_c, namespace="tenant-b", **GREEDY)
        assert t.usage.cached_tokens == 0
        assert c.stats(probe=prefix, namespace="tenant-b")["probe"][t.worker] >= 300
        assert c.stats(probe=prefix, namespace="tenant-b")["probe"][a.worker if t.worker != a.worker else other] == 0

        # unrelated long prompts fill both 600-token pools: the prefix gets evicted, and the
        # router's index forgets it; at idle each index equals the worker's cached tokens exactly
        for p in random_prompts([350] * 6, seed=23):
            c.generate(p, **GREEDY)
        stats = _settle(c)
        probe = c.stats(probe=prefix)["probe"]
        assert probe[a.worker] < 300
        for name, w in stats["workers"].items():
            e = w["engine"]
            assert w["inflight"] == 0
            assert e["evictions"] > 0 or name != a.worker
            assert w["index_tokens"] == e["kv_evictable_tokens"] + e["kv_locked_tokens"], (name, w)
            assert w["index_tokens"] <= e["kv_total_tokens"]


def test_burst_of_a_new_prefix_sticks_to_one_worker(cluster):
    prefix = random_prompts([200], seed=31)[0]
    tails = random_prompts([8] * 8, seed=32)
    with Client(cluster.address, timeout=60) as c:
        outs = c.batch([prefix + t for t in tails], **GREEDY)  # concurrently, before any cache event
        assert len({o.worker for o in outs}) == 1
        stats = c.stats()
        assert stats["router"]["counters"]["routed_cache_hit"] >= 7

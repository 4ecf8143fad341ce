"""The radix cache inside the engine: hits, tenants, pins, dedup, preemption, page alignment."""

from __future__ import annotations

import pytest

from radixserve import BadRequestError, Engine, SamplingParams

from conftest import random_prompts

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def make(llama_dir, **kw) -> Engine:
    return Engine(llama_dir, debug_checks=True, **{"kv_cache_tokens": 4096, **kw})


def test_shared_prefix_hits_and_counters(llama_dir):
    engine = make(llama_dir)
    system = random_prompts((200,), seed=1)[0]
    a, b = (system + tail for tail in random_prompts((20, 30), seed=2))
    first = engine.generate([a], GREEDY)[0]
    second = engine.generate([b], GREEDY)[0]
    assert first.cached_tokens == 0
    assert second.cached_tokens == 200
    stats = engine.stats()
    assert stats["prefix_query_tokens"] == len(a) + len(b)
    assert stats["prefix_hit_tokens"] == 200


def test_next_turn_hits_its_own_previous_answer(llama_dir):
    engine = make(llama_dir)
    turn1 = random_prompts((50,), seed=3)[0]
    out = engine.generate([turn1], GREEDY)[0]
    turn2 = turn1 + out.token_ids + random_prompts((10,), seed=4)[0]
    # Everything but the last generated token (its KV was never computed) is cached.
    assert engine.generate([turn2], GREEDY)[0].cached_tokens == len(turn1) + len(out.token_ids) - 1


def test_full_hit_still_computes_the_last_token(llama_dir):
    engine = make(llama_dir)
    prompt = random_prompts((40,), seed=5)[0]
    first = engine.generate([prompt], GREEDY)[0]
    again = engine.generate([prompt], GREEDY)[0]
    assert again.cached_tokens == len(prompt) - 1
    assert again.token_ids == first.token_ids


def test_tenants_never_share_prefixes(llama_dir):
    engine = make(llama_dir)
    prompt = random_prompts((120,), seed=6)[0]
    engine.generate([prompt], GREEDY, namespace="tenant-a")
    assert engine.generate([prompt], GREEDY, namespace="tenant-b")[0].cached_tokens == 0
    assert engine.generate([prompt], GREEDY, namespace="tenant-a")[0].cached_tokens == len(prompt) - 1


def test_cache_off_reports_zero_hits(llama_dir):
    engine = make(llama_dir, enable_prefix_cache=False)
    prompt = random_prompts((60,), seed=7)[0]
    outs = [engine.generate([prompt], GREEDY)[0] for _ in range(2)]
    assert [o.cached_tokens for o in outs] == [0, 0]
    assert outs[0].token_ids == outs[1].token_ids
    assert engine.stats()["kv_used_tokens"] == 0


def test_pinned_prefix_survives_memory_pressure(llama_dir):
    engine = make(llama_dir, kv_cache_tokens=600)
    system = random_prompts((150,), seed=8)[0]
    assert engine.pin(system) == 150
    assert engine.stats()["kv_pinned_tokens"] == 150
    # Fill the pool many times over with unrelated prompts: LRU would evict the system prompt.
    for i in range(6):
        engine.generate(random_prompts((200, 200), seed=100 + i), GREEDY)
    assert engine.stats()["evictions"] > 0
    hit = engine.generate([system + [42, 43]], GREEDY)[0]
    assert hit.cached_tokens == 150
    assert engine.unpin(system)
    assert engine.stats()["kv_pinned_tokens"] == 0
    for i in range(6):
        engine.generate(random_prompts((200, 200), seed=200 + i), GREEDY)
    assert engine.generate([system + [42, 44]], GREEDY)[0].cached_tokens < 150  # evicted once unpinned


def test_pin_budget_is_enforced(llama_dir):
    engine = make(llama_dir, kv_cache_tokens=1000, pin_budget_tokens=100)
    with pytest.raises(BadRequestError, match="pin budget"):
        engine.pin(random_prompts((120,), seed=9)[0])
    engine.pin(random_prompts((80,), seed=9)[0])
    with pytest.raises(BadRequestError, match="pin budget"):
        engine.pin(random_prompts((30,), seed=10)[0])


def test_preemption_recompute_is_never_a_hit(llama_dir):
    engine = make(llama_dir, kv_cache_tokens=330, max_prefill_chunk=32)
    prompts = random_prompts((100, 100, 100), seed=11)
    outs = engine.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    stats = engine.stats()
    assert stats["preemptions"] > 0
    assert stats["prefix_hit_tokens"] == 0 and all(o.cached_tokens == 0 for o in outs)
    reference = make(llama_dir).generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]


def test_page_alignment_waste_is_reported(llama_dir):
    engine = make(llama_dir, page_size=16)
    prompt = random_prompts((50,), seed=12)[0]
    engine.generate([prompt], GREEDY)  # 55 tokens computed: 48 cached in whole pages, 7 thrown away
    assert engine.stats()["prefix_alignment_waste_tokens"] == 7
    again = engine.generate([prompt + [9, 9]], GREEDY)[0]
    assert again.cached_tokens == 48


def test_in_batch_dedup_lets_siblings_hit(llama_dir):
    system = random_prompts((300,), seed=13)[0]
    prompts = [system + tail for tail in random_prompts((10, 12, 14, 16), seed=14)]

    def hits(**kw) -> int:
        engine = make(llama_dir, max_prefill_chunk=64, **kw)
        return sum(o.cached_tokens for o in engine.generate(prompts, GREEDY))

    assert hits(schedule_policy="fcfs", dedup_min_tokens=0) == 0  # all four prefill the prefix at once
    assert hits() == 3 * 300  # one computes it, the others wait a step and hit


def test_longest_prefix_first_admits_cache_friendly_requests_first(llama_dir):
    engine = make(llama_dir, max_running=1)
    warm = random_prompts((100,), seed=15)[0]
    engine.generate([warm], GREEDY)
    cold = random_prompts((30,), seed=16)[0]
    reqs = [engine.make_request(p, GREEDY) for p in (cold, warm + [7, 8])]
    for r in reqs:
        engine.add_request(r)
    order = []
    while engine.scheduler.has_work or not order:
        for chunk in engine.step():
            if chunk.finished:
                order.append(chunk.request_id)
    assert order == [reqs[1].input.rid, reqs[0].input.rid]


def test_aging_bounds_the_wait(llama_dir):
    """A cold request is overtaken by at most max_overtakes warm later arrivals."""
    engine = make(llama_dir, max_running=1, max_overtakes=2)
    warm = random_prompts((100,), seed=17)[0]
    engine.generate([warm], GREEDY)
    cold = engine.make_request(random_prompts((30,), seed=18)[0], GREEDY)
    warms = [engine.make_request(warm + [7, i], GREEDY) for i in range(5)]
    for r in [cold, *warms]:
        engine.add_request(r)
    order = []
    while len(order) < 6:
        order += [c.request_id for c in engine.step() if c.finished]
    assert order.index(cold.input.rid) == 2  # two warm ones overtook it, then its bound was reached
    assert order[3:] == [r.input.rid for r in warms[2:]]

"""Shared-prefix (cascade) attention equals flat paged attention, and leaves greedy tokens alone."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.attention.cascade import attend_with_lse, merge_states
from radixserve.attention.metadata import build_metadata
from radixserve.attention.torch_backend import TorchAttention
from radixserve.kv.pool import KVPool

from conftest import hf_greedy, random_prompts


def run_attention(pool, q, k, v, tables, kv_lens, page_size, groups=(), qo_lens=None):
    backend = TorchAttention(pool, scale=q.shape[-1] ** -0.5)
    qo_lens = qo_lens or [1] * len(tables)
    backend.plan(build_metadata(tables, kv_lens, qo_lens, page_size, groups=groups))
    return backend.forward(q, k, v, layer=0)


@pytest.mark.parametrize("extends", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(6))
def test_cascade_equals_flat(page_size, seed, extends):
    # with extends: group members (and ungrouped sequences) have several new tokens, all after
    # the shared prefix, each attending to the prefix and to its own suffix causally
    rng = random.Random(seed)
    heads, kv_heads, dim = rng.choice([(4, 2, 16), (8, 8, 8), (6, 1, 16)])
    pool = KVPool(num_layers=1, num_pages=4096 // page_size, page_size=page_size, num_kv_heads=kv_heads, head_dim=dim, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(seed)
    pool.k[0].normal_(generator=g)
    pool.v[0].normal_(generator=g)

    tables, kv_lens, qo_lens, groups = [], [], [], []
    for _ in range(rng.randint(1, 4)):  # groups, each with its own shared prefix (maybe empty)
        prefix_pages = pool.alloc(rng.choice([0, 1, 3, 17]))
        members = rng.randint(1, 5)
        groups.append((len(tables), members, len(prefix_pages) * page_size))
        for _ in range(members):
            suffix = rng.randint(1, 3 * page_size + 5)  # includes the new tokens
            tables.append(prefix_pages + pool.alloc(-(-suffix // page_size)))
            kv_lens.append(len(prefix_pages) * page_size + suffix)
            qo_lens.append(rng.randint(1, suffix) if extends else 1)
    for _ in range(rng.randint(0, 3)):  # ungrouped sequences alongside
        n = rng.randint(1, 40)
        tables.append(pool.alloc(-(-n // page_size)))
        kv_lens.append(n)
        qo_lens.append(rng.randint(1, n) if extends else 1)

    rows = sum(qo_lens)
    q = torch.randn(rows, heads, dim, generator=g)
    k = torch.randn(rows, kv_heads, dim, generator=g)
    v = torch.randn(rows, kv_heads, dim, generator=g)
    flat = run_attention(pool, q, k, v, tables, kv_lens, page_size, qo_lens=qo_lens)
    cascade = run_attention(pool, q, k, v, tables, kv_lens, page_size, groups, qo_lens=qo_lens)
    torch.testing.assert_close(cascade, flat, atol=1e-5, rtol=0)


def test_cascade_metadata_of_extends():
    # rows per group and per member; new tokens that reach into the shared prefix are refused
    tables = [[0, 1, 2], [0, 1, 3], [4]]
    meta = build_metadata(tables, [11, 12, 3], [3, 4, 2], 4, groups=[(0, 2, 8)])
    c = meta.cascade
    assert c.prefix_qo_indptr.tolist() == [0, 7] and c.suffix_qo_indptr.tolist() == [0, 3, 7]
    assert c.suffix_kv_indptr.tolist() == [0, 1, 2] and c.suffix_kv_last_page_len.tolist() == [3, 4]
    assert not c.decodes_only
    assert build_metadata(tables, [11, 12, 3], [1, 1, 2], 4, groups=[(0, 2, 8)]).cascade.decodes_only
    with pytest.raises(AssertionError, match="follow its shared prefix"):
        build_metadata(tables, [11, 12, 3], [3, 5, 2], 4, groups=[(0, 2, 8)])


def test_empty_kv_sets_merge_as_no_ops():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, generator=g) for _ in range(3))
    out, lse = attend_with_lse(q, k, v, 0.3)
    empty_out, empty_lse = attend_with_lse(q, k[:, :0], v[:, :0], 0.3)
    assert torch.isneginf(empty_lse).all() and (empty_out == 0).all()
    torch.testing.assert_close(merge_states(out, lse, empty_out, empty_lse), out)
    masked_out, masked_lse = attend_with_lse(q, k, v, 0.3, torch.zeros(1, 1, 3, dtype=torch.bool))
    torch.testing.assert_close(merge_states(masked_out, masked_lse, out, lse), out)


def test_lse_is_base_2():
    q, k, v = torch.ones(1, 1, 4), torch.zeros(1, 2, 4), torch.zeros(1, 2, 4)
    _, lse = attend_with_lse(q, k, v, 1.0)
    assert lse.item() == pytest.approx(1.0)  # log2(e^0 + e^0)


def test_greedy_tokens_unchanged_with_cascade(llama_dir):
    system = random_prompts((160,), seed=21)[0]
    prompts = [system + tail for tail in random_prompts((3, 9, 14, 20, 31), seed=22)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reference = hf_greedy(llama_dir, prompts, 12)
    engine = Engine(llama_dir, kv_cache_tokens=4096, cascade_min_shared_tokens=1, debug_checks=True)
    outputs = engine.generate(prompts, params)
    assert [o.token_ids for o in outputs] == reference
    assert engine.stats()["cascade_steps"] > 0
    # extends in groups: the first request caches the system prompt, then the others' tails (3 to
    # 31 new tokens) run as one cascade group over it, on the backend that takes extends
    assert engine.runner.attention.cascade_extends
    engine = Engine(llama_dir, kv_cache_tokens=4096, cascade_min_shared_tokens=1, debug_checks=True)
    seen = []
    plan = engine.runner.attention.plan
    engine.runner.attention.plan = lambda meta: (seen.append(meta.cascade), plan(meta))[1]
    assert [o.token_ids for o in engine.generate(prompts[:1], params)] == reference[:1]
    assert [o.token_ids for o in engine.generate(prompts[1:], params)] == reference[1:]
    assert any(c is not None and not c.decodes_only for c in seen)
    off = Engine(llama_dir, kv_cache_tokens=4096, cascade_min_shared_tokens=None)
    off.generate(prompts, params)
    assert off.stats()["cascade_steps"] == 0


def test_greedy_tokens_unchanged_with_decodes_apart_from_extends(llama_dir):
    """Level 1 in two calls (the decode members on the decode kernel, the extends on the GEMM
    kernel; CpuAttention's split thresholds lowered to any decode): requests that join while others
    of the group decode still produce transformers' greedy tokens."""
    system = random_prompts((160,), seed=23)[0]
    prompts = [system + tail for tail in random_prompts((3, 9, 14, 20, 31, 5), seed=24)]
    reference = hf_greedy(llama_dir, prompts, 10)
    engine = Engine(llama_dir, kv_cache_tokens=4096, cascade_min_shared_tokens=1, debug_checks=True)
    attention = engine.runner.attention
    if not hasattr(attention, "suffix_split_min_decodes"):
        pytest.skip("the csrc/ kernels did not build here")
    attention.suffix_split_min_decodes = 1
    attention.suffix_split_tokens_per_decode = 1 << 30
    splits = []
    plan = attention.plan
    attention.plan = lambda meta: (plan(meta), splits.append(attention._suffix_split is not None))[0]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    requests = [engine.make_request(p, params) for p in prompts]
    done = {}
    for i, req in enumerate(requests):  # one joins every other step: decodes and extends mix
        engine.add_request(req)
        for _ in range(2 if i < len(requests) - 1 else 100):
            for chunk in engine.step():
                if chunk.output is not None:
                    done[chunk.request_id] = list(chunk.output.token_ids)
    assert [done[r.input.rid] for r in requests] == reference
    assert any(splits)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_out_slots_are_each_new_tokens_slot(page_size):
    """out_slots lists, in batch order, the KV slot of every new token: page table entry of its
    position times the page size plus its offset, for chunks that start and end mid-page."""
    rng = random.Random(page_size)
    pages = list(range(2000))
    rng.shuffle(pages)
    tables, kv_lens, qo_lens = [], [], []
    for _ in range(12):
        kv = rng.randint(1, 150)
        qo = rng.randint(1, kv)
        n = -(-kv // page_size)
        tables.append([pages.pop() for _ in range(n + rng.randint(0, 2))])  # extra pages are ignored
        kv_lens.append(kv)
        qo_lens.append(qo)
    meta = build_metadata(tables, kv_lens, qo_lens, page_size)
    want = [t[pos // page_size] * page_size + pos % page_size for t, kv, qo in zip(tables, kv_lens, qo_lens) for pos in range(kv - qo, kv)]
    assert meta.out_slots.dtype == torch.int64 and meta.out_slots.tolist() == want

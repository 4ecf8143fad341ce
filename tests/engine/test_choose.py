"""Engine.choose: choice log-probabilities equal transformers' on the same tiny model, with and
without cache hits and across chunked-prefill boundaries; the prompt is prefilled once."""

from __future__ import annotations

import pytest
import torch

from radixserve import Engine
from radixserve.errors import BadRequestError

from conftest import random_prompts


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


def hf_scores(model, prompt: list[int], choices: list[list[int]]) -> list[list[float]]:
    out = []
    for c in choices:
        ids = torch.tensor([prompt + c])
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        n = len(prompt)
        out.append([float(lp[n - 1 + j, t]) for j, t in enumerate(c)])
    return out


def check(result, expected: list[list[float]]) -> None:
    by_choice = {tuple(r.choice) if isinstance(r.choice, list) else r.choice: r for r in result.ranked}
    assert len(by_choice) == len(expected)
    for key, lps in expected:
        r = by_choice[key]
        assert r.n_tokens == len(lps)
        assert r.logprob_sum == pytest.approx(sum(lps), abs=1e-4)
        assert r.logprob_mean == pytest.approx(sum(lps) / len(lps), abs=1e-4)


@pytest.mark.parametrize("chunk", [None, 5])
def test_choose_matches_transformers(llama_dir, hf_model, chunk):
    engine = Engine(llama_dir, kv_cache_tokens=4096, max_prefill_chunk=chunk, debug_checks=True)
    prompt = random_prompts([37], seed=1)[0]
    choices = random_prompts([1, 3, 4, 7, 2], seed=2)
    choices[4] = choices[2][:2]  # a choice that is a prefix of another
    texts = [engine.tokenizer.decode(c) for c in choices]
    ids = [engine.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    expected = hf_scores(hf_model, prompt, ids)

    first = engine.choose(prompt, texts)  # cold: nothing cached
    check(first, list(zip(texts, expected)))
    u = first.usage
    assert u.prompt_tokens == len(prompt) and u.choice_tokens == sum(map(len, ids))
    assert u.prompt_cached_tokens == 0
    # every scoring request hit the prompt prefilled first (all but its last token)
    assert u.cached_tokens == len(texts) * (len(prompt) - 1)
    assert u.computed_tokens == len(prompt) + sum(len(c) + 1 for c in ids)
    assert first.best == first.ranked[0].choice

    again = engine.choose(prompt, texts, normalize="mean")  # warm: prompt and choices cached
    check(again, list(zip(texts, expected)))
    assert again.usage.prompt_cached_tokens == len(prompt) - 1
    means = [r.logprob_mean for r in again.ranked]
    assert means == sorted(means, reverse=True)
    assert engine.stats()["running"] == 0 and engine.stats()["kv_locked_tokens"] == 0


def test_choose_partial_prefix_hit_and_batched(llama_dir, hf_model):
    """A second prompt sharing part of the first one; choose calls run from asyncio concurrently."""
    engine = Engine(llama_dir, kv_cache_tokens=4096, max_prefill_chunk=8)
    base = random_prompts([30], seed=3)[0]
    p1, p2 = base + [11, 12, 13], base + [21, 22]
    choices = [engine.tokenizer.decode(c) for c in random_prompts([2, 5, 3], seed=4)]
    ids = [engine.tokenizer.encode(t, add_special_tokens=False) for t in choices]
    r1 = engine.choose(p1, choices)
    r2 = engine.choose(p2, choices)
    assert r2.usage.prompt_cached_tokens == len(base)
    check(r1, list(zip(choices, hf_scores(hf_model, p1, ids))))
    check(r2, list(zip(choices, hf_scores(hf_model, p2, ids))))


def test_choose_sampling_and_errors(llama_dir):
    engine = Engine(llama_dir, kv_cache_tokens=2048)
    prompt = random_prompts([12], seed=5)[0]
    choices = ["a", "bb", "ccc", "dddd"]
    picks = [engine.choose(prompt, choices, temperature=5.0, seed=s).best for s in range(12)]
    assert set(picks) <= set(choices) and len(set(picks)) > 1  # high temperature: spread out
    assert picks == [engine.choose(prompt, choices, temperature=5.0, seed=s).best for s in range(12)]
    greedy = engine.choose(prompt, choices)
    assert greedy.best == greedy.ranked[0].choice
    with pytest.raises(BadRequestError):
        engine.choose(prompt, [])
    with pytest.raises(BadRequestError):
        engine.choose(prompt, choices, normalize="max")
    with pytest.raises(BadRequestError):
        engine.choose(prompt, ["a", ""])


def test_choose_over_the_sdk(llama_dir):
    """Router + worker path: the same scores as the offline engine; bad input answered with a code."""
    from radixserve.client import Client

    from serve_cluster import Cluster

    engine = Engine(llama_dir, kv_cache_tokens=4096)
    prompt = "You play White. Legal moves: e2e4 d2d4 g1f3. Your move:" * 4
    choices = [" e2e4", " d2d4", " g1f3", " a2a3"]
    offline = engine.choose(prompt, choices, normalize="mean")
    cluster = Cluster(llama_dir, 1)
    try:
        with Client(cluster.address, timeout=60) as c:
            first = c.choose(prompt, choices, normalize="mean")
            again = c.choose(prompt, choices, normalize="mean", temperature=2.0, seed=7)
            ids = c.choose(engine.tokenizer.encode(prompt), choices, normalize="mean")
            with pytest.raises(BadRequestError):
                c.choose(prompt, [])
            with pytest.raises(BadRequestError):
                c.choose(prompt, ["a"], normalize="median")
            counters = c.stats()["router"]["counters"]
    finally:
        cluster.stop()
    for got in (first, ids):
        assert [r.choice for r in got.ranked] == [r.choice for r in offline.ranked]
        for a, b in zip(got.ranked, offline.ranked):
            choice, lp_sum, lp_mean, n = a
            assert n == b.n_tokens and lp_sum == pytest.approx(b.logprob_sum, abs=1e-4)
        assert got.best == offline.best and got.worker
    n = first.usage.prompt_tokens
    assert first.usage.prompt_cached_tokens == 0 and again.usage.prompt_cached_tokens == n - 1
    assert again.usage.cached_tokens == (len(choices) + 1) * (n - 1)
    assert again.best in choices and again.ranked[0].choice == offline.ranked[0].choice
    assert counters["choose_requests"] == 3 and counters["errors_bad_request"] == 2

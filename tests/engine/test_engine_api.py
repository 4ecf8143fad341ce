"""The public API: sampling, stop conditions, logprobs, streaming, abort, bad input, stats."""

from __future__ import annotations

import asyncio

import pytest
import torch

from radixserve import BadRequestError, Engine, ModelLoadError, SamplingParams, TooLongError

from conftest import random_prompts


@pytest.fixture(scope="module")
def engine(llama_dir):
    return Engine(llama_dir, kv_cache_tokens=4096, debug_checks=True)


def test_text_and_token_prompts_agree(engine):
    text = "e2e4 is a fine opening move."
    ids = engine.tokenizer.encode(text)
    params = SamplingParams(max_tokens=5, temperature=0)
    a, b = engine.generate([text, ids], params)
    assert a.token_ids == b.token_ids and a.prompt_tokens == len(ids)
    assert a.text == engine.tokenizer.decode(a.token_ids, skip_special_tokens=True)


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine):
    prompt = random_prompts((30,), seed=2)[0]
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    alone = engine.generate([prompt], seeded)[0].token_ids
    others = random_prompts((5, 60, 17), seed=3)
    crowded = engine.generate([*others, prompt], [SamplingParams(max_tokens=12, temperature=1.0)] * 3 + [seeded])
    assert crowded[-1].token_ids == alone
    other_seed = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=99))[0]
    assert other_seed.token_ids != alone


def test_engine_seed_makes_unseeded_sampling_reproducible(llama_dir):
    prompts = random_prompts((10, 20), seed=4)
    params = SamplingParams(max_tokens=8, temperature=0.8)
    runs = [Engine(llama_dir, seed=5, kv_cache_tokens=2048).generate(prompts, params) for _ in range(2)]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]


def test_top_k_1_and_tiny_top_p_are_greedy(engine):
    prompt = random_prompts((25,), seed=5)[0]
    greedy = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0))[0].token_ids
    for params in (
        SamplingParams(max_tokens=6, top_k=1, seed=1),
        SamplingParams(max_tokens=6, top_p=1e-6, seed=1),
        SamplingParams(max_tokens=6, min_p=1.0, seed=1),
    ):
        assert engine.generate([prompt], params)[0].token_ids == greedy


def test_penalties_change_greedy_choice(engine):
    prompt = random_prompts((8,), seed=6)[0]
    plain = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0].token_ids
    penalised = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0, frequency_penalty=2.0, repetition_penalty=1.5))[0].token_ids
    assert penalised != plain
    assert len(set(penalised)) >= len(set(plain))


def test_logprobs_match_log_softmax(engine):
    from transformers import AutoModelForCausalLM

    prompt = random_prompts((12,), seed=7)[0]
    out = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0, logprobs=4))[0]
    hf = AutoModelForCausalLM.from_pretrained(engine.loaded.path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 :]
    expected = torch.log_softmax(logits, -1)
    assert len(out.logprobs) == 3
    for step, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[step]
        assert lp.logprob == pytest.approx(float(expected[step, lp.token_id]), abs=1e-4)
        top = torch.topk(expected[step], 4)
        assert [t for t, _ in lp.top] == top.indices.tolist()


def test_stop_token_ids_and_eos(engine):
    prompt = random_prompts((20,), seed=8)[0]
    free = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    stop_at = free[3]
    out = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == free[: free.index(stop_at) + 1] and out.finish_reason == "stop"


def test_stop_strings_cut_the_text(engine):
    prompt = "the knight moves"
    free = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    assert len(free.text) > 6
    stop = free.text[3:6]
    out = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.index(stop)]
    kept = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True))[0]
    assert kept.text == free.text[: free.text.index(stop) + len(stop)]


def test_max_tokens_past_the_context_is_refused_with_the_numbers(llama_dir):
    """Issue 49 item 2: max_tokens past what the context leaves was clipped without a word. The
    rule, as vLLM's: refused with the numbers; unset (None) generates until the context is full."""
    engine = Engine(llama_dir, max_model_len=64, kv_cache_tokens=1024)
    prompt = random_prompts((60,))[0]
    with pytest.raises(TooLongError) as info:
        engine.generate([prompt], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    assert info.value.field == "max_tokens" and info.value.code == "too_long"
    assert "50 + 60 prompt tokens exceeds the model's context (64 tokens); at most 4 fit" in str(info.value)
    for max_tokens in (4, None):
        out = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0]
        assert len(out.token_ids) == 4 and out.finish_reason == "length"
    small_pool = Engine(llama_dir, kv_cache_tokens=64)  # a pool smaller than the context bounds a request too
    with pytest.raises(TooLongError, match=r"KV pool \(raise kv_cache_tokens\) \(64 tokens\)"):
        small_pool.make_request(prompt, SamplingParams(max_tokens=5))


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ("", None, "prompt"),
        ([], None, "prompt"),
        ([5, 100000], None, "prompt"),
        ([5, -1], None, "prompt"),
        ([5, 7.0], None, "prompt"),
        ([5, "7"], None, "prompt"),
        ([5, None], None, "prompt"),
        ("hi", SamplingParams(max_tokens=0), "max_tokens"),
        ("hi", SamplingParams(temperature=-0.5), "temperature"),
        ("hi", SamplingParams(top_p=0.0), "top_p"),
        ("hi", SamplingParams(top_p=1.5), "top_p"),
        ("hi", SamplingParams(top_k=0), "top_k"),
        ("hi", SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
        ("hi", SamplingParams(logprobs=1000), "logprobs"),
    ],
)
def test_bad_input_names_the_field(engine, prompt, params, field):
    with pytest.raises(BadRequestError) as info:
        engine.generate([prompt], params)
    assert info.value.field == field
    # ...and the engine keeps serving.
    assert engine.generate(["still alive"], SamplingParams(max_tokens=2))[0].finish_reason == "length"


def test_too_long_prompt(llama_dir):
    engine = Engine(llama_dir, max_model_len=32, kv_cache_tokens=1024)
    with pytest.raises(TooLongError, match="32"):
        engine.generate([list(range(10, 42))])
    assert engine.generate([list(range(10, 41))], SamplingParams(max_tokens=1))[0].token_ids  # the one token that fits


def test_bad_model_directories(tmp_path, llama_dir):
    with pytest.raises(ModelLoadError, match="does not exist"):
        Engine(str(tmp_path / "nope"))
    import json
    import shutil

    other = tmp_path / "gpt2ish"
    shutil.copytree(llama_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    config["model_type"] = "gpt2"
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        Engine(str(other))


def test_bad_engine_settings(llama_dir):
    with pytest.raises(BadRequestError, match="page_size"):
        Engine(llama_dir, page_size=0)
    with pytest.raises(BadRequestError, match="dtype"):
        Engine(llama_dir, dtype="float8")


def test_stats_count_requests_and_tokens(llama_dir):
    engine = Engine(llama_dir, kv_cache_tokens=1000)
    engine.generate(random_prompts((10, 20), seed=9), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    stats = engine.stats()
    assert stats["requests"] == 2 and stats["prompt_tokens"] == 30 and stats["generated_tokens"] == 8
    assert stats["kv_total_tokens"] == 1000 and stats["running"] == stats["waiting"] == 0
    assert stats["kv_used_tokens"] == stats["kv_evictable_tokens"] > 0  # finished KV stays cached


def test_async_stream_and_abort(llama_dir):
    engine = Engine(llama_dir, kv_cache_tokens=2048)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = engine.generate(["stream me"], params)[0]

    async def main():
        chunks = [c async for c in engine.stream("stream me", params)]
        assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
        assert sum((c.token_ids for c in chunks), []) == expected.token_ids
        assert "".join(c.text for c in chunks) == expected.text

        long = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)  # near the tiny model's 1,024
        got = []
        async for chunk in engine.stream("abort me", long, request_id="victim"):
            got.append(chunk)
            if len(got) == 2:
                engine.abort("victim")
        assert got[-1].output.finish_reason == "abort" and len(got[-1].output.token_ids) < 1000

    try:
        asyncio.run(main())
        assert engine.generate(["after"], SamplingParams(max_tokens=2))[0].token_ids  # through the thread
    finally:
        engine.shutdown()
    engine.scheduler.check()


def test_static_batching_waits_for_the_whole_batch(llama_dir):
    prompts = random_prompts((10, 12, 14), seed=30)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (2, 9, 3)]
    static = Engine(llama_dir, kv_cache_tokens=2048, batching="static", max_running=2)
    continuous = Engine(llama_dir, kv_cache_tokens=2048, max_running=2)
    a, b = static.generate(prompts, params), continuous.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    # Continuous admits the third request as soon as the first (2 tokens) leaves; static waits for
    # the 9-token one, so the third request's first token comes ~7 decode steps later.
    assert static.stats()["steps"] > continuous.stats()["steps"]


def test_info_cache_events_and_cache_leaves(llama_dir):
    engine = Engine(llama_dir, kv_cache_tokens=64, debug_checks=True)
    info = engine.info()
    assert info["kv_capacity_tokens"] == 64 and info["page_size"] == 1 and info["prefix_cache"] is True
    assert info["model"] == str(engine.loaded.path) and info["attention"] == type(engine.runner.attention).__name__
    events = []
    engine.on_cache_event(events.append)
    a, b = random_prompts((40, 40), seed=21)
    engine.generate([a], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), namespace="t")
    assert events and all(e[:2] == ("insert", "t") for e in events) and events[-1][2][:40] == a
    assert engine.cache_leaves() == [("t", events[-1][2])]
    engine.generate([b], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # 64 tokens: evicts a
    assert any(e[0] == "evict" and e[1] == "t" for e in events)
    assert [ns for ns, _ in engine.cache_leaves()] == [None]
    engine.on_cache_event(None)
    n = len(events)
    engine.generate([a], SamplingParams(max_tokens=1, temperature=0.0))
    assert len(events) == n

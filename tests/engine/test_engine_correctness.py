"""The engine's greedy tokens equal transformers' generate (fp32, CPU) on every supported
architecture: plain, chunked prefill, paged KV, preemption, mixed batches, cache on and off."""

from __future__ import annotations

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.attention.metadata import build_metadata
from radixserve.attention.torch_backend import TorchAttention
from radixserve.model.llama import ForwardBatch, head_dim_of
from radixserve.testing import TINY_ARCHS

from conftest import hf_greedy, random_prompts

LENGTHS = (1, 2, 9, 37, 64, 130, 300)
NEW = 10
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)

ENGINE_SETUPS = {
    "plain": dict(),
    "chunked": dict(max_prefill_chunk=16),
    "mixed": dict(max_batched_tokens=40),  # decodes share every step with prefill chunks
    "page16": dict(page_size=16),
    "page16-chunked": dict(page_size=16, max_prefill_chunk=24),
    "tiny-pool": dict(kv_cache_tokens=360, max_prefill_chunk=32),
    "no-cache": dict(enable_prefix_cache=False),
}


@pytest.fixture(scope="module")
def references(tiny_models):
    prompts = random_prompts(LENGTHS, seed=1)
    return prompts, {arch: hf_greedy(tiny_models[arch], prompts, NEW) for arch in TINY_ARCHS}


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("setup", list(ENGINE_SETUPS))
def test_greedy_matches_transformers(tiny_models, references, arch, setup):
    prompts, refs = references
    setup = {"kv_cache_tokens": 4096, **ENGINE_SETUPS[setup]}
    engine = Engine(tiny_models[arch], debug_checks=True, **setup)
    outputs = engine.generate(prompts, GREEDY)
    for prompt, out, ref in zip(prompts, outputs, refs[arch]):
        assert out.token_ids == ref, f"prompt of {len(prompt)} tokens diverged"
        assert out.finish_reason == "length"
    if setup["kv_cache_tokens"] < 1000:
        assert engine.stats()["preemptions"] > 0, "the tiny pool was meant to force preemption"
    engine.scheduler.check()


def test_greedy_matches_after_cache_hits(tiny_models, references):
    """A second identical batch hits the cache (even mid-node) and must decode the same."""
    prompts, refs = references
    engine = Engine(tiny_models["qwen3"], debug_checks=True, page_size=4, kv_cache_tokens=4096)
    engine.generate(prompts, GREEDY)
    again = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in again] == refs["qwen3"]
    assert sum(o.cached_tokens for o in again) > 0.9 * sum(len(p) for p in prompts[1:])


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_prefill_logits_match_transformers(tiny_models, arch):
    """Logits at every prompt position, computed on top of a cached prefix, within 1e-4."""
    from transformers import AutoModelForCausalLM

    engine = Engine(tiny_models[arch], page_size=4, kv_cache_tokens=512)
    prompt = random_prompts([90], seed=3)[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]

    pages = engine.pool.alloc(-(-len(prompt) // 4))
    model = engine.loaded.model
    attention = TorchAttention(engine.pool, head_dim_of(model.config) ** -0.5)
    got = []
    for start, end in ((0, 41), (41, 90)):  # a prefix, then an extend on top of it
        attention.plan(build_metadata([pages], [end], [end - start], 4))
        batch = ForwardBatch(
            input_ids=torch.tensor(prompt[start:end]),
            positions=torch.arange(start, end),
            attention=attention,
            logits_rows=torch.arange(end - start),
        )
        got.append(model(batch))
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(tie_word_embeddings=True),
        dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=128)),
        dict(rope_theta=500000.0, num_key_value_heads=1),
    ],
    ids=["tied", "llama3-rope", "theta-mqa"],
)
def test_llama_variants_match(tmp_path, overrides):
    from radixserve.testing import make_tiny_model_dir

    model_dir = str(make_tiny_model_dir(tmp_path / "m", "llama", seed=11, **overrides))
    prompts = random_prompts((3, 150, 260), seed=4)
    ref = hf_greedy(model_dir, prompts, NEW)
    outputs = Engine(model_dir, max_prefill_chunk=64).generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == ref


def test_sharded_checkpoint_loads(tmp_path, llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(llama_dir).save_pretrained(sharded, max_shard_size="60KB")
    AutoTokenizer.from_pretrained(llama_dir).save_pretrained(sharded)
    assert (sharded / "model.safetensors.index.json").is_file()
    prompts = random_prompts((20, 70), seed=5)
    a = Engine(str(sharded)).generate(prompts, GREEDY)
    b = Engine(llama_dir).generate(prompts, GREEDY)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes_run(llama_dir, dtype):
    engine = Engine(llama_dir, dtype=dtype)
    assert engine.pool.k[0].dtype == getattr(torch, dtype)
    fp32 = Engine(llama_dir).generate(random_prompts((40,), seed=6), GREEDY)[0].token_ids
    half = engine.generate(random_prompts((40,), seed=6), GREEDY)[0].token_ids
    assert len(half) == NEW
    assert half[:2] == fp32[:2]  # low precision may drift later, not at once

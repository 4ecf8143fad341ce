"""The fused decode path (csrc/decode.cpp through radixserve/kernels/fused_decode.py) gives the same
logits as the layer-by-layer path, bit for bit, on every decode batch it takes (on the small-M
kernel, and on oneDNN where that is the GEMM for the batch); and models or batches it cannot take
fall back to the layers."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.kernels import attention, fused_decode, gemm
from radixserve.kernels import linear as lin
from radixserve.testing import make_tiny_model_dir

from conftest import random_prompts

TOOLCHAIN = shutil.which(os.environ.get("CXX", "c++")) is not None and not os.environ.get("RADIXSERVE_NO_EXT")
pytestmark = pytest.mark.skipif(not TOOLCHAIN, reason="no C++ compiler (or RADIXSERVE_NO_EXT)")
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
MODELS = {  # (arch, config overrides): biases on every linear layer, MQA, the qkv bias alone
    "llama": ("llama", {}),
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama-mqa": ("llama", dict(num_key_value_heads=1)),
    "qwen2": ("qwen2", {}),
    "mistral": ("mistral", {}),
}


def _needs_kernel(monkeypatch, dtype: torch.dtype) -> None:
    """Skip where the small-M kernel does not take ``dtype``. fp32 takes it only where oneDNN is
    the fp32 GEMM, which ``gemm_backend`` chooses by timing it against MKL: under load either may
    win, and the fp32 cases then skipped now and then. So fp32 is pinned to oneDNN wherever torch
    has it, on copies of the modules' decisions that the test's end puts back (a later test must
    not meet a row limit derived from a backend it did not choose)."""
    if dtype == torch.float32 and gemm.has_onednn_ops(dtype):
        monkeypatch.setattr(gemm, "_state", {**gemm._state, ("gemm", dtype): "onednn"})
        if lin.kernel() is not None:  # (the row limit is derived from the backend)
            limits = {k: v for k, v in lin._state["limits"].items() if k != dtype}
            monkeypatch.setattr(lin, "_state", {**lin._state, "limits": limits})
    if lin.max_rows(dtype) < 1:
        pytest.skip(f"the small-M linear kernel does not take {dtype} on this CPU (the fused path is off)")


def _randomize_vectors(engine: Engine) -> None:
    """Random biases and norm weights, the same for every engine of one checkpoint (the tiny
    checkpoints have zero biases and unit norms, which would hide a bias or norm left out)."""
    g = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for _, p in sorted(engine.runner.model.named_parameters(), key=lambda kv: kv[0]):
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))


def _run(model_dir: str, dtype: str, prompts, monkeypatch, fused: bool, *, cached: list[int] | None = None, **options) -> tuple[list, list, Engine]:
    """Token ids and every step's logits of a greedy run, with the fused path on or off;
    ``cached``: a prompt prefilled first, so that prompts starting with it hit the cache."""
    if fused:
        monkeypatch.delenv(fused_decode.ENV, raising=False)
    else:
        monkeypatch.setenv(fused_decode.ENV, "0")
    engine = Engine(model_dir, dtype=dtype, attention="cpu", **{"kv_cache_tokens": 2048, **options})
    _randomize_vectors(engine)
    if cached is not None:
        engine.generate([cached], SamplingParams(max_tokens=1, temperature=0.0))
    logits: list[torch.Tensor] = []
    engine.runner.model.register_forward_hook(lambda module, args, out: logits.append(out.clone()))
    outputs = engine.generate(prompts, GREEDY)
    return [o.token_ids for o in outputs], logits, engine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_fused_decode_equals_layer_by_layer(tmp_path, monkeypatch, name, dtype):
    _needs_kernel(monkeypatch, getattr(torch, dtype))
    arch, overrides = MODELS[name]
    model_dir = str(make_tiny_model_dir(tmp_path / name, arch, seed=3, **overrides))
    # batch 1 and 2 on the small-M kernel; 6 on oneDNN where it is the GEMM for that batch (more
    # rows than the kernel takes in fp32 and in bf16 without AMX), else layer by layer
    for prompts in (random_prompts((9,), seed=1), random_prompts((5, 40), seed=2), random_prompts((3, 8, 13, 21, 34, 55), seed=3)):
        tokens, logits, engine = _run(model_dir, dtype, prompts, monkeypatch, fused=True)
        want_tokens, want_logits, reference = _run(model_dir, dtype, prompts, monkeypatch, fused=False)
        qkv = engine.runner.model.model.layers[0].self_attn.qkv_proj
        rows = len(prompts)
        with torch.inference_mode():  # (as the engine's forward runs)
            onednn = lin.prepacked_weight(rows, qkv.weight, qkv.bias, qkv.packed) is not None
        fusable = rows <= lin.max_rows(qkv.weight.dtype) or onednn
        if fusable:
            assert engine.runner.model.fused_decode.batches >= GREEDY.max_tokens - 1  # every decode step
        else:
            assert engine.runner.model.fused_decode.batches == 0
        assert reference.runner.model.fused_decode.batches == 0
        assert tokens == want_tokens
        assert len(logits) == len(want_logits)
        for step, (got, want) in enumerate(zip(logits, want_logits)):
            assert torch.equal(got, want), f"step {step}: max difference {(got - want).abs().max().item()}"


@pytest.mark.parametrize("name", ["llama", "llama-biases"])
def test_fused_decode_on_the_amx_gemm_equals_layer_by_layer(tmp_path, monkeypatch, name):
    """bf16 decode batches beyond the kernel's rows run fused over the AMX GEMM's packed weights
    (csrc/decode.cpp calls amx_linear, as linear() does layer by layer): the same logits."""
    if gemm.gemm_backend(torch.bfloat16) != "amx" or not torch.ops.radixserve_linear.supports_amx_gemm():
        pytest.skip("no AMX GEMM here")
    arch, overrides = MODELS[name]
    model_dir = str(make_tiny_model_dir(tmp_path / name, arch, seed=3, **overrides))
    prompts = random_prompts(tuple(3 + i % 7 for i in range(40)), seed=4)
    tokens, logits, engine = _run(model_dir, "bfloat16", prompts, monkeypatch, fused=True)
    want_tokens, want_logits, _ = _run(model_dir, "bfloat16", prompts, monkeypatch, fused=False)
    qkv = engine.runner.model.model.layers[0].self_attn.qkv_proj
    with torch.inference_mode():
        packed = lin.prepacked_weight(40, qkv.weight, qkv.bias, qkv.packed)
    assert packed is not None and packed.dim() == 4  # the AMX GEMM's tiles, not oneDNN's copy
    assert engine.runner.model.fused_decode.batches >= GREEDY.max_tokens - 1
    assert tokens == want_tokens
    for step, (got, want) in enumerate(zip(logits, want_logits, strict=True)):
        assert torch.equal(got, want), f"step {step}: max difference {(got - want).abs().max().item()}"


def _assert_grouped_decodes_fused(model_dir: str, dtype: str, prompts, shared: list[int], monkeypatch) -> list:
    """Greedy runs fused and layer by layer with ``shared`` cached and cascade groups on: the
    decodes ran in a group and every decode step fused, with the same tokens and, step by step,
    bit-identical logits. Returns the tokens."""
    grouped = dict(cached=shared, kv_cache_tokens=4096, cascade_min_shared_tokens=8)
    tokens, logits, engine = _run(model_dir, dtype, prompts, monkeypatch, fused=True, **grouped)
    want_tokens, want_logits, reference = _run(model_dir, dtype, prompts, monkeypatch, fused=False, **grouped)
    assert engine.stats()["cascade_steps"] >= GREEDY.max_tokens - 1  # the decodes did run in a group
    assert engine.runner.model.fused_decode.batches >= GREEDY.max_tokens - 1  # every decode step, fused
    assert reference.runner.model.fused_decode.batches == 0
    assert tokens == want_tokens
    for step, (got, want) in enumerate(zip(logits, want_logits, strict=True)):
        assert torch.equal(got, want), f"step {step}: max difference {(got - want).abs().max().item()}"
    return tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["llama", "llama-biases", "llama-mqa"])
def test_fused_decode_of_cascade_groups_equals_layer_by_layer(tmp_path, monkeypatch, name, dtype):
    """Decodes that are all in cascade groups run fused too (each layer also attends to the
    shared prefix and merges, in csrc/decode.cpp), with the layer-by-layer path's logits."""
    _needs_kernel(monkeypatch, getattr(torch, dtype))
    arch, overrides = MODELS[name]
    model_dir = str(make_tiny_model_dir(tmp_path / name, arch, seed=3, **overrides))
    shared = random_prompts((70,), seed=7)[0]
    tails = random_prompts((3, 9, 5), seed=8)  # 3 rows: the kernel's, in every dtype it takes
    prompts = [shared + tail for tail in tails]
    _assert_grouped_decodes_fused(model_dir, dtype, prompts, shared, monkeypatch)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_of_groups_and_ungrouped_decodes_equals_layer_by_layer(tmp_path, monkeypatch, dtype):
    """Decodes in a cascade group followed by decodes in none (a GSP batch's straggler from
    another group) run fused too: one decode-kernel call over the members' suffixes and the
    others' whole contexts, the prefix level and merge for the grouped rows only; the same logits
    as layer by layer, and the same tokens as the torch backend."""
    _needs_kernel(monkeypatch, getattr(torch, dtype))
    arch, overrides = MODELS["llama"]
    model_dir = str(make_tiny_model_dir(tmp_path / "llama", arch, seed=3, **overrides))
    shared = random_prompts((70,), seed=7)[0]
    prompts = [shared + tail for tail in random_prompts((3, 9), seed=8)] + random_prompts((12,), seed=9)
    tokens = _assert_grouped_decodes_fused(model_dir, dtype, prompts, shared, monkeypatch)
    if dtype == "float32":  # the combined path against the plain-torch attention oracle
        oracle = Engine(model_dir, dtype=dtype, attention="torch", kv_cache_tokens=4096)
        _randomize_vectors(oracle)
        assert [o.token_ids for o in oracle.generate(prompts, GREEDY)] == tokens


def test_models_it_cannot_take_run_layer_by_layer(tmp_path, monkeypatch, tiny_models):
    """QK norm (Qwen3) and forward hooks on a layer (tensor parallelism's all-reduce) keep the
    layers; so do batches too large for the small-M kernel (a prefill)."""
    _needs_kernel(monkeypatch, torch.float32)
    prompts = random_prompts((6, 11), seed=4)
    qwen3 = Engine(tiny_models["qwen3"], kv_cache_tokens=2048, attention="cpu")
    qwen3.generate(prompts, GREEDY)
    assert qwen3.runner.model.fused_decode.batches == 0

    llama = Engine(tiny_models["llama"], kv_cache_tokens=2048, attention="cpu")
    _randomize_vectors(llama)
    seen = []
    llama.runner.model.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    hooked = [o.token_ids for o in llama.generate(prompts, GREEDY)]
    assert llama.runner.model.fused_decode.batches == 0
    assert len(seen) == GREEDY.max_tokens  # the hook ran at every step: prefill and each decode
    plain, _, engine = _run(tiny_models["llama"], "float32", prompts, monkeypatch, fused=True)
    assert hooked == plain
    assert engine.runner.model.fused_decode.batches == GREEDY.max_tokens - 1  # decodes only, not the prefill


def test_decode_weights_refuse_malformed_lists():
    """``DecodeWeights`` (decode_layers' weights, taken apart once) names what is wrong with its
    lists rather than reading past them at a later step."""
    ops = attention.ops()
    if ops is None:
        pytest.skip("the CPU extension is not built")
    params = [torch.ones(4)] * 10
    ops.decode_weights(params, [])  # one dense layer
    with pytest.raises(RuntimeError, match="10 parameters per layer"):
        ops.decode_weights(params[:9], [])
    dense = torch.tensor([0])
    with pytest.raises(RuntimeError, match="int64 .parts, impl, qtypes"):
        ops.decode_weights(params, [torch.tensor([0.0])] * 4)
    with pytest.raises(RuntimeError, match="quant ends inside a linear layer's parts"):
        ops.decode_weights(params, [dense] * 3 + [torch.tensor([1, 4, 2])])
    with pytest.raises(RuntimeError, match="quant has more tensors"):
        ops.decode_weights(params, [dense] * 5)


def test_decode_layers_refuse_a_bad_batch_before_writing_anything():
    """``decode_layers`` checks a batch once, before its first layer (its loop then writes the
    caches through raw pointers): a slot outside the caches, caches of different shapes or RoPE
    tables of the wrong shape are refused with the cache and the residual stream untouched."""
    ops = attention.ops()
    if ops is None:
        pytest.skip("the CPU extension is not built")
    g = torch.Generator().manual_seed(0)
    hidden, heads, kv_heads, dim, inter, layers = 32, 2, 1, 16, 24, 2

    def w(*shape):
        return 0.1 * torch.randn(*shape, generator=g)

    none = torch.empty(0)
    params = []
    for _ in range(layers):
        params += [1 + w(hidden), w((heads + 2 * kv_heads) * dim, hidden), none, w(hidden, heads * dim), none]
        params += [1 + w(hidden), w(2 * inter, hidden), none, w(hidden, inter), none]
    weights = ops.decode_weights(params, [])
    pages, page_size = 4, 16
    caches = [torch.zeros(pages, page_size, kv_heads, dim) for _ in range(2 * layers)]
    x = w(1, hidden)
    cos, sin = torch.ones(1, dim // 2), torch.zeros(1, dim // 2)
    meta = [
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([2], dtype=torch.int32),
        torch.tensor([6], dtype=torch.int32),
    ]

    def call(slot, k_caches=caches[:layers], cos=cos, x=x):
        slots = torch.tensor([slot])
        return ops.decode_layers(weights, x, [], k_caches, caches[layers:], cos, sin, slots, *meta, heads, kv_heads, dim, 1e-5, dim**-0.5, [])

    before = x.clone()
    for bad, match in (
        (dict(slot=pages * page_size), "outside the caches"),
        (dict(slot=-1), "outside the caches"),
        (dict(slot=37, k_caches=[caches[0], torch.zeros(pages + 1, page_size, kv_heads, dim)]), "one shape and dtype"),
        (dict(slot=37, cos=torch.ones(1, dim)), "cos and sin must be"),
    ):
        with pytest.raises(RuntimeError, match=match):
            call(**bad)
        assert torch.equal(x, before) and all(not c.any() for c in caches)
    out = call(37)  # slot 37: page 2, offset 5 (the context's sixth token)
    assert out.shape == (1, hidden) and not torch.equal(x, before)
    for c in caches:
        assert c.view(-1, kv_heads * dim)[37].any() and not c.view(-1, kv_heads * dim)[:37].any()


def test_roofline_against_another_build_alternates_fused_steps(llama_dir, capsys, monkeypatch):
    """``bench roofline --against DIR``: DIR's decode_layers (here this checkout's csrc/, built again
    under names of its own, as ``bench kernels --against`` builds it) takes every other fused step,
    and the run reports both medians and the median ratio of adjacent steps."""
    import argparse
    import json
    from pathlib import Path

    from bench import roofline

    _needs_kernel(monkeypatch, torch.float32)
    csrc = str(Path(__file__).resolve().parents[2] / "csrc")
    parser = argparse.ArgumentParser()
    roofline.add_arguments(parser)
    args = parser.parse_args(["--model", llama_dir, "--context", "8", "--steps", "4", "--buffer-mib", "8", "--against", csrc, "--json"])
    assert roofline.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["fused_layers"] and result["against_fused"] and result["against"] == csrc
    assert result["decode_step_against_ms"] > 0 and result["against_over_this"] > 0 and result["against_pairs"] == 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_roofline_batch_times_fused_and_layer_steps(llama_dir, capsys, dtype):
    """``bench roofline --batch N``: N requests decode together; where their layers run in one
    call (on the small-M kernel, or on oneDNN beyond its rows) the steps alternate with layer-by-layer ones.
    ``--fragment`` (half the KV pool held, half freed in no order first) leaves room to run."""
    import argparse
    import json

    from bench import roofline

    parser = argparse.ArgumentParser()
    roofline.add_arguments(parser)
    args = parser.parse_args(
        ["--model", llama_dir, "--dtype", dtype, "--batch", "6", "--context", "8", "--steps", "3", "--buffer-mib", "8", "--fragment", "--json"]
    )
    assert roofline.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["batch"] == 6 and result["decode_step_ms"] > 0 and result["fragment"]
    engine = Engine(llama_dir, dtype=dtype, kv_cache_tokens=512)
    qkv = engine.runner.model.model.layers[0].self_attn.qkv_proj
    with torch.inference_mode():
        onednn = lin.prepacked_weight(6, qkv.weight, qkv.bias, qkv.packed) is not None
    fused = 6 <= lin.max_rows(getattr(torch, dtype)) or onednn  # (the kernel takes 6 bf16 rows with AMX)
    assert result["fused_layers"] == fused
    assert ("decode_step_layers_ms" in result) == fused

"""The small-M linear kernel (csrc/linear.cpp) equals F.linear computed in fp32 on the same bf16/fp16
inputs; radixserve.model.linear dispatches to it only where it applies and falls back otherwise."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from radixserve.attention import cpu_ext
from radixserve.model import linear as lin

ext = cpu_ext.load()
TOOLCHAIN = shutil.which(os.environ.get("CXX", "c++")) is not None and not os.environ.get("RADIXSERVE_NO_EXT")
needs_ext = pytest.mark.skipif(ext is None and not TOOLCHAIN,
                               reason="no C++ compiler (or RADIXSERVE_NO_EXT set): the CPU kernels cannot build")


def op():
    k = lin.kernel()
    assert k is not None, "the extension built but torch.ops.radixserve_linear is missing"
    return k


def supported(dtype) -> bool:
    op()
    return lin.max_rows(dtype) > 0


def impls(dtype) -> list[int]:
    """Kernel paths to test: 1 (AVX-512) always, 2 (AMX) for bf16 where the CPU has it."""
    amx = dtype == torch.bfloat16 and torch.ops.radixserve_linear.supports_amx()
    return [1, 2] if amx else [1]


def reference(x, w, b):
    """F.linear in fp32 arithmetic on the (bf16/fp16) inputs: the kernel's own precision."""
    return F.linear(x.float(), w.float(), None if b is None else b.float())


def check(y, ref, dtype, fp32_out):
    if fp32_out:
        assert y.dtype == torch.float32
        # fp32 sums of exact products; only the summation order differs
        torch.testing.assert_close(y, ref, atol=1e-3, rtol=1e-4)
    else:
        assert y.dtype == dtype
        # one rounding of the fp32 result to the output dtype
        torch.testing.assert_close(y, ref.to(dtype), atol=1e-2, rtol=1.6e-2 if dtype == torch.bfloat16 else 2e-3)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp32_out", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_fp32_linear_every_row_count_and_tails(dtype, fp32_out, bias):
    if not supported(dtype):
        pytest.skip(f"this CPU has no kernel for {dtype}")
    g = torch.Generator().manual_seed(0)
    # K: below one vector, a vector + odd tail, exact multiples, long with a tail; N: tails of 1..3
    # (AVX-512 tiles of 4) and of up to 15 (AMX tiles of 16)
    shapes = [(7, 5), (33, 17), (64, 16), (96, 35), (511, 67), (1030, 19)]
    for m in sorted(set(range(1, 18)) | {lin.MAX_ROWS_VECTOR + 1, lin.MAX_ROWS, lin.MAX_ROWS + 1, 31, 32, 33}):
        for k, n in shapes:
            x = torch.randn(m, k, generator=g).to(dtype)
            w = torch.randn(n, k, generator=g).to(dtype)
            b = torch.randn(n, generator=g).to(dtype) if bias else None
            ref = reference(x, w, b)
            check(op()(x, w, b, fp32_out), ref, dtype, fp32_out)  # the automatic choice
            for impl in impls(dtype):
                if impl == 2 and m > 32:
                    with pytest.raises(RuntimeError, match="AMX path"):
                        op()(x, w, b, fp32_out, impl)
                    continue
                check(op()(x, w, b, fp32_out, impl), ref, dtype, fp32_out)


@needs_ext
def test_kernel_strided_rows_and_weight_rows():
    """Rows of x and of W may be strided (views into wider buffers); values beyond K are not read."""
    g = torch.Generator().manual_seed(1)
    xb = torch.randn(5, 100, generator=g).bfloat16()
    wb = torch.randn(21, 80, generator=g).bfloat16()
    x, w = xb[:, 3:70], wb[:, 1:68]
    assert not x.is_contiguous() and not w.is_contiguous()
    for impl in impls(torch.bfloat16):
        check(op()(x, w, None, True, impl), reference(x, w, None), torch.bfloat16, True)
    # poison what lies between the rows: a read past K would turn into inf/nan
    xb[:, 70:] = float("inf")
    wb[:, 68:] = float("nan")
    for impl in impls(torch.bfloat16):
        check(op()(x, w, None, True, impl), reference(x, w, None), torch.bfloat16, True)


@needs_ext
def test_kernel_refuses_bad_input_clearly():
    x = torch.randn(2, 8).bfloat16()
    w = torch.randn(3, 8).bfloat16()
    with pytest.raises(RuntimeError, match="last dimension"):
        op()(torch.randn(8, 2).bfloat16().t(), w, None, False)  # transposed x: columns not contiguous
    with pytest.raises(RuntimeError, match="last dimension"):
        op()(x, torch.randn(8, 3).bfloat16().t(), None, False)
    with pytest.raises(RuntimeError, match="weight is"):
        op()(x, w.float(), None, False)
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        op()(x.float(), w.float(), None, False)
    with pytest.raises(RuntimeError, match="K=8"):
        op()(x, torch.randn(3, 9).bfloat16(), None, False)
    with pytest.raises(RuntimeError, match="bias"):
        op()(x, w, torch.zeros(4).bfloat16(), False)
    with pytest.raises(RuntimeError, match="bias must be float32 or"):
        op()(x, w, torch.zeros(3).half(), False)
    with pytest.raises(RuntimeError, match=r"\[M, K\]"):
        op()(x[None], w, None, False)
    with pytest.raises(RuntimeError, match="impl"):
        op()(x, w, None, False, 3)


@needs_ext
def test_linear_dispatch_uses_the_kernel_only_where_it_applies(monkeypatch):
    calls = []
    real = op()

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setitem(lin._state, "op", spy)
    layer = lin.Linear(48, 40, bias=True).bfloat16()
    g = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        rows = lin.max_rows(torch.bfloat16)
        assert rows >= 1
        for shape in [(48,), (1, 48), (rows, 48), (1, 1, 48), (1, rows, 48)]:
            x = torch.randn(*shape, generator=g).bfloat16()
            y = layer(x)
            assert y.shape == (*shape[:-1], 40) and y.dtype == torch.bfloat16
            check(y.reshape(-1, 40), reference(x.reshape(-1, 48), layer.weight, layer.bias), torch.bfloat16, False)
        assert len(calls) == 5
        # a strided last dimension: made contiguous, same answer
        xt = torch.randn(1, 96, generator=g).bfloat16()[:, ::2]
        assert xt.stride(-1) == 2
        check(layer(xt), reference(xt, layer.weight, layer.bias), torch.bfloat16, False)
        assert len(calls) == 6
        # too many rows, fp32, autograd: F.linear
        layer(torch.randn(lin.max_rows(torch.bfloat16) + 1, 48).bfloat16())
        layer.float()(torch.randn(2, 48))
        assert len(calls) == 6
    x = torch.randn(2, 48, requires_grad=True).bfloat16()
    layer.bfloat16()(x).sum().backward()
    assert len(calls) == 6
    # logits: through the kernel for bf16, rounded to bf16 as F.linear's are (so greedy ties do not
    # depend on which path the batch size picked), then fp32; fp32_out keeps the kernel's fp32 sums
    emb = torch.randn(300, 48).bfloat16()
    h = torch.randn(1, 48).bfloat16()
    with torch.inference_mode():
        out = lin.logits(h, emb)
        sums = lin.linear(h, emb, fp32_out=True)
    assert out.dtype == torch.float32 and sums.dtype == torch.float32 and len(calls) == 8
    torch.testing.assert_close(sums, reference(h, emb, None), atol=1e-3, rtol=1e-4)
    assert torch.equal(out, sums.bfloat16().float())


def test_fallback_without_the_extension(monkeypatch):
    """With the extension unavailable (RADIXSERVE_NO_EXT, no compiler) every call is F.linear."""
    monkeypatch.setattr(lin, "_state", {})
    monkeypatch.setattr(cpu_ext, "_state", {})
    monkeypatch.setenv("RADIXSERVE_NO_EXT", "1")
    layer = lin.Linear(24, 10).bfloat16()
    x = torch.randn(2, 24).bfloat16()
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        emb = torch.randn(50, 24).bfloat16()
        out = lin.logits(x, emb)
        assert out.dtype == torch.float32 and torch.equal(out, F.linear(x, emb).float())
    assert lin._state["op"] is None


def test_fp32_is_always_f_linear(monkeypatch):
    """fp32 stays on MKL and never even loads the extension."""
    monkeypatch.setattr(lin, "_state", {})
    layer = lin.Linear(24, 10)
    x = torch.randn(1, 24)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        assert torch.equal(lin.logits(x, layer.weight), F.linear(x, layer.weight))
    assert "op" not in lin._state


def test_state_dict_is_nn_linears():
    a = torch.nn.Linear(16, 8)
    b = lin.Linear(16, 8)
    b.load_state_dict(a.state_dict())
    assert list(b.state_dict()) == ["weight", "bias"] and isinstance(b, torch.nn.Linear)
    assert torch.equal(b.weight, a.weight)


@needs_ext
def test_bf16_engine_tokens_mostly_equal_the_f_linear_path(llama_dir, monkeypatch):
    """bf16 greedy tokens with the kernel vs with F.linear: the sums are added in another order,
    so near-ties may flip; most requests must agree token for token (measured: 10 of 12 here,
    before the logits were rounded alike on both paths)."""
    from conftest import random_prompts

    from radixserve import Engine, SamplingParams

    prompts = random_prompts([40, 9, 70, 25, 13, 55, 31, 18, 60, 5, 44, 21], seed=3)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    real = op()
    calls = []

    def spy(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setitem(lin._state, "op", spy)
    with_kernel = [o.token_ids for o in Engine(llama_dir, dtype="bfloat16", kv_cache_tokens=4096).generate(prompts, params)]
    assert calls and max(calls) <= lin.max_rows(torch.bfloat16), "the bf16 decode steps did not use the kernel"
    monkeypatch.setitem(lin._state, "op", None)
    without = [o.token_ids for o in Engine(llama_dir, dtype="bfloat16", kv_cache_tokens=4096).generate(prompts, params)]
    same = sum(a == b for a, b in zip(with_kernel, without))
    tokens = sum(x == y for a, b in zip(with_kernel, without) for x, y in zip(a, b))
    assert same >= 8 and tokens >= 0.85 * 12 * 16, (same, tokens)


def test_roofline_bench_runs_the_ab_and_the_gemv_table(llama_dir, capsys):
    import argparse
    import json

    from bench import roofline

    parser = argparse.ArgumentParser()
    roofline.add_arguments(parser)
    args = parser.parse_args(["--model", llama_dir, "--dtype", "bfloat16", "--context", "8", "--steps", "3",
                              "--buffer-mib", "8", "--gemv", "--gemv-rows", "1,3", "--gemv-mib", "1", "--json"])
    assert roofline.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["decode_step_ms"] > 0 and result["floor_ms"] > 0
    assert len(result["gemv"]) == 7 * 2 and all(r["torch_ms"] > 0 and r["torch_fp32_gb_s"] > 0 for r in result["gemv"])
    if lin.kernel() is not None:
        assert result["linear"] == "kernel" and result["decode_step_f_linear_ms"] > 0
        assert all(r["kernel_ms"] > 0 and r["dispatched"] for r in result["gemv"])

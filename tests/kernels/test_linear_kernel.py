"""The small-M linear kernel (csrc/linear.cpp) equals F.linear computed in fp32 on the same bf16/fp16/fp32
inputs; radixserve.kernels.linear dispatches to it only where it applies and falls back otherwise."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from radixserve.kernels import build, gemm
from radixserve.kernels import linear as lin
from radixserve.kernels import packed as packing

ext = build.load()
TOOLCHAIN = shutil.which(os.environ.get("CXX", "c++")) is not None and not os.environ.get("RADIXSERVE_NO_EXT")
needs_ext = pytest.mark.skipif(ext is None and not TOOLCHAIN, reason="no C++ compiler (or RADIXSERVE_NO_EXT set): the CPU kernels cannot build")


def op():
    k = lin.kernel()
    assert k is not None, "the extension built but torch.ops.radixserve_linear is missing"
    return k


def supported(dtype) -> bool:
    """The op has a path for ``dtype`` on this CPU (whether or not linear() dispatches to it)."""
    op()
    if dtype == torch.float32:
        return torch.ops.radixserve_linear.supports_fp32()
    return lin.max_rows(dtype) > 0


def impls(dtype) -> list[int]:
    """Kernel paths to test: 1 (vector: AVX-512 or AVX2) always, 2 (AMX) for bf16 where the CPU has it."""
    amx = dtype == torch.bfloat16 and torch.ops.radixserve_linear.supports_amx()
    return [1, 2] if amx else [1]


def spy_onednn(monkeypatch) -> list[int]:
    """Record the row count of every oneDNN product (radixserve.kernels.gemm.onednn_linear)."""
    rows: list[int] = []
    real = gemm.onednn_linear

    def spy(x, p, b):
        rows.append(x.numel() // x.shape[-1])
        return real(x, p, b)

    monkeypatch.setattr(gemm, "onednn_linear", spy)
    return rows


def pin_gemm(monkeypatch, dtype, backend: str) -> None:
    """Make ``backend`` the GEMM of ``dtype`` for one test, dropping the kernel's row limit that was
    derived from the previous backend (fp32's depends on it)."""
    monkeypatch.setitem(gemm._state, ("gemm", dtype), backend)
    if lin.kernel() is not None:
        monkeypatch.delitem(lin._state["limits"], dtype, raising=False)


def reference(x, w, b):
    """F.linear in fp32 arithmetic on the (bf16/fp16) inputs: the kernel's own precision."""
    return F.linear(x.float(), w.float(), None if b is None else b.float())


def check(y, ref, dtype, fp32_out):
    if fp32_out or dtype == torch.float32:
        assert y.dtype == torch.float32
        # fp32 sums of exact products; only the summation order differs
        torch.testing.assert_close(y, ref, atol=1e-3, rtol=1e-4)
    else:
        assert y.dtype == dtype
        # one rounding of the fp32 result to the output dtype
        torch.testing.assert_close(y, ref.to(dtype), atol=1e-2, rtol=1.6e-2 if dtype == torch.bfloat16 else 2e-3)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fp32_out", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_fp32_linear_every_row_count_and_tails(dtype, fp32_out, bias):
    if not supported(dtype):
        pytest.skip(f"this CPU has no kernel for {dtype}")
    g = torch.Generator().manual_seed(0)
    # K: below one vector, a vector + odd tail, exact multiples, long with a tail; N: tails of 1..3
    # (AVX-512 tiles of 4) and of up to 15 (AMX tiles of 16)
    shapes = [(7, 5), (33, 17), (64, 16), (96, 35), (511, 67), (1030, 19)]
    for m in sorted(set(range(1, 18)) | {gemm.MAX_ROWS_VECTOR + 1, gemm.MAX_ROWS, gemm.MAX_ROWS + 1, 31, 32, 33}):
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
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_strided_rows_and_weight_rows(dtype):
    """Rows of x and of W may be strided (views into wider buffers); values beyond K are not read."""
    if not supported(dtype):
        pytest.skip(f"this CPU has no kernel for {dtype}")
    g = torch.Generator().manual_seed(1)
    xb = torch.randn(5, 100, generator=g).to(dtype)
    wb = torch.randn(21, 80, generator=g).to(dtype)
    x, w = xb[:, 3:70], wb[:, 1:68]
    assert not x.is_contiguous() and not w.is_contiguous()
    for impl in impls(dtype):
        check(op()(x, w, None, True, impl), reference(x, w, None), dtype, True)
    # poison what lies between the rows: a read past K would turn into inf/nan
    xb[:, 70:] = float("inf")
    wb[:, 68:] = float("nan")
    for impl in impls(dtype):
        check(op()(x, w, None, True, impl), reference(x, w, None), dtype, True)


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
    with pytest.raises(RuntimeError, match="bfloat16, float16 or float32 only"):
        op()(x.double(), w.double(), None, False)
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
        # too many rows, fp32 beyond fp32's limit (0 where fp32 stays on MKL), autograd: F.linear
        layer(torch.randn(lin.max_rows(torch.bfloat16) + 1, 48).bfloat16())
        layer.float()(torch.randn(lin.max_rows(torch.float32) + 1, 48))
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
    monkeypatch.setattr(gemm, "_state", {})
    monkeypatch.setattr(packing, "_state", {})
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setenv("RADIXSERVE_NO_EXT", "1")
    layer = lin.Linear(24, 10).bfloat16()
    x = torch.randn(2, 24).bfloat16()
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        emb = torch.randn(50, 24).bfloat16()
        out = lin.logits(x, emb)
        assert out.dtype == torch.float32 and torch.equal(out, F.linear(x, emb).float())
    assert lin._state["op"] is None


def test_fp32_few_rows_is_always_f_linear_with_mkl(monkeypatch):
    """With MKL as the fp32 GEMM (RADIXSERVE_CPU_GEMM=mkl, or what auto chooses on most CPUs), fp32
    below PACKED_MIN_ROWS stays on F.linear (the kernel's fp32 path was measured against oneDNN
    only) and packs nothing."""
    monkeypatch.setattr(lin, "_state", {})
    monkeypatch.setattr(gemm, "_state", {})
    monkeypatch.setattr(packing, "_state", {})
    monkeypatch.setenv("RADIXSERVE_CPU_GEMM", "mkl")
    layer = lin.Linear(24, 10)
    x = torch.randn(gemm.PACKED_MIN_ROWS - 1, 24)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        assert torch.equal(lin.logits(x, layer.weight, lin.PackedWeight()), F.linear(x, layer.weight))
    assert "packed" not in gemm._state and "policy" not in gemm._state
    assert gemm.gemm_backend(torch.float32) == "mkl" and lin.max_rows(torch.float32) == 0


def test_state_dict_is_nn_linears():
    a = torch.nn.Linear(16, 8)
    b = lin.Linear(16, 8)
    b.load_state_dict(a.state_dict())
    assert list(b.state_dict()) == ["weight", "bias"] and isinstance(b, torch.nn.Linear)
    assert torch.equal(b.weight, a.weight)


@needs_ext
def test_bf16_engine_tokens_mostly_equal_the_f_linear_path(llama_dir, monkeypatch):
    """bf16 greedy tokens with the fast paths (the small-M kernel; with AMX the AMX GEMM, which
    takes this model's weights at every row count; without AMX also the widened packed GEMM) vs
    with F.linear everywhere: the sums are added in another order, so near-ties may flip; most
    requests must agree token for token (measured: 10 of 12 here, before the logits were rounded
    alike on both paths)."""
    from radixserve import Engine, SamplingParams

    from conftest import random_prompts

    prompts = random_prompts([40, 9, 70, 25, 13, 55, 31, 18, 60, 5, 44, 21], seed=3)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    real = op()
    calls = []

    def spy(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setitem(lin._state, "op", spy)
    widened = _Spy(packed())
    monkeypatch.setitem(gemm._state, "packed", widened)
    onednn_rows = spy_onednn(monkeypatch)
    with_kernel = [o.token_ids for o in Engine(llama_dir, dtype="bfloat16", kv_cache_tokens=4096).generate(prompts, params)]
    assert all(n <= lin.max_rows(torch.bfloat16) for n in calls)
    if gemm.gemm_backend(torch.bfloat16) == "amx" and torch.ops.radixserve_linear.supports_amx_gemm():
        # every product on the AMX GEMM (the tiny model's sizes are multiples of 32): prefills and
        # the 12-row decode steps (layer by layer for the logits; decode.cpp for the layers)
        assert not calls and 12 in widened.calls and max(widened.calls) > gemm.MAX_ROWS, widened.calls[:20]
    elif lin.max_rows(torch.bfloat16) >= len(prompts):  # (AMX: the decode steps, 12 rows, on the kernel)
        assert calls, "the bf16 decode steps did not use the kernel"
    else:  # no AMX: batches of more than MAX_ROWS_VECTOR rows widened or on oneDNN, whichever is faster here
        rows = widened.calls if gemm.gemm_backend(torch.bfloat16) == "widen" else onednn_rows
        assert rows and min(rows) > gemm.MAX_ROWS_VECTOR, f"bf16 batches did not take the {gemm.gemm_backend(torch.bfloat16)} GEMM"
    monkeypatch.setitem(lin._state, "op", None)
    monkeypatch.setitem(gemm._state, "packed", None)
    monkeypatch.setitem(gemm._state, ("gemm", torch.bfloat16), "none")
    without = [o.token_ids for o in Engine(llama_dir, dtype="bfloat16", kv_cache_tokens=4096).generate(prompts, params)]
    same = sum(a == b for a, b in zip(with_kernel, without))
    tokens = sum(x == y for a, b in zip(with_kernel, without) for x, y in zip(a, b))
    assert same >= 8 and tokens >= 0.85 * 12 * 16, (same, tokens)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_roofline_bench_runs_the_ab_and_the_gemv_table(llama_dir, capsys, dtype):
    import argparse
    import json

    from bench import roofline

    parser = argparse.ArgumentParser()
    roofline.add_arguments(parser)
    args = parser.parse_args(
        [
            "--model",
            llama_dir,
            "--dtype",
            dtype,
            "--context",
            "8",
            "--steps",
            "3",
            "--buffer-mib",
            "8",
            "--gemv",
            "--gemv-rows",
            "1,3",
            "--gemv-mib",
            "1",
            "--json",
        ]
    )
    assert roofline.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["decode_step_ms"] > 0 and result["floor_ms"] > 0
    assert len(result["gemv"]) == 7 * 2 and all(r["torch_ms"] > 0 and r["torch_fp32_gb_s"] > 0 for r in result["gemv"])
    if lin.kernel() is not None:
        amx = (
            dtype == "bfloat16" and gemm.gemm_backend(torch.bfloat16) == "amx" and torch.ops.radixserve_linear.supports_amx_gemm()
        )  # (the tiny model's sizes are multiples of 32)
        assert result["linear"] == ("amx" if amx else "kernel") and result["decode_step_fallback_ms"] > 0
        assert result["fallback"] == "F.linear"
        assert all(r["kernel_ms"] > 0 and r["dispatched"] for r in result["gemv"])
        # bf16: the kernel steps ran the layers in one native call, the "layers" steps one by one
        assert result["fused_layers"] == (dtype == "bfloat16")
        assert ("decode_step_layers_ms" in result) == (dtype == "bfloat16")
    if dtype == "bfloat16" and gemm.has_onednn_ops(torch.bfloat16):
        assert all(r["onednn_ms"] > 0 for r in result["gemv"])
    if dtype == "float16":  # (radixserve never runs fp16 on oneDNN: no column)
        assert not any("onednn_ms" in r for r in result["gemv"])


@needs_ext
def test_roofline_bench_fp32_ab_names_the_path_without_the_kernel(llama_dir, capsys, monkeypatch):
    """fp32: where the kernel takes one-row batches (oneDNN as the fp32 GEMM, a CPU with the fp32
    path) the steps alternate between it and oneDNN; elsewhere they all run the one path there is."""
    import argparse
    import json

    from bench import roofline

    pin_gemm(monkeypatch, torch.float32, "onednn" if gemm.has_onednn_ops() else "mkl")
    parser = argparse.ArgumentParser()
    roofline.add_arguments(parser)
    args = parser.parse_args(["--model", llama_dir, "--context", "8", "--steps", "3", "--buffer-mib", "8", "--json"])
    assert roofline.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    if lin.max_rows(torch.float32) > 0:
        assert result["linear"] == "kernel" and result["fallback"] == "oneDNN"
        assert result["decode_step_fallback_ms"] > 0
    else:
        assert result["linear"] == result["fallback"] and "decode_step_fallback_ms" not in result


# ---- fp32: MKL's packed GEMM (torch.ops.radixserve_linear.pack_fp32 / packed_linear) ----


def packed():
    ns = gemm.packed_ops()
    assert ns is not None, "the extension built but torch.ops.radixserve_linear.pack_fp32 is missing"
    return ns


# (N, K): K and N not multiples of 16 (and K below one vector), and the bench model's K=512 shapes,
# all of which add in sgemm's order on this machine at >= 16 rows
EXACT_SHAPES = [(37, 53), (300, 17), (96, 100), (40, 512), (1024, 512)]


def mkl_backends(monkeypatch) -> None:
    """Pin the GEMMs that are MKL's on CPUs where MKL is fast: fp32 on MKL's packed GEMM, bf16
    widened to it (without AMX) or on AMX, whatever this CPU would choose."""
    pin_gemm(monkeypatch, torch.float32, "mkl")
    amx = ext is not None and torch.ops.radixserve_linear.supports_amx()
    monkeypatch.setitem(gemm._state, ("gemm", torch.bfloat16), ("amx" if gemm.has_onednn_ops(torch.bfloat16) else "none") if amx else "widen")


@pytest.fixture
def fresh_state(monkeypatch):
    """The packed path on with the "exact" policy and MKL's GEMMs, whatever the environment says."""
    monkeypatch.setitem(gemm._state, "policy", "exact")
    monkeypatch.delitem(gemm._state, "packed", raising=False)
    mkl_backends(monkeypatch)
    yield
    gemm._state.pop("packed", None)


@needs_ext
@pytest.mark.parametrize("bias", [False, True])
def test_packed_op_equals_f_linear_bit_exactly_from_16_rows(fresh_state, bias):
    g = torch.Generator().manual_seed(10)
    for n, k in EXACT_SHAPES:
        w = torch.randn(n, k, generator=g)
        b = torch.randn(n, generator=g) if bias else None
        p = packed().pack_fp32(w)
        assert p.dtype == torch.uint8 and p.dim() == 1 and p.data_ptr() % 64 == 0
        for m in (16, 17, 64, 300):
            x = torch.randn(m, k, generator=g)
            y = packed().packed_linear(x, p, n, k, b)
            assert y.shape == (m, n) and y.dtype == torch.float32
            assert torch.equal(y, F.linear(x, w, b)), (n, k, m)
        # fewer rows: another MKL path, equal up to fp32 rounding
        for m in (0, 1, 2, 5, 15):
            x = torch.randn(m, k, generator=g)
            ref = F.linear(x, w, b)
            y = packed().packed_linear(x, p, n, k, b)
            assert y.shape == (m, n)
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * max(1.0, float(ref.abs().max()) if m else 1.0))


@needs_ext
def test_packed_op_any_pack_rows_computes_any_row_count(fresh_state):
    """pack_fp32's rows picks MKL's blocking, not what can be computed: every packing serves every M."""
    g = torch.Generator().manual_seed(14)
    for n, k in [(37, 53), (64, 700)]:
        w = torch.randn(n, k, generator=g)
        for rows in (1, 16, 2048):
            p = packed().pack_fp32(w, rows)
            for m in (1, 16, 100, 600):
                x = torch.randn(m, k, generator=g)
                ref = F.linear(x, w)
                torch.testing.assert_close(packed().packed_linear(x, p, n, k, None), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@needs_ext
def test_packed_op_strided_rows_and_weight_views(fresh_state):
    """x rows and W rows may be strided views; nothing past K is read."""
    g = torch.Generator().manual_seed(11)
    xb = torch.randn(40, 90, generator=g)
    wb = torch.randn(33, 80, generator=g)
    x, w = xb[:, 5:58], wb[:, 2:55]  # K = 53
    assert not x.is_contiguous() and not w.is_contiguous()
    ref = F.linear(x, w)
    p = packed().pack_fp32(w)
    xb[:, 58:] = float("inf")
    wb[:, 55:] = float("nan")  # after packing: the pack read W then; x is read now
    assert torch.equal(packed().packed_linear(x, p, 33, 53, None), ref)
    # a bias that is a strided view
    bb = torch.randn(66, generator=g)
    assert torch.equal(packed().packed_linear(x, p, 33, 53, bb[::2]), F.linear(x, w, bb[::2]))


@needs_ext
def test_packed_op_refuses_bad_input_clearly(fresh_state):
    ops = packed()
    w = torch.randn(20, 24)
    p = ops.pack_fp32(w)
    x = torch.randn(16, 24)
    with pytest.raises(RuntimeError, match="weight must be float32"):
        ops.pack_fp32(w.bfloat16())
    with pytest.raises(RuntimeError, match=r"weight must be \[N, K\]"):
        ops.pack_fp32(w[None])
    with pytest.raises(RuntimeError, match="last dimension of weight"):
        ops.pack_fp32(torch.randn(24, 20).t())
    with pytest.raises(RuntimeError, match="empty weight"):
        ops.pack_fp32(torch.randn(0, 24))
    with pytest.raises(RuntimeError, match="x must be float32"):
        ops.packed_linear(x.bfloat16(), p, 20, 24, None)
    with pytest.raises(RuntimeError, match=r"x must be \[M, K\]"):
        ops.packed_linear(x[None], p, 20, 24, None)
    with pytest.raises(RuntimeError, match="x has K=25 but the packed weight has k=24"):
        ops.packed_linear(torch.randn(16, 25), p, 20, 24, None)
    with pytest.raises(RuntimeError, match=r"holds a \[20, 24\] weight, not \[20, 25\]"):
        ops.packed_linear(torch.randn(16, 25), p, 20, 25, None)
    with pytest.raises(RuntimeError, match=r"holds a \[20, 24\] weight, not \[21, 24\]"):
        ops.packed_linear(x, p, 21, 24, None)
    with pytest.raises(RuntimeError, match="last dimension of x"):
        ops.packed_linear(torch.randn(24, 16).t(), p, 20, 24, None)
    with pytest.raises(RuntimeError, match="bad header"):
        ops.packed_linear(x, torch.zeros_like(p), 20, 24, None)
    with pytest.raises(RuntimeError, match="uint8 tensor pack_fp32 returned"):
        ops.packed_linear(x, w, 20, 24, None)
    with pytest.raises(RuntimeError, match="bytes, expected"):
        ops.packed_linear(x, p[:-64].clone(), 20, 24, None)
    with pytest.raises(RuntimeError, match="copied or moved"):  # MKL's packed data cannot move
        ops.packed_linear(x, p.clone(), 20, 24, None)
    with pytest.raises(RuntimeError, match="rows must be positive"):
        ops.pack_fp32(w, 0)
    with pytest.raises(RuntimeError, match="bias must be a float32"):
        ops.packed_linear(x, p, 20, 24, torch.zeros(21))
    with pytest.raises(RuntimeError, match="bias must be a float32"):
        ops.packed_linear(x, p, 20, 24, torch.zeros(20).double())
    # the good call still works after all that
    assert torch.equal(ops.packed_linear(x, p, 20, 24, None), F.linear(x, w))


class _Spy:
    """Stands in for torch.ops.radixserve_linear in gemm._state["packed"], counting calls."""

    def __init__(self, real):
        self.real, self.packs, self.calls = real, 0, []

    def pack_fp32(self, w):
        self.packs += 1
        return self.real.pack_fp32(w)

    def packed_linear(self, x, p, n, k, b):
        self.calls.append(x.shape[0])
        return self.real.packed_linear(x, p, n, k, b)

    def amx_linear(self, x, p, b, fp32_out):
        self.calls.append(x.shape[0])
        return self.real.amx_linear(x, p, b, fp32_out)

    def __getattr__(self, name):  # supports_amx and the rest: the real ops
        return getattr(self.real, name)


@pytest.fixture
def spy(fresh_state, monkeypatch):
    s = _Spy(packed())
    monkeypatch.setitem(gemm._state, "packed", s)
    return s


@needs_ext
def test_linear_dispatch_packs_fp32_from_16_rows(spy):
    layer = lin.Linear(53, 37, bias=True)
    g = torch.Generator().manual_seed(12)
    with torch.inference_mode():
        for shape in [(1, 53), (15, 53), (3, 5, 53)]:  # < 16 rows: F.linear, nothing packed
            x = torch.randn(*shape, generator=g)
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        assert spy.packs == 0 and spy.calls == []
        for shape in [(16, 53), (100, 53), (4, 5, 53), (2, 256, 53), (gemm.PACKED_MAX_ROWS + 1, 53)]:
            x = torch.randn(*shape, generator=g)
            y = layer(x)
            assert y.shape == (*shape[:-1], 37)
            assert torch.equal(y, F.linear(x, layer.weight, layer.bias))
        # packed once (then checked against F.linear at PROBE_ROWS rows), reused; more than
        # PACKED_MAX_ROWS rows: F.linear
        assert spy.packs == 1 and spy.calls == [*gemm.PROBE_ROWS, 16, 100, 20, 512]
        del spy.calls[:]
        xt = torch.randn(20, 106, generator=g)[:, ::2]  # a strided last dimension: made contiguous
        assert torch.equal(layer(xt), F.linear(xt, layer.weight, layer.bias)) and spy.calls == [20]
    # autograd: F.linear (no backward through the op), and no pack made for it
    x = torch.randn(20, 53, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and spy.calls == [20] and spy.packs == 1
    # bf16 weights: the packed path only widened, on a CPU without AMX (test_bf16_widened_...)
    layer.bfloat16()
    with torch.inference_mode():
        layer(torch.randn(20, 53).bfloat16())
    assert spy.calls == ([20, 20] if gemm.gemm_backend(torch.bfloat16) == "widen" else [20])


@needs_ext
def test_bf16_widened_to_the_packed_fp32_gemm_without_amx(spy):
    """Without AMX, bf16 batches of more than MAX_ROWS_VECTOR rows run the packed fp32 GEMM on the
    exactly widened weight and rows, rounded to bf16 (the bf16 kernel keeps the fewer rows); with
    AMX, bf16 never takes it."""
    layer = lin.Linear(53, 37, bias=True).bfloat16()
    g = torch.Generator().manual_seed(15)
    widens = not packed().supports_amx()
    assert (gemm.gemm_backend(torch.bfloat16) == "widen") == widens
    emb = torch.randn(300, 53).bfloat16()  # (made outside inference mode: such tensors are never packed)
    with torch.inference_mode():
        for rows in (1, gemm.MAX_ROWS_VECTOR, gemm.MAX_ROWS_VECTOR + 1, 16, 700):
            x = torch.randn(rows, 53, generator=g).bfloat16()
            y = layer(x)
            assert y.dtype == torch.bfloat16 and y.shape == (rows, 37)
            if widens and rows > gemm.MAX_ROWS_VECTOR:  # the same fp32 sums, rounded once
                want = F.linear(x.float(), layer.weight.float(), layer.bias.float()).bfloat16()
                torch.testing.assert_close(y.float(), want.float(), atol=0, rtol=2**-8)
            else:
                check(y, reference(x, layer.weight, layer.bias), torch.bfloat16, False)
        # logits too: bf16-rounded, then fp32
        h = torch.randn(9, 53, generator=g).bfloat16()
        out = lin.logits(h, emb, lin.PackedWeight())
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, F.linear(h.float(), emb.float()).bfloat16().float(), atol=0, rtol=2**-8)
    expected = [gemm.MAX_ROWS_VECTOR + 1, 16, 700, 9] if widens else []
    assert spy.calls == expected and spy.packs == (2 if widens else 0)


@needs_ext
def test_packed_copy_follows_the_weight(spy):
    """In-place writes (the loader's copy_ into views, under no_grad or inference mode), a new
    parameter (tensor-parallel sharding) and .data assignment all repack; the test would fail
    on a stale copy: the old weights give other outputs."""
    layer = lin.Linear(40, 30, bias=False)
    x = torch.randn(20, 40)
    with torch.inference_mode():
        before = layer(x)
        assert spy.packs == 1
        layer(x)
        assert spy.packs == 1
    with torch.no_grad():
        layer.weight.narrow(0, 3, 5).mul_(-2.0)  # through a view, as the loader writes
    with torch.inference_mode():
        after = layer(x)
        assert spy.packs == 2 and not torch.equal(after, before)
        assert torch.equal(after, F.linear(x, layer.weight))
        layer.weight.add_(1.0)  # in inference mode (a normal tensor: still versioned)
        assert torch.equal(layer(x), F.linear(x, layer.weight)) and spy.packs == 3
    layer.weight = torch.nn.Parameter(torch.randn(12, 40), requires_grad=False)  # a new parameter, new shape
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight)) and spy.packs == 4
    layer.weight.data = torch.randn(12, 40)  # new storage under the same parameter
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight)) and spy.packs == 5
        # writes through .data bypass the version counter: the documented limit, and what a stale
        # copy looks like (this is the check that the comparisons above can fail)
        stale = layer(x)
        layer.weight.data.mul_(3.0)
        assert torch.equal(layer(x), stale) and not torch.equal(stale, F.linear(x, layer.weight))
        layer.packed.clear()
        assert torch.equal(layer(x), F.linear(x, layer.weight)) and spy.packs == 6
    # another thread count: packed again (MKL's order may depend on it)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3 - min(threads, 2))
        with torch.inference_mode():
            assert torch.equal(layer(x), F.linear(x, layer.weight)) and spy.packs == 7
    finally:
        torch.set_num_threads(threads)


@needs_ext
def test_exact_policy_keeps_f_linear_for_shapes_that_differ(spy, monkeypatch):
    """Under "exact" a weight whose packed products differ from F.linear (here: made to look so)
    keeps F.linear, checked once per weight version; "all" packs it anyway; off never packs."""
    layer = lin.Linear(24, 20)
    x = torch.randn(32, 24)
    checks = []

    def differs(weight, p, ops):
        checks.append(tuple(weight.shape))
        return False

    monkeypatch.setattr(packing, "_bit_identical", differs)
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert checks == [(20, 24)] and spy.packs == 1 and spy.calls == []
    assert layer.packed._entry is not None and layer.packed._entry[2] is None  # the copy was dropped
    monkeypatch.setitem(gemm._state, "policy", "all")
    layer.packed.clear()
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert checks == [(20, 24)] and spy.calls == [32]
    monkeypatch.setitem(gemm._state, "policy", "off")
    monkeypatch.delitem(gemm._state, "packed")
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert gemm._state["packed"] is None and spy.calls == [32]


@needs_ext
def test_exact_policy_probe_agrees_with_the_real_comparison(fresh_state):
    """The probe says "identical" exactly when the packed products equal F.linear's (here at 16-300
    rows), on an identical shape and on one that differs on this machine (if any does)."""
    g = torch.Generator().manual_seed(13)
    for n, k in [(40, 512), (512, 1408)]:
        w = torch.randn(n, k, generator=g)
        p = packed().pack_fp32(w)
        same = all(torch.equal(packed().packed_linear(x, p, n, k, None), F.linear(x, w)) for x in (torch.randn(m, k, generator=g) for m in (16, 33, 300)))
        assert packing._bit_identical(w, p, packed()) == same, (n, k)
        layer = lin.Linear(k, n, bias=False)
        with torch.no_grad():
            layer.weight.copy_(w)
        with torch.inference_mode():
            x = torch.randn(20, k, generator=g)
            assert torch.equal(layer(x), F.linear(x, w))
        assert (layer.packed._entry[2] is not None) == same


@needs_ext
def test_packed_logits_and_nothing_new_in_state_dict(spy, llama_dir, monkeypatch):
    import copy
    import pickle

    from radixserve.model.loader import load_model

    emb = torch.randn(300, 48)
    h = torch.randn(20, 48)
    pw = lin.PackedWeight()
    with torch.inference_mode():
        out = lin.logits(h, emb, pw)
    assert out.dtype == torch.float32 and torch.equal(out, F.linear(h, emb)) and spy.calls[-1] == 20

    # (under "all": whether a 16 x 8 weight adds in F.linear's order depends on the CPU, e.g. not on
    # an AMD EPYC, and the "exact" policy would drop that copy)
    monkeypatch.setitem(gemm._state, "policy", "all")
    layer = lin.Linear(16, 8)
    with torch.inference_mode():
        layer(torch.randn(16, 16))
    assert spy.packs == 2 and layer.packed._entry[2] is not None
    assert list(layer.state_dict()) == ["weight", "bias"]
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"] and list(layer.buffers()) == []
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):  # copies start unpacked
        assert clone.packed._entry is None and torch.equal(clone.weight, layer.weight)

    model = load_model(llama_dir).model
    names = set(model.state_dict())
    with torch.inference_mode():
        from radixserve.kernels import layers  # noqa: F401  (the layers' kernels, as the engine runs them)

        x = torch.randn(20, model.config.hidden_size)
        model.model.layers[0].mlp(x)
        lin.logits(x, model.output_embedding, model.output_packed)
    assert set(model.state_dict()) == names and all("packed" not in n for n in names)
    assert {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()} >= names
    assert model.output_packed._entry[2] is not None


@needs_ext
def test_fp32_engine_tokens_equal_with_and_without_packing(llama_dir, spy, monkeypatch):
    """The fp32 engine prefills through the packed path and its greedy tokens are the same as with
    F.linear everywhere (the tiny model's shapes are bit-identical here)."""
    from radixserve import Engine, SamplingParams

    from conftest import random_prompts

    prompts = random_prompts([40, 9, 70, 25, 3], seed=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    packed_tokens = [o.token_ids for o in Engine(llama_dir, kv_cache_tokens=4096).generate(prompts, params)]
    assert spy.calls and min(spy.calls) >= gemm.PACKED_MIN_ROWS, "the fp32 prefill did not use the packed path"
    assert max(spy.calls) <= gemm.PACKED_MAX_ROWS
    monkeypatch.setitem(gemm._state, "packed", None)
    plain = [o.token_ids for o in Engine(llama_dir, kv_cache_tokens=4096).generate(prompts, params)]
    assert packed_tokens == plain


@needs_ext
def test_packed_copies_stay_within_the_memory_budget(spy, monkeypatch):
    """Past the budget a weight keeps F.linear (no pack made); a freed copy returns its bytes."""
    import gc

    gc.collect()  # (earlier tests' copies return their bytes now, not into this test's budget)
    a, b = lin.Linear(64, 32), lin.Linear(64, 32)
    x = torch.randn(20, 64)
    monkeypatch.setitem(packing._state, "pack_budget", 4 * 64 * 32 + 100)  # room for one copy
    with torch.inference_mode():
        assert torch.equal(a(x), F.linear(x, a.weight, a.bias))
        assert spy.packs == 1 and packing._state["pack_budget"] == 100
        assert torch.equal(b(x), F.linear(x, b.weight, b.bias))
        assert spy.packs == 1 and spy.calls.count(20) == 1  # b: F.linear, nothing packed
    a.packed.clear()  # a's copy freed: its bytes come back, and b packs on its next call
    gc.collect()
    assert packing._state["pack_budget"] == 4 * 64 * 32 + 100
    b.packed.clear()
    with torch.inference_mode():
        assert torch.equal(b(x), F.linear(x, b.weight, b.bias))
    assert spy.packs == 2


@needs_ext
def test_engine_prepacks_every_fp32_weight_at_load(llama_dir, spy, monkeypatch):
    """The model runner packs every linear weight and the output embedding when it is made, so no
    served step pays for packing; serving then packs nothing more."""
    from radixserve import Engine, SamplingParams

    from conftest import random_prompts

    monkeypatch.setitem(gemm._state, "policy", "all")  # (the default: no copy dropped by a probe)

    eng = Engine(llama_dir, kv_cache_tokens=4096)
    model = eng.runner.model
    layers = [m for m in model.modules() if isinstance(m, lin.Linear)]
    assert spy.packs == len(layers) + 1  # + the output embedding
    assert all(m.packed._entry is not None and m.packed._entry[2] is not None for m in layers)
    assert model.output_packed._entry is not None and model.output_packed._entry[2] is not None
    prompts = random_prompts([40, 30], seed=5)
    eng.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert spy.calls and spy.packs == len(layers) + 1  # used, not repacked
    eng.shutdown()


@needs_ext
def test_prepack_skips_what_never_packs(spy, monkeypatch):
    model = torch.nn.Sequential(lin.Linear(32, 16), lin.Linear(16, 8))
    with torch.inference_mode():
        frozen = lin.Linear(32, 16)  # made under inference mode: no version counter to key on
    assert lin.prepack(torch.nn.Sequential(frozen)) == 0 and spy.packs == 0
    model[1].double()  # neither fp32 nor bf16
    assert lin.prepack(model) == 1 and spy.packs == 1
    monkeypatch.setitem(gemm._state, "packed", None)  # RADIXSERVE_PACKED_LINEAR=0
    assert lin.prepack(torch.nn.Sequential(lin.Linear(32, 16))) == 0


def _packed_kind(layer) -> str | None:
    entry = layer.packed._entry
    buf = None if entry is None else entry[2]
    return None if buf is None else "onednn" if buf.is_mkldnn else "amx" if buf.dim() == 4 else "other"


@needs_ext
@pytest.mark.parametrize("shape, kind", [((96, 160), "amx"), ((100, 72), "onednn")])
def test_bf16_on_amx_runs_on_a_prepacked_copy(fresh_state, shape, kind):
    """With AMX, bf16 products use a packed copy of the weight (made once, remade when the weight
    changes): the AMX GEMM's tiles when both sizes are multiples of 32, at every row count (the
    small-M kernel's rows too); otherwise oneDNN's prepacked copy for MAX_ROWS + 1 to
    ONEDNN_MAX_ROWS rows, the kernel below and F.linear above. Results match F.linear to bf16
    rounding (the GEMMs sum in other orders)."""
    if gemm.gemm_backend(torch.bfloat16) != "amx":
        pytest.skip("no AMX here (or torch lacks the mkldnn linear ops): bf16 never takes this path")
    if kind == "amx" and not torch.ops.radixserve_linear.supports_amx_gemm():
        pytest.skip("this build has no AMX GEMM")
    g = torch.Generator().manual_seed(21)
    k, n = shape
    layer = lin.Linear(k, n, bias=True).bfloat16()
    lo, hi = (1, 1000) if kind == "amx" else (gemm.MAX_ROWS + 1, gemm.ONEDNN_MAX_ROWS)
    with torch.inference_mode():
        for rows in (1, 7, gemm.MAX_ROWS, gemm.MAX_ROWS + 1, 64, 128, 129, 300):
            x = torch.randn(rows, k, generator=g).bfloat16()
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=2e-2, rtol=2e-2)
            assert _packed_kind(layer) == (kind if rows >= lo else None), rows  # made at the first batch in range
            assert (lin.prepacked_weight(rows, layer.weight, layer.bias, layer.packed) is not None) == (lo <= rows <= hi), rows
        sums = lin.linear(x, layer.weight, layer.bias, fp32_out=True, packed=layer.packed)
        assert sums.dtype == torch.float32  # (the AMX GEMM's unrounded sums; the others' cast)
        torch.testing.assert_close(sums, F.linear(x.float(), layer.weight.float(), layer.bias.float()), atol=2e-2, rtol=2e-2)
        x3 = torch.randn(2, 40, k, generator=g).bfloat16()  # 80 rows in a 3-D batch
        torch.testing.assert_close(layer(x3), F.linear(x3, layer.weight, layer.bias), atol=2e-2, rtol=2e-2)
        old = layer.packed._entry[2]
    with torch.no_grad():
        layer.weight.mul_(2)  # an in-place write: the next batch repacks
    with torch.inference_mode():
        x = torch.randn(64, k, generator=g).bfloat16()
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=4e-2, rtol=2e-2)
        assert layer.packed._entry[2] is not old


needs_amx_gemm = pytest.mark.skipif(ext is None or not torch.ops.radixserve_linear.supports_amx_gemm(), reason="no AMX GEMM here (the CPU or the build)")


@needs_amx_gemm
@pytest.mark.parametrize("n, k", [(32, 32), (96, 64), (160, 96), (512, 1408)])
def test_amx_gemm_equals_a_float64_product(n, k):
    """amx_linear over pack_amx's tiles is x W^T (+ b) with fp32 sums: against a float64 product of
    the same bf16 values, within fp32 rounding with fp32_out and within bf16's half ulp otherwise,
    at row counts around its 32-row blocks and 256-row chunks, on strided rows, with and without a
    bias (bf16 or fp32)."""
    ops = torch.ops.radixserve_linear
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    packed = ops.pack_amx(w)
    assert packed.shape == (n // 16, k // 32, 16, 32) and packed.dtype == torch.bfloat16
    for rows in (1, 15, 16, 17, 31, 32, 33, 64, 100, 255, 256, 257, 600):
        wide = torch.randn(rows, k + 16, generator=g).bfloat16()
        x = wide[:, 3 : 3 + k]  # strided rows (and not 64-byte aligned)
        for bias in (None, torch.randn(n, generator=g).bfloat16(), torch.randn(n, generator=g)):
            want = x.double() @ w.double().t() + (0 if bias is None else bias.double())
            got = ops.amx_linear(x, packed, bias, True)
            assert got.dtype == torch.float32 and got.shape == (rows, n)
            torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
            rounded = ops.amx_linear(x, packed, bias, False)
            assert rounded.dtype == torch.bfloat16
            assert torch.equal(rounded, got.bfloat16()), rows  # the same sums, rounded to nearest even


@needs_amx_gemm
@pytest.mark.parametrize("n, k", [(2816, 512), (64, 512), (96, 1408)])
def test_amx_gemm_is_the_same_at_any_thread_count(n, k):
    """The GEMM's tasks (256-row x 256-column chunks, narrower while there are fewer tasks than
    threads: at 33 rows n = 64 gets chunks of one column pair at 2 and 5 threads, n = 96 at 5) go
    to whichever thread asks next, and the micro-kernel walks K forwards or backwards by its output columns: every
    output element is still made once, by the same sums, so the result is bit for bit the same at
    1, 2 and 5 threads (a task handed out twice or never would leave garbage from torch.empty, or
    race; a direction that followed the chunking would change the rounding)."""
    ops = torch.ops.radixserve_linear
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    packed = ops.pack_amx(w)
    threads = torch.get_num_threads()
    try:
        for rows in (33, 300, 1100):
            x = torch.randn(rows, k, generator=g).bfloat16()
            got = {}
            for t in (1, 2, 5):
                torch.set_num_threads(t)
                got[t] = (ops.amx_linear(x, packed, None, True), ops.amx_linear_silu(x, packed, None))
            for t in (2, 5):
                assert torch.equal(got[t][0], got[1][0]) and torch.equal(got[t][1], got[1][1]), (rows, t)
            want = x.double() @ w.double().t()
            torch.testing.assert_close(got[1][0].double(), want, atol=1e-4, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


@needs_amx_gemm
@pytest.mark.parametrize("n, k", [(64, 64), (96, 512), (2816, 512)])
def test_amx_gemm_with_silu_and_mul_equals_the_two_steps(n, k):
    """amx_linear_silu over a packed [gate; up] weight is silu(gate) * up of the same fp32 sums
    amx_linear makes (fp32_out), within bf16's rounding: output tiles of 16 (n = 96: three gate
    tiles, so column chunks end mid-pair), row counts around the 32-row blocks, strided rows, with
    and without a bias."""
    ops = torch.ops.radixserve_linear
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    packed = ops.pack_amx(w)
    for rows in (1, 16, 17, 33, 100, 257):
        x = torch.randn(rows, k + 16, generator=g).bfloat16()[:, 5 : 5 + k]
        for bias in (None, torch.randn(n, generator=g).bfloat16(), torch.randn(n, generator=g)):
            sums = ops.amx_linear(x, packed, bias, True).double()
            want = F.silu(sums[:, : n // 2]) * sums[:, n // 2 :]
            got = ops.amx_linear_silu(x, packed, bias)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, n // 2)
            torch.testing.assert_close(got.double(), want, rtol=4e-3, atol=1e-5)
    with pytest.raises(RuntimeError, match="even"):
        ops.amx_linear_silu(torch.randn(2, 64).bfloat16(), torch.zeros(3, 2, 16, 32, dtype=torch.bfloat16), None)


@needs_amx_gemm
def test_mlp_takes_the_gemm_with_silu_on_amx(fresh_state):
    """linear_silu_and_mul (the MLP's gate_up_proj and activation) runs amx_linear_silu where linear
    would take the AMX GEMM, and matches the product-then-activation path within bf16's rounding;
    without the packed copy it is exactly that path."""
    from radixserve.kernels import layers as fused

    g = torch.Generator().manual_seed(3)
    layer = lin.Linear(512, 2816, bias=False).to(torch.bfloat16).requires_grad_(False)
    layer.weight.copy_(torch.randn(2816, 512, generator=g) * 0.05)
    x = torch.randn(300, 512, generator=g).bfloat16()
    assert torch.equal(lin.linear_silu_and_mul(x, layer.weight, None), fused.silu_and_mul(lin.linear(x, layer.weight, None)))
    two_steps = fused.silu_and_mul(layer(x))  # (the AMX GEMM, its sums rounded to bf16, then the op)
    got = lin.linear_silu_and_mul(x, layer.weight, None, packed=layer.packed)
    buf = layer.packed.get(layer.weight, gemm.packed_ops())
    assert buf is not None and buf.dim() == 4  # the AMX GEMM's tiles
    assert torch.equal(got, torch.ops.radixserve_linear.amx_linear_silu(x, buf, None))
    assert not torch.equal(got, two_steps)  # (no bf16 rounding of gate and up in between)
    torch.testing.assert_close(got.float(), two_steps.float(), rtol=2e-2, atol=2e-3)


@needs_amx_gemm
def test_amx_gemm_refuses_bad_input():
    ops = torch.ops.radixserve_linear
    w = torch.randn(64, 64).bfloat16()
    packed = ops.pack_amx(w)
    with pytest.raises(RuntimeError, match="multiples of 32"):
        ops.pack_amx(torch.randn(48, 64).bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.pack_amx(torch.randn(64, 64))
    with pytest.raises(RuntimeError, match="K=32"):
        ops.amx_linear(torch.randn(4, 32).bfloat16(), packed, None, False)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.amx_linear(torch.randn(4, 64), packed, None, False)
    with pytest.raises(RuntimeError, match="pack_amx"):
        ops.amx_linear(torch.randn(4, 64).bfloat16(), w, None, False)
    with pytest.raises(RuntimeError, match="bias"):
        ops.amx_linear(torch.randn(4, 64).bfloat16(), packed, torch.randn(63), False)
    assert ops.amx_linear(torch.randn(0, 64).bfloat16(), packed, None, False).shape == (0, 64)


needs_onednn = pytest.mark.skipif(not gemm.has_onednn_ops(), reason="torch lacks the mkldnn linear ops")
needs_onednn_bf16 = pytest.mark.skipif(not gemm.has_onednn_ops(torch.bfloat16), reason="no oneDNN bf16 GEMM here (torch or the CPU: AVX2 only)")


@needs_ext
@needs_onednn
def test_fp32_on_onednn_from_one_row(monkeypatch):
    """Where oneDNN is the fp32 backend (auto on CPUs where MKL's fp32 is slow, e.g. AMD EPYC),
    every fp32 batch runs oneDNN over a prepacked copy of the weight: results equal F.linear's to
    fp32 rounding (the summation order differs), the copy is made once and remade when the weight
    changes, autograd keeps F.linear, and the "exact" probe compares oneDNN's products. Batches of
    up to max_rows(fp32) rows (where the kernel has an fp32 path) go to the kernel instead."""
    pin_gemm(monkeypatch, torch.float32, "onednn")
    few = lin.max_rows(torch.float32)
    assert few == (
        0
        if not torch.ops.radixserve_linear.supports_fp32()
        else gemm.MAX_ROWS_FP32_AVX512
        if torch.backends.cpu.get_cpu_capability().startswith("AVX512")
        else gemm.MAX_ROWS_FP32
    )
    monkeypatch.setitem(gemm._state, "policy", "all")
    monkeypatch.delitem(gemm._state, "packed", raising=False)
    real = gemm.onednn_linear
    rows_seen = spy_onednn(monkeypatch)
    g = torch.Generator().manual_seed(31)
    layer = lin.Linear(53, 37, bias=True)
    emb = torch.randn(300, 53)  # (made outside inference mode: such tensors are never packed)
    with torch.inference_mode():
        for shape in [(1, 53), (15, 53), (16, 53), (3, 5, 53), (700, 53)]:
            x = torch.randn(*shape, generator=g)
            y = layer(x)
            assert y.shape == (*shape[:-1], 37)
            torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        xt = torch.randn(20, 106, generator=g)[:, ::2]  # a strided last dimension: made contiguous
        torch.testing.assert_close(layer(xt), F.linear(xt, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        h = torch.randn(2, 53, generator=g)
        torch.testing.assert_close(lin.logits(h, emb, lin.PackedWeight()), F.linear(h, emb), atol=1e-5, rtol=1e-5)
    assert rows_seen == [r for r in (1, 15, 16, 15, 700, 20, 2) if r > few]
    old = layer.packed._entry[2]
    assert old.is_mkldnn
    with torch.no_grad():
        layer.weight.mul_(2)  # an in-place write: the next batch repacks
    with torch.inference_mode():
        x = torch.randn(8, 53, generator=g)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    assert layer.packed._entry[2] is not old
    x = torch.randn(20, 53, requires_grad=True)  # autograd: F.linear
    layer(x).sum().backward()
    assert x.grad is not None and len(rows_seen) == len([r for r in (1, 15, 16, 15, 700, 20, 2) if r > few]) + 1
    # "exact": the probe runs oneDNN's product; it keeps the copy exactly when that equals F.linear
    w = torch.randn(40, 512, generator=g)
    p = torch.ops.mkldnn._reorder_linear_weight(w)
    monkeypatch.setattr(gemm, "onednn_linear", real)
    same = all(torch.equal(real(x_, p, None), F.linear(x_, w)) for x_ in (torch.randn(m, 512, generator=g) for m in (*gemm.PROBE_ROWS, 33, 300)))
    assert packing._bit_identical(w, p, packed()) == same


@needs_ext
@needs_onednn_bf16
def test_bf16_on_onednn_without_amx(monkeypatch):
    """Where oneDNN is the bf16 backend without AMX (CPUs with avx512_bf16 whose vdpbf16ps GEMM
    beats the widened fp32 one), bf16 batches of more than MAX_ROWS_VECTOR rows run oneDNN over a
    prepacked bf16 copy; fewer keep the kernel. Results match fp32 arithmetic to bf16 rounding."""
    monkeypatch.setitem(gemm._state, ("gemm", torch.bfloat16), "onednn")
    monkeypatch.delitem(gemm._state, "packed", raising=False)
    if lin.max_rows(torch.bfloat16) != gemm.MAX_ROWS_VECTOR:
        pytest.skip("AMX here: the kernel takes up to MAX_ROWS bf16 rows")
    g = torch.Generator().manual_seed(32)
    layer = lin.Linear(96, 160, bias=True).bfloat16()
    with torch.inference_mode():
        for rows in (1, gemm.MAX_ROWS_VECTOR, gemm.MAX_ROWS_VECTOR + 1, 64, 700):
            x = torch.randn(rows, 96, generator=g).bfloat16()
            y = layer(x)
            assert y.dtype == torch.bfloat16
            check(y, reference(x, layer.weight, layer.bias), torch.bfloat16, False)
            entry = layer.packed._entry
            assert (entry is not None and entry[2] is not None and entry[2].is_mkldnn) == (rows > gemm.MAX_ROWS_VECTOR)
        h = torch.randn(9, 96, generator=g).bfloat16()
        emb = torch.randn(300, 96).bfloat16()
        out = lin.logits(h, emb, lin.PackedWeight())  # rounded to bf16, then fp32
        assert out.dtype == torch.float32 and torch.equal(out, out.bfloat16().float())
        torch.testing.assert_close(out, reference(h, emb, None), atol=5e-2, rtol=1.6e-2)


@needs_ext
@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_weight_names_the_batches_linear_sends_to_a_prepacked_copy(monkeypatch, dtype):
    """The fused decode path (csrc/decode.cpp) multiplies by prepacked_weight's copy exactly where
    linear() would run oneDNN: for each row count, it returns the copy linear() used, or None
    where linear() took another path (the kernel, F.linear: a float64 bias, a weight that needs
    grad, an inference tensor)."""
    if dtype == torch.bfloat16 and not gemm.has_onednn_ops(torch.bfloat16):
        pytest.skip("no oneDNN bf16 GEMM here")
    pin_gemm(monkeypatch, dtype, "onednn")
    monkeypatch.setitem(gemm._state, "policy", "all")
    monkeypatch.delitem(gemm._state, "packed", raising=False)
    rows_seen = spy_onednn(monkeypatch)
    g = torch.Generator().manual_seed(33)
    layers = {
        "plain": lin.Linear(40, 24, bias=True).to(dtype),
        "f64 bias": lin.Linear(40, 24, bias=True).to(dtype),
        "grad": lin.Linear(40, 24, bias=False).to(dtype),
    }
    layers["f64 bias"].bias.data = layers["f64 bias"].bias.data.double()
    with torch.inference_mode():
        frozen = lin.Linear(40, 24, bias=False).to(dtype)  # an inference tensor: never packed
    for name, layer in {**layers, "inference": frozen}.items():
        layer.weight.requires_grad_(name == "grad")
        for rows in range(1, 41):
            x = torch.randn(rows, 40, generator=g).to(dtype)
            del rows_seen[:]
            with torch.inference_mode() if name != "grad" else torch.enable_grad():
                try:
                    layer(x)
                except RuntimeError:  # (F.linear refuses the float64 bias with bf16 input)
                    assert name == "f64 bias"
                buf = lin.prepacked_weight(rows, layer.weight, layer.bias, layer.packed)
            assert (buf is not None) == (rows_seen == [rows]), (name, rows)
            if buf is not None:
                assert buf is layer.packed._entry[2]
    # the kernel's rows and the weights linear() never packs: None; the plain layer beyond them: a copy
    with torch.inference_mode():
        assert lin.prepacked_weight(lin.max_rows(dtype) + 5, layers["plain"].weight, layers["plain"].bias, layers["plain"].packed) is not None


@needs_ext
def test_gemm_backend_is_measured_or_chosen(monkeypatch, caplog):
    """auto measures MKL against oneDNN once per dtype and takes oneDNN only when it is more than
    1.1x faster; RADIXSERVE_CPU_GEMM=mkl/onednn chooses; anything else warns and measures; bf16
    with AMX is always AMX; fp16 and no extension: F.linear."""
    amx = torch.ops.radixserve_linear.supports_amx() if ext is not None else False
    monkeypatch.setattr(gemm, "has_onednn_ops", lambda dtype=torch.float32: True)
    rates = {"mkl": 100.0, "widen": 100.0, "onednn": 105.0}
    measured = []

    def fake_measure(dtype, candidates):
        measured.append((dtype, candidates))
        return {c: rates[c] for c in candidates}

    monkeypatch.setattr(gemm, "measure", fake_measure)
    for env, onednn_rate, fp32, bf16 in [
        ("auto", 105.0, "mkl", "widen"),
        ("", 120.0, "onednn", "onednn"),
        ("mkl", 500.0, "mkl", "widen"),
        ("onednn", 1.0, "onednn", "onednn"),
        ("fast", 300.0, "onednn", "onednn"),
    ]:
        monkeypatch.setattr(lin, "_state", {})
        monkeypatch.setattr(gemm, "_state", {})
        monkeypatch.setattr(packing, "_state", {})
        monkeypatch.setenv("RADIXSERVE_CPU_GEMM", env)
        rates["onednn"] = onednn_rate
        measured.clear()
        with caplog.at_level("INFO", logger="radixserve"):
            assert gemm.gemm_backend(torch.float32) == fp32, env
            assert gemm.gemm_backend(torch.bfloat16) == ("amx" if amx else bf16), env
            assert gemm.gemm_backend(torch.float32) == fp32  # decided once
        assert gemm.gemm_backend(torch.float16) == "none"
        want = [(torch.float32, ("mkl", "onednn"))] + ([] if amx else [(torch.bfloat16, ("widen", "onednn"))])
        assert measured == (want if env in ("auto", "", "fast") else []), env
    assert "RADIXSERVE_CPU_GEMM='fast' is not one of" in caplog.text
    assert "GFLOP/s" in caplog.text
    # a CPU without oneDNN's bf16 (AVX2 only): bf16 widens without measuring; asking for oneDNN warns.
    # (With AMX, whose path is oneDNN's bf16 GEMM, bf16 batches beyond the kernel fall back to F.linear.)
    monkeypatch.setattr(gemm, "has_onednn_ops", lambda dtype=torch.float32: dtype != torch.bfloat16)
    for env in ("auto", "onednn"):
        monkeypatch.setattr(lin, "_state", {})
        monkeypatch.setattr(gemm, "_state", {})
        monkeypatch.setattr(packing, "_state", {})
        monkeypatch.setenv("RADIXSERVE_CPU_GEMM", env)
        measured.clear()
        caplog.clear()
        with caplog.at_level("INFO", logger="radixserve"):
            assert gemm.gemm_backend(torch.bfloat16) == ("none" if amx else "widen"), env
        assert not measured
        assert ("oneDNN's bfloat16 GEMM does not run" in caplog.text) == (env == "onednn" and not amx), env
    # the real measurement: a rate for each candidate
    monkeypatch.setattr(lin, "_state", {})
    monkeypatch.setattr(gemm, "_state", {})
    monkeypatch.setattr(packing, "_state", {})
    monkeypatch.undo()
    if gemm.has_onednn_ops():
        got = gemm.measure(torch.float32, ("mkl", "onednn"))
        assert set(got) == {"mkl", "onednn"} and all(r > 0 for r in got.values())
    monkeypatch.setattr(gemm, "_state", {"packed": None})  # RADIXSERVE_PACKED_LINEAR=0 / no extension
    assert gemm.gemm_backend(torch.float32) == "none" and gemm.gemm_backend(torch.bfloat16) == "none"


@needs_ext
def test_gemm_backend_probe_times_the_models_own_shapes(monkeypatch, caplog):
    """prepack() names the model's linear shapes (not its output embedding) before the backend is
    chosen, so the probe times those products rather than the default square one."""
    if not gemm.has_onednn_ops():
        pytest.skip("oneDNN's fp32 GEMM does not run here: nothing to measure")
    model = torch.nn.Module()
    model.qkv = lin.Linear(64, 96, bias=False)
    model.up = lin.Linear(64, 160, bias=False)
    model.down = lin.Linear(80, 64, bias=True)
    model.other = lin.Linear(64, 96, bias=True)  # a shape seen already: timed once
    timed = []
    real = gemm.measure

    def spy(dtype, candidates):
        timed.append(gemm._state.get("probe_shapes") or gemm.GEMM_PROBE_SHAPES)
        return real(dtype, candidates)

    monkeypatch.setattr(gemm, "measure", spy)
    monkeypatch.setattr(lin, "_state", {})
    monkeypatch.setattr(gemm, "_state", {})
    monkeypatch.setattr(packing, "_state", {})
    monkeypatch.setenv("RADIXSERVE_CPU_GEMM", "auto")
    with caplog.at_level("INFO", logger="radixserve"):
        lin.prepack(model)
    assert timed and timed[0] == ((64, 80), (96, 64), (160, 64))
    assert "64 x 80, 96 x 64, 160 x 64" in caplog.text
    # a large model's shapes keep their K with fewer output rows (nothing allocated: meta weights)
    big = torch.nn.Module()
    big.up = lin.Linear(4096, 28672, bias=False, device="meta")
    big.down = lin.Linear(14336, 4096, bias=False, device="meta")
    big.o = lin.Linear(64, 96, bias=False, device="meta")
    lin.probe_shapes(big)
    assert gemm._state["probe_shapes"] == ((96, 64), (128, 14336), (512, 4096))
    # with no model named, the square default
    monkeypatch.setattr(lin, "_state", {})
    monkeypatch.setattr(gemm, "_state", {})
    monkeypatch.setattr(packing, "_state", {})
    timed.clear()
    assert gemm.gemm_backend(torch.float32) in ("mkl", "onednn")
    assert timed == [gemm.GEMM_PROBE_SHAPES]


@needs_ext
@pytest.mark.parametrize("backend", ["mkl", "onednn"])
def test_fp32_engine_greedy_tokens_equal_transformers_on_each_gemm(llama_dir, monkeypatch, backend):
    """Greedy tokens equal transformers' fp32 generate with either fp32 GEMM, whichever this CPU
    would choose (the other correctness tests run the chosen one)."""
    if backend == "onednn" and not gemm.has_onednn_ops():
        pytest.skip("torch lacks the mkldnn linear ops")
    from radixserve import Engine, SamplingParams

    from conftest import hf_greedy, random_prompts

    pin_gemm(monkeypatch, torch.float32, backend)
    kernel_rows: list[int] = []
    real = lin.kernel()

    def spy(*args):
        kernel_rows.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setitem(lin._state, "op", spy)
    prompts = random_prompts([40, 9, 70, 3], seed=6)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eng = Engine(llama_dir, kv_cache_tokens=4096)
    got = [o.token_ids for o in eng.generate(prompts, params)]
    # one request alone: its decode steps are 1-row batches, the fp32 kernel's (where it has one)
    alone = [o.token_ids for o in eng.generate(prompts[:1], params)]
    layer = next(m for m in eng.runner.model.modules() if isinstance(m, lin.Linear))
    assert layer.packed._entry[2].is_mkldnn == (backend == "onednn")
    eng.shutdown()
    assert bool(kernel_rows) == (lin.max_rows(torch.float32) > 0)
    assert all(n <= lin.max_rows(torch.float32) for n in kernel_rows)
    assert lin.max_rows(torch.float32) == 0 or backend == "onednn"
    assert got == hf_greedy(llama_dir, prompts, 8)
    assert alone == got[:1]


def test_products_off_the_cpu_never_load_the_extension(monkeypatch):
    """A model on another device (CUDA; here the meta device) runs F.linear and never loads, let
    alone builds, the CPU extension, whatever its dtype and batch (a CUDA bf16 model once built it
    on its first product, through the AMX GEMM's check)."""
    from radixserve.kernels import build

    def refuse(*args, **kwargs):
        raise AssertionError("the CPU extension was asked for")

    monkeypatch.setattr(build, "ops", refuse)
    monkeypatch.setattr(build, "load", refuse)
    monkeypatch.setattr(lin, "_state", {})
    monkeypatch.setattr(gemm, "_state", {})
    monkeypatch.setattr(packing, "_state", {})
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        layer = lin.Linear(64, 96, device="meta", dtype=dtype)
        for rows in (1, 16, 64, 300):
            assert layer(torch.empty(rows, 64, device="meta", dtype=dtype)).shape == (rows, 96)
        assert lin.logits(torch.empty(3, 64, device="meta", dtype=dtype), layer.weight, lin.PackedWeight()).shape == (3, 96)


def test_onednn_meets_a_bounded_set_of_row_counts():
    """oneDNN keeps a compiled kernel per row count and weight (about 0.6 MiB each): a server that
    calls it with every batch size grows without end. Rows are padded to a bounded set (exact up to
    64), and the padding changes no real row's result."""
    from radixserve.kernels import gemm

    rows = [gemm.onednn_rows(m) for m in range(1, 2049)]
    assert len(set(rows)) <= 132 and all(r >= m for m, r in zip(range(1, 2049), rows))
    assert rows[:64] == list(range(1, 65)) and max(r / m for m, r in zip(range(65, 2049), rows[64:])) < 1.25
    if not gemm.has_onednn_ops():
        pytest.skip("torch without oneDNN's prepacked linear ops")
    w = torch.randn(96, 64)
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    for shape in ((65, 64), (300, 64), (3, 100, 64)):
        x = torch.randn(*shape)
        y = gemm.onednn_linear(x, packed, None)
        assert y.shape == (*shape[:-1], 96)
        assert torch.equal(y, torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))

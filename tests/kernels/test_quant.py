"""GGUF's quantized blocks multiplied in place (csrc/quant.cpp, radixserve.kernels.quant): every
type's rows equal gguf's numpy dequantize bit for bit, and its products equal
dequantize-then-matmul within fp32 tolerance, on every path (the AVX-512 rows and tiles, the
portable loops, and a build for an AVX2 CPU), for odd shapes and 1 to 512 rows. With activations
quantized to int8 (impl 4, csrc/quant_int8.cpp), each type's products equal the exact arithmetic
of the quantized activations within fp32 tolerance."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import gguf
import numpy as np
import pytest
import torch

from radixserve.kernels import build as cpu_build
from radixserve.kernels import quant
from radixserve.kernels.quant import QTYPES, QuantLinear, QuantTensor
from radixserve.testing_gguf import quantize

ops = quant.ops()
pytestmark = pytest.mark.skipif(ops is None, reason="the CPU extension is not built")
IMPLS = (1, 2, 3) if ops is not None and ops.has_avx512() else (1,)  # portable; AVX-512 rows; AVX-512 tiles
ROWS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64, 100, 512)
NO_MAP = torch.empty(0, dtype=torch.int32)


def blocks(qtype: int, n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return quantize(rng.normal(size=(n, k)).astype(np.float32), qtype)


def reference(raw: np.ndarray, qtype: int) -> torch.Tensor:
    return torch.from_numpy(gguf.dequantize(raw, gguf.GGMLQuantizationType(qtype)).reshape(raw.shape[0], -1))


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("qtype", sorted(QTYPES), ids=QTYPES.get)
def test_dequantize_equals_gguf_bit_for_bit(qtype):
    for n, k in [(1, 256), (7, 512), (33, 768)]:
        raw = blocks(qtype, n, k, seed=n)
        ref = reference(raw, qtype)
        got = ops.dequantize(torch.from_numpy(raw), qtype, k, torch.empty(0, dtype=torch.long))
        assert torch.equal(got, ref), (QTYPES[qtype], n, k)
        rows = torch.tensor([n - 1, 0, n // 2, 0])
        assert torch.equal(ops.dequantize(torch.from_numpy(raw), qtype, k, rows), ref[rows])


@pytest.mark.parametrize("qtype", sorted(QTYPES), ids=QTYPES.get)
def test_qlinear_equals_dequantize_then_matmul(qtype):
    n, k = 37, 512  # an odd N: partial tiles and thread shares
    raw = blocks(qtype, n, k, seed=qtype)
    w = reference(raw, qtype).double()
    g = torch.Generator().manual_seed(qtype)
    for m in ROWS:
        x = torch.randn(m, k, generator=g)
        ref = x.double() @ w.T
        for impl in (0, *IMPLS):
            y = ops.qlinear(x, [torch.from_numpy(raw)], [qtype], [NO_MAP], None, impl)
            assert y.shape == (m, n) and y.dtype == torch.float32
            assert relative_error(y, ref) < 2e-6, (QTYPES[qtype], m, impl)


def test_parts_of_mixed_types_row_maps_bias_and_strided_rows():
    k = 512
    raws = [blocks(12, 48, k, 1), blocks(14, 16, k, 2), blocks(8, 21, k, 3)]  # a Q4_K_M-like q / v / other
    types = [12, 14, 8]
    perm = torch.randperm(48, generator=torch.Generator().manual_seed(0)).to(torch.int32)  # all rows: computed in order, then gathered
    some = torch.tensor([3, 3, 0, 15, 7], dtype=torch.int32)  # fewer rows than the data, one twice: read through the map
    w = torch.cat([reference(raws[0], 12)[perm.long()], reference(raws[1], 14)[some.long()], reference(raws[2], 8)]).double()
    bias = torch.randn(w.shape[0])
    x_all = torch.randn(70, 2 * k)
    for m in (1, 3, 8, 70):
        x = x_all[:m, :k]  # rows strided (ldx = 2K)
        ref = torch.nn.functional.linear(x.double(), w, bias.double())
        for impl in (0, *IMPLS):
            y = ops.qlinear(x, [torch.from_numpy(r) for r in raws], types, [perm, some, NO_MAP], bias, impl)
            assert relative_error(y, ref) < 2e-6, (m, impl)


# ---- impl 4: activations quantized to int8 (csrc/quant_int8.cpp) ----------------------------------
INT8_TYPES = (2, 3, 8, 12, 14)  # Q4_0, Q4_1, Q8_0, Q4_K, Q6_K
needs_int8 = pytest.mark.skipif(ops is None or not ops.has_int8(), reason="this CPU's build has no int8 kernels (AVX-512 VNNI, VBMI)")


def group_offsets(raw: np.ndarray, qtype: int, k: int) -> np.ndarray:
    """Each weight's group offset o (w = s u + o), [N, K]: Q4_1's m, Q4_K's -dmin * min; else 0."""
    n = raw.shape[0]
    if qtype == 3:
        m = raw.reshape(n, k // 32, 20)[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float64)
        return np.repeat(m, 32, axis=1)
    if qtype == 12:
        b = raw.reshape(n, k // 256, 144)
        dmin = b[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float64)
        s = b[:, :, 4:16].astype(np.int64)
        mins = np.stack([s[:, :, j + 4] & 63 if j < 4 else (s[:, :, j + 4] >> 4) | ((s[:, :, j] >> 6) << 4) for j in range(8)], axis=-1)
        return np.repeat(-dmin[:, :, None] * mins, 32, axis=2).reshape(n, k)
    return np.zeros((n, k))


def int8_reference(raw: np.ndarray, qtype: int, x: torch.Tensor) -> torch.Tensor:
    """What impl 4 computes, in float64: x quantized per 32 values as ggml's Q8_0 (d = max|x| / 127
    in fp32, q = x * (127 / max|x|) rounded half to even), then sum (w - o) d q + o x."""
    xs = x.numpy().astype(np.float32)
    m, k = xs.shape
    w = reference(raw, qtype).double().numpy()
    o = group_offsets(raw, qtype, k)
    blocks32 = xs.reshape(m, k // 32, 32)
    amax = np.abs(blocks32).max(-1)
    d = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(blocks32 * inv[:, :, None]), -127, 127)
    xq = (q * d[:, :, None].astype(np.float64)).reshape(m, k)
    return torch.from_numpy(xq @ (w - o).T + xs.astype(np.float64) @ o.T)


@needs_int8
@pytest.mark.parametrize("qtype", INT8_TYPES, ids=QTYPES.get)
def test_int8_products_equal_their_reference(qtype):
    """Each type's int8 product equals the exact arithmetic of quantized activations (fp32
    tolerance), for odd N, K not a multiple of a kernel's 128-value chunk, 1 to 12 rows, zero and
    outlying activations; it stays within int8's error of the fp32 product; a row's result is the
    same bit for bit whatever rows come with it; past 12 rows the fp32 kernels take over."""
    g = torch.Generator().manual_seed(qtype)
    shapes = [(37, 512), (5, 256), (33, 768)] + ([(19, 544), (64, 96), (3, 32)] if qtype in (2, 3, 8) else [])
    for n, k in shapes:
        raw = blocks(qtype, n, k, seed=n + k)
        exact = reference(raw, qtype).double()
        for m in (1, 2, 3, 5, 8, 9, 12):
            x = torch.randn(m, k, generator=g)
            x[0, :32] = 0  # a block of zeros: d = 0
            x[-1, k // 2] = 40.0  # an outlier
            y = ops.qlinear(x, [torch.from_numpy(raw)], [qtype], [NO_MAP], None, 4)
            assert relative_error(y, int8_reference(raw, qtype, x)) < 2e-6, (QTYPES[qtype], n, k, m)
            assert relative_error(y, x.double() @ exact.T) < 0.05, (QTYPES[qtype], n, k, m)
            alone = ops.qlinear(x[-1:], [torch.from_numpy(raw)], [qtype], [NO_MAP], None, 4)
            assert torch.equal(y[-1:], alone), (QTYPES[qtype], n, k, m)
        x = torch.randn(13, k, generator=g)
        assert torch.equal(
            ops.qlinear(x, [torch.from_numpy(raw)], [qtype], [NO_MAP], None, 4), ops.qlinear(x, [torch.from_numpy(raw)], [qtype], [NO_MAP], None, 3)
        )


@needs_int8
def test_int8_parts_of_mixed_types_row_maps_bias_and_strided_rows():
    """A fused projection whose parts differ in type: each int8 type's part takes the int8 kernel
    (one quantization of x for all), a Q5_0 part the fp32 one; row maps, bias and strided rows hold."""
    k = 512
    types = [12, 14, 6, 2]
    raws = [blocks(12, 48, k, 1), blocks(14, 16, k, 2), blocks(6, 21, k, 3), blocks(2, 9, k, 4)]
    perm = torch.randperm(48, generator=torch.Generator().manual_seed(0)).to(torch.int32)  # all rows: computed in order, then gathered
    some = torch.tensor([3, 3, 0, 15, 7], dtype=torch.int32)  # fewer rows than the data, one twice: read through the map
    bias = torch.randn(48 + 5 + 21 + 9)
    x_all = torch.randn(12, 2 * k)
    for m in (1, 4, 8, 12):
        x = x_all[:m, :k]  # rows strided (ldx = 2K)
        y = ops.qlinear(x, [torch.from_numpy(r) for r in raws], types, [perm, some, NO_MAP, NO_MAP], bias, 4)
        xc = x.contiguous()
        want = torch.cat(
            [
                int8_reference(raws[0], 12, xc)[:, perm.long()],
                int8_reference(raws[1], 14, xc)[:, some.long()],
                xc.double() @ reference(raws[2], 6).double().T,
                int8_reference(raws[3], 2, xc),
            ],
            dim=1,
        )
        assert relative_error(y, want + bias.double()) < 2e-6, m


def test_bad_arguments_are_refused():
    raw = torch.from_numpy(blocks(2, 4, 256, 0))
    x = torch.randn(2, 256)
    with pytest.raises(RuntimeError, match="unsupported GGUF type id 10"):
        ops.qlinear(x, [raw], [10], [NO_MAP], None, 0)
    with pytest.raises(RuntimeError, match="must be a uint8 CPU tensor"):
        ops.qlinear(x, [raw], [3], [NO_MAP], None, 0)  # Q4_0's bytes read as Q4_1
    with pytest.raises(ValueError, match="row_map must be"):  # (checked once, where the kernels do not look)
        QuantTensor(raw, 2, (2, 256), torch.tensor([0, 4], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="not a multiple"):
        ops.qlinear(torch.randn(2, 100), [raw], [2], [NO_MAP], None, 0)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.dequantize(raw, 2, 256, torch.tensor([4]))
    with pytest.raises(ValueError, match="does not hold"):
        QuantTensor(raw, 3, (4, 256))


def test_quant_linear_module_matches_its_dense_twin():
    k = 256
    raws = [blocks(3, 24, k, 5), blocks(6, 40, k, 6)]  # a Q4_1 gate, a Q5_0 up
    layer = QuantLinear([QuantTensor(torch.from_numpy(r), t, (r.shape[0], k)) for r, t in zip(raws, (3, 6))])
    dense = torch.cat([reference(raws[0], 3), reference(raws[1], 6)])
    x = torch.randn(2, 5, k)  # any leading shape
    assert layer.out_features == 64 and layer.nbytes == sum(r.nbytes for r in raws)
    torch.testing.assert_close(layer(x), x @ dense.T, rtol=1e-5, atol=1e-5)
    y = layer(x.bfloat16())
    assert y.dtype == torch.bfloat16 and y.shape == (2, 5, 64)
    with pytest.raises(ValueError, match="share K"):
        QuantLinear([layer.parts[0], QuantTensor(torch.from_numpy(blocks(3, 2, 512, 0)), 3, (2, 512))])


AVX2_CHECK = """
import sys, torch, numpy as np, gguf
torch.ops.load_library(sys.argv[1])
from radixserve.testing_gguf import quantize
ops = torch.ops.radixserve_quant
assert not ops.has_avx512() and not ops.has_int8()
for qtype in (2, 3, 6, 7, 8, 12, 13, 14):
    raw = quantize(np.random.default_rng(qtype).normal(size=(19, 512)).astype(np.float32), qtype)
    ref = torch.from_numpy(gguf.dequantize(raw, gguf.GGMLQuantizationType(qtype)).reshape(19, 512))
    assert torch.equal(ops.dequantize(torch.from_numpy(raw), qtype, 512, torch.empty(0, dtype=torch.long)), ref)
    for m in (1, 3, 8, 40):
        x = torch.randn(m, 512)
        y = ops.qlinear(x, [torch.from_numpy(raw)], [qtype], [torch.empty(0, dtype=torch.int32)], None, 0)
        assert torch.equal(y, ops.qlinear(x, [torch.from_numpy(raw)], [qtype], [torch.empty(0, dtype=torch.int32)], None, 4))
        r = x.double() @ ref.double().T
        assert ((y.double() - r).abs().max() / r.abs().max()).item() < 2e-6, (qtype, m)
print("avx2 ok")
"""


def test_an_avx2_build_computes_the_same(tmp_path):
    # The build targets this CPU: on an AVX-512 machine (CI's) the path an AVX2 CPU runs is only
    # reachable as impl 1. Build quant.cpp and quant_int8.cpp alone for x86-64-v3 (AVX2, no AVX-512) and check its
    # results in a process of its own (the two builds register the same ops).
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if platform.machine() != "x86_64" or shutil.which(cxx) is None:
        pytest.skip("needs an x86-64 C++ compiler")
    csrc = cpu_build.csrc_dir()
    lib = tmp_path / "quant_avx2.so"
    flags = [f for f in cpu_build.CFLAGS if not f.startswith("-march")] + ["-march=x86-64-v3", "-shared", "-fPIC"]
    includes = [f"-I{csrc}", f"-I{sysconfig.get_paths()['include']}", *(f"-I{p}" for p in cpp_extension.include_paths())]
    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    cmd = [
        cxx,
        *flags,
        *includes,
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        str(csrc / "quant.cpp"),
        str(csrc / "quant_int8.cpp"),
        "-o",
        str(lib),
        f"-L{libdir}",
        "-lc10",
        "-ltorch",
        "-ltorch_cpu",
        f"-Wl,-rpath,{libdir}",
    ]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    script = tmp_path / "check.py"
    script.write_text(textwrap.dedent(AVX2_CHECK))
    run = subprocess.run([sys.executable, str(script), str(lib)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "avx2 ok" in run.stdout, run.stdout + run.stderr[-3000:]

"""The C++ CPU attention kernels (csrc/) equal the torch backend, and greedy tokens still equal
transformers with them on."""

from __future__ import annotations

import os
import platform
import random
import shutil
import sys

import pytest
import torch

from radixserve.attention.cascade import attend_with_lse
from radixserve.attention.cpu_backend import CpuAttention
from radixserve.attention.metadata import build_metadata
from radixserve.attention.torch_backend import TorchAttention
from radixserve.kernels import attention as attention_ops
from radixserve.kernels import build as cpu_build
from radixserve.kv.pool import KVPool

ext = attention_ops.ops()
# Skip only where the kernels cannot be built at all; with a compiler, a broken build must fail here.
TOOLCHAIN = shutil.which(os.environ.get("CXX", "c++")) is not None and not os.environ.get("RADIXSERVE_NO_EXT")
pytestmark = pytest.mark.skipif(ext is None and not TOOLCHAIN, reason="no C++ compiler (or RADIXSERVE_NO_EXT set): the CPU kernels cannot build")


def test_the_extension_builds_where_a_compiler_exists():
    assert ext is not None, "csrc/ did not build although a C++ compiler is present: see the warning logged above"


def test_the_sources_compile_for_a_cpu_without_avx512():
    # The build targets this CPU (-march=native), so on an AVX-512 machine (CI's) the AVX2 and
    # plain fallbacks of csrc/ are never compiled, and an error there would only show on such a
    # CPU, as a build failure and the torch backend. Compile each source for x86-64-v3 (AVX2, no
    # AVX-512), syntax only, two at a time (each compiler holds about 0.8 GB: all six at once
    # made this the suite's peak, 4.6 GB).
    import subprocess
    import sysconfig

    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if platform.machine() != "x86_64" or shutil.which(cxx) is None:
        pytest.skip("needs an x86-64 C++ compiler")
    csrc = cpu_build.csrc_dir()
    flags = [f for f in cpu_build.CFLAGS if not f.startswith(("-march", "-O"))]  # the build's own, another target
    flags += [
        "-march=x86-64-v3",
        "-fsyntax-only",
        f"-I{csrc}",
        f"-I{sysconfig.get_paths()['include']}",
        *(f"-I{path}" for path in cpp_extension.include_paths()),
    ]
    from concurrent.futures import ThreadPoolExecutor

    def check(name: str) -> tuple[int, str]:
        run = subprocess.run([cxx, *flags, str(csrc / name)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
        return run.returncode, run.stdout

    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(cpu_build.SOURCES, pool.map(check, cpu_build.SOURCES), strict=True))
    failed = {name: out for name, (code, out) in results.items() if code != 0}
    assert not failed, "\n".join(f"{name}:\n{out[-3000:]}" for name, out in failed.items())


TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=2e-3, rtol=2e-3)}
HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (6, 1)}


def make_case(seed, page_size, heads, kv_heads, dtype, *, qo_kv, groups=(), head_dim=64, layers=2, order="shuffled"):
    """A pool with random contents and a batch of (qo_len, kv_len) sequences on shuffled pages
    (``order`` "ascending"/"descending": each sequence on consecutive pages, the way a fresh pool
    allocates); the first ``share`` tokens' pages of sequences in a group are the group leader's."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-kv // page_size) for _, kv in qo_kv) + 4
    pool = KVPool(num_layers=layers, num_pages=need, page_size=page_size, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device="cpu")
    for layer in range(layers):
        pool.k[layer].copy_(torch.randn(pool.k[layer].shape, generator=g))
        pool.v[layer].copy_(torch.randn(pool.v[layer].shape, generator=g))
    free = list(range(need))
    if order == "shuffled":
        rng.shuffle(free)
    elif order == "ascending":
        free.reverse()  # pop() hands out 0, 1, 2, ...
    tables = [[free.pop() for _ in range(-(-kv // page_size))] for _, kv in qo_kv]
    for first, count, prefix in groups:
        for i in range(first + 1, first + count):
            tables[i][: prefix // page_size] = tables[first][: prefix // page_size]
    meta = build_metadata(tables, [kv for _, kv in qo_kv], [qo for qo, _ in qo_kv], page_size, groups=groups)
    t = sum(qo for qo, _ in qo_kv)
    q = torch.randn(t, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(t, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(t, kv_heads, head_dim, generator=g).to(dtype)
    return pool, meta, q, k, v


KERNEL_ONLY = 1 << 30  # dense_min_tokens that keeps every chunk on the csrc/ kernel


def both(pool, meta, q, k, v, layer=1, dense_min_tokens=None, dense_path=None, split_min_decodes=None):
    """(cpu kernels, torch oracle) outputs of one layer; each writes the same new K/V first.
    ``dense_min_tokens``: CpuAttention's many-row threshold (None: its default); ``dense_path``
    its many-row path ("gemm", "flash"; None: its default for the dtype); ``split_min_decodes``
    its suffix_split_min_decodes, with any number of extend tokens per decode (None: its defaults)."""
    scale = q.shape[-1] ** -0.5
    cpu = CpuAttention(pool, scale, ext)
    if dense_min_tokens is not None:
        cpu.dense_min_tokens = dense_min_tokens
    if split_min_decodes is not None:
        cpu.suffix_split_min_decodes = split_min_decodes
        cpu.suffix_split_tokens_per_decode = 1 << 30
    cpu.dense_path = dense_path
    cpu.plan(meta)
    assert split_min_decodes is None or cpu._suffix_split is not None
    got = cpu.forward(q, k, v, layer)
    ref_backend = TorchAttention(pool, scale)
    ref_backend.plan(meta)
    if q.dtype == torch.float32:
        want = ref_backend.forward(q, k, v, layer)
    else:  # the oracle in fp32 over the same (rounded) values
        f32 = KVPool(
            num_layers=len(pool.k),
            num_pages=pool.num_pages,
            page_size=pool.page_size,
            num_kv_heads=pool.k[0].shape[2],
            head_dim=pool.k[0].shape[3],
            dtype=torch.float32,
            device="cpu",
        )
        for i in range(len(pool.k)):
            f32.k[i].copy_(pool.k[i])
            f32.v[i].copy_(pool.v[i])
        ref_backend = TorchAttention(f32, scale)
        ref_backend.plan(meta)
        want = ref_backend.forward(q.float(), k.float(), v.float(), layer)
    return got, want


@pytest.mark.parametrize("dense", [None, KERNEL_ONLY], ids=["flash_chunks", "kernel_only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", ["mha", "gqa", "mqa"])
def test_mixed_decode_and_extend_equal_torch(dtype, page_size, layout, dense):
    heads, kv_heads = HEADS[layout]
    # decodes with short and long contexts, a fresh prefill, extends over a cached prefix,
    # a one-token context and a chunk crossing pages
    qo_kv = [(1, 1), (1, 37), (1, 1500), (19, 19), (7, 300), (1, 16), (40, 41), (3, 17), (1, 700)]
    pool, meta, q, k, v = make_case(page_size * 31 + heads, page_size, heads, kv_heads, dtype, qo_kv=qo_kv)
    got, want = both(pool, meta, q, k, v, dense_min_tokens=dense)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_only_split_contexts_equal_torch(page_size):
    # few rows and long contexts: the kernel splits each context and merges the splits
    qo_kv = [(1, 4000), (1, 2500), (1, 257)]
    pool, meta, q, k, v = make_case(3, page_size, 8, 2, torch.float32, qo_kv=qo_kv)
    got, want = both(pool, meta, q, k, v)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seqs", [1, 6])
def test_items_over_several_kv_heads_equal_torch(seqs, page_size, dtype, threads):
    # sequences with few rows per KV head (decodes, 1-3 token extends) take one work item over
    # several KV heads. With six sequences, the short contexts get items of all 3 KV heads at 1
    # thread, of 2 and then 1 at 2 threads, of 1 at 4 (too few sequences for the threads); the
    # long ones all 3, split by context where the threads need more items. The lone short
    # decode gets items of 1 KV head.
    qo_kv = [(1, 300), (2, 2600), (1, 40), (3, 3), (1, 1100), (1, 9)][:seqs] if seqs > 1 else [(1, 200)]
    pool, meta, q, k, v = make_case(seqs * 7 + page_size, page_size, 6, 3, dtype, qo_kv=qo_kv)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, want = both(pool, meta, q, k, v, dense_min_tokens=KERNEL_ONLY)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dense", [None, KERNEL_ONLY], ids=["flash_chunks", "kernel_only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", ["mha", "gqa", "mqa"])
def test_many_query_blocks_over_long_contexts_equal_torch(dtype, page_size, layout, dense):
    # Each (sequence, KV head) of a long chunk has many query blocks; the kernel gathers that
    # pair's K/V once and every block reuses it. Several such sequences of different lengths sit
    # side by side (a wrong offset or head in the shared gather shows up), next to a chunk with a
    # single block (gathers its own tiles), a fresh prefill and decodes.
    heads, kv_heads = HEADS[layout]
    qo_kv = [(150, 1800), (1, 900), (96, 96), (70, 1300), (5, 400), (33, 2100)]
    pool, meta, q, k, v = make_case(page_size * 7 + heads + 100, page_size, heads, kv_heads, dtype, qo_kv=qo_kv)
    got, want = both(pool, meta, q, k, v, dense_min_tokens=dense)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("path", ["gemm", "flash"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", ["mha", "gqa", "mqa"])
def test_many_row_paths_big_chunks_equal_torch(dtype, page_size, layout, path):
    # Big chunks (the own causal part and the folded prefix part, hundreds of rows) next to small
    # ones, a chunk exactly at the flash threshold, one just below it (csrc/ kernel), and decodes.
    from radixserve.attention.cpu_backend import dense_min_tokens_for

    heads, kv_heads = HEADS[layout]
    least = dense_min_tokens_for(dtype, path)
    qo_kv = [(300, 300), (1, 500), (261, 1200), (least, 900), (least - 1, 300), (1, 1)]
    pool, meta, q, k, v = make_case(page_size * 5 + heads + 300, page_size, heads, kv_heads, dtype, qo_kv=qo_kv)
    got, want = both(pool, meta, q, k, v, dense_path=path)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("path", ["gemm", "flash"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_level0_many_rows_equal_torch(dtype, path):
    # 40 grouped decodes x 8 heads: the prefix level is one folded flash call of 160 rows per KV
    # head, next to a group of 3 and an ungrouped extend.
    qo_kv = [(1, 700)] * 40 + [(1, 400), (1, 410), (1, 420), (30, 500)]
    groups = ((0, 40, 640), (40, 3, 384))
    pool, meta, q, k, v = make_case(77, 1, 8, 2, dtype, qo_kv=qo_kv, groups=groups)
    got, want = both(pool, meta, q, k, v, dense_path=path)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("head_dim", [16, 48, 80, 256])
def test_many_row_products_every_head_dim_equal_torch(head_dim):
    """The GEMM-tiled path's products (AVX-512: keys transposed in 16 x 16 blocks, then 8 x 32
    register tiles) at head dims that leave partial blocks and tiles: 37 grouped decodes x 4 heads
    per KV head over a 300-key prefix (a partial key tile), and a 45-token extend."""
    qo_kv = [(1, 333)] * 37 + [(45, 290)]
    pool, meta, q, k, v = make_case(head_dim, 1, 8, 2, torch.float32, qo_kv=qo_kv, groups=((0, 37, 300),), head_dim=head_dim)
    got, want = both(pool, meta, q, k, v, dense_path="gemm")
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("path", ["gemm", "flash"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_cascade_groups_equal_torch(dtype, page_size, path):
    # two groups (one with an empty shared prefix), ungrouped decodes and extends around them
    qo_kv = [(5, 60), (1, 300), (1, 290), (1, 333), (1, 50), (1, 20), (1, 70), (9, 9), (40, 400)]
    groups = ((1, 3, 256), (5, 2, 0))
    pool, meta, q, k, v = make_case(11 + page_size, page_size, 8, 2, dtype, qo_kv=qo_kv, groups=groups)
    got, want = both(pool, meta, q, k, v, dense_path=path)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_grouped_decodes_then_ungrouped_decodes_equal_torch(dtype, page_size):
    """Decodes in cascade groups first, then decodes in none (what the scheduler builds when a
    group's straggler decodes next to it): one decode-kernel call over the members' suffixes and
    the others' whole contexts, the prefix level and the merge for the grouped rows only; and
    the fused decode layers get the same arguments (decode_kernel_args)."""
    qo_kv = [(1, 300), (1, 290), (1, 333), (1, 270), (1, 264), (1, 50), (1, 1), (1, 700)]
    groups = ((0, 3, 256), (3, 2, 256))
    pool, meta, q, k, v = make_case(31 + page_size, page_size, 8, 2, dtype, qo_kv=qo_kv, groups=groups)
    cpu = CpuAttention(pool, q.shape[-1] ** -0.5, ext)
    cpu.plan(meta)
    args = cpu.decode_kernel_args()
    assert cpu._combined is not None and args is not None and len(args.prefix) == 4
    assert args.qo_indptr.tolist() == list(range(len(qo_kv) + 1))  # every row, grouped ones first
    assert int(args.prefix[0][-1]) == 5  # the prefix level covers the five grouped rows
    got, want = both(pool, meta, q, k, v)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("split", [None, 1], ids=["one_call", "decodes_apart"])
@pytest.mark.parametrize("path", ["gemm", "flash"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_cascade_groups_with_extends_equal_torch(dtype, page_size, path, split):
    # groups of extend chunks and decodes over a shared prefix (level 1 on the GEMM kernel,
    # bottom-right causal in each suffix; with split 1 its two decodes on the decode kernel),
    # a group of extends only, ungrouped sequences around
    qo_kv = [(5, 60), (17, 400), (1, 290), (130, 420), (1, 300), (8, 80), (33, 70), (9, 9), (40, 400)]
    groups = ((1, 4, 256), (5, 2, 32))
    pool, meta, q, k, v = make_case(17 + page_size, page_size, 8, 2, dtype, qo_kv=qo_kv, groups=groups)
    assert not meta.cascade.decodes_only
    got, want = both(pool, meta, q, k, v, dense_path=path, split_min_decodes=split)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_many_decodes_next_to_extends_take_the_decode_kernel(dtype, page_size):
    """A fleet-like level 1: a group whose decodes and turns of a few tokens interleave (rows not
    one run), and one with many decodes and a single extend. At the default threshold the decodes
    go to the decode kernel and the extends to the GEMM kernel; outputs equal the oracle's."""
    first = [(1, 40 + i) if i % 6 else (9, 48 + i) for i in range(24)]  # 20 decodes, 4 turns of 9
    second = [(1, 70 + i) for i in range(16)] + [(5, 90)]
    qo_kv = [(3, 30)] + first + second + [(1, 500)]
    groups = ((1, len(first), 32), (1 + len(first), len(second), 48))
    pool, meta, q, k, v = make_case(41 + page_size, page_size, 8, 2, dtype, qo_kv=qo_kv, groups=groups)
    cpu = CpuAttention(pool, q.shape[-1] ** -0.5, ext)
    cpu.plan(meta)
    assert cpu._suffix_split is not None
    (dec_rows, dec_qo, *_), (ext_rows, ext_qo, *_) = cpu._suffix_split
    assert dec_qo.tolist() == list(range(36 + 1)) and int(ext_qo[-1]) == 4 * 9 + 5
    assert isinstance(dec_rows, torch.Tensor) and isinstance(ext_rows, torch.Tensor)  # interleaved: gathered
    assert cpu.suffix_level(dec_qo) and cpu.suffix_level(meta.cascade.suffix_qo_indptr)
    assert not cpu.suffix_level(meta.qo_indptr)
    got, want = both(pool, meta, q, k, v)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    cpu.suffix_split_min_decodes = 37  # more than the 36 decodes: one call again
    cpu.plan(meta)
    assert cpu._suffix_split is None
    cpu.suffix_split_min_decodes = 8
    cpu.suffix_split_tokens_per_decode = 1  # 36 decodes against 41 extend tokens: one call
    cpu.plan(meta)
    assert cpu._suffix_split is None


def test_few_decodes_next_to_long_extends_stay_in_one_call():
    """GSP's level 1 (9 decodes next to 7 questions of 128 tokens) keeps one call at the defaults:
    there the second call's copies of the extends' rows cost more than the decodes save."""
    qo_kv = [(1, 1100 + i) for i in range(9)] + [(128, 1152)] * 7
    pool, meta, q, k, v = make_case(5, 1, 8, 2, torch.bfloat16, qo_kv=qo_kv, groups=((0, 16, 1024),))
    cpu = CpuAttention(pool, q.shape[-1] ** -0.5, ext)
    cpu.plan(meta)
    assert not meta.cascade.decodes_only and cpu._suffix_split is None


def test_empty_context_and_lse_base2():
    # non-causal level with an empty KV set: out 0, lse -inf; otherwise lse equals the torch one
    pool, _, q, _, _ = make_case(5, 16, 4, 2, torch.float32, qo_kv=[(1, 64)])
    pages = torch.tensor([0, 1, 2], dtype=torch.int32)
    q = torch.randn(6, 4, 64)
    qo_indptr = torch.tensor([0, 2, 6], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 0, 3], dtype=torch.int32)
    last = torch.tensor([16, 9], dtype=torch.int32)
    out, lse = ext.paged_attention(q, pool.k[0], pool.v[0], qo_indptr, kv_indptr, pages, last, 0.125, False)
    assert torch.equal(out[:2], torch.zeros_like(out[:2])) and torch.isinf(lse[:2]).all() and (lse[:2] < 0).all()
    keys = pool.k_slots(0)[: 2 * 16 + 9]
    vals = pool.v_slots(0)[: 2 * 16 + 9]
    qg = q[2:].view(4, 2, 2, 64).permute(1, 0, 2, 3).reshape(2, 8, 64)  # [Hkv, queries x group, D]
    ref_out, ref_lse = attend_with_lse(qg, keys.transpose(0, 1), vals.transpose(0, 1), 0.125)
    ref_out = ref_out.view(2, 4, 2, 64).permute(1, 0, 2, 3).reshape(4, 4, 64)
    ref_lse = ref_lse.view(2, 4, 2).permute(1, 0, 2).reshape(4, 4)
    torch.testing.assert_close(out[2:], ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse[2:], ref_lse, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [32, 40])  # (40: a partial vector of 8 after two full ones)
def test_merge_state_equals_torch(dtype, dim):
    from radixserve.attention.cascade import merge_states

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 3, dim, generator=g).to(dtype), torch.randn(5, 3, dim, generator=g).to(dtype)
    la, lb = torch.randn(5, 3, generator=g) * 4, torch.randn(5, 3, generator=g) * 4
    la[0, 0] = float("-inf")
    got = ext.merge_state(a, la, b, lb)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, merge_states(a, la, b, lb))
    else:  # the fp32 merge of the bf16 inputs, rounded once: within one bf16 rounding of it
        want = merge_states(a.float(), la, b.float(), lb)
        torch.testing.assert_close(got.float(), want, atol=1e-6, rtol=2.0**-8)


def test_rejects_bad_input():
    pool, meta, q, _, _ = make_case(1, 1, 4, 2, torch.float32, qo_kv=[(2, 5)])
    args = (meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, 0.1, True)
    with pytest.raises(RuntimeError, match="dtype"):
        ext.paged_attention(q.bfloat16(), pool.k[0], pool.v[0], *args)
    with pytest.raises(RuntimeError, match="qo_indptr"):
        ext.paged_attention(q[:1], pool.k[0], pool.v[0], *args)
    with pytest.raises(RuntimeError, match="int32"):
        ext.paged_attention(q, pool.k[0], pool.v[0], meta.qo_indptr.long(), *args[1:])


def test_unsupported_kv_dtype_falls_back_to_torch(llama_dir):
    from radixserve.attention.cpu_backend import supports

    pool = KVPool(num_layers=1, num_pages=2, page_size=1, num_kv_heads=2, head_dim=64, dtype=torch.int8, device="cpu")
    assert "int8" in supports(pool, 4)
    pool = KVPool(num_layers=1, num_pages=2, page_size=1, num_kv_heads=2, head_dim=24, dtype=torch.float32, device="cpu")
    assert "head_dim" in supports(pool, 4)


def test_engine_picks_cpu_kernels_and_greedy_matches_transformers(llama_dir):
    from radixserve import Engine, SamplingParams

    from conftest import hf_greedy, random_prompts

    prompts = random_prompts([40, 9, 70, 40], seed=3)
    prompts[3] = prompts[0][:30] + prompts[3][:10]  # a cache hit on a shared prefix
    engine = Engine(llama_dir, kv_cache_tokens=2048, max_batched_tokens=48, page_size=1)
    assert type(engine.runner.attention).__name__ == "CpuAttention"
    got = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in got] == hf_greedy(llama_dir, prompts, 12)


def test_each_version_of_the_sources_builds_in_its_own_directory(monkeypatch, tmp_path):
    """Two checkouts sharing one cache (or csrc/ edited) never rebuild over each other: the build
    directory names the sources' contents, not only torch, python and the CPU."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "attention.cpp").write_text("// one\n")
        (tmp_path / name / "common.h").write_text("// header\n")
    dirs = {}
    for name in ("a", "b"):
        monkeypatch.setattr(cpu_build, "csrc_dir", lambda name=name: tmp_path / name)
        dirs[name] = cpu_build.build_dir()
    assert dirs["a"] == dirs["b"]  # same contents, another place: one build
    (tmp_path / "b" / "common.h").write_text("// header, changed\n")  # a header counts too
    assert cpu_build.build_dir() != dirs["a"]
    assert cpu_build.build_dir().parent == dirs["a"].parent


def test_the_build_runs_this_environments_ninja(monkeypatch, tmp_path):
    """torch runs whichever ``ninja`` PATH finds: an activated venv (its own ninja) and the same
    venv's python run without activation (the system's) rebuilt the extension after each other,
    every time. The build puts the ninja package's binary first on PATH, and only while it runs."""
    import types

    own = tmp_path / "venv-bin"
    own.mkdir()
    (own / "ninja").write_text("#!/bin/sh\n")
    monkeypatch.setitem(sys.modules, "ninja", types.SimpleNamespace(BIN_DIR=str(own)))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with cpu_build._own_ninja_first():
        assert os.environ["PATH"].split(os.pathsep) == [str(own), "/usr/bin", "/bin"]
    assert os.environ["PATH"] == "/usr/bin:/bin"
    # without the package's binary, PATH is left alone
    monkeypatch.setitem(sys.modules, "ninja", types.SimpleNamespace(BIN_DIR=str(tmp_path / "nowhere")))
    with cpu_build._own_ninja_first():
        assert os.environ["PATH"] == "/usr/bin:/bin"


def test_each_torch_install_builds_in_its_own_directory(monkeypatch, tmp_path):
    """torch's include and library paths are in the build's ninja file: two environments with the
    same torch version sharing one cache (a checkout's venv and a CI clone's) rebuilt the
    extension at every switch between them. Each install now has a directory of its own."""
    here = cpu_build.build_dir()
    assert cpu_build.build_dir() == here  # (stable within one install)
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
    elsewhere = cpu_build.build_dir()
    assert elsewhere != here and elsewhere.parent == here.parent


def test_checkouts_of_the_same_sources_build_from_the_same_paths(monkeypatch, tmp_path):
    """The build compiles copies of csrc/ kept in its directory, so torch's ninja file names the
    same paths whichever checkout loads it (it named each checkout's own csrc/, and every switch
    rebuilt). A copy is rewritten only when it differs: ninja must see the old file times."""
    import os

    build = tmp_path / "build"
    build.mkdir()
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "attention.cpp").write_text("// one\n")
        (tmp_path / name / "common.h").write_text("// header\n")
    monkeypatch.setattr(cpu_build, "csrc_dir", lambda: tmp_path / "a")
    staged = cpu_build._stage_sources(build)
    assert staged.parent == build and sorted(p.name for p in staged.iterdir()) == ["attention.cpp", "common.h"]
    os.utime(staged / "attention.cpp", (1_000_000, 1_000_000))
    monkeypatch.setattr(cpu_build, "csrc_dir", lambda: tmp_path / "b")
    assert cpu_build._stage_sources(build) == staged
    assert (staged / "attention.cpp").stat().st_mtime == 1_000_000  # the same contents: untouched
    (tmp_path / "b" / "common.h").write_text("// header, changed\n")
    cpu_build._stage_sources(build)
    assert (staged / "common.h").read_text() == "// header, changed\n"


def test_build_failure_falls_back_with_one_warning(monkeypatch, tmp_path, caplog, llama_dir):
    from radixserve import Engine

    monkeypatch.setattr(cpu_build, "csrc_dir", lambda: tmp_path / "no-csrc")
    monkeypatch.setattr(cpu_build, "_state", {})
    with caplog.at_level("WARNING", logger="radixserve"):
        assert cpu_build.load() is None
        assert cpu_build.load() is None  # remembered: no second attempt, no second warning
        engine = Engine(llama_dir, kv_cache_tokens=256)
    assert type(engine.runner.attention).__name__ == "TorchAttention"
    warnings = [r for r in caplog.records if "CPU kernels unavailable" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.parametrize("order", ["ascending", "descending"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_contiguous_prefixes_read_in_place_equal_torch(order, dtype, page_size):
    # Prefixes on one contiguous range of slots are read in place (a slice, not a gather), in
    # either order of the slots; a group's shared prefix likewise.
    from radixserve.attention.cpu_dense import plan_dense

    qo_kv = [(40, 700), (300, 1000), (1, 333), (1, 343), (1, 353), (17, 17)]
    groups = ((2, 3, 320),)
    pool, meta, q, k, v = make_case(5 + page_size, page_size, 8, 2, dtype, qo_kv=qo_kv, groups=groups, order=order)
    # (descending pages of 16 with a partial last page leave a hole: that prefix is gathered)
    if order == "ascending" or page_size == 1:
        assert all(isinstance(d.prefix_slots, slice) for d in plan_dense(meta, [0, 1]))
    got, want = both(pool, meta, q, k, v)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_a_stale_torch_build_lock_is_removed_instead_of_waited_on(tmp_path, caplog):
    """A build killed midway leaves torch's ``lock`` file; the next start must not hang on it."""
    (tmp_path / "lock").touch()
    with caplog.at_level("WARNING", logger="radixserve"), cpu_build._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert "stale build lock" in caplog.text
    caplog.clear()
    with cpu_build._build_lock(tmp_path):  # nothing stale: no warning
        pass
    assert "stale" not in caplog.text


def test_the_build_lock_admits_one_builder_at_a_time(tmp_path):
    import subprocess
    import sys
    import time

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(1.5)",
            str(tmp_path / "radixserve.flock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with cpu_build._build_lock(tmp_path):
            waited = time.monotonic() - t0
        assert waited > 0.5  # it waited for the holder (a sleeping process, 1.5 s) to let go
    finally:
        holder.wait(10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_what_index_copy_writes(dtype):
    """store_kv puts each token's K/V rows in its slot, from the strided views of a fused qkv
    output as from contiguous tensors, touching no other slot; bad input is refused clearly."""
    pool = KVPool(num_layers=1, num_pages=9, page_size=4, num_kv_heads=2, head_dim=16, dtype=dtype, device="cpu")
    g = torch.Generator().manual_seed(3)
    for t in (pool.k[0], pool.v[0]):
        t.copy_(torch.randn(t.shape, generator=g))
    for tokens in (5, 300 // 16):  # (few rows: inline; the larger batch as well)
        qkv = torch.randn(tokens, (4 + 2 * 2) * 16, generator=g).to(dtype)
        k = qkv[:, 64:96].view(tokens, 2, 16)  # strided: a row of qkv apart
        v = qkv[:, 96:].view(tokens, 2, 16)
        slots = torch.randperm(36, generator=g)[:tokens]
        want_k, want_v = pool.k_slots(0).clone(), pool.v_slots(0).clone()
        want_k.index_copy_(0, slots, k)
        want_v.index_copy_(0, slots, v)
        ext.store_kv(pool.k[0], pool.v[0], slots, k, v)
        assert torch.equal(pool.k_slots(0), want_k) and torch.equal(pool.v_slots(0), want_v)
        heads_apart = torch.randn(tokens, 3, 16, generator=g).to(dtype)[:, ::2]  # heads not adjacent
        ext.store_kv(pool.k[0], pool.v[0], slots, heads_apart, heads_apart.contiguous())
        assert torch.equal(pool.k_slots(0)[slots], heads_apart) and torch.equal(pool.v_slots(0)[slots], heads_apart)
    k = torch.zeros(2, 2, 16, dtype=dtype)
    with pytest.raises(RuntimeError, match="outside the cache's 36 slots"):
        ext.store_kv(pool.k[0], pool.v[0], torch.tensor([0, 36]), k, k)
    with pytest.raises(RuntimeError, match="outside"):
        ext.store_kv(pool.k[0], pool.v[0], torch.tensor([-1, 3]), k, k)
    with pytest.raises(RuntimeError, match="int64"):
        ext.store_kv(pool.k[0], pool.v[0], torch.tensor([0, 1], dtype=torch.int32), k, k)
    with pytest.raises(RuntimeError, match="matching the cache"):
        ext.store_kv(pool.k[0], pool.v[0], torch.tensor([0, 1]), torch.zeros(2, 3, 16, dtype=dtype), k)
    with pytest.raises(RuntimeError, match="share one dtype"):
        ext.store_kv(pool.k[0], pool.v[0], torch.tensor([0, 1]), k.double(), k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_q_k_v_from_a_fused_qkv_equal_contiguous(dtype):
    """The model hands the backend q/k/v as views of one fused qkv output: the kernels read them in
    place, with the same results as contiguous copies (every path: decode, gemm, cascade)."""
    heads, kv_heads, dim = 8, 2, 64
    qo_kv = [(1, 300), (33, 300), (1, 290), (17, 17), (1, 60)]
    groups = ((0, 3, 256),)
    for grouped in (False, True):
        pool, meta, q, k, v = make_case(11, 16, heads, kv_heads, dtype, qo_kv=qo_kv, groups=groups if grouped else ())
        fused_qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
        qs, ks, vs = fused_qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
        qs, ks, vs = qs.view(-1, heads, dim), ks.view(-1, kv_heads, dim), vs.view(-1, kv_heads, dim)
        assert not qs.is_contiguous()
        cpu = CpuAttention(pool, dim**-0.5, ext)
        cpu.plan(meta)
        want = cpu.forward(q, k, v, 0)
        got = cpu.forward(qs, ks, vs, 0)
        assert got.is_contiguous() and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_short_extends_whose_first_rows_miss_a_tile_equal_torch(dtype, page_size):
    """Short causal extends on the decode kernel (MHA: under 8 rows per KV head) whose last tile
    of 32 keys begins past their first tokens' last visible key: those rows see nothing of it and
    must add nothing to their outputs (e.g. 3 tokens over 34 keys: the first sees keys 0-31)."""
    qo_kv = [(3, 34), (2, 33), (5, 37), (7, 40), (4, 65)]
    pool, meta, q, k, v = make_case(page_size + 11, page_size, 4, 4, dtype, qo_kv=qo_kv)
    got, want = both(pool, meta, q, k, v, dense_min_tokens=KERNEL_ONLY)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("head_dim", [16, 48, 80, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_rows_every_head_dim_and_dtype_equal_torch(dtype, head_dim):
    """The decode kernel's few-row paths over head dims with 1-16 blocks of 16: on AVX-512 at
    head_dim 64 and 128, fp32 and bf16 (AVX512-BF16) take attend_small_512 (scores 16 keys at a
    time, bf16 P V two keys per vdpbf16ps, so odd tiles pair a key with itself); the rest the
    widening form (every output block accumulated at once). Contexts of 1, 31, 33 and 47 keys
    end tiles at every parity and on both sides of 16."""
    qo_kv = [(1, 1), (1, 31), (1, 33), (1, 47), (1, 300), (2, 64), (3, 17), (1, 700)]
    pool, meta, q, k, v = make_case(head_dim + 7, 16, 8, 2, dtype, qo_kv=qo_kv, head_dim=head_dim)
    got, want = both(pool, meta, q, k, v, dense_min_tokens=KERNEL_ONLY)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])

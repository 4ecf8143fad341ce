"""The csrc/ GEMM prefill kernel (csrc/prefill.cpp, ``prefill_attention``) equals the torch backend
and the csrc/ decode kernel: cached prefix and own tokens in one bottom-right causal pass, GQA folded
into the query rows, K/V read in place (slots in one ascending run) or gathered (any other layout)."""

from __future__ import annotations

import pytest
import torch

from radixserve.attention.cascade import attend_with_lse

from test_cpu_kernels import HEADS, TOL, both, ext, make_case, pytestmark  # noqa: F401 (the skip mark)

# decodes, a one-token context, a fresh prefill, short and long (2-4k) contexts with and without a
# cached prefix, a chunk of several query blocks, a chunk crossing pages
CHUNKS = [(1, 1), (1, 600), (200, 200), (17, 40), (130, 2500), (300, 3100), (33, 3900), (5, 300), (64, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", ["mha", "gqa", "mqa"])
def test_prefill_kernel_in_the_backend_equals_torch(layout, page_size, dtype):
    # dense_min_tokens 1: every sequence (decodes too) on the GEMM kernel; the default: a mixed
    # decode + extend batch split between the two kernels. Slots shuffled (gathered K/V) or in
    # one ascending run (read in place), each order with both page sizes and both dtypes.
    heads, kv_heads = HEADS[layout]
    order = "ascending" if (page_size == 16) != (dtype == torch.bfloat16) else "shuffled"
    pool, meta, q, k, v = make_case(page_size * 13 + heads, page_size, heads, kv_heads, dtype, qo_kv=CHUNKS, order=order)
    for least in (1, None):
        got, want = both(pool, meta, q, k, v, dense_min_tokens=least, dense_path="gemm")
        assert got.dtype == dtype and got.shape == q.shape
        torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("order", ["shuffled", "ascending"])
def test_prefill_kernel_equals_decode_kernel_with_lse(dtype, order, causal):
    # the two csrc/ kernels on the same call, outputs and base-2 LSEs (fp16 runs widened to fp32)
    pool, meta, q, _, _ = make_case(21, 16, 8, 2, dtype, qo_kv=CHUNKS, order=order)
    args = (q, pool.k[0], pool.v[0], meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, 0.125, causal)
    out, lse = ext.prefill_attention(*args)
    ref_out, ref_lse = ext.paged_attention(*args)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)


def test_prefill_kernel_empty_context_and_lse_against_torch():
    # a non-causal "sequence" with no keys: out 0, lse -inf; the other's LSE equals torch's
    pool, _, _, _, _ = make_case(5, 16, 4, 2, torch.float32, qo_kv=[(1, 64)])
    q = torch.randn(6, 4, 64)
    qo_indptr = torch.tensor([0, 2, 6], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 0, 3], dtype=torch.int32)
    last = torch.tensor([16, 9], dtype=torch.int32)
    pages = torch.tensor([0, 1, 2], dtype=torch.int32)
    out, lse = ext.prefill_attention(q, pool.k[0], pool.v[0], qo_indptr, kv_indptr, pages, last, 0.125, False)
    assert torch.equal(out[:2], torch.zeros_like(out[:2])) and torch.isinf(lse[:2]).all() and (lse[:2] < 0).all()
    keys, vals = pool.k_slots(0)[: 2 * 16 + 9], pool.v_slots(0)[: 2 * 16 + 9]
    qg = q[2:].view(4, 2, 2, 64).permute(1, 0, 2, 3).reshape(2, 8, 64)
    ref_out, ref_lse = attend_with_lse(qg, keys.transpose(0, 1), vals.transpose(0, 1), 0.125)
    torch.testing.assert_close(out[2:], ref_out.view(2, 4, 2, 64).permute(1, 0, 2, 3).reshape(4, 4, 64), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse[2:], ref_lse.view(2, 4, 2).permute(1, 0, 2).reshape(4, 4), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("gemm", ["fp32", "brgemm", "dpbf16"])
def test_prefill_kernel_bf16_empty_context_after_another_sequence(gemm):
    # bf16: a sequence with no keys gets out 0 and lse -inf, also when its rows come after another
    # sequence's in the same thread's scratch (the AMX path does not zero its output rows first)
    if gemm == "brgemm" and not ext.bf16_brgemm():
        pytest.skip("no AMX: brgemm is not available on this CPU")
    if gemm == "dpbf16" and not ext.bf16_dpbf16():
        pytest.skip("no AVX512-BF16 here: the vdpbf16ps kernels are not built")
    pool, _, _, _, _ = make_case(5, 16, 4, 2, torch.bfloat16, qo_kv=[(1, 64)])
    q = torch.randn(6, 4, 64).bfloat16()
    qo_indptr = torch.tensor([0, 4, 6], dtype=torch.int32)  # the one with keys first (and costlier)
    kv_indptr = torch.tensor([0, 3, 3], dtype=torch.int32)
    last = torch.tensor([9, 16], dtype=torch.int32)
    pages = torch.tensor([0, 1, 2], dtype=torch.int32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (one thread: the empty sequence's items run after the other's)
    try:
        out, lse = ext.prefill_attention(q, pool.k[0], pool.v[0], qo_indptr, kv_indptr, pages, last, 0.125, False, gemm)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out[4:], torch.zeros_like(out[4:])) and torch.isinf(lse[4:]).all() and (lse[4:] < 0).all()
    assert out[:4].abs().amax() > 0 and torch.isfinite(lse[:4]).all()


@pytest.mark.parametrize("gemm", ["fp32", "brgemm", "dpbf16"])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("order", ["shuffled", "ascending"])
def test_prefill_kernel_bf16_gemms_equal_decode_kernel(gemm, head_dim, order):
    # bf16 runs widened to fp32 (the micro-kernels), on brgemm (AMX) or on vdpbf16ps (AVX512-BF16), the last two
    # over VNNI-packed K/V in column blocks of 64 (a head_dim of 80 leaves a partial block); odd context and
    # chunk lengths leave half-filled key pairs
    if gemm == "brgemm" and not ext.bf16_brgemm():
        pytest.skip("no AMX: brgemm is not available on this CPU")
    if gemm == "dpbf16" and not ext.bf16_dpbf16():
        pytest.skip("no AVX512-BF16 here: the vdpbf16ps kernels are not built")
    pool, meta, q, _, _ = make_case(
        head_dim, 1, 4, 2, torch.bfloat16, qo_kv=[(150, 700), (3, 65), (40, 40), (1, 1), (77, 333), (9, 2500)], head_dim=head_dim, order=order
    )
    args = (q, pool.k[0], pool.v[0], meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, 0.1, True)
    out, lse = ext.prefill_attention(*args, bf16_gemm=gemm)
    ref_out, ref_lse = ext.paged_attention(*args)
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL[torch.bfloat16])
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)


def test_prefill_kernel_threads_agree():
    # work items are split across threads differently with 1 and 2 threads; results agree
    pool, meta, q, _, _ = make_case(8, 1, 8, 2, torch.float32, qo_kv=[(700, 900), (2, 3)])
    args = (q, pool.k[0], pool.v[0], meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, 0.125, True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ext.prefill_attention(*args)[0]
        torch.set_num_threads(2)
        two = ext.prefill_attention(*args)[0]
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one, two, atol=1e-6, rtol=1e-6)


def test_prefill_kernel_rejects_bad_input():
    pool, meta, q, _, _ = make_case(1, 1, 4, 2, torch.float32, qo_kv=[(2, 5)])
    args = (meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, 0.1, True)
    with pytest.raises(RuntimeError, match="dtype"):
        ext.prefill_attention(q.bfloat16(), pool.k[0], pool.v[0], *args)
    with pytest.raises(RuntimeError, match="qo_indptr"):
        ext.prefill_attention(q[:1], pool.k[0], pool.v[0], *args)
    with pytest.raises(RuntimeError, match="bf16_gemm"):
        ext.prefill_attention(q, pool.k[0], pool.v[0], *args, bf16_gemm="fast")
    if not ext.bf16_dpbf16():
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            ext.prefill_attention(q.bfloat16(), pool.k[0].bfloat16(), pool.v[0].bfloat16(), *args, bf16_gemm="dpbf16")
    with pytest.raises(RuntimeError, match="qo_len <= kv_len"):
        ext.prefill_attention(
            q,
            pool.k[0],
            pool.v[0],
            meta.qo_indptr,
            torch.tensor([0, 1], dtype=torch.int32),
            meta.kv_indices[:1],
            torch.tensor([1], dtype=torch.int32),
            0.1,
            True,
        )


@pytest.mark.parametrize("dtype, gemm", [(torch.bfloat16, "auto"), (torch.bfloat16, "dpbf16"), (torch.float32, "auto")])
def test_prefill_kernel_scores_rising_past_the_running_max(dtype, gemm):
    # rows past their first key tile keep their running max from tile to tile until a lane's sum of
    # a tile's probabilities against it passes 2^8; then the tile is redone against the new max (fp32
    # from the scores it kept apart from the probabilities). Keys along a ramp toward the queries'
    # direction, so each 256-key tile's scores top the last one's by over 32: kept, the old max would
    # let the probabilities of a 1500-key context pass 2^128 (inf in fp32)
    if gemm == "dpbf16" and not ext.bf16_dpbf16():
        pytest.skip("no AVX512-BF16 here: the vdpbf16ps kernels are not built")
    scale = 0.1
    pool, meta, q, _, _ = make_case(3, 16, 4, 2, dtype, qo_kv=[(40, 1500), (3, 900)])
    u = torch.nn.functional.normalize(torch.randn(64, generator=torch.Generator().manual_seed(1)), dim=0)
    q = (q.float() * 0.3 + 8 * u).to(dtype)
    for seq in range(2):
        pages = meta.kv_indices[meta.kv_indptr[seq] : meta.kv_indptr[seq + 1]].long()
        kv_len = (len(pages) - 1) * 16 + int(meta.kv_last_page_len[seq])
        pos = torch.arange(kv_len)
        keys = pool.k[0][pages].flatten(0, 1)[:kv_len].float() * 0.3 + (pos * 0.12)[:, None, None] * u
        for i, page in enumerate(pages.tolist()):
            rows = keys[i * 16 : (i + 1) * 16]
            pool.k[0][page, : len(rows)] = rows.to(dtype)
    rise = (8 * u @ (256 * 0.12 * u)) * scale * 1.4426950408889634
    assert rise > 32  # each tile's scores top the previous tile's by this much (base 2), far past the headroom
    args = (q, pool.k[0], pool.v[0], meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, scale, True)
    out, lse = ext.prefill_attention(*args, bf16_gemm=gemm)
    ref_out, ref_lse = ext.paged_attention(*args)
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, atol=1e-3 if dtype == torch.bfloat16 else 1e-4, rtol=1e-4)

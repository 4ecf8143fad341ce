// Small-M linear layers on the CPU: y = x W^T (+ b) for decode-sized batches.
//
// x is [M, K] (rows may be strided, the last dimension contiguous), W is [N, K] in the Hugging
// Face layout (each output column's weights contiguous), b is [N]. bf16 (or fp16) inputs,
// fp32 accumulation, bf16/fp16 or fp32 output. With few rows the product is bound by reading W,
// so the kernel streams each weight row exactly once for all M rows, the output columns split
// over torch's intra-op pool (one parallel region per call).
//
// Three paths:
// - AMX (bf16, M <= 32): a work item is 16 output columns; C[16 columns, M rows] accumulates
//   A[16 W rows, 32 k] . B[16 k pairs, M rows, 2]. A is loaded straight from W at W's row stride
//   (no pre-packed weights); x is packed once per call into B's pair-interleaved layout. K tail:
//   the rows' last values in a zero-padded buffer; N tail (< 16 columns): the AVX-512 path.
// - AVX-512 (fp16; bf16 without AMX): a tile is 4 columns x up to 4 rows, 16 accumulators.
//   bf16 uses vdpbf16ps, which consumes (k, k+1) pairs of both operands: W's and x's natural
//   layout. fp16 widens to fp32 (vcvtph2ps) and uses FMAs. The K tail is a masked load (zeros
//   contribute nothing); the N tail uses 1-column tiles, the M tail smaller row tiles.
// - AVX2 (+FMA, F16C; bf16 where AVX512-BF16 is missing, fp16 where AVX-512 is, and fp32 on
//   every x86 CPU): the same tiles on 8 fp32 lanes, bf16/fp16 widened (bf16 by a 16-bit shift).
//   On an AVX2-only AMD EPYC it is 1.2-1.7x faster than torch's bf16 F.linear at 1 row and 2.3-3x
//   at 4 rows (`python -m bench roofline --dtype bfloat16 --gemv`).
// - With 1-2 rows of x (kStreamMaxRows; 1-4 for bf16 on vdpbf16ps, kStreamMaxRowsBf16) both vector
//   paths take W one row at a time, in order, with two accumulators per row: one sequential stream
//   per thread instead of four interleaved ones.
// On the Xeon of bench/RESULTS.md vdpbf16ps has no more MACs per cycle than fp32 FMAs, so the
// vector paths are compute-bound beyond a few rows; AMX stays bandwidth-bound up to 16-32 rows.
//
// Built with -march=native: without AVX2/FMA/F16C (or AVX-512) the op refuses that dtype and the
// Python side (radixserve/kernels/linear.py) keeps F.linear.
//
// fp32: MKL's packed GEMM (cblas_sgemm_pack / cblas_sgemm_compute, exported by the MKL inside
// torch's x86 wheels, like sgemm_). torch's fp32 F.linear hands W to sgemm, which re-packs all of
// W into its blocked layout on every call; at decode-sized batches (tens of rows) that copy costs
// as much as the product. pack_fp32(W, rows) packs W once ([N, K] fp32, last dimension
// contiguous) into a uint8 tensor: a 64-byte header (a magic tag, N, K, rows, the packed size and
// the packed data's address) then MKL's packed B = W^T, starting 64-byte aligned.
// packed_linear(x, packed, n, k, bias) is y = x W^T (+ b) from it: x [M, K] fp32 (rows may be
// strided, the last dimension contiguous), y [M, N] fp32, any M. With a bias, y starts as the
// bias rows and MKL adds the product (beta = 1), as torch's addmm does.
// - rows is the m MKL packs for: it picks the blocking (the size does not depend on it). Packed
//   for 16 rows, products of 2048 rows ran 1.6-2.7x slower than F.linear here; packed for 256
//   (the default), 1.03-1.65x faster than F.linear at every M from 16 to 2048 (bench shapes).
// - The packed data must not move: MKL's docs say its metadata depends on its address. The
//   header keeps that address and packed_linear refuses a moved (copied) buffer.
// - Results equal F.linear's bit for bit only where MKL adds the K products in sgemm's order: it
//   depends on the shape, M and the thread count (never below 16 rows here; at 16-2048 rows the
//   bench model's K=512 weights always, its K=1408 one never). radixserve/kernels/packed.py checks.
// - The packed copy is as large as W in resident memory (MKL's size has ~7.6 MiB more per matrix
//   that is never touched), so it doubles an fp32 model's weight memory.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

#include "aligned.h"
#include "parallel.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "avx512_math.h"
#endif

// MKL's packed sgemm (CBLAS, LP64: 32-bit ints; the CBLAS enums are ints).
extern "C" size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k);
extern "C" void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha,
                                 const float* src, int ld, float* dest);
extern "C" void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k, const float* a,
                                    int lda, const float* b, int ldb, float beta, float* c, int ldc);

namespace {

constexpr int kTileN = 4;  // output columns per tile
constexpr int kTileM = 4;  // rows of x per tile
// Up to this many rows of x, the vector paths read W one row at a time (1-column tiles, in
// order): one sequential stream per thread, which the hardware prefetcher follows at close to the
// memory's read rate; 4-column tiles read four rows of W at once. With 3-4 rows of x the 4-column
// tiles win again (4x fewer loads of x per FMA). `python -m bench roofline --gemv`, fp32, 2
// threads, AMD EPYC Zen 4: 1 row 1.3-2x faster (lm_head 3.3-3.5 -> 2.6-2.9 ms), 4 rows 0.7-1.0x.
constexpr int64_t kStreamMaxRows = 2;
// bf16 with vdpbf16ps (AVX512-BF16, no AMX) streams W one row at a time up to 4 rows (the kernel's
// most on such CPUs): on an AMD EPYC Zen 4 the 4-column tiles read W at about half the rate of
// one stream there, and vdpbf16ps (two MACs per fp32 lane) keeps up with it. `python -m bench
// roofline --dtype bfloat16 --gemv --gemv-rows 3,4` (bench/RESULTS.md section 24).
constexpr int64_t kStreamMaxRowsBf16 = 4;
constexpr int kAmxMaxM = 32;  // most rows of x on the AMX path (two C tiles of 16)

// The element types of x and W: bf16 and fp16 as raw 16-bit values, fp32 as floats.
enum class Dt { bf16, fp16, fp32 };
template <Dt D>
using Elem = std::conditional_t<D == Dt::fp32, float, uint16_t>;

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RADIXSERVE_AVX2_LINEAR 1

// AVX2 (CPUs without AVX-512, or without AVX512-BF16 for bf16): 8 fp32 lanes, FMAs. bf16 widens
// by a 16-bit shift, fp16 with vcvtph2ps (F16C); the K tail goes through zero-padded copies.
template <Dt D>
inline __m256 load8(const Elem<D>* p) {
  if constexpr (D == Dt::fp32) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (D == Dt::bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    else return _mm256_cvtph_ps(h);
  }
}

inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

template <Dt D, int MB, int NB>
inline void tile_avx2(const Elem<D>* x, int64_t ldx, const Elem<D>* w, int64_t ldw, int64_t K, float* out) {
  using E = Elem<D>;
  constexpr int64_t kLine = 64 / sizeof(E);  // elements per cache line
  // One W row (NB == 1, the streaming order of column_block): two accumulators per row of x, on
  // alternate 8-element blocks, so the FMA latency does not cap the read rate.
  constexpr int U = NB == 1 ? 2 : 1;
  __m256 acc[MB][NB * U];
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB * U; ++j) acc[i][j] = _mm256_setzero_ps();
  auto step = [&](const E* xs, int64_t lx, const E* ws, int64_t lw) {
    __m256 wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) wv[j] = load8<D>(ws + j * lw);
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i) {
      const __m256 xv = load8<D>(xs + i * lx);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  };
  int64_t k = 0;
  if constexpr (U == 2) {
    for (; k + 16 <= K; k += 16) {
      const __m256 w0 = load8<D>(w + k), w1 = load8<D>(w + k + 8);
#pragma GCC unroll 4
      for (int i = 0; i < MB; ++i) {
        acc[i][0] = _mm256_fmadd_ps(load8<D>(x + i * ldx + k), w0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(load8<D>(x + i * ldx + k + 8), w1, acc[i][1]);
      }
    }
  }
  for (; k + 8 <= K; k += 8) {
    if (NB > 1 && k % kLine == 0) {  // once per 64-byte line of each W row, two tiles ahead (as tile_bf16)
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (2 * NB + j) * ldw + k), _MM_HINT_T0);
    }
    step(x + k, ldx, w + k, ldw);
  }
  if (k < K) {  // the K tail: zeros beyond K contribute nothing
    E xt[MB][8] = {}, wt[NB][8] = {};
    const size_t bytes = sizeof(E) * static_cast<size_t>(K - k);
    for (int i = 0; i < MB; ++i) std::memcpy(xt[i], x + i * ldx + k, bytes);
    for (int j = 0; j < NB; ++j) std::memcpy(wt[j], w + j * ldw + k, bytes);
    step(&xt[0][0], 8, &wt[0][0], 8);
  }
  if constexpr (U == 2) {
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i) acc[i][0] = _mm256_add_ps(acc[i][0], acc[i][1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) out[i * NB + j] = reduce_add8(acc[i][j]);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define RADIXSERVE_HAVE_BF16 1

template <int MB, int NB>
inline void tile_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K,
                      float* out) {
  // One W row (NB == 1, the streaming order of column_block): a second accumulator per row of x
  // for alternate 32-element blocks (as tile_avx2), and no software prefetch: one sequential
  // stream per thread is what the hardware prefetcher follows best.
  constexpr int U = NB == 1 ? 2 : 1;
  __m512 acc[MB][NB * U];
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB * U; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  if constexpr (U == 2) {
    for (; k + 64 <= K; k += 64) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k), w1 = (__m512bh)_mm512_loadu_si512(w + k + 32);
#pragma GCC unroll 4
      for (int i = 0; i < MB; ++i) {
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], (__m512bh)_mm512_loadu_si512(x + i * ldx + k), w0);
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], (__m512bh)_mm512_loadu_si512(x + i * ldx + k + 32), w1);
      }
    }
  }
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      // the same k of the rows two tiles on: W streams from memory, and its short rows (1-3 KiB)
      // give the hardware prefetcher little to lock on to (a prefetch past W's end is harmless)
      if (NB > 1) _mm_prefetch(reinterpret_cast<const char*>(w + (2 * NB + j) * ldw + k), _MM_HINT_T0);
      wv[j] = (__m512bh)_mm512_loadu_si512(w + j * ldw + k);
    }
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * ldx + k);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  if (k < K) {  // the K tail: masked loads, zeros beyond K
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1);
    __m512bh wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + j * ldw + k);
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i * ldx + k);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  if constexpr (U == 2) {
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i) acc[i][0] = _mm512_add_ps(acc[i][0], acc[i][1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) out[i * NB + j] = _mm512_reduce_add_ps(acc[i][j]);
}
#define RADIXSERVE_BF16_AVX512 1
#elif defined(RADIXSERVE_AVX2_LINEAR)
#define RADIXSERVE_HAVE_BF16 1
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)  // (the intrinsics used need all three)
#define RADIXSERVE_HAVE_FP16 1

inline __m512 load_half(const uint16_t* p, __mmask16 mask) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}

template <int MB, int NB>
inline void tile_fp16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K,
                      float* out) {
  __m512 acc[MB][NB];
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? static_cast<__mmask16>(0xFFFF)
                                       : static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (2 * NB + j) * ldw + k), _MM_HINT_T0);  // as tile_bf16
      wv[j] = load_half(w + j * ldw + k, mask);
    }
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = load_half(x + i * ldx + k, mask);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) out[i * NB + j] = _mm512_reduce_add_ps(acc[i][j]);
}
#define RADIXSERVE_FP16_AVX512 1
#elif defined(RADIXSERVE_AVX2_LINEAR)
#define RADIXSERVE_HAVE_FP16 1
#endif

// fp32 (AVX2 and AVX-512 builds alike: the 8-lane tiles are bound by reading W). At 1-2 rows it
// beats oneDNN's prepacked fp32 GEMM (bench/RESULTS.md, section 20); radixserve/kernels/linear.py
// sends it no more rows than that measurement supports.
#if defined(RADIXSERVE_AVX2_LINEAR)
#define RADIXSERVE_HAVE_FP32 1
#endif


#if defined(RADIXSERVE_HAVE_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define RADIXSERVE_HAVE_AMX 1

// AMX: C[16 columns of W, up to 16 rows of x] += A[16 W rows, 32 k] . B[16 k pairs, rows of x, 2].
// A is read straight from W (16 rows at W's row stride), so W needs no packing; x is packed once
// per call into B's pair-interleaved layout, zero-padded past K. Two C/B tile pairs cover up to
// 32 rows of x.
constexpr int kAmxRows = 16;        // W rows (output columns) per tile
constexpr int kAmxBlock = 16 * 16 * 2;  // bf16 values of one packed B tile (16 k pairs x 16 rows)

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC's tile load/store intrinsics are asm statements without a memory operand: without this
// barrier it may drop or move the stores into a buffer a tile load reads (or reads after a store).
inline void memory_barrier() { __asm__ volatile("" ::: "memory"); }

bool amx_permitted() {  // Linux hands out the 8 KiB tile state only on request, once per process
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// x [M, K] -> packed [kblocks][2 halves][16 k pairs][16 rows][2], zeros past K and past M.
radixserve::AlignedVector<uint16_t> pack_x(const uint16_t* x, int64_t ldx, int64_t M, int64_t K) {
  const int64_t kblocks = (K + 31) / 32;
  radixserve::AlignedVector<uint16_t> packed(static_cast<size_t>(kblocks * 2 * kAmxBlock), 0);
  for (int64_t m = 0; m < M; ++m) {
    const int64_t half = m / 16, col = m % 16;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t kb = k / 32, pair = (k % 32) / 2;
      packed[((kb * 2 + half) * 16 + pair) * 32 + col * 2 + (k & 1)] = x[m * ldx + k];
    }
  }
  return packed;
}

// Output columns [n0, n0 + 16) for all M (<= 32) rows; tiles 0/1: C, 2: A, 3/4: B.
template <typename Out>
void amx_block(const uint16_t* xp, const uint16_t* w, int64_t ldw, int64_t M, int64_t K, int64_t N,
               int64_t n0, const float* bias, Out* y) {
  const bool two = M > 16;
  const int64_t full = K / 32;
  _tile_zero(0);
  if (two) _tile_zero(1);
  const uint16_t* wrow = w + n0 * ldw;
  // The next block's rows, one cache line per row per step: 16 short streams are more than the
  // hardware prefetcher ramps up on in time.
  const uint16_t* next = n0 + 2 * kAmxRows <= N ? wrow + kAmxRows * ldw : nullptr;
  for (int64_t kb = 0; kb < full; ++kb) {
    if (next)
      for (int r = 0; r < kAmxRows; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(next + r * ldw + kb * 32), _MM_HINT_T0);
    _tile_loadd(2, wrow + kb * 32, ldw * 2);
    _tile_loadd(3, xp + (kb * 2) * kAmxBlock, 64);
    _tile_dpbf16ps(0, 2, 3);
    if (two) {
      _tile_loadd(4, xp + (kb * 2 + 1) * kAmxBlock, 64);
      _tile_dpbf16ps(1, 2, 4);
    }
  }
  if (full * 32 < K) {  // the K tail: the 16 rows' last values, zero-padded to 32
    alignas(64) uint16_t tail[kAmxRows * 32] = {};
    const int64_t rem = K - full * 32;
    for (int r = 0; r < kAmxRows; ++r)
      std::memcpy(tail + r * 32, wrow + r * ldw + full * 32, static_cast<size_t>(rem) * 2);
    memory_barrier();
    _tile_loadd(2, tail, 64);
    _tile_loadd(3, xp + (full * 2) * kAmxBlock, 64);
    _tile_dpbf16ps(0, 2, 3);
    if (two) {
      _tile_loadd(4, xp + (full * 2 + 1) * kAmxBlock, 64);
      _tile_dpbf16ps(1, 2, 4);
    }
  }
  alignas(64) float c[2][kAmxRows * 16];
  _tile_stored(0, c[0], 64);
  if (two) _tile_stored(1, c[1], 64);
  memory_barrier();
  for (int64_t m = 0; m < M; ++m) {
    const float* col = c[m / 16] + m % 16;
    Out* row = y + m * N + n0;
    for (int j = 0; j < kAmxRows; ++j) row[j] = static_cast<Out>(col[j * 16] + (bias ? bias[n0 + j] : 0.0f));
  }
}

// ---- bf16 on AMX, any number of rows: a GEMM over a weight packed once into B tiles ----
#if defined(__AVX512BF16__)
#define RADIXSERVE_HAVE_AMX_GEMM 1
//
// y[M, N] = x[M, K] W^T: the transposed orientation of amx_block, for batches of more than
// kAmxMaxM rows. A tiles are 16 rows x 32 k of x, loaded in place (x's row stride); B tiles are W
// packed once (pack_amx) into [N/16][K/32][16 k pairs][16 columns][2], so one tile load reads a
// contiguous 1 KiB. The micro-kernel keeps four C tiles (32 rows x 32 columns) over all of K: per
// 32 k, two A and two B loads feed four tile products; it walks K in alternate directions from
// one column pair to the next and prefetches the output rows for writing (see amx_tile_pair).
// Work: the columns cut into chunks (256 columns: a chunk's B tiles, 256-720 KiB for the bench
// model, stay in L2) times row chunks of 256, handed out one at a time in column-major order
// (radixserve::parallel_tasks): the threads work down one chunk of B together, each thread's 32
// rows of A stay mostly in L1 across the chunk's column pairs, and a thread whose core runs slower
// takes fewer tasks. Row tails (M % 32) go through a zero-padded copy of those rows. oneDNN's
// bf16 brgemm matmul (F.linear, or its prepacked copy) has slow regimes on the bench model's shapes
// (about 1,000 GFLOP/s on the K = 1408 down_proj at 512-1,088 rows); at decode sizes, weights
// from memory, this GEMM took 0.48-0.86x of oneDNN's prepacked time and 0.46-0.84x of the small-M
// kernel's at 1-32 rows (`python -m bench roofline --dtype bfloat16 --gemv`, bench/RESULTS.md
// section 27).
constexpr int64_t kAmxGemmCols = 256;  // columns per chunk (a multiple of 32)
constexpr int64_t kAmxGemmRows = 256;  // rows per chunk (a multiple of 32)
constexpr int64_t kAmxTile = 16 * 32;  // bf16 values of one packed B tile

template <typename Out>
inline void amx_store_rows(const float* c, int rows, int cols, Out* y, int64_t ldy, const float* bias) {
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < cols; h += 16) {
      __m512 v = _mm512_loadu_ps(c + r * 32 + h);
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + h));
      if constexpr (std::is_same_v<Out, float>)
        _mm512_storeu_ps(y + r * ldy + h, v);
      else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + h), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

// Rows [0, rows) (rows <= 32; A of row stride lda) times two column tiles of B (b0, b1: 16
// columns each, kblocks tiles of 32 k apiece) into c [32 rows][32 columns] fp32: b0's columns in
// c's first 16, b1's in the last 16. backward walks K from its end: called for consecutive column
// pairs with alternating directions, the A lines a call reads last are the next call's first, still
// in L1 (a 32-row panel of A and a pair's B tiles, 32 KiB each at K = 512, do not both fit). out,
// out_stride: the rows of the output these sums go to, prefetched for writing while the tiles work.
inline void amx_tile_pair(const uint16_t* a, int64_t lda, int rows, const uint16_t* b0, const uint16_t* b1,
                          int64_t kblocks, float* c, bool backward, const char* out, int64_t out_stride) {
  const bool two = rows > 16;
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t per = (rows + kblocks - 1) / kblocks;  // output rows to prefetch per step of K
  for (int64_t i = 0; i < kblocks; ++i) {
    for (int64_t r = i * per, e = std::min<int64_t>(rows, r + per); r < e; ++r)
      __builtin_prefetch(out + r * out_stride, 1, 3);
    const int64_t kb = backward ? kblocks - 1 - i : i;
    _tile_loadd(4, a + kb * 32, lda * 2);
    _tile_loadd(6, b0 + kb * kAmxTile, 64);
    _tile_loadd(7, b1 + kb * kAmxTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, a + 16 * lda + kb * 32, lda * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  if (two) {
    _tile_stored(2, c + 512, 128);
    _tile_stored(3, c + 512 + 16, 128);
  }
  memory_barrier();
}

// silu(g + bias_g) * (u + bias_u) of c's rows (g: its first 16 columns, u: its last 16) into y.
template <typename Out>
inline void amx_store_glu(const float* c, int rows, Out* y, int64_t ldy, const float* bg, const float* bu) {
  for (int r = 0; r < rows; ++r) {
    __m512 g = _mm512_loadu_ps(c + r * 32), u = _mm512_loadu_ps(c + r * 32 + 16);
    if (bg) {
      g = _mm512_add_ps(g, _mm512_loadu_ps(bg));
      u = _mm512_add_ps(u, _mm512_loadu_ps(bu));
    }
    const __m512 v = radixserve::silu_mul_v<!std::is_same_v<Out, float>>(g, u);
    if constexpr (std::is_same_v<Out, float>)
      _mm512_storeu_ps(y + r * ldy, v);
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// Rows [0, rows) (rows <= 32; a contiguous A of row stride lda) times output columns [n0, n1).
// Plain (kGlu false): B's column tiles in pairs, 32 output columns at a time. kGlu: B holds
// [gate; up] (2 * inter columns, inter = half * 16), and output column j is silu(gate j) * up j:
// gate tile j / 16 paired with up tile half + j / 16, 16 output columns at a time, the activation
// applied to the fp32 sums as they leave the tiles (no [M, 2 * inter] product in memory, no
// separate pass).
template <typename Out, bool kGlu>
void amx_gemm_rows(const uint16_t* a, int64_t lda, int rows, const uint16_t* b, int64_t kblocks, int64_t n0,
                   int64_t n1, const float* bias, Out* y, int64_t ldy, int64_t half) {
  alignas(64) float c[32 * 32];
  const int64_t tile_stride = kblocks * kAmxTile;  // bf16 values of one column tile of B
  constexpr int64_t step = kGlu ? 16 : 32;
  for (int64_t n = n0; n < n1; n += step) {
    const uint16_t* b0 = b + (n / 16) * tile_stride;
    const uint16_t* b1 = kGlu ? b + (half + n / 16) * tile_stride : b0 + tile_stride;
    // (the direction by the output columns, not by the call: the same sums however the columns
    // are cut into chunks, at any thread count)
    const bool backward = (n / step) % 2 == 1;
    amx_tile_pair(a, lda, rows, b0, b1, kblocks, c, backward, reinterpret_cast<const char*>(y + n),
                  ldy * static_cast<int64_t>(sizeof(Out)));
    if constexpr (kGlu)
      amx_store_glu<Out>(c, rows, y + n, ldy, bias ? bias + n : nullptr, bias ? bias + half * 16 + n : nullptr);
    else
      amx_store_rows<Out>(c, rows, 32, y + n, ldy, bias ? bias + n : nullptr);
  }
}

// y [M, N] = x [M, K] W^T (+ bias) over pack_amx's packed W; kGlu: N = inter output columns of a
// packed [gate; up] W of 2 * inter columns (see amx_gemm_rows).
template <typename Out, bool kGlu = false>
void amx_gemm(const uint16_t* x, int64_t ldx, const uint16_t* b, int64_t M, int64_t K, int64_t N, const float* bias,
              Out* y) {
  const int64_t kblocks = K / 32;
  const int64_t step = kGlu ? 16 : 32;  // output columns per micro-kernel call
  const int64_t threads = at::get_num_threads();
  const int64_t row_chunks = (M + kAmxGemmRows - 1) / kAmxGemmRows;
  int64_t cols = kAmxGemmCols;  // narrower chunks while there are fewer tasks than threads
  while (cols > step && row_chunks * ((N + cols - 1) / cols) < threads) cols /= 2;
  const int64_t col_chunks = (N + cols - 1) / cols;
  const int64_t n_tasks = row_chunks * col_chunks;
  radixserve::parallel_tasks(n_tasks, [&](auto& next) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.rows[t] = 16;
      cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);  // per thread: the tile configuration is thread state
    radixserve::AlignedVector<uint16_t> tail;  // the zero-padded rows of a chunk's last, partial 32-row block
    for (int64_t task = next(); task < n_tasks; task = next()) {
      const int64_t cc = task / row_chunks, rc = task % row_chunks;
      const int64_t n0 = cc * cols, n1 = std::min(N, n0 + cols);
      const int64_t m_end = std::min(M, (rc + 1) * kAmxGemmRows);
      for (int64_t m = rc * kAmxGemmRows; m < m_end; m += 32) {
        const int rows = static_cast<int>(std::min<int64_t>(32, m_end - m));
        const uint16_t* a = x + m * ldx;
        int64_t lda = ldx;
        if (rows < 32) {
          tail.assign(static_cast<size_t>(32 * K), 0);
          for (int r = 0; r < rows; ++r) std::memcpy(tail.data() + r * K, a + r * ldx, static_cast<size_t>(K) * 2);
          memory_barrier();
          a = tail.data();
          lda = K;
        }
        amx_gemm_rows<Out, kGlu>(a, lda, rows, b, kblocks, n0, n1, bias, y + m * N, N, N / 16);
      }
    }
    _tile_release();
  });
}
#endif  // __AVX512BF16__
#endif

template <Dt D>
using TileFn = void (*)(const Elem<D>*, int64_t, const Elem<D>*, int64_t, int64_t, float*);

// (small_m_linear checks supports_*() first: a build without the dtype's kernel never calls this)
template <Dt D, int MB, int NB>
void tile_missing(const Elem<D>*, int64_t, const Elem<D>*, int64_t, int64_t, float*) {
  TORCH_CHECK(false, "linear: this build has no ", D == Dt::bf16 ? "bf16" : D == Dt::fp16 ? "fp16" : "fp32",
              " vector kernel");
}

// The tile of dtype D: its AVX-512 kernel where the build has one, else the AVX2 one, else none.
template <Dt D, int MB, int NB>
constexpr TileFn<D> tile_of() {
#if defined(RADIXSERVE_BF16_AVX512)
  if constexpr (D == Dt::bf16) return &tile_bf16<MB, NB>;
#endif
#if defined(RADIXSERVE_FP16_AVX512)
  if constexpr (D == Dt::fp16) return &tile_fp16<MB, NB>;
#endif
#if defined(RADIXSERVE_AVX2_LINEAR)
  return &tile_avx2<D, MB, NB>;
#else
  return &tile_missing<D, MB, NB>;
#endif
}

// Tile functions indexed by [rows - 1][columns == kTileN].
template <Dt D>
TileFn<D> tile_fn(int rows, int cols) {
#define RADIXSERVE_TILE(MB, NB) tile_of<D, MB, NB>()
  static const TileFn<D> table[kTileM][2] = {
      {RADIXSERVE_TILE(1, 1), RADIXSERVE_TILE(1, 4)},
      {RADIXSERVE_TILE(2, 1), RADIXSERVE_TILE(2, 4)},
      {RADIXSERVE_TILE(3, 1), RADIXSERVE_TILE(3, 4)},
      {RADIXSERVE_TILE(4, 1), RADIXSERVE_TILE(4, 4)},
  };
#undef RADIXSERVE_TILE
  return table[rows - 1][cols == kTileN ? 1 : 0];
}

template <typename Out>
inline Out cast_out(float v) {
  return static_cast<Out>(v);
}

// Most rows of x for which dtype D reads W one row at a time (column_block); at most kTileM.
template <Dt D>
constexpr int64_t stream_max_rows() {
#if defined(RADIXSERVE_BF16_AVX512)
  if constexpr (D == Dt::bf16) return kStreamMaxRowsBf16;
#endif
  return kStreamMaxRows;
}

// Columns [n0, n0 + cols) for all M rows.
template <Dt D, typename Out>
void column_block(const Elem<D>* x, int64_t ldx, const Elem<D>* w, int64_t ldw, int64_t M,
                  int64_t K, int64_t N, int64_t n0, int cols, const float* bias, Out* y) {
  static_assert(stream_max_rows<D>() <= kTileM, "the streaming tiles come from tile_fn's table");
  float sums[kTileM * kTileN];
  if (M <= stream_max_rows<D>()) {  // one W row at a time: a single sequential stream per thread
    const TileFn<D> tile = tile_fn<D>(static_cast<int>(M), 1);
    for (int j = 0; j < cols; ++j) {
      tile(x, ldx, w + (n0 + j) * ldw, ldw, K, sums);
      const float b = bias ? bias[n0 + j] : 0.0f;
      for (int i = 0; i < M; ++i) y[i * N + n0 + j] = cast_out<Out>(sums[i] + b);
    }
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += kTileM) {
    const int rows = static_cast<int>(std::min<int64_t>(kTileM, M - m0));
    tile_fn<D>(rows, cols)(x + m0 * ldx, ldx, w + n0 * ldw, ldw, K, sums);
    for (int i = 0; i < rows; ++i) {
      Out* row = y + (m0 + i) * N + n0;
      for (int j = 0; j < cols; ++j) {
        const float v = sums[i * cols + j] + (bias ? bias[n0 + j] : 0.0f);
        row[j] = cast_out<Out>(v);
      }
    }
  }
}

template <Dt D, typename Out>
void run(const Elem<D>* x, int64_t ldx, const Elem<D>* w, int64_t ldw, int64_t M, int64_t K,
         int64_t N, const float* bias, Out* y, bool amx) {
  // At least ~64 KiB of weights per chunk, so small layers do not pay for threads they cannot use.
  const int64_t grain_rows = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, K * static_cast<int64_t>(sizeof(Elem<D>))));
#if defined(RADIXSERVE_HAVE_AMX)
  if constexpr (D == Dt::bf16) {
    if (amx) {
      const radixserve::AlignedVector<uint16_t> xp = pack_x(x, ldx, M, K);
      TileConfig cfg;
      const int cols0 = static_cast<int>(std::min<int64_t>(M, 16)), cols1 = static_cast<int>(M - cols0);
      cfg.rows[0] = cfg.rows[2] = cfg.rows[3] = 16;
      cfg.colsb[0] = cfg.colsb[3] = static_cast<uint16_t>(cols0 * 4);
      cfg.colsb[2] = 64;
      if (cols1 > 0) {
        cfg.rows[1] = cfg.rows[4] = 16;
        cfg.colsb[1] = cfg.colsb[4] = static_cast<uint16_t>(cols1 * 4);
      }
      const int64_t full = N / kAmxRows;
      const int64_t blocks = full + (N % kAmxRows ? 1 : 0);
      at::parallel_for(0, blocks, std::max<int64_t>(1, grain_rows / kAmxRows), [&](int64_t begin, int64_t end) {
        _tile_loadconfig(&cfg);  // per thread: the tile configuration is thread state
        for (int64_t b = begin; b < std::min(end, full); ++b)
          amx_block<Out>(xp.data(), w, ldw, M, K, N, b * kAmxRows, bias, y);
        _tile_release();
        if (end > full) {  // the N tail (< 16 columns) on AVX-512
          for (int64_t n = full * kAmxRows; n < N; ++n)
            column_block<D, Out>(x, ldx, w, ldw, M, K, N, n, 1, bias, y);
        }
      });
      return;
    }
  }
#endif
  (void)amx;
  const int64_t full = N / kTileN;
  const int64_t blocks = full + (N % kTileN ? 1 : 0);
  at::parallel_for(0, blocks, std::max<int64_t>(1, grain_rows / kTileN), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if (b < full) {
        column_block<D, Out>(x, ldx, w, ldw, M, K, N, b * kTileN, kTileN, bias, y);
      } else {
        for (int64_t n = full * kTileN; n < N; ++n)  // the N tail, one column at a time
          column_block<D, Out>(x, ldx, w, ldw, M, K, N, n, 1, bias, y);
      }
    }
  });
}

bool supports_bf16() {
#if defined(RADIXSERVE_HAVE_BF16)
  return true;
#else
  return false;
#endif
}

bool supports_amx() {
#if defined(RADIXSERVE_HAVE_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

bool supports_fp16() {
#if defined(RADIXSERVE_HAVE_FP16)
  return true;
#else
  return false;
#endif
}

bool supports_fp32() {
#if defined(RADIXSERVE_HAVE_FP32)
  return true;
#else
  return false;
#endif
}

// The bias as float32 values: bias's own data when it is a contiguous float32 [N], else a copy in
// ``storage`` (a std::vector: cheaper than a tensor op per call). nullptr without a bias.
const float* bias_fp32(const c10::optional<torch::Tensor>& bias, int64_t N, at::ScalarType dtype,
                       std::vector<float>& storage, const char* op) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, op, ": bias must be [N]=[", N, "], got ", bias->sizes());
  const auto bt = bias->scalar_type();
  TORCH_CHECK(bt == at::kFloat || bt == dtype, op, ": bias must be float32 or ", dtype, ", got ", bt);
  if (bt == at::kFloat && bias->is_contiguous()) return bias->data_ptr<float>();
  const auto bc = bias->contiguous();
  storage.resize(static_cast<size_t>(N));
  if (bt == at::kFloat) {
    std::copy_n(bc.data_ptr<float>(), N, storage.data());
  } else if (bt == at::kBFloat16) {
    const auto* src = bc.data_ptr<c10::BFloat16>();
    for (int64_t j = 0; j < N; ++j) storage[j] = static_cast<float>(src[j]);
  } else {
    const auto* src = bc.data_ptr<c10::Half>();
    for (int64_t j = 0; j < N; ++j) storage[j] = static_cast<float>(src[j]);
  }
  return storage.data();
}

torch::Tensor small_m_linear(const torch::Tensor& x, const torch::Tensor& weight,
                             const c10::optional<torch::Tensor>& bias, bool fp32_out, int64_t impl) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "linear: x must be [M, K] and weight [N, K], got ",
              x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "linear: x is ", x.scalar_type(),
              " but weight is ", weight.scalar_type());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat,
              "linear: bfloat16, float16 or float32 only, got ", dtype);
  TORCH_CHECK(dtype == at::kBFloat16 ? supports_bf16() : dtype == at::kHalf ? supports_fp16() : supports_fp32(),
              "linear: this build has no vector kernel for ", dtype, " (use F.linear)");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, "linear: x has K=", K, " but weight is ", weight.sizes());
  TORCH_CHECK(K > 0 && N > 0, "linear: empty K or N");
  TORCH_CHECK(x.stride(1) == 1 && weight.stride(1) == 1,
              "linear: the last dimension of x and weight must be contiguous (got strides ",
              x.strides(), " and ", weight.strides(), ")");
  TORCH_CHECK(impl >= 0 && impl <= 2, "linear: impl must be 0 (auto), 1 (vector: AVX-512 or AVX2) or 2 (AMX)");
  // auto: AMX for bf16 up to 32 rows when the CPU and the OS allow it, else the vector path
  const bool amx_ok = dtype == at::kBFloat16 && supports_amx() && M <= kAmxMaxM;
  TORCH_CHECK(impl != 2 || amx_ok, "linear: the AMX path needs bf16, at most 32 rows, and AMX");
  const bool amx = impl == 2 || (impl == 0 && amx_ok);
  std::vector<float> bias_storage;
  const float* bp = bias_fp32(bias, N, dtype, bias_storage, "linear");
  auto y = torch::empty({M, N}, x.options().dtype(fp32_out ? at::kFloat : dtype));
  if (M == 0) return y;
  const int64_t ldx = x.stride(0), ldw = weight.stride(0);
  if (dtype == at::kFloat) {
    run<Dt::fp32, float>(x.data_ptr<float>(), ldx, weight.data_ptr<float>(), ldw, M, K, N, bp, y.data_ptr<float>(),
                         false);
    return y;
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  if (dtype == at::kBFloat16) {
    if (fp32_out)
      run<Dt::bf16, float>(xp, ldx, wp, ldw, M, K, N, bp, y.data_ptr<float>(), amx);
    else
      run<Dt::bf16, c10::BFloat16>(xp, ldx, wp, ldw, M, K, N, bp, y.data_ptr<c10::BFloat16>(), amx);
  } else {
    if (fp32_out)
      run<Dt::fp16, float>(xp, ldx, wp, ldw, M, K, N, bp, y.data_ptr<float>(), false);
    else
      run<Dt::fp16, c10::Half>(xp, ldx, wp, ldw, M, K, N, bp, y.data_ptr<c10::Half>(), false);
  }
  return y;
}

// ---- bf16 on AMX: the packed weight and the GEMM over it (amx_gemm) ----

bool supports_amx_gemm() {
#if defined(RADIXSERVE_HAVE_AMX_GEMM)
  return amx_permitted();
#else
  return false;
#endif
}

// W [N, K] bf16 (N and K multiples of 32) -> [N/16, K/32, 16, 32] bf16: B tiles of 16 k pairs x 16
// columns x 2, each tile's 1 KiB contiguous, a column block's K tiles in order.
torch::Tensor pack_amx(const torch::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2,
              "pack_amx: weight must be a bfloat16 [N, K] CPU tensor, got ", weight.scalar_type(), " ", weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N > 0 && K > 0 && N % 32 == 0 && K % 32 == 0, "pack_amx: N and K must be positive multiples of 32, got ",
              weight.sizes());
  const auto w = weight.contiguous();
  auto packed = torch::empty({N / 16, K / 32, 16, 32}, weight.options());
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  const int64_t kblocks = K / 32;
  at::parallel_for(0, N / 16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb)
      for (int64_t kb = 0; kb < kblocks; ++kb) {
        uint16_t* tile = dst + (nb * kblocks + kb) * 512;
        for (int pair = 0; pair < 16; ++pair)
          for (int col = 0; col < 16; ++col) {
            const uint16_t* from = src + (nb * 16 + col) * K + kb * 32 + pair * 2;
            tile[(pair * 16 + col) * 2] = from[0];
            tile[(pair * 16 + col) * 2 + 1] = from[1];
          }
      }
  });
  return packed;
}

// y = x W^T (+ b) from pack_amx's packed W: x [M, K] bf16 (rows may be strided, the last dimension
// contiguous), y [M, N] bf16, or float32 (the sums unrounded) with fp32_out.
// x [M, K] bf16 rows and pack_amx's tiles for amx_linear (name) and amx_linear_silu (pairs: an even
// number of column tiles, [gate; up]); returns N, the packed weight's rows.
int64_t check_amx_inputs(const torch::Tensor& x, const torch::Tensor& packed, const char* name, bool pairs) {
  TORCH_CHECK(supports_amx_gemm(), name, ": this build or CPU has no AMX GEMM");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2,
              name, ": x must be a bfloat16 [M, K] CPU tensor, got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == 16 &&
                  packed.size(3) == 32 && packed.is_contiguous() && (!pairs || packed.size(0) % 2 == 0),
              name, ": packed must be the [N/16, K/32, 16, 32] tensor pack_amx returned",
              pairs ? " for an even number of column tiles" : "", ", got ", packed.sizes());
  const int64_t K = x.size(1);
  TORCH_CHECK(packed.size(1) * 32 == K, name, ": x has K=", K, " but the packed weight has K=", packed.size(1) * 32);
  TORCH_CHECK(x.stride(1) == 1 && x.stride(0) >= K, name, ": x's rows must be contiguous and not overlap (strides ",
              x.strides(), ")");
  return packed.size(0) * 16;
}

torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                         bool fp32_out) {
  const int64_t N = check_amx_inputs(x, packed, "amx_linear", false);
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<float> bias_storage;
  const float* bp = bias_fp32(bias, N, at::kBFloat16, bias_storage, "amx_linear");
  auto y = torch::empty({M, N}, x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
#if defined(RADIXSERVE_HAVE_AMX_GEMM)
  if (M == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  if (fp32_out)
    amx_gemm<float>(xp, x.stride(0), wp, M, K, N, bp, y.data_ptr<float>());
  else
    amx_gemm<c10::BFloat16>(xp, x.stride(0), wp, M, K, N, bp, y.data_ptr<c10::BFloat16>());
#endif
  return y;
}

// silu(gate) * up of y = x W^T (+ bias) for pack_amx's packed W = [gate; up] (rows 0..inter-1 the
// gate projection, inter..2*inter-1 the up projection, as the model's gate_up_proj): y [M, inter]
// bf16, the activation applied to the GEMM's fp32 sums in its epilogue (amx_gemm_rows, kGlu).
torch::Tensor amx_linear_silu(const torch::Tensor& x, const torch::Tensor& packed,
                              const c10::optional<torch::Tensor>& bias) {
  const int64_t N = check_amx_inputs(x, packed, "amx_linear_silu", true);
  const int64_t M = x.size(0), K = x.size(1), inter = N / 2;
  std::vector<float> bias_storage;
  const float* bp = bias_fp32(bias, N, at::kBFloat16, bias_storage, "amx_linear_silu");
  auto y = torch::empty({M, inter}, x.options().dtype(at::kBFloat16));
#if defined(RADIXSERVE_HAVE_AMX_GEMM)
  if (M == 0) return y;
  amx_gemm<c10::BFloat16, true>(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0),
                                reinterpret_cast<const uint16_t*>(packed.data_ptr()), M, K, inter, bp,
                                y.data_ptr<c10::BFloat16>());
#endif
  return y;
}

// ---- fp32: MKL's packed GEMM ----

constexpr int kCblasRowMajor = 101, kCblasNoTrans = 111, kCblasTrans = 112, kCblasPacked = 151,
              kCblasBMatrix = 162;
constexpr int64_t kPackHeader = 64;  // bytes before the packed data (keeps it 64-byte aligned)
constexpr int64_t kPackAlign = 64;
constexpr char kPackMagic[8] = {'R', 'S', 'P', 'A', 'C', 'K', '2', '\0'};

struct PackHeader {
  char magic[8];
  int64_t n, k, rows, bytes;
  uint64_t address;  // of the packed data when packed: MKL's packed data must not move
};
static_assert(sizeof(PackHeader) <= kPackHeader, "the header must fit its 64 bytes");

constexpr int64_t kIntMax = std::numeric_limits<int>::max();

torch::Tensor pack_fp32(const torch::Tensor& weight, int64_t rows) {
  TORCH_CHECK(weight.device().is_cpu(), "pack_fp32: weight must be a CPU tensor");
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "pack_fp32: weight must be float32, got ", weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2, "pack_fp32: weight must be [N, K], got ", weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N > 0 && K > 0, "pack_fp32: empty weight ", weight.sizes());
  TORCH_CHECK(weight.stride(1) == 1 || K == 1,
              "pack_fp32: the last dimension of weight must be contiguous (got strides ", weight.strides(), ")");
  const int64_t ld = N == 1 ? K : weight.stride(0);
  TORCH_CHECK(ld >= K, "pack_fp32: weight rows overlap (row stride ", weight.stride(0), " < K=", K, ")");
  TORCH_CHECK(N <= kIntMax && K <= kIntMax && ld <= kIntMax, "pack_fp32: weight ", weight.sizes(), " (row stride ",
              ld, ") exceeds MKL's 32-bit sizes");
  TORCH_CHECK(rows > 0 && rows <= kIntMax, "pack_fp32: rows must be positive, got ", rows);
  const auto bytes = static_cast<int64_t>(cblas_sgemm_pack_get_size(kCblasBMatrix, static_cast<int>(rows),
                                                                     static_cast<int>(N), static_cast<int>(K)));
  TORCH_CHECK(bytes > 0, "pack_fp32: MKL returned no packed size for ", weight.sizes());
  // over-allocate, then start the result at a 64-byte boundary (torch's CPU allocator aligns to 64
  // already; this does not rely on it)
  auto raw = torch::empty({kPackHeader + bytes + kPackAlign}, weight.options().dtype(at::kByte));
  const auto addr = reinterpret_cast<uintptr_t>(raw.data_ptr());
  const auto offset = static_cast<int64_t>((kPackAlign - addr % kPackAlign) % kPackAlign);
  auto packed = raw.narrow(0, offset, kPackHeader + bytes);
  auto* base = static_cast<uint8_t*>(packed.data_ptr());
  PackHeader header{};
  std::memcpy(header.magic, kPackMagic, sizeof(kPackMagic));
  header.n = N;
  header.k = K;
  header.rows = rows;
  header.bytes = bytes;
  header.address = reinterpret_cast<uint64_t>(base + kPackHeader);
  std::memset(base, 0, kPackHeader);
  std::memcpy(base, &header, sizeof(header));
  cblas_sgemm_pack(kCblasRowMajor, kCblasBMatrix, kCblasTrans, static_cast<int>(rows), static_cast<int>(N),
                   static_cast<int>(K), 1.0f, weight.data_ptr<float>(), static_cast<int>(ld),
                   reinterpret_cast<float*>(base + kPackHeader));
  return packed;
}

torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, int64_t k,
                            const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "packed_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "packed_linear: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, "packed_linear: x must be [M, K], got ", x.sizes());
  TORCH_CHECK(n > 0 && k > 0 && n <= kIntMax && k <= kIntMax, "packed_linear: bad n=", n, " or k=", k);
  TORCH_CHECK(x.size(1) == k, "packed_linear: x has K=", x.size(1), " but the packed weight has k=", k);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 1 && packed.is_contiguous() &&
                  packed.numel() >= kPackHeader,
              "packed_linear: packed must be the uint8 tensor pack_fp32 returned");
  const auto* base = static_cast<const uint8_t*>(packed.data_ptr());
  PackHeader header;
  std::memcpy(&header, base, sizeof(header));
  TORCH_CHECK(std::memcmp(header.magic, kPackMagic, sizeof(kPackMagic)) == 0,
              "packed_linear: packed is not a pack_fp32 result (bad header)");
  TORCH_CHECK(header.n == n && header.k == k, "packed_linear: packed holds a [", header.n, ", ", header.k,
              "] weight, not [", n, ", ", k, "]");
  TORCH_CHECK(packed.numel() == kPackHeader + header.bytes, "packed_linear: packed has ", packed.numel(),
              " bytes, expected ", kPackHeader + header.bytes);
  TORCH_CHECK(header.address == reinterpret_cast<uint64_t>(base + kPackHeader),
              "packed_linear: packed was copied or moved since pack_fp32 made it (MKL's packed data cannot move; "
              "pack the weight again)");
  const int64_t M = x.size(0);
  TORCH_CHECK(x.stride(1) == 1 || k == 1,
              "packed_linear: the last dimension of x must be contiguous (got strides ", x.strides(), ")");
  const int64_t ldx = M <= 1 ? k : x.stride(0);
  TORCH_CHECK(ldx >= k, "packed_linear: x rows overlap (row stride ", x.stride(0), " < K=", k, ")");
  TORCH_CHECK(M <= kIntMax && ldx <= kIntMax, "packed_linear: x ", x.sizes(), " exceeds MKL's 32-bit sizes");
  auto y = torch::empty({M, n}, x.options());
  float beta = 0.0f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->dim() == 1 &&
                    bias->size(0) == n,
                "packed_linear: bias must be a float32 [N]=[", n, "] CPU tensor, got ", bias->scalar_type(), " ",
                bias->sizes());
    y.copy_(bias->unsqueeze(0).expand({M, n}));  // y = b, then y += x W^T: torch's addmm order
    beta = 1.0f;
  }
  if (M == 0) return y;
  cblas_sgemm_compute(kCblasRowMajor, kCblasNoTrans, kCblasPacked, static_cast<int>(M), static_cast<int>(n),
                      static_cast<int>(k), x.data_ptr<float>(), static_cast<int>(ldx),
                      reinterpret_cast<const float*>(base + kPackHeader), static_cast<int>(n), beta,
                      y.data_ptr<float>(), static_cast<int>(n));
  return y;
}

}  // namespace

// Registered as torch ops, like every op of the extension:
// torch.ops.radixserve_linear.linear(x, weight, bias, fp32_out), .supports_bf16(), .supports_fp16(),
// and for fp32 .pack_fp32(weight, rows=256) and .packed_linear(x, packed, n, k, bias).
TORCH_LIBRARY(radixserve_linear, m) {
  m.def("pack_fp32(Tensor weight, int rows=256) -> Tensor", &pack_fp32);  // (rows: see the top of the file)
  m.def("packed_linear(Tensor x, Tensor packed, int n, int k, Tensor? bias) -> Tensor", &packed_linear);
  m.def("linear(Tensor x, Tensor weight, Tensor? bias, bool fp32_out, int impl=0) -> Tensor", &small_m_linear);
  m.def("pack_amx(Tensor weight) -> Tensor", &pack_amx);
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias, bool fp32_out=False) -> Tensor", &amx_linear);
  m.def("amx_linear_silu(Tensor x, Tensor packed, Tensor? bias) -> Tensor", &amx_linear_silu);
  m.def("supports_amx() -> bool", &supports_amx);
  m.def("supports_amx_gemm() -> bool", &supports_amx_gemm);
  m.def("supports_bf16() -> bool", &supports_bf16);
  m.def("supports_fp16() -> bool", &supports_fp16);
  m.def("supports_fp32() -> bool", &supports_fp32);
}

// Many-row (prefill / extend) paged attention on the CPU, GEMM-shaped, reading the KV pool in place.
//
// Same interface as paged_attention (attention.cpp): FlashInfer paged metadata, a per-layer cache
// [num_pages, page_size, num_kv_heads, head_dim], bottom-right causal mask (query t of a chunk of n
// over a context of L sees keys < L - n + t + 1) or none; returns the output and base-2 LSEs. One
// call covers a chunk's cached prefix and its own new tokens together (no LSE merge, no K/V head
// repetition), for every sequence of the batch, in one parallel region.
//
// Work: per (sequence, KV head), the query rows are the G query heads of that KV head times the
// chunk's tokens (GQA folded into the rows, so each K/V row is read once per group), cut into
// blocks of ~kRows rows. A work item is one (sequence, KV head) with a range of its blocks; its
// keys are prepared once for all of the item's blocks. Per block and tile of kKeys keys:
// S = Q K^T, an online softmax pass over S (vectorised exp2, scores in base 2; rows past their first
// tile take one pass against their running max while no score rises far above it), O += P V.
// Items are handed out longest first from an atomic counter, so uneven chunks balance across
// threads. Softmax statistics and accumulation are fp32.
//
// Two paths:
// - fp32 compute (fp32; fp16 and bf16 widened to fp32 where bf16 has no AMX), with AVX-512:
//   oneDNN's fp32 brgemm ukernel (torch's at::native::cpublas::brgemm; a JIT kernel per shape,
//   cached per thread, that packs nothing itself) on blocks of kSubRows rows. K^T is packed once
//   per item into tiles of [D][kKeys] (16 x 16 transposes, widening as it goes); P V reads V rows
//   in place when the sequence's slots are one ascending run (else gathered once), its last < 16
//   keys by a 6-row x 64-dim block of FMAs. Each row block stops at its last visible key, so a
//   causal diagonal tile costs little more than its visible part (64-row blocks trim it more
//   coarsely than the 12-row FMA blocks before them: 1.07x on the short extend7x128/130 of bench
//   kernels). MKL's sgemm on the same small blocks spent much of its time re-packing both
//   operands on every call. Without AVX-512 the blocks go to MKL's sgemm.
// - bf16 on AMX: oneDNN's brgemm (run_item_amx), K^T and V packed into VNNI blocks, P rounded to
//   bf16 as torch's flash kernel does.

#include <torch/extension.h>

#include "aligned.h"
#include "paged_common.h"
#include "parallel.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)  // (the intrinsics used need all three)
#include <immintrin.h>

#include "avx512_math.h"
#endif

namespace {

#ifndef PREFILL_ROWS  // (both overridable with -D for tuning builds)
#define PREFILL_ROWS 128
#endif
#ifndef PREFILL_KEYS
// 256: a 128 x 256 fp32 score tile (128 KiB) stays in L2 between the products and the softmax.
// python -m bench kernels --modes gemm --threads 2, bf16 on AMX, three interleaved rounds of
// builds with 512 and 256: fresh2048 8.87/9.23/9.41 -> 7.33/7.41/7.33 ms, gsp8x128/1152+fresh1024
// 7.26/6.88/6.91 -> 5.94/6.05/6.29 ms; fp32 within noise (17.5-19.2 vs 16.4-18.3 ms on fresh2048).
#define PREFILL_KEYS 256
#endif
constexpr int kRows = PREFILL_ROWS;  // query rows (tokens x heads of a group) per block, about
constexpr int kKeys = PREFILL_KEYS;  // keys per tile of the online softmax (a multiple of 32)
static_assert(kRows >= 1, "PREFILL_ROWS must be at least 1");
static_assert(kKeys >= 32 && kKeys % 32 == 0, "PREFILL_KEYS must be a positive multiple of 32 (AMX tiles, key packing)");
constexpr int kMaxDim = 256;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// 2^x, x <= 0 (clamped at -126): 2^(x - n) by a degree-7 polynomial on [-0.5, 0.5] times 2^n in the
// exponent bits (relative error ~4e-9). Written to vectorise under omp simd.
inline float exp2_neg(float x) {
  x = std::max(x, -126.0f);
  const float n = std::nearbyint(x);
  const float f = x - n;
  float p = 1.5252733804059841e-05f;
  p = p * f + 1.5403530393381608e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.6181291076284772e-03f;
  p = p * f + 5.5504108664821580e-02f;
  p = p * f + 2.4022650695910071e-01f;
  p = p * f + 6.9314718055994531e-01f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline uint16_t to_bf16_bits(float x) {  // round to nearest even (inputs are finite)
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Copy (and widen) d values of a row: bf16 bits stay bf16 for the AMX path, everything else
// becomes fp32.
template <typename T, typename C>
inline void copy_row(const T* src, C* dst, int d) {
  if constexpr (sizeof(T) == sizeof(C)) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if constexpr (sizeof(C) == 2) {
      // bf16 rows (128 bytes at head_dim 64): 64-byte masked moves, not a call to memcpy per row
      // (python -m bench kernels --dtype bfloat16 --modes gemm --against: 0.97-0.99x on the short
      // cases; fp32's 256-byte rows the same way measured 1.00-1.03x, so they keep memcpy)
      const char* from = reinterpret_cast<const char*>(src);
      char* to = reinterpret_cast<char*>(dst);
      const int bytes = static_cast<int>(sizeof(C)) * d;
      for (int i = 0; i < bytes; i += 64) {
        const __mmask64 m = bytes - i >= 64 ? ~__mmask64{0} : (__mmask64{1} << (bytes - i)) - 1;
        _mm512_mask_storeu_epi8(to + i, m, _mm512_maskz_loadu_epi8(m, from + i));
      }
      return;
    }
#endif
    std::memcpy(dst, src, sizeof(C) * d);
  } else {
#pragma omp simd
    for (int i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

// The fallback of builds without AVX-512: MKL sgemm (run sequentially inside the parallel region).
// S [m][n] (row-major, ld ldc) = alpha * A [m][k] B[n][k]^T
inline void gemm_abt(int m, int n, int k, float alpha, const float* a, int lda, const float* b, int ldb, float* c,
                     int ldc) {
  // column-major: C^T [n][m] = B A^T
  const char t = 'T', nn = 'N';
  const float zero = 0.0f;
  sgemm_(&t, &nn, &n, &m, &k, &alpha, b, &ldb, a, &lda, &zero, c, &ldc);
}
// O [m][n] (row-major, ld ldc) += A [m][k] B [k][n]
inline void gemm_ab_acc(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c, int ldc) {
  const char nn = 'N';
  const float one = 1.0f;
  sgemm_(&nn, &nn, &n, &m, &k, &one, b, &ldb, a, &lda, &one, c, &ldc);
}

template <typename T>
struct Problem {
  const T* q;
  int64_t q_stride_t, q_stride_h;
  const T* k;
  const T* v;
  int64_t slot_stride;  // elements between consecutive slots (num_kv_heads * head_dim)
  const int32_t* qo_indptr;
  const int32_t* kv_indptr;
  const int32_t* kv_indices;
  const int32_t* last_page_len;
  int page_size, num_kv_heads, group, dim;
  float scale_log2;  // softmax scale * log2(e): scores are kept in base 2
  bool causal;
  T* out;
  float* lse;
  bool amx;     // bf16 through brgemm (run_item_amx) rather than the fp32 micro-kernels
  bool dpbf16;  // bf16 through the vdpbf16ps micro-kernels (run_item_dpbf16)
};

struct Seq {
  int qo_start, qo_len, kv_len;
  int64_t first_slot;  // slot of position 0 when the positions are one ascending run of slots, else -1
  int tokens;          // tokens per query block
};

struct Item {
  int seq, head, b0, b1;  // query blocks [b0, b1) of (seq, KV head)
  double cost;
};

// Per-thread buffers, grown on demand.
template <typename C>
struct Scratch {
  // (on 64-byte boundaries: the AMX path's tiles read and write them row by row)
  radixserve::AlignedVector<C> q, k, v;
  radixserve::AlignedVector<float> s, o;
  std::vector<float> m, l;  // each row's running max and softmax sum (fp32 only: bf16 keeps lv)
  // probabilities: bf16 (the AMX and vdpbf16ps paths), or fp32 of blocks of several key tiles (the
  // fp32 path with AVX-512; one tile's go in place of its scores)
  radixserve::AlignedVector<C> p;
  radixserve::AlignedVector<float> lv;    // bf16: each row's softmax sum as kSumLanes partial sums
  std::vector<int> limit;
};

// bf16 rows keep their softmax sums as 16 partial sums, added up once per block
// (finish_block_bf16) rather than reduced across lanes on every tile.
constexpr int kSumLanes = 16;

inline int kend_of(const Seq& s, int t1, bool causal) {  // one past the last key rows before t1 see
  return causal ? s.kv_len - s.qo_len + t1 : s.kv_len;
}

// Size the per-block buffers for up to ``max_rows`` query rows (tokens x heads of a group).
template <typename C>
void size_block(Scratch<C>& w, int max_rows, int D) {
  w.q.resize(static_cast<size_t>(max_rows) * D);
  w.o.resize(static_cast<size_t>(max_rows) * D);
  w.s.resize(static_cast<size_t>(max_rows) * kKeys);
  if constexpr (std::is_same_v<C, uint16_t>) {
    w.p.resize(static_cast<size_t>(max_rows) * kKeys);
    w.lv.resize(static_cast<size_t>(max_rows) * kSumLanes);
  } else {
    w.l.resize(max_rows);
  }
  w.m.resize(max_rows);
  w.limit.resize(max_rows);
}

// Start a block of query tokens [t0, t1) of one (sequence, KV head): copy its rows into w.q with
// GQA folded (row (t - t0) * G + g is query head head * G + g of token t), reset their softmax
// state and output (zero_out false: the caller's first P V overwrites every row instead), and set
// each row's visible-key limit. Returns the number of rows.
template <typename T, typename C>
int start_block(const Problem<T>& p, const Seq& s, const Item& it, int t0, int t1, int G, Scratch<C>& w,
                bool zero_out = true) {
  const int D = p.dim;
  const int R = (t1 - t0) * G;
  for (int t = t0; t < t1; ++t)
    for (int g = 0; g < G; ++g) {
      const int r = (t - t0) * G + g;
      copy_row(p.q + (s.qo_start + t) * p.q_stride_t + (it.head * G + g) * p.q_stride_h, w.q.data() + r * D, D);
      w.m[r] = kNegInf;
      if constexpr (std::is_same_v<C, uint16_t>) std::fill_n(w.lv.data() + r * kSumLanes, kSumLanes, 0.0f);
      else w.l[r] = 0.0f;
      w.limit[r] = p.causal ? s.kv_len - s.qo_len + t + 1 : s.kv_len;  // keys < limit are visible
    }
  if (zero_out) std::fill(w.o.begin(), w.o.begin() + static_cast<int64_t>(R) * D, 0.0f);
  return R;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)  // (the intrinsics used need all three)
// 2^x for 16 lanes, x <= 0 (bf16's lazy rows: any, kept only if <= 8): fp32 by the degree-6 Taylor
// polynomial (relative error ~2.2e-7 in fp32), bf16 by exp2_minimax4 (2.7e-6, about as the
// degree-5 Taylor polynomial before it, with one FMA and one instruction for the fraction fewer).
// bf16's probabilities round to 2^-9, but its LSEs (which the cascade merges) are fp32: a degree-3
// minimax polynomial (7.5e-5) moved them by up to 1.04e-4 in the kernel tests. bf16 prefill
// attention (bench/RESULTS.md section 34): the degree-4 polynomial on [-0.5, 0.5] 0.97-0.98x the
// time of the Taylor one; then on [0, 1) with vreduceps, with exp_pass's paired stores, 0.91-0.93x.
template <bool kBf16>
inline __m512 exp2_v(__m512 x) {
  if constexpr (kBf16) return radixserve::exp2_minimax4(x);
  else return radixserve::exp2_poly<6>(x);
}

using radixserve::tail_mask;

template <bool kBf16>
inline void store_p(float* sr, uint16_t* pb, int j, __m512 e, __mmask16 keep) {
  if constexpr (kBf16) {
#ifdef __AVX512BF16__
    _mm256_mask_storeu_epi16(pb + j, keep, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
#else
    const __m512i u = _mm512_castps_si512(e);
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                                       _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
    _mm256_mask_storeu_epi16(pb + j, keep, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
#endif
  } else {
    _mm512_mask_storeu_ps(sr + j, keep, e);
  }
}

// 32 probabilities as bf16 into pb[0, 32): one vcvtne2ps2bf16 and one 64-byte store.
inline void store_p2(uint16_t* pb, __m512 e0, __m512 e1) {
#ifdef __AVX512BF16__
  _mm512_storeu_si512(pb, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e1, e0)));
#else
  store_p<true>(nullptr, pb, 0, e0, 0xFFFF);
  store_p<true>(nullptr, pb, 16, e1, 0xFFFF);
#endif
}

// sr[j] <- 2^(scale * sr[j] - m) (or its bf16 in pb, sr left as it is; fp32 into pf instead of sr
// where pf is given) for j < valid, 0 for [valid, n); returns their sum in 16 lanes. bf16 takes its
// full vectors two at a time (store_p2).
template <bool kBf16>
inline __m512 exp_pass(float* sr, int n, int valid, float scale, float m, uint16_t* pb, float* pf = nullptr) {
  float* out = pf != nullptr ? pf : sr;
  const int full = valid & ~15;
  const __m512 vm = _mm512_set1_ps(m), vs = _mm512_set1_ps(scale);
  __m512 vsum = _mm512_setzero_ps();
  int j = 0;
  if constexpr (kBf16) {
    for (; j + 32 <= full; j += 32) {
      const __m512 x0 = _mm512_loadu_ps(sr + j), x1 = _mm512_loadu_ps(sr + j + 16);
      const __m512 e0 = exp2_v<true>(_mm512_fmsub_ps(x0, vs, vm));
      const __m512 e1 = exp2_v<true>(_mm512_fmsub_ps(x1, vs, vm));
      vsum = _mm512_add_ps(vsum, _mm512_add_ps(e0, e1));
      store_p2(pb + j, e0, e1);
    }
  }
  for (; j < full; j += 16) {
    const __m512 x = _mm512_loadu_ps(sr + j);
    const __m512 e = exp2_v<kBf16>(_mm512_fmsub_ps(x, vs, vm));
    vsum = _mm512_add_ps(vsum, e);
    store_p<kBf16>(out, pb, j, e, 0xFFFF);
  }
  for (j = full; j < n; j += 16) {  // the partly visible vector, then zeros up to n
    const __mmask16 live = tail_mask(valid - j);
    const __m512 x = _mm512_maskz_loadu_ps(live, sr + j);
    const __m512 e = _mm512_maskz_mov_ps(live, exp2_v<kBf16>(_mm512_fmsub_ps(x, vs, vm)));
    vsum = _mm512_add_ps(vsum, e);
    store_p<kBf16>(out, pb, j, e, tail_mask(n - j));
  }
  return vsum;
}

// How large a row's probabilities may grow against its running max before it moves: at most
// 2^8 (scores up to 8 above it, base 2), their sums and the outputs far inside fp32's range, with
// fp32's and bf16's relative precision at any scale (the largest probability of a tile is no longer
// exactly 1: on the kernel cases of bench kernels the mean error against fp32 rose 2-3%).
constexpr float kLazyLimit = 256.0f;

// The exponentials of a row's scores sr[0, valid) against its running max (base 2), into sr or
// pf (fp32) or pb (bf16), 0 for [valid, n); returns their sum in 16 lanes, and m_out the max they
// were taken against.
// Rows that already have a running max take one pass against it and keep it unless a lane's sum
// of the probabilities passed kLazyLimit (NaN included; a sum bounds each of its terms, so every
// kept probability is within the limit): then two passes (the row max of scale * sr and m_in,
// then the exponentials against it; the fp32 scores are still in sr). A row's first tile, and
// fp32 written in place (no pf: a block of one key tile), take the two passes. The separate max
// pass was a third of the softmax's time on AMX (its reduction serialises each row), and rows
// whose max stays put skip rescaling their output. The check was first on each lane's max score,
// tracked during the pass: checking the sums instead drops that max from the loop (python -m bench
// kernels --modes gemm --dtype bfloat16 --threads 2 --against the previous build: 0.97-0.99x on
// the long-context cases, about 1.0x on the fleet's short turns; bench/RESULTS.md section 36).
// fp32 took the one pass from section 38 on (P in its own buffer, so that sr survives a fallback):
// 0.96-0.97x on its long-context cases.
template <bool kBf16>
inline __m512 exp_row(float* sr, int n, int valid, float scale, float m_in, float& m_out, uint16_t* pb,
                      float* pf = nullptr) {
  if constexpr (kBf16) {
    if (m_in != kNegInf) {
      const __m512 vsum = exp_pass<true>(sr, n, valid, scale, m_in, pb);
      if (!_mm512_cmp_ps_mask(vsum, _mm512_set1_ps(kLazyLimit), _CMP_NLE_UQ)) {
        m_out = m_in;
        return vsum;
      }
      // (a lane's sum past the limit: the max pass and the exponentials again, below)
    }
  } else {
    if (m_in != kNegInf && pf != nullptr) {
      const __m512 vsum = exp_pass<false>(sr, n, valid, scale, m_in, pb, pf);
      if (!_mm512_cmp_ps_mask(vsum, _mm512_set1_ps(kLazyLimit), _CMP_NLE_UQ)) {
        m_out = m_in;
        return vsum;
      }
    }
  }
  const int full = valid & ~15;
  __m512 vmax = _mm512_set1_ps(kNegInf);
  for (int j = 0; j < full; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(sr + j));
  if (full < valid) vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, tail_mask(valid - full), sr + full));
  m_out = std::max(m_in, _mm512_reduce_max_ps(vmax) * scale);
  return exp_pass<kBf16>(sr, n, valid, scale, m_out, pb, pf);
}
#endif

// Softmax pass over one tile for row r: updates max/sum, rescales the row's output, leaves the
// probabilities (0 past the row's last visible key) in pf, or in place (fp32), or in pb (bf16). l:
// the row's sum (fp32), or its kSumLanes partial sums (bf16).
template <typename C>
inline void softmax_row(float* sr, int n, int valid, float scale, float& m, float* l, float* orow, int D,
                        uint16_t* pb, float* pf = nullptr) {
  constexpr bool kBf16 = std::is_same_v<C, uint16_t>;
  constexpr int lanes = kBf16 ? kSumLanes : 1;
  if (valid <= 0) {  // the whole tile is past this row's causal bound
    if constexpr (kBf16) std::memset(pb, 0, sizeof(uint16_t) * n);
    else std::memset(pf != nullptr ? pf : sr, 0, sizeof(float) * n);
    return;
  }
  float m_new, sum = 0.0f;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)  // (the intrinsics used need all three)
  const __m512 vsum = exp_row<kBf16>(sr, n, valid, scale, m, m_new, pb, pf);
  if constexpr (!kBf16) sum = _mm512_reduce_add_ps(vsum);
#else
  float mx = kNegInf;
#pragma omp simd reduction(max : mx)
  for (int j = 0; j < valid; ++j) mx = std::max(mx, sr[j]);
  m_new = std::max(m, mx * scale);
  if constexpr (kBf16) {
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < valid; ++j) {
      const float e = exp2_neg(sr[j] * scale - m_new);
      sum += e;
      pb[j] = to_bf16_bits(e);
    }
    std::memset(pb + valid, 0, sizeof(uint16_t) * (n - valid));
  } else {
    float* out = pf != nullptr ? pf : sr;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < valid; ++j) {
      const float e = exp2_neg(sr[j] * scale - m_new);
      out[j] = e;
      sum += e;
    }
    std::memset(out + valid, 0, sizeof(float) * (n - valid));
  }
#endif
  if (m_new != m) {
    const float alpha = m == kNegInf ? 0.0f : exp2_neg(m - m_new);
    for (int i = 0; i < lanes; ++i) l[i] *= alpha;
    if (m != kNegInf) {
#pragma omp simd
      for (int d = 0; d < D; ++d) orow[d] *= alpha;
    }
    m = m_new;
  }
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)  // (the intrinsics used need all three)
  if constexpr (kBf16) {
    static_assert(kSumLanes == 16, "the partial sums are one vector");
    _mm512_storeu_ps(l, _mm512_add_ps(_mm512_loadu_ps(l), vsum));
    return;
  }
#endif
  l[0] += sum;
}

// f(std::integral_constant<int, rb>{}) for 1 <= rb <= Max: picks the register block of a row
// tail at run time for micro-kernels templated on their row count.
template <int Max, typename F>
inline void with_rows(int rb, F&& f) {
  if constexpr (Max > 1) {
    if (rb < Max) return with_rows<Max - 1>(rb, f);
  }
  f(std::integral_constant<int, Max>{});
}

// KV head ``head``'s row at position ``pos`` of a sequence, in the cache ``base`` (p.k or p.v):
// straight from its first slot when its pages are one ascending run, else through its page table.
template <typename T>
inline const T* kv_row(const Problem<T>& p, const Seq& s, const int32_t* pages, const T* base, int head, int pos) {
  const int64_t slot = s.first_slot >= 0 ? s.first_slot + pos
                                         : static_cast<int64_t>(pages[pos / p.page_size]) * p.page_size +
                                               pos % p.page_size;
  return base + slot * p.slot_stride + static_cast<int64_t>(head) * p.dim;
}

// bf16 through oneDNN's brgemm ukernel (torch's at::native::cpublas::brgemm: AMX tiles), where
// cpublas::could_pack says the CPU has it. Its B operand is VNNI-packed: pairs of consecutive K
// rows interleaved ([K/2][N][2]). The gather writes K^T and V in that layout directly, zero-padded:
// K^T per tile of kKeys keys as [D/2][width][2] (width: kKeys, or the last tile's keys rounded up
// to kKeyPad), so S of a whole tile is one call; V as [keys/2][n][2] per block of n <= kDimBlock
// head dims. The softmax scale is applied in the softmax pass (brgemm has no alpha).
constexpr int kKeyPad = 32;
constexpr int kDimBlock = 64;

inline const uint16_t* bf16_row(const Problem<c10::BFloat16>& p, const Seq& s, const int32_t* pages,
                                const c10::BFloat16* base, int head, int pos) {
  return reinterpret_cast<const uint16_t*>(kv_row(p, s, pages, base, head, pos));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)  // (the intrinsics used need all three)
// out[k][0..16) = rows[i][k] for a 16 x 16 block of dwords: rows i at src[i] + dp0, out rows at
// dst + k * ld.
inline void transpose16(const uint32_t* const* src, int dp0, uint32_t* dst, int64_t ld) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i)
    r[i] = src[i] == nullptr ? _mm512_setzero_si512() : _mm512_loadu_si512(src[i] + dp0);
  for (int a = 0; a < 8; ++a) {
    t[2 * a] = _mm512_unpacklo_epi32(r[2 * a], r[2 * a + 1]);
    t[2 * a + 1] = _mm512_unpackhi_epi32(r[2 * a], r[2 * a + 1]);
  }
  for (int b = 0; b < 4; ++b) {  // u[4b + c], lane L: column 4L + c of rows 4b..4b+3
    r[4 * b + 0] = _mm512_unpacklo_epi64(t[4 * b], t[4 * b + 2]);
    r[4 * b + 1] = _mm512_unpackhi_epi64(t[4 * b], t[4 * b + 2]);
    r[4 * b + 2] = _mm512_unpacklo_epi64(t[4 * b + 1], t[4 * b + 3]);
    r[4 * b + 3] = _mm512_unpackhi_epi64(t[4 * b + 1], t[4 * b + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i p0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), q0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xdd);
    const __m512i p1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
    const __m512i q1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xdd);
    _mm512_storeu_si512(dst + (c + 0) * ld, _mm512_shuffle_i32x4(p0, p1, 0x88));
    _mm512_storeu_si512(dst + (c + 8) * ld, _mm512_shuffle_i32x4(p0, p1, 0xdd));
    _mm512_storeu_si512(dst + (c + 4) * ld, _mm512_shuffle_i32x4(q0, q1, 0x88));
    _mm512_storeu_si512(dst + (c + 12) * ld, _mm512_shuffle_i32x4(q0, q1, 0xdd));
  }
}
#endif

// K^T of keys [0, kmax) into tiles of kKeys: tile c (keys [c, c + width)) at kp + c * D / 2 dwords,
// dword (dp, j) at dp * width + j; keys past kmax are 0.
void pack_keys(const Problem<c10::BFloat16>& p, const Seq& s, const int32_t* pages, int head, int kmax, int kpad,
               uint32_t* kp) {
  const int half = p.dim / 2;
  for (int c = 0; c < kpad; c += kKeys) {
    const int width = std::min(kKeys, kpad - c);
    uint32_t* tile = kp + static_cast<int64_t>(c) * half;
    for (int j0 = 0; j0 < width; j0 += 16) {
      const uint32_t* rows[16];
      for (int i = 0; i < 16; ++i) {
        const int pos = c + j0 + i;
        rows[i] = pos < kmax ? reinterpret_cast<const uint32_t*>(bf16_row(p, s, pages, p.k, head, pos)) : nullptr;
        if (pos + 16 < kmax)
          __builtin_prefetch(reinterpret_cast<const char*>(bf16_row(p, s, pages, p.k, head, pos + 16)), 0, 3);
      }
      int dp = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)  // (the intrinsics used need all three)
      for (; dp + 16 <= half; dp += 16) transpose16(rows, dp, tile + static_cast<int64_t>(dp) * width + j0, width);
#endif
      for (; dp < half; ++dp)
        for (int i = 0; i < 16; ++i) tile[static_cast<int64_t>(dp) * width + j0 + i] = rows[i] ? rows[i][dp] : 0u;
    }
  }
}

// V of keys [0, kpad) as [kpad/2][nb][2] per block of nb head dims starting at d0: at vp + d0 * kpad / 2.
void pack_values(const Problem<c10::BFloat16>& p, const Seq& s, const int32_t* pages, int head, int kmax, int kpad,
                 uint32_t* vp) {
  const int D = p.dim;
  for (int jp = 0; jp < kpad / 2; ++jp) {
    const int j0 = 2 * jp;
    const uint16_t* r0 = j0 < kmax ? bf16_row(p, s, pages, p.v, head, j0) : nullptr;
    const uint16_t* r1 = j0 + 1 < kmax ? bf16_row(p, s, pages, p.v, head, j0 + 1) : nullptr;
    if (j0 + 8 < kmax) __builtin_prefetch(reinterpret_cast<const char*>(bf16_row(p, s, pages, p.v, head, j0 + 8)), 0, 3);
    if (j0 + 9 < kmax) __builtin_prefetch(reinterpret_cast<const char*>(bf16_row(p, s, pages, p.v, head, j0 + 9)), 0, 3);
    for (int d0 = 0; d0 < D; d0 += kDimBlock) {
      const int nb = std::min(kDimBlock, D - d0);
      uint32_t* dst = vp + static_cast<int64_t>(d0) * (kpad / 2) + static_cast<int64_t>(jp) * nb;
      if (r0 == nullptr) {
        std::memset(dst, 0, sizeof(uint32_t) * nb);
      } else if (r1 == nullptr) {
#pragma omp simd
        for (int dd = 0; dd < nb; ++dd) dst[dd] = static_cast<uint32_t>(r0[d0 + dd]);
      } else {
#pragma omp simd
        for (int dd = 0; dd < nb; ++dd)
          dst[dd] = static_cast<uint32_t>(r0[d0 + dd]) | static_cast<uint32_t>(r1[d0 + dd]) << 16;
      }
    }
  }
}

// Normalise the block's rows of tokens [t0, t1) into the bf16 output and write their base-2 LSEs
// (a row that saw no key: 0 and -inf, its output row in w.o not read). The AMX and vdpbf16ps
// paths' last step.
void finish_block_bf16(const Problem<c10::BFloat16>& p, const Seq& s, const Item& it, int t0, int t1,
                       const Scratch<uint16_t>& w) {
  const int D = p.dim, G = p.group, hq = p.num_kv_heads * G;
  for (int t = t0; t < t1; ++t)
    for (int g = 0; g < G; ++g) {
      const int r = (t - t0) * G + g;
      const int64_t row = static_cast<int64_t>(s.qo_start + t) * hq + it.head * G + g;
      const float* orow = w.o.data() + r * D;
      c10::BFloat16* dst = p.out + row * D;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
      const float l = _mm512_reduce_add_ps(_mm512_loadu_ps(w.lv.data() + r * kSumLanes));  // (kSumLanes == 16)
#else
      const float l = std::accumulate(w.lv.data() + r * kSumLanes, w.lv.data() + (r + 1) * kSumLanes, 0.0f);
#endif
      if (l == 0.0f) {  // (no key seen: the AMX path never wrote this row of w.o)
        std::memset(dst, 0, sizeof(c10::BFloat16) * D);
        p.lse[row] = kNegInf;
        continue;
      }
      const float inv = 1.0f / l;
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
      radixserve::scale_to_bf16(orow, inv, dst, D);
#else
      for (int d = 0; d < D; ++d) dst[d] = static_cast<c10::BFloat16>(orow[d] * inv);
#endif
      p.lse[row] = w.m[r] + std::log2(l);
    }
}

void run_item_amx(const Problem<c10::BFloat16>& p, const Seq& s, const Item& it, Scratch<uint16_t>& w) {
  using at::native::cpublas::brgemm;
  const int D = p.dim, G = p.group;
  const int t_lo = it.b0 * s.tokens, t_hi = std::min(s.qo_len, it.b1 * s.tokens);
  const int kmax = std::max(0, kend_of(s, t_hi, p.causal));
  const int kpad = (kmax + kKeyPad - 1) / kKeyPad * kKeyPad;
  const int32_t* pages = p.kv_indices + p.kv_indptr[it.seq];
  w.k.resize(static_cast<size_t>(kpad) * D);
  w.v.resize(static_cast<size_t>(kpad) * D);
  pack_keys(p, s, pages, it.head, kmax, kpad, reinterpret_cast<uint32_t*>(w.k.data()));
  pack_values(p, s, pages, it.head, kmax, kpad, reinterpret_cast<uint32_t*>(w.v.data()));
  size_block(w, s.tokens * G, D);
  const at::BFloat16* qb = reinterpret_cast<const at::BFloat16*>(w.q.data());
  const at::BFloat16* kb = reinterpret_cast<const at::BFloat16*>(w.k.data());
  const at::BFloat16* vb = reinterpret_cast<const at::BFloat16*>(w.v.data());
  const at::BFloat16* pb = reinterpret_cast<const at::BFloat16*>(w.p.data());
  for (int t0 = t_lo; t0 < t_hi; t0 += s.tokens) {
    const int t1 = std::min(t_hi, t0 + s.tokens);
    const int kend = kend_of(s, t1, p.causal);
    // (O is not zeroed: the first tile's P V writes all R rows, add_C off; with no keys at all,
    // finish_block_bf16 writes zeros without reading it)
    const int R = start_block(p, s, it, t0, t1, G, w, false);
    for (int c = 0; c < kend; c += kKeys) {
      const int n = std::min(kKeys, kend - c);
      const int width = std::min(kKeys, kpad - c);  // the packed tile's
      const int npad = (n + kKeyPad - 1) / kKeyPad * kKeyPad;  // <= width: keys this block needs, padded
      float* sb = w.s.data();
      brgemm(R, npad, D, D, width, kKeys, false, qb, kb + static_cast<int64_t>(c) * D, sb, true);
      for (int r = 0; r < R; ++r)
        softmax_row<uint16_t>(sb + static_cast<int64_t>(r) * kKeys, npad, std::min(n, w.limit[r] - c), p.scale_log2,
                              w.m[r], w.lv.data() + r * kSumLanes, w.o.data() + r * D, D,
                              w.p.data() + static_cast<int64_t>(r) * kKeys);
      for (int d0 = 0; d0 < D; d0 += kDimBlock) {
        const int nb = std::min(kDimBlock, D - d0);
        brgemm(R, nb, npad, kKeys, nb, D, c > 0, pb, vb + static_cast<int64_t>(d0) * kpad + static_cast<int64_t>(c) * nb,
               w.o.data() + d0, true);
      }
    }
    finish_block_bf16(p, s, it, t0, t1, w);
  }
}

// -- the fp32-compute path ---------------------------------------------------------------------
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)  // (the intrinsics used need all three)
constexpr int kQkRows = 12;  // vdpbf16ps S block: 12 rows x 32 keys = 24 accumulators
constexpr int kPvRows = 6;   // P V block: 6 rows x 64 dims = 24 accumulators
constexpr int kPvKeys = 128;  // keys per pass of vdpbf16ps P V, so the V rows of a pass stay in L1
// Rows per fp32 brgemm call. On the fleet's prefix level (1,088 query tokens over 2,048 keys, not
// causal), in-process against the 12 x 32 micro-kernels this replaced: 64 rows 0.95x the time,
// 128 rows 0.95-0.96x, 32 rows 0.97-0.99x (bench/RESULTS.md section 37).
constexpr int kSubRows = 64;

// O[r][16x] += sum_j P[r][j] V[j][16x], j < nk, for RB rows and NV vectors of 16 dims.
template <int RB, int NV>
inline void pv_block(const float* pm, int ldp, int nk, const float* v, int64_t ldv, float* o, int D) {
  __m512 acc[RB][NV];
#pragma GCC unroll 6
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int x = 0; x < NV; ++x) acc[r][x] = _mm512_loadu_ps(o + r * D + 16 * x);
  for (int j = 0; j < nk; ++j) {
    __m512 b[NV];
#pragma GCC unroll 4
    for (int x = 0; x < NV; ++x) b[x] = _mm512_loadu_ps(v + j * ldv + 16 * x);
#pragma GCC unroll 6
    for (int r = 0; r < RB; ++r) {
      const __m512 a = _mm512_set1_ps(pm[static_cast<int64_t>(r) * ldp + j]);
#pragma GCC unroll 4
      for (int x = 0; x < NV; ++x) acc[r][x] = _mm512_fmadd_ps(a, b[x], acc[r][x]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int x = 0; x < NV; ++x) _mm512_storeu_ps(o + r * D + 16 * x, acc[r][x]);
}

template <int RB>
inline void pv_dims(const float* pm, int ldp, int nk, const float* v, int64_t ldv, float* o, int D) {
  int d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) pv_block<RB, 4>(pm, ldp, nk, v + d0, ldv, o + d0, D);
  switch ((D - d0) / 16) {  // head_dim is a multiple of 16
    case 1: return pv_block<RB, 1>(pm, ldp, nk, v + d0, ldv, o + d0, D);
    case 2: return pv_block<RB, 2>(pm, ldp, nk, v + d0, ldv, o + d0, D);
    case 3: return pv_block<RB, 3>(pm, ldp, nk, v + d0, ldv, o + d0, D);
    default: return;
  }
}

inline void pv_rows(int rb, const float* pm, int ldp, int nk, const float* v, int64_t ldv, float* o, int D) {
  with_rows<kPvRows>(rb, [&](auto r) { pv_dims<decltype(r)::value>(pm, ldp, nk, v, ldv, o, D); });
}

// K^T of keys [0, kmax) into tiles of kKeys keys, widened to fp32: tile c (keys [c, c + kKeys))
// at kt + c * D, value (d, j) at d * kKeys + j (one row stride for every tile, so one brgemm
// kernel serves them all); keys in [kmax, kpad) are 0, the last tile's columns past kpad unwritten.
// kpad: kmax rounded up to 16; kt holds kpad rounded up to kKeys.
template <typename T>
void pack_keys_f32(const Problem<T>& p, const Seq& s, const int32_t* pages, int head, int kmax, int kpad,
                   float* kt, float* rows16) {
  const int D = p.dim;
  for (int c = 0; c < kpad; c += kKeys) {
    const int width = std::min(kKeys, kpad - c);
    float* tile = kt + static_cast<int64_t>(c) * D;
    for (int j0 = 0; j0 < width; j0 += 16) {
      const uint32_t* rows[16];
      for (int i = 0; i < 16; ++i) {
        const int pos = c + j0 + i;
        if (pos >= kmax) {
          rows[i] = nullptr;
          continue;
        }
        const T* src = kv_row(p, s, pages, p.k, head, pos);
        if constexpr (std::is_same_v<T, float>) {
          rows[i] = reinterpret_cast<const uint32_t*>(src);
        } else {
          copy_row(src, rows16 + i * D, D);
          rows[i] = reinterpret_cast<const uint32_t*>(rows16 + i * D);
        }
      }
      for (int dp = 0; dp < D; dp += 16)
        transpose16(rows, dp, reinterpret_cast<uint32_t*>(tile + static_cast<int64_t>(dp) * kKeys + j0), kKeys);
    }
  }
}
#endif

// -- bf16 on AVX512-BF16 without AMX ------------------------------------------------------------
// The AMX path's layouts (pack_keys, pack_values, bf16 P from the softmax pass) with vdpbf16ps
// micro-kernels in place of brgemm: each instruction adds the products of two bf16 pairs into 16
// fp32 lanes, twice the multiply-adds of an fp32 FMA, with Q K^T exact products as in the widened
// path and P rounded to bf16 as on AMX.
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RADIXSERVE_DPBF16 1
inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// S[r][16x] = sum_dp Q[r] pair dp . KT pair (dp, 16x) for RB rows and NB vectors of 16 keys: q rows
// of half = D/2 dwords (bf16 pairs), kt the tile at its first key (row stride width dwords).
template <int RB, int NB>
inline void qk_bf16(const uint32_t* q, int half, const uint32_t* kt, int width, float* s, int lds) {
  __m512 acc[RB][NB];
#pragma GCC unroll 12
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 2
    for (int x = 0; x < NB; ++x) acc[r][x] = _mm512_setzero_ps();
  for (int dp = 0; dp < half; ++dp) {
    __m512i b[NB];
#pragma GCC unroll 2
    for (int x = 0; x < NB; ++x) b[x] = _mm512_loadu_si512(kt + static_cast<int64_t>(dp) * width + 16 * x);
#pragma GCC unroll 12
    for (int r = 0; r < RB; ++r) {
      const __m512i a = _mm512_set1_epi32(static_cast<int>(q[r * half + dp]));
#pragma GCC unroll 2
      for (int x = 0; x < NB; ++x) acc[r][x] = _mm512_dpbf16_ps(acc[r][x], as_bh(a), as_bh(b[x]));
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 2
    for (int x = 0; x < NB; ++x) _mm512_storeu_ps(s + static_cast<int64_t>(r) * lds + 16 * x, acc[r][x]);
}

template <int NB>
inline void qk_bf16_rows(int rb, const uint32_t* q, int half, const uint32_t* kt, int width, float* s, int lds) {
  with_rows<kQkRows>(rb, [&](auto r) { qk_bf16<decltype(r)::value, NB>(q, half, kt, width, s, lds); });
}

// O[r][16x] += sum_jp P[r] pair jp . V pair (jp, 16x) for RB rows and NV vectors of 16 dims: p rows
// of ldp dwords (bf16 pairs of keys), v the column block's pairs (ldv dwords per key pair).
template <int RB, int NV>
inline void pv_bf16(const uint32_t* pm, int ldp, int npairs, const uint32_t* v, int ldv, float* o, int D) {
  __m512 acc[RB][NV];
#pragma GCC unroll 6
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int x = 0; x < NV; ++x) acc[r][x] = _mm512_loadu_ps(o + r * D + 16 * x);
  for (int jp = 0; jp < npairs; ++jp) {
    __m512i b[NV];
#pragma GCC unroll 4
    for (int x = 0; x < NV; ++x) b[x] = _mm512_loadu_si512(v + static_cast<int64_t>(jp) * ldv + 16 * x);
#pragma GCC unroll 6
    for (int r = 0; r < RB; ++r) {
      const __m512i a = _mm512_set1_epi32(static_cast<int>(pm[static_cast<int64_t>(r) * ldp + jp]));
#pragma GCC unroll 4
      for (int x = 0; x < NV; ++x) acc[r][x] = _mm512_dpbf16_ps(acc[r][x], as_bh(a), as_bh(b[x]));
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int x = 0; x < NV; ++x) _mm512_storeu_ps(o + r * D + 16 * x, acc[r][x]);
}

template <int RB>
inline void pv_bf16_dims(int nv, const uint32_t* pm, int ldp, int npairs, const uint32_t* v, int ldv, float* o, int D) {
  switch (nv) {  // vectors of 16 dims in this column block (kDimBlock = 64: up to 4)
    case 1: return pv_bf16<RB, 1>(pm, ldp, npairs, v, ldv, o, D);
    case 2: return pv_bf16<RB, 2>(pm, ldp, npairs, v, ldv, o, D);
    case 3: return pv_bf16<RB, 3>(pm, ldp, npairs, v, ldv, o, D);
    default: return pv_bf16<RB, 4>(pm, ldp, npairs, v, ldv, o, D);
  }
}

inline void pv_bf16_rows(int rb, int nv, const uint32_t* pm, int ldp, int npairs, const uint32_t* v, int ldv, float* o,
                         int D) {
  with_rows<kPvRows>(rb, [&](auto r) { pv_bf16_dims<decltype(r)::value>(nv, pm, ldp, npairs, v, ldv, o, D); });
}

void run_item_dpbf16(const Problem<c10::BFloat16>& p, const Seq& s, const Item& it, Scratch<uint16_t>& w) {
  static_assert(kDimBlock == 64, "pv_bf16_dims handles column blocks of up to 4 vectors");
  const int D = p.dim, G = p.group, half = D / 2;
  const int t_lo = it.b0 * s.tokens, t_hi = std::min(s.qo_len, it.b1 * s.tokens);
  const int kmax = std::max(0, kend_of(s, t_hi, p.causal));
  const int kpad = (kmax + kKeyPad - 1) / kKeyPad * kKeyPad;
  const int32_t* pages = p.kv_indices + p.kv_indptr[it.seq];
  w.k.resize(static_cast<size_t>(kpad) * D);
  w.v.resize(static_cast<size_t>(kpad) * D);
  const uint32_t* kp = reinterpret_cast<const uint32_t*>(w.k.data());
  const uint32_t* vp = reinterpret_cast<const uint32_t*>(w.v.data());
  pack_keys(p, s, pages, it.head, kmax, kpad, reinterpret_cast<uint32_t*>(w.k.data()));
  pack_values(p, s, pages, it.head, kmax, kpad, reinterpret_cast<uint32_t*>(w.v.data()));
  size_block(w, s.tokens * G, D);
  const uint32_t* q32 = reinterpret_cast<const uint32_t*>(w.q.data());
  const uint32_t* p32 = reinterpret_cast<const uint32_t*>(w.p.data());
  for (int t0 = t_lo; t0 < t_hi; t0 += s.tokens) {
    const int t1 = std::min(t_hi, t0 + s.tokens);
    const int R = start_block(p, s, it, t0, t1, G, w);
    const int kend = kend_of(s, t1, p.causal);
    for (int c = 0; c < kend; c += kKeys) {
      const int n = std::min(kKeys, kend - c);
      const int width = std::min(kKeys, kpad - c);  // the packed tile's
      const int npad = (n + kKeyPad - 1) / kKeyPad * kKeyPad;  // <= width: P is written (0 past each row's keys) to here
      float* sb = w.s.data();
      const uint32_t* tile = kp + static_cast<int64_t>(c) * half;
      for (int r0 = 0; r0 < R; r0 += kQkRows) {  // each row block up to its last visible key
        const int rb = std::min(kQkRows, R - r0);
        const int cols = (std::clamp(w.limit[r0 + rb - 1] - c, 0, n) + 15) / 16 * 16;
        int j0 = 0;
        for (; j0 + 32 <= cols; j0 += 32)
          qk_bf16_rows<2>(rb, q32 + static_cast<int64_t>(r0) * half, half, tile + j0, width, sb + r0 * kKeys + j0, kKeys);
        if (j0 < cols)
          qk_bf16_rows<1>(rb, q32 + static_cast<int64_t>(r0) * half, half, tile + j0, width, sb + r0 * kKeys + j0, kKeys);
      }
      for (int r = 0; r < R; ++r)
        softmax_row<uint16_t>(sb + static_cast<int64_t>(r) * kKeys, npad, std::min(n, w.limit[r] - c), p.scale_log2,
                              w.m[r], w.lv.data() + r * kSumLanes, w.o.data() + r * D, D,
                              w.p.data() + static_cast<int64_t>(r) * kKeys);
      for (int k0 = 0; k0 < n; k0 += kPvKeys) {  // P is 0 past each row's last visible key, up to npad
        for (int r0 = 0; r0 < R; r0 += kPvRows) {
          const int rb = std::min(kPvRows, R - r0);
          const int nk = std::clamp(w.limit[r0 + rb - 1] - c - k0, 0, std::min(kPvKeys, n - k0));
          if (nk == 0) continue;
          const uint32_t* prow = p32 + static_cast<int64_t>(r0) * (kKeys / 2) + k0 / 2;
          for (int d0 = 0; d0 < D; d0 += kDimBlock) {
            const int nb = std::min(kDimBlock, D - d0);
            const uint32_t* vblk = vp + static_cast<int64_t>(d0) * (kpad / 2) + static_cast<int64_t>((c + k0) / 2) * nb;
            pv_bf16_rows(rb, nb / 16, prow, kKeys / 2, (nk + 1) / 2, vblk, nb, w.o.data() + static_cast<int64_t>(r0) * D + d0, D);
          }
        }
      }
    }
    finish_block_bf16(p, s, it, t0, t1, w);
  }
}
#endif

template <typename T>
void run_item(const Problem<T>& p, const Seq& s, const Item& it, Scratch<float>& w) {
  const int D = p.dim, G = p.group;
  const int t_lo = it.b0 * s.tokens, t_hi = std::min(s.qo_len, it.b1 * s.tokens);
  const int kmax = std::max(0, kend_of(s, t_hi, p.causal));
  const int hq = p.num_kv_heads * G;
  const int32_t* pages = p.kv_indices + p.kv_indptr[it.seq];
  // V of keys [0, kmax) (and K for the sgemm fallback): in place when fp32 and the slots run in
  // order, else gathered (widened) once for all blocks.
  const float* kb = nullptr;
  const float* vb;
  int64_t ld;
  constexpr bool kF32 = std::is_same_v<T, float>;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  constexpr bool kMicro = true;
#else
  constexpr bool kMicro = false;
#endif
  if (kF32 && s.first_slot >= 0) {
    const int64_t off = s.first_slot * p.slot_stride + static_cast<int64_t>(it.head) * D;
    kb = reinterpret_cast<const float*>(p.k + off);
    vb = reinterpret_cast<const float*>(p.v + off);
    ld = p.slot_stride;
  } else {
    if (w.v.size() < static_cast<size_t>(kmax) * D) w.v.resize(static_cast<size_t>(kmax) * D);
    if (!kMicro && w.k.size() < static_cast<size_t>(kmax) * D) w.k.resize(static_cast<size_t>(kmax) * D);
    for (int pos = 0; pos < kmax; ++pos) {
      copy_row(kv_row(p, s, pages, p.v, it.head, pos), w.v.data() + static_cast<int64_t>(pos) * D, D);
      if (!kMicro) copy_row(kv_row(p, s, pages, p.k, it.head, pos), w.k.data() + static_cast<int64_t>(pos) * D, D);
    }
    kb = w.k.data();
    vb = w.v.data();
    ld = D;
  }
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  (void)kb;  // (brgemm reads K through the packed K^T)
  const int kpad = (kmax + 15) / 16 * 16;
  const size_t kt_size = static_cast<size_t>((kpad + kKeys - 1) / kKeys * kKeys) * D;
  if (w.k.size() < kt_size + 16 * static_cast<size_t>(D)) w.k.resize(kt_size + 16 * static_cast<size_t>(D));
  float* kt = w.k.data();  // K^T tiles, then 16 rows of scratch for the widening
  pack_keys_f32(p, s, pages, it.head, kmax, kpad, kt, kt + kt_size);
  const float softmax_scale = p.scale_log2;  // brgemm computes Q K^T unscaled (it has no alpha)
#else
  const float softmax_scale = 1.0f;  // sgemm applies it as alpha
#endif
  size_block(w, s.tokens * G, D);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if (kmax > kKeys && w.p.size() < static_cast<size_t>(s.tokens) * G * kKeys)
    w.p.resize(static_cast<size_t>(s.tokens) * G * kKeys);  // (only where some block has several tiles)
#endif
  for (int t0 = t_lo; t0 < t_hi; t0 += s.tokens) {
    const int t1 = std::min(t_hi, t0 + s.tokens);
    const int R = start_block(p, s, it, t0, t1, G, w);
    const int kend = kend_of(s, t1, p.causal);
    for (int c = 0; c < kend; c += kKeys) {
      const int n = std::min(kKeys, kend - c);
      float* sb = w.s.data();
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
      const float* tile = kt + static_cast<int64_t>(c) * D;
      for (int r0 = 0; r0 < R; r0 += kSubRows) {  // each row block up to its last visible key (<= kpad - c)
        const int rb = std::min(kSubRows, R - r0);
        const int cols = (std::clamp(w.limit[r0 + rb - 1] - c, 0, n) + 15) / 16 * 16;
        if (cols > 0)
          at::native::cpublas::brgemm(rb, cols, D, D, kKeys, kKeys, false, w.q.data() + static_cast<int64_t>(r0) * D,
                                      tile, sb + static_cast<int64_t>(r0) * kKeys, false);
      }
#else
      gemm_abt(R, n, D, p.scale_log2, w.q.data(), D, kb + c * ld, static_cast<int>(ld), sb, kKeys);
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
      // P apart from S where the block has more tiles, so that a row past its first tile takes one
      // pass (exp_row); a single tile's P goes in place, sparing the second buffer's cache lines
      float* pf = kend > kKeys ? w.p.data() : nullptr;
#else
      float* pf = nullptr;  // (in place)
#endif
      for (int r = 0; r < R; ++r)
        softmax_row<float>(sb + static_cast<int64_t>(r) * kKeys, n, std::min(n, w.limit[r] - c), softmax_scale, w.m[r],
                           &w.l[r], w.o.data() + r * D, D, nullptr, pf ? pf + static_cast<int64_t>(r) * kKeys : nullptr);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
      for (int r0 = 0; r0 < R; r0 += kSubRows) {  // P is 0 past each row's last visible key
        const int rb = std::min(kSubRows, R - r0);
        const int nk = std::clamp(w.limit[r0 + rb - 1] - c, 0, n);
        const int whole = nk / 16 * 16;  // keys brgemm takes (its K: few shapes); the rest (< 16) below
        const float* prow = (pf ? pf : sb) + static_cast<int64_t>(r0) * kKeys;
        float* orow = w.o.data() + static_cast<int64_t>(r0) * D;
        if (whole > 0) at::native::cpublas::brgemm(rb, D, whole, kKeys, ld, D, true, prow, vb + c * ld, orow, false);
        for (int q0 = 0; q0 < rb && whole < nk; q0 += kPvRows)
          pv_rows(std::min(kPvRows, rb - q0), prow + static_cast<int64_t>(q0) * kKeys + whole, kKeys, nk - whole,
                  vb + (c + whole) * ld, ld, orow + static_cast<int64_t>(q0) * D, D);
      }
#else
      gemm_ab_acc(R, D, n, sb, kKeys, vb + c * ld, static_cast<int>(ld), w.o.data(), D);
#endif
    }
    for (int t = t0; t < t1; ++t)
      for (int g = 0; g < G; ++g) {
        const int r = (t - t0) * G + g;
        const int64_t row = static_cast<int64_t>(s.qo_start + t) * hq + it.head * G + g;
        const float* orow = w.o.data() + r * D;
        T* dst = p.out + row * D;
        if (w.l[r] > 0.0f) {
          const float inv = 1.0f / w.l[r];
          for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(orow[d] * inv);
          p.lse[row] = w.m[r] + std::log2(w.l[r]);
        } else {  // no key visible (an empty context): output 0, LSE -inf
          for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(0.0f);
          p.lse[row] = kNegInf;
        }
      }
  }
}

template <typename T>
void run(const Problem<T>& p, int num_seqs) {
  const int G = p.group;
  const int threads = at::get_num_threads();
  std::vector<Seq> seqs(num_seqs);
  int64_t blocks_total = 0;
  for (int i = 0; i < num_seqs; ++i) {
    Seq& s = seqs[i];
    s.qo_start = p.qo_indptr[i];
    s.qo_len = p.qo_indptr[i + 1] - s.qo_start;
    const int pages = p.kv_indptr[i + 1] - p.kv_indptr[i];
    s.kv_len = pages == 0 ? 0 : (pages - 1) * p.page_size + p.last_page_len[i];
    const int32_t* table = p.kv_indices + p.kv_indptr[i];
    bool run = pages > 0;
    for (int j = 1; run && j < pages; ++j) run = table[j] == table[0] + j;
    s.first_slot = run ? static_cast<int64_t>(table[0]) * p.page_size : -1;
    s.tokens = std::max(1, std::min(s.qo_len, (kRows + G - 1) / G));
    blocks_total += (s.qo_len + s.tokens - 1) / s.tokens;
  }
  // One item per (sequence, KV head) when there are enough of them to keep every thread busy;
  // otherwise each pair's blocks are split into ranges (each range gathers its own K/V).
  const int64_t pairs = static_cast<int64_t>(num_seqs) * p.num_kv_heads;
  const int64_t want = 3LL * threads;
  std::vector<Item> items;
  for (int i = 0; i < num_seqs; ++i) {
    const Seq& s = seqs[i];
    if (s.qo_len == 0) continue;
    const int nb = (s.qo_len + s.tokens - 1) / s.tokens;
    int ranges = 1;
    if (threads > 1 && pairs < want) ranges = static_cast<int>(std::min<int64_t>(nb, (want + pairs - 1) / pairs));
    const int per = (nb + ranges - 1) / ranges;
    for (int h = 0; h < p.num_kv_heads; ++h)
      for (int b0 = 0; b0 < nb; b0 += per) {
        const int b1 = std::min(nb, b0 + per);
        double cost = 0;
        for (int b = b0; b < b1; ++b) {
          const int t1 = std::min(s.qo_len, (b + 1) * s.tokens);
          cost += static_cast<double>(t1 - b * s.tokens) * std::max(1, kend_of(s, t1, p.causal));
        }
        items.push_back({i, h, b0, b1, cost});
      }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t n_items = static_cast<int64_t>(items.size());
  bool amx = false;
  if constexpr (std::is_same_v<T, c10::BFloat16>) amx = p.amx;
  radixserve::parallel_tasks(n_items, [&](auto& next) {
    Scratch<float> w;
    Scratch<uint16_t> wb;  // (the AMX and vdpbf16ps paths'; stays empty otherwise)
    for (int64_t i = next(); i < n_items; i = next()) {
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (amx) {
          run_item_amx(p, seqs[items[i].seq], items[i], wb);
          continue;
        }
#ifdef RADIXSERVE_DPBF16
        if (p.dpbf16) {
          run_item_dpbf16(p, seqs[items[i].seq], items[i], wb);
          continue;
        }
#endif
      }
      run_item(p, seqs[items[i].seq], items[i], w);
    }
    if (amx) at::native::cpublas::brgemm_release(true);
  });
}

}  // namespace

bool bf16_dpbf16();

// q [T, Hq, D]; k_cache, v_cache [pages, page_size, Hkv, D]; returns (out [T, Hq, D], lse [T, Hq] fp32).
std::vector<torch::Tensor> prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                             torch::Tensor qo_indptr, torch::Tensor kv_indptr,
                                             torch::Tensor kv_indices, torch::Tensor kv_last_page_len,
                                             double scale, bool causal, const std::string& bf16_gemm) {
  const radixserve::PagedShape shape = radixserve::check_paged_inputs(
      q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, kMaxDim);
  const int num_seqs = shape.num_seqs, hq = shape.hq, hkv = shape.hkv, D = shape.head_dim;
  const int page_size = shape.page_size;
  const int32_t* qo = qo_indptr.data_ptr<int32_t>();
  const int32_t* kvp = kv_indptr.data_ptr<int32_t>();
  const int32_t* last = kv_last_page_len.data_ptr<int32_t>();
  for (int i = 0; i < num_seqs; ++i) {  // the kernel indexes by these: check them once
    const int pages = kvp[i + 1] - kvp[i];
    const int kv_len = pages == 0 ? 0 : (pages - 1) * page_size + last[i];
    TORCH_CHECK(pages >= 0 && (pages == 0 || (last[i] >= 1 && last[i] <= page_size)), "bad kv_last_page_len");
    TORCH_CHECK(qo[i + 1] >= qo[i] && (!causal || qo[i + 1] - qo[i] <= kv_len),
                "a causal sequence needs qo_len <= kv_len");
  }
  auto out = torch::empty({q.size(0), hq, D}, q.options().memory_format(torch::MemoryFormat::Contiguous));
  auto lse = torch::empty({q.size(0), hq}, q.options().dtype(torch::kFloat32));
  if (q.size(0) == 0) return {out, lse};
  TORCH_CHECK(bf16_gemm == "auto" || bf16_gemm == "brgemm" || bf16_gemm == "dpbf16" || bf16_gemm == "fp32",
              "bf16_gemm must be 'auto', 'brgemm', 'dpbf16' or 'fp32', not '", bf16_gemm, "'");
  const bool packs = at::native::cpublas::could_pack(at::kBFloat16);
  TORCH_CHECK(packs || bf16_gemm != "brgemm", "bf16_gemm 'brgemm' needs a CPU with AMX (cpublas::could_pack)");
  TORCH_CHECK(bf16_dpbf16() || bf16_gemm != "dpbf16",
              "bf16_gemm 'dpbf16' needs a CPU with AVX512-BF16 (and the kernels built for it)");
  const bool use_amx = (bf16_gemm == "auto" || bf16_gemm == "brgemm") && packs;
  const bool use_dpbf16 = !use_amx && (bf16_gemm == "auto" || bf16_gemm == "dpbf16") && bf16_dpbf16();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "prefill_attention", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "float64 is not supported");
    } else {
      Problem<scalar_t> p{q.data_ptr<scalar_t>(), q.stride(0), q.stride(1),
                          k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                          static_cast<int64_t>(hkv) * D, qo, kvp, kv_indices.data_ptr<int32_t>(), last, page_size,
                          hkv, hq / hkv, D, static_cast<float>(scale * 1.4426950408889634), causal,
                          out.data_ptr<scalar_t>(), lse.data_ptr<float>(), use_amx, use_dpbf16};
      run(p, num_seqs);
    }
  });
  return {out, lse};
}

// Whether bf16 runs on brgemm (AMX) here.
bool bf16_brgemm() { return at::native::cpublas::could_pack(at::kBFloat16); }

// Whether the vdpbf16ps micro-kernels are built (-march=native on a CPU with AVX512-BF16): bf16's
// path where there is no AMX.
bool bf16_dpbf16() {
#ifdef RADIXSERVE_DPBF16
  return true;
#else
  return false;
#endif
}

// Paged attention on the CPU, reading the KV pool in place.
//
// Driven by FlashInfer's paged metadata (qo_indptr, kv_indptr, kv_indices, kv_last_page_len),
// over a per-layer cache [num_pages, page_size, num_kv_heads, head_dim] (NHD). One call handles a
// whole batch: decode rows and prefill/extend chunks alike (bottom-right causal mask), or, with
// causal=false, a cascade level in which each "sequence" is a group's queries against a shared
// prefix. Returns the output and the base-2 log-sum-exp of every row.
//
// Work items are (sequence, KV head, block of query tokens, split of the context). An item's
// rows are all query heads of one KV head's group for a block of tokens, so each K/V row is read
// once for all of them; an item with few rows per KV head (a decode) covers several KV heads,
// so each slot's rows are read together. Softmax is online (running max and sum per row); long contexts with few
// rows are split and the partial states merged by LSE. Items run on torch's intra-op pool
// (OpenMP), so torch.set_num_threads governs them.
//
// The inner loops are written with fixed trip counts (16 or 32 floats) so that -O3
// -march=native vectorises them; bf16/fp16 values are widened to fp32 as they are loaded and all
// arithmetic is fp32. The exception is the few-row path on AVX-512 at head_dim 64 and 128
// (attend_small_512): fp32 as above, and bf16, where the CPU has AVX512-BF16, on vdpbf16ps with
// the probabilities rounded to bf16 for P V, as the prefill kernel's bf16 paths do.

#include <torch/extension.h>

#include "paged_common.h"
#include "parallel.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "avx512_gemm.h"
#include "avx512_math.h"
#define RADIXSERVE_ATTENTION_GEMM_512 1
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

constexpr int kChunk = 32;    // keys per tile
constexpr int kMaxRows = 64;  // query rows (tokens x heads of a group) per work item
constexpr int kGemmRows = 8;  // items with at least this many rows use the GEMM-tiled path
constexpr int kBlockN = 256;  // keys per tile of the GEMM-tiled path
constexpr int kMaxDim = 256;  // largest head_dim
constexpr int kMinSplit = 256;  // fewest keys per context split
// ... of an item with fewer than kGemmRows rows per KV head (a decode). Such an item covers all of a
// sequence's KV heads, so each slot's K/V is read as one run, and a batch of few sequences is split
// over the keys rather than the heads: a SmolLM2 decode (3 KV heads, 2 threads) at 200-264 tokens
// of context ran 1.3x faster so than as one item per head (bench/RESULTS.md section 46)
constexpr int kMinSplitFewRows = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// 2^x for x in [-126, 127]: round to nearest integer n, 2^(x-n) by a degree-7 Taylor polynomial
// on [-0.5, 0.5] (relative error ~4e-9), times 2^n built in the exponent bits. Vectorises.
inline float exp2_approx(float x) {
  x = std::min(std::max(x, -126.0f), 127.0f);
  const float n = std::floor(x + 0.5f);
  const float f = x - n;
  float p = 1.5252733804059841e-05f;
  p = p * f + 1.5403530393381608e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.6181291076284772e-03f;
  p = p * f + 5.5504108664821580e-02f;
  p = p * f + 2.4022650695910071e-01f;
  p = p * f + 6.9314718055994531e-01f;
  p = p * f + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

template <typename T>
inline void load_row(const T* src, float* dst, int d) {
#pragma omp simd
  for (int i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int d) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* o = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int i = 0; i < d; ++i) o[i] = static_cast<uint32_t>(s[i]) << 16;
}

template <typename T>
inline void store_row(const float* src, T* dst, int d) {
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) return radixserve::scale_to_bf16(src, 1.0f, dst, d);
#endif
  for (int i = 0; i < d; ++i) dst[i] = static_cast<T>(src[i]);
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
  int page_size, group, dim;
  float scale_log2;  // softmax scale * log2(e): scores are kept in base 2
  bool causal;
};

// Work item: rows (tokens t0..t1 x heads g0..g1 of each KV head in [head, h1)) of sequence seq
// against its keys [k0, k1). Only items with fewer than kGemmRows rows per KV head (decodes, short
// extends) span several KV heads: they walk the keys once for all of them, tile by tile, so a
// slot's rows are read together. One item per KV head read a head's share of each slot (a quarter
// on the bench model) in a separate pass, and contexts that live in memory, not in the caches,
// were read at a fraction of the memory bandwidth.
struct Item {
  int seq, head, h1, g0, g1, t0, t1, k0, k1;
  int64_t partial;  // -1: write the result directly; else the first of its rows in the partial buffer
  // The GEMM path's K/V of (seq, head) already gathered to fp32 ([kv_len][dim] K, then V), shared
  // by all of that pair's query blocks; nullptr: the item gathers its tiles itself.
  const float* kv = nullptr;
  int64_t merge = -1;  // a split's index in run()'s merges
};

// Cap on the fp32 K/V gathered once per (sequence, KV head) for reuse by its query blocks.
constexpr int64_t kMaxGatherFloats = 64LL << 20;  // 256 MiB

inline int head_rows(const Item& it) { return (it.t1 - it.t0) * (it.g1 - it.g0); }
inline int item_rows(const Item& it) { return (it.h1 - it.head) * head_rows(it); }

inline int kv_len_of(const int32_t* kv_indptr, const int32_t* last, int page_size, int s) {
  const int pages = kv_indptr[s + 1] - kv_indptr[s];
  return pages == 0 ? 0 : (pages - 1) * page_size + last[s];
}

inline void gemm(char ta, char tb, int m, int n, int k, const float* a, int lda, const float* b, int ldb,
                 float beta, float* c, int ldc) {
  const float one = 1.0f;
  sgemm_(&ta, &tb, &m, &n, &k, &one, a, &lda, b, &ldb, &beta, c, &ldc);
}

// Per-thread scratch of the GEMM-tiled path (896 KiB), sized on its first use: decode rows never
// need it, and zeroing it for each parallel chunk cost a batch-1 decode call ~30 us of its ~50.
// kt: a K tile transposed ([dim][kBlockN]), for the AVX-512 products.
struct Scratch {
  std::vector<float> q, k, v, s, kt;
  void reserve() {
    if (!k.empty()) return;
    q.resize(kMaxRows * kMaxDim);
    k.resize(kBlockN * kMaxDim);
    v.resize(kBlockN * kMaxDim);
    s.resize(kMaxRows * kBlockN);
    kt.resize(kMaxDim * kBlockN);
  }
};

// An item's rows (KV head by KV head), set up for the online softmax: its query rows loaded into
// qb as fp32 scaled to log2 units (unless load_q is false: bf16 on vdpbf16ps reads q in place),
// running max / sum reset, each row's last visible key (bottom-right causal), outputs zeroed.
struct Rows {
  int kv_len;            // keys of the sequence
  int kend;              // one past the last key any row of the item may see
  const int32_t* pages;  // the sequence's page table
};

template <typename T>
Rows start_rows(const Problem<T>& p, const Item& it, float* qb, float* m, float* l, int* limit, float* out,
                bool load_q = true) {
  const int D = p.dim;
  const int heads = it.g1 - it.g0;
  const int qo_start = p.qo_indptr[it.seq];
  const int qo_len = p.qo_indptr[it.seq + 1] - qo_start;
  const int kv_len = kv_len_of(p.kv_indptr, p.last_page_len, p.page_size, it.seq);
  for (int h = it.head; h < it.h1; ++h) {
    for (int t = it.t0; t < it.t1; ++t) {
      for (int g = it.g0; g < it.g1; ++g) {
        const int r = ((h - it.head) * (it.t1 - it.t0) + (t - it.t0)) * heads + (g - it.g0);
        const T* src = p.q + (qo_start + t) * p.q_stride_t + (h * p.group + g) * p.q_stride_h;
        if (load_q) {
          load_row(src, qb + r * D, D);
          for (int d = 0; d < D; ++d) qb[r * D + d] *= p.scale_log2;
        }
        m[r] = kNegInf;
        l[r] = 0.0f;
        limit[r] = p.causal ? kv_len - qo_len + t : kv_len - 1;
      }
    }
  }
  std::fill(out, out + item_rows(it) * D, 0.0f);
  int kend = it.k1;
  if (p.causal) kend = std::min(kend, kv_len - qo_len + it.t1);  // past the last row's limit
  return {kv_len, kend, p.kv_indices + p.kv_indptr[it.seq]};
}

// Normalise each row's output by its softmax sum and write its base-2 LSE (-inf for a row that
// saw no key, whose output stays 0).
inline void finish_rows(int R, int D, const float* m, const float* l, float* out, float* lse) {
  for (int r = 0; r < R; ++r) {
    float* orow = out + r * D;
    if (l[r] > 0.0f) {
      const float inv = 1.0f / l[r];
      for (int d = 0; d < D; ++d) orow[d] *= inv;
      lse[r] = m[r] + std::log2(l[r]);
    } else {
      lse[r] = kNegInf;
    }
  }
}

// orow[0, NB * 16) += sum over j < n of p[j] * v[j][d0, d0 + NB * 16) (v: row pointers, so fp32
// rows are read in place in the pages; copying them first was a third of a decode call's time).
// Every 16-wide block of the row accumulates at once (and, for D = 64, even and odd keys apart):
// block by block, each key's FMA waited on the previous one (4 cycles), ~4x slower at D = 64.
template <int NB>
inline void pv_blocks(const float* p, int n, const float* const* v, int d0, float* orow) {
#if defined(__AVX512F__)
  constexpr int kSets = NB <= 4 ? 2 : 1;  // accumulator sets over alternating keys
  __m512 acc[kSets][NB];
  for (int b = 0; b < NB; ++b) {
    acc[0][b] = _mm512_loadu_ps(orow + 16 * b);
    for (int k = 1; k < kSets; ++k) acc[k][b] = _mm512_setzero_ps();
  }
  int j = 0;
  for (; j + kSets <= n; j += kSets)
    for (int k = 0; k < kSets; ++k) {
      const __m512 pj = _mm512_set1_ps(p[j + k]);
      const float* vr = v[j + k] + d0;
      for (int b = 0; b < NB; ++b) acc[k][b] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + 16 * b), acc[k][b]);
    }
  for (; j < n; ++j) {
    const __m512 pj = _mm512_set1_ps(p[j]);
    for (int b = 0; b < NB; ++b) acc[0][b] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v[j] + d0 + 16 * b), acc[0][b]);
  }
  for (int b = 0; b < NB; ++b) {
    __m512 t = acc[0][b];
    for (int k = 1; k < kSets; ++k) t = _mm512_add_ps(t, acc[k][b]);
    _mm512_storeu_ps(orow + 16 * b, t);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (NB > 4) {  // 16 ymm registers: 64 dims (8 accumulators) at a time
    pv_blocks<4>(p, n, v, d0, orow);
    pv_blocks<NB - 4>(p, n, v, d0 + 64, orow + 64);
  } else {
    __m256 acc[2 * NB];
    for (int b = 0; b < 2 * NB; ++b) acc[b] = _mm256_loadu_ps(orow + 8 * b);
    for (int j = 0; j < n; ++j) {
      const __m256 pj = _mm256_set1_ps(p[j]);
      const float* vr = v[j] + d0;
      for (int b = 0; b < 2 * NB; ++b) acc[b] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 8 * b), acc[b]);
    }
    for (int b = 0; b < 2 * NB; ++b) _mm256_storeu_ps(orow + 8 * b, acc[b]);
  }
#else
  for (int b = 0; b < NB * 16; b += 16) {
    alignas(64) float acc[16];
    std::memcpy(acc, orow + b, sizeof(acc));
    for (int j = 0; j < n; ++j) {
      const float pj = p[j];
      const float* vr = v[j] + d0 + b;
#pragma omp simd
      for (int x = 0; x < 16; ++x) acc[x] += pj * vr[x];
    }
    std::memcpy(orow + b, acc, sizeof(acc));
  }
#endif
}

inline void pv_row(const float* p, int n, const float* const* v, int D, float* orow) {
  switch (D) {
    case 64: pv_blocks<4>(p, n, v, 0, orow); return;
    case 128: pv_blocks<8>(p, n, v, 0, orow); return;
    default:  // other multiples of 16, up to kMaxDim: four blocks (or fewer) at a time
      for (int d0 = 0; d0 < D; d0 += 64) {
        const int left = D - d0;
        if (left >= 64) pv_blocks<4>(p, n, v, d0, orow + d0);
        else if (left >= 48) pv_blocks<3>(p, n, v, d0, orow + d0);
        else if (left >= 32) pv_blocks<2>(p, n, v, d0, orow + d0);
        else pv_blocks<1>(p, n, v, d0, orow + d0);
      }
  }
}

// Attend an item's rows to its keys, tile by tile, KV head by KV head within a tile. Writes
// normalised outputs [rows][dim] and base-2 LSEs [rows] (0 and -inf for an empty row).
template <typename T>
void attend_small(const Problem<T>& p, const Item& it, float* out, float* lse) {
  const int D = p.dim;
  const int R = head_rows(it);  // rows of each KV head
  const int NH = it.h1 - it.head;
  alignas(64) float qb[kMaxRows * kMaxDim];
  alignas(64) float kc[kChunk * kMaxDim];
  alignas(64) float vc[kChunk * kMaxDim];
  alignas(64) float s[kGemmRows * kChunk];
  const float* vrow[kChunk];
  for (int j = 0; j < kChunk; ++j) vrow[j] = vc + j * D;
  float m[kMaxRows], l[kMaxRows];
  int limit[kMaxRows];  // last key index each row may see

  const Rows rows = start_rows(p, it, qb, m, l, limit, out);
  const int kend = rows.kend;
  const int32_t* pages = rows.pages;

  for (int c = it.k0; c < kend; c += kChunk) {
    const int n = std::min(kChunk, kend - c);
    for (int h = 0; h < NH; ++h) {
      for (int j = 0; j < n; ++j) {
        const int pos = c + j;
        const int64_t slot = static_cast<int64_t>(pages[pos / p.page_size]) * p.page_size + pos % p.page_size;
        const int64_t off = slot * p.slot_stride + static_cast<int64_t>(it.head + h) * D;
        load_row(p.k + off, kc + j * D, D);
        load_row(p.v + off, vc + j * D, D);
      }
      // Scores (already in base 2).
      for (int i = 0; i < R; ++i) {
        const float* qr = qb + (h * R + i) * D;
        for (int j = 0; j < n; ++j) {
          const float* kr = kc + j * D;
          float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
          for (int d = 0; d < D; ++d) acc += qr[d] * kr[d];
          s[i * kChunk + j] = acc;
        }
      }
      // Online softmax, then O += P V.
      for (int i = 0; i < R; ++i) {
        const int r = h * R + i;
        const int valid = std::min(n, limit[r] - c + 1);
        if (valid <= 0) continue;
        float* sr = s + i * kChunk;
        float mx = kNegInf;
        for (int j = 0; j < valid; ++j) mx = std::max(mx, sr[j]);
        const float m_new = std::max(m[r], mx);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < valid; ++j) {
          const float e = exp2_approx(sr[j] - m_new);
          sr[j] = e;
          sum += e;
        }
        float* orow = out + r * D;
        if (m[r] != m_new) {
          const float alpha = m[r] == kNegInf ? 0.0f : exp2_approx(m[r] - m_new);
          l[r] *= alpha;
#pragma omp simd
          for (int d = 0; d < D; ++d) orow[d] *= alpha;
          m[r] = m_new;
        }
        l[r] += sum;
        pv_row(sr, valid, vrow, D, orow);
      }
    }
  }
  finish_rows(NH * R, D, m, l, out, lse);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)  // (the intrinsics used need all three)
#define RADIXSERVE_DECODE_VECTOR 1
using radixserve::tail_mask;

// exp2_approx on 16 lanes (x <= 0 here): clamped at -126, the degree-7 polynomial.
inline __m512 exp2_poly7(__m512 x) {
  return radixserve::exp2_poly<7>(_mm512_max_ps(x, _mm512_set1_ps(-126.0f)));
}

// A K/V row as fp32: in place for fp32, else widened into buf (bf16 by a shift, fp16 by vcvtph2ps).
template <typename T>
inline const float* row_f32(const T* src, float* buf, int D) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (int d = 0; d < D; d += 16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d));
      _mm512_storeu_ps(buf + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
    return buf;
  } else {
    for (int d = 0; d < D; d += 16)
      _mm512_storeu_ps(buf + d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d))));
    return buf;
  }
}

#elif defined(__AVX2__) && defined(__FMA__)
#define RADIXSERVE_DECODE_VECTOR 1

// exp2_approx on 8 lanes (x <= 0 here): clamped at -126, its polynomial, 2^n in the exponent bits.
inline __m256 exp2_poly7(__m256 x) {
  constexpr float c[8] = {1.5252733804059841e-05f, 1.5403530393381608e-04f, 1.3333558146428443e-03f,
                          9.6181291076284772e-03f, 5.5504108664821580e-02f, 2.4022650695910071e-01f,
                          6.9314718055994531e-01f, 1.0f};
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 poly = _mm256_set1_ps(c[0]);
  for (int i = 1; i < 8; ++i) poly = _mm256_fmadd_ps(poly, f, _mm256_set1_ps(c[i]));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(poly, _mm256_castsi256_ps(scale));
}

// A K/V row as fp32: in place for fp32, else widened into buf.
template <typename T>
inline const float* row_f32(const T* src, float* buf, int D) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    load_row(src, buf, D);
    return buf;
  }
}

inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float reduce_max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

#endif

#ifdef RADIXSERVE_DECODE_VECTOR
// Keys [c, c + n) of one KV head of a sequence (its page table ``pages``): K and V rows as fp32
// pointers in krow and vrow, in place for fp32, else widened into kc and vc.
template <typename T>
inline void gather_tile(const Problem<T>& p, const int32_t* pages, int head, int c, int n, float* kc, float* vc,
                        const float** krow, const float** vrow) {
  const int D = p.dim;
  for (int j = 0; j < n; ++j) {
    const int pos = c + j;
    const int64_t slot = static_cast<int64_t>(pages[pos / p.page_size]) * p.page_size + pos % p.page_size;
    const int64_t off = slot * p.slot_stride + static_cast<int64_t>(head) * D;
    krow[j] = row_f32(p.k + off, kc + j * D, D);
    vrow[j] = row_f32(p.v + off, vc + j * D, D);
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// The online-softmax update of one row by a tile of up to 32 scores (base 2), s0 keys 0-15 and s1
// keys 16-31, -inf past the row's valid > 0 visible keys: its running max m and sum l, its output
// orow rescaled where the max rose, and the probabilities in e0, e1 (0 past valid).
inline void online_softmax_tile(__m512 s0, __m512 s1, int valid, int D, float& m, float& l, float* orow, __m512& e0,
                                __m512& e1) {
  const float m_new = std::max(m, _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
  const __m512 vm = _mm512_set1_ps(m_new);
  e0 = _mm512_maskz_mov_ps(tail_mask(valid), exp2_poly7(_mm512_sub_ps(s0, vm)));
  e1 = _mm512_maskz_mov_ps(tail_mask(valid - 16), exp2_poly7(_mm512_sub_ps(s1, vm)));
  if (m != m_new) {
    const float alpha = m == kNegInf ? 0.0f : exp2_approx(m - m_new);
    l *= alpha;
    const __m512 va = _mm512_set1_ps(alpha);
    for (int d = 0; d < D; d += 16) _mm512_storeu_ps(orow + d, _mm512_mul_ps(va, _mm512_loadu_ps(orow + d)));
    m = m_new;
  }
  l += _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
}

// One row of a tile on AVX-512 registers (head_dim a multiple of 16): the scores q . k of keys
// [0, valid), the online-softmax update of the row's max m, sum l and output orow, and the
// probabilities left in s[0, 32) (0 past valid) for P V. The tile's softmax is two vectors. The
// auto-vectorised loops of attend_small reduced each score and ran the exp scalar (perf: ~3x
// slower on decode rows).
inline void softmax_tile_row(const float* qr, const float* const* krow, int valid, int D, float& m, float& l, float* s,
                             float* orow) {
  static_assert(kChunk == 32, "the softmax below holds a tile in two vectors");
  for (int j = 0; j < valid; ++j) {
    const float* kr = krow[j];
    __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(qr), _mm512_loadu_ps(kr));
    __m512 a1 = _mm512_setzero_ps();
    int d = 16;
    for (; d + 32 <= D; d += 32) {
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qr + d), _mm512_loadu_ps(kr + d), a1);
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qr + d + 16), _mm512_loadu_ps(kr + d + 16), a0);
    }
    if (d < D) a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qr + d), _mm512_loadu_ps(kr + d), a1);
    s[j] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  }
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  __m512 e0, e1;
  online_softmax_tile(_mm512_mask_loadu_ps(neg_inf, tail_mask(valid), s),
                      _mm512_mask_loadu_ps(neg_inf, tail_mask(valid - 16), s + 16), valid, D, m, l, orow, e0, e1);
  _mm512_storeu_ps(s, e0);
  _mm512_storeu_ps(s + 16, e1);
}
#elif defined(__AVX2__) && defined(__FMA__)
// The same on AVX2 registers (CPUs without AVX-512): 8 lanes, the tile's softmax in four vectors,
// lanes past the row's last key set to -inf and zeroed after the exp. On an AVX2-only AMD EPYC the
// auto-vectorised attend_small took ~2x as long per decode row (python -m bench kernels --modes decode).
inline void softmax_tile_row(const float* qr, const float* const* krow, int valid, int D, float& m, float& l, float* s,
                             float* orow) {
  static_assert(kChunk == 32, "the softmax below holds a tile in four vectors");
  for (int j = 0; j < valid; ++j) {
    const float* kr = krow[j];
    __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(qr), _mm256_loadu_ps(kr));
    __m256 a1 = _mm256_mul_ps(_mm256_loadu_ps(qr + 8), _mm256_loadu_ps(kr + 8));
    for (int d = 16; d < D; d += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d), _mm256_loadu_ps(kr + d), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d + 8), _mm256_loadu_ps(kr + d + 8), a1);
    }
    s[j] = reduce_add8(_mm256_add_ps(a0, a1));
  }
  std::fill(s + valid, s + kChunk, kNegInf);
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  __m256 sv[4], e[4];
  for (int b = 0; b < 4; ++b) sv[b] = _mm256_load_ps(s + 8 * b);
  const __m256 mx = _mm256_max_ps(_mm256_max_ps(sv[0], sv[1]), _mm256_max_ps(sv[2], sv[3]));
  const float m_new = std::max(m, reduce_max8(mx));
  const __m256 vm = _mm256_set1_ps(m_new);
  for (int b = 0; b < 4; ++b) {
    e[b] = _mm256_and_ps(exp2_poly7(_mm256_sub_ps(sv[b], vm)), _mm256_cmp_ps(sv[b], neg_inf, _CMP_NEQ_OQ));
    _mm256_store_ps(s + 8 * b, e[b]);
  }
  if (m != m_new) {
    const float alpha = m == kNegInf ? 0.0f : exp2_approx(m - m_new);
    l *= alpha;
    const __m256 va = _mm256_set1_ps(alpha);
    for (int d = 0; d < D; d += 8) _mm256_storeu_ps(orow + d, _mm256_mul_ps(va, _mm256_loadu_ps(orow + d)));
    m = m_new;
  }
  l += reduce_add8(_mm256_add_ps(_mm256_add_ps(e[0], e[1]), _mm256_add_ps(e[2], e[3])));
}
#endif

#ifdef RADIXSERVE_DECODE_VECTOR
// attend_small on vector registers: K/V rows read in place (fp32) or widened a tile at a time,
// each row's tile through softmax_tile_row, then P V with every output block live at once.
template <typename T>
void attend_small_v(const Problem<T>& p, const Item& it, float* out, float* lse) {
  const int D = p.dim;
  const int R = head_rows(it);  // rows of each KV head
  const int NH = it.h1 - it.head;
  alignas(64) float qb[kMaxRows * kMaxDim];
  alignas(64) float kc[kChunk * kMaxDim];
  alignas(64) float vc[kChunk * kMaxDim];
  alignas(64) float s[kChunk];
  const float* krow[kChunk];
  const float* vrow[kChunk];
  float m[kMaxRows], l[kMaxRows];
  int limit[kMaxRows];
  const Rows rows = start_rows(p, it, qb, m, l, limit, out);
  for (int c = it.k0; c < rows.kend; c += kChunk) {
    const int n = std::min(kChunk, rows.kend - c);
    for (int h = 0; h < NH; ++h) {
      gather_tile(p, rows.pages, it.head + h, c, n, kc, vc, krow, vrow);
      for (int r = h * R; r < (h + 1) * R; ++r) {
        const int valid = std::min(n, limit[r] - c + 1);
        if (valid <= 0) continue;
        softmax_tile_row(qb + r * D, krow, valid, D, m[r], l[r], s, out + r * D);
        pv_row(s, valid, vrow, D, out + r * D);
      }
    }
  }
  finish_rows(NH * R, D, m, l, out, lse);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RADIXSERVE_DECODE_512 1
// Lane k of the result is the sum of the 16 lanes of v[i] with kReduceKey[i] == k: a tree of
// 256-, 128-, 64- and 32-bit shuffles and adds (45 instructions for 16 sums, against ~9 each for
// _mm512_reduce_add_ps, whose shuffles each waited on the last).
constexpr int kReduceKey[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
inline __m512 reduce16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: halves of v[2i] summed, 8-15: of v[2i+1]
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lane L: v[4i + L]'s four partial sums
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // lane L: two partials of v[8i + L] (dwords 0, 2) and v[8i + 4 + L] (1, 3)
    c[i] = _mm512_add_ps(_mm512_unpacklo_ps(b[2 * i], b[2 * i + 1]), _mm512_unpackhi_ps(b[2 * i], b[2 * i + 1]));
  // dword 4L + m: the sum of v[4m + L], which holds key kReduceKey[4m + L] = 4L + m
  const __m512d c0 = _mm512_castps_pd(c[0]), c1 = _mm512_castps_pd(c[1]);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c0, c1)), _mm512_castpd_ps(_mm512_unpackhi_pd(c0, c1)));
}

// Scores of one query row against keys [0, n) (n <= 16) of a tile, read in place: lane j is
// q . k_j (0 for j >= n). fp32: q (NQ vectors of 16) in registers, FMAs; bf16: q as NQ vectors
// of 16 bf16 pairs, vdpbf16ps (products exact, fp32 sums).
template <typename T, int NQ>
inline __m512 row_scores16(const __m512* qv, const T* const* krow, int n) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    const int j = kReduceKey[i];
    acc[i] = _mm512_setzero_ps();
    if (j >= n) continue;
    const T* kr = krow[j];
#pragma GCC unroll 8
    for (int x = 0; x < NQ; ++x) {
      if constexpr (std::is_same_v<T, float>) {
        acc[i] = _mm512_fmadd_ps(qv[x], _mm512_loadu_ps(kr + 16 * x), acc[i]);
      } else {
#ifdef __AVX512BF16__
        acc[i] = _mm512_dpbf16_ps(acc[i], reinterpret_cast<__m512bh>(qv[x]),
                                  reinterpret_cast<__m512bh>(_mm512_loadu_si512(kr + 32 * x)));
#endif
      }
    }
  }
  return reduce16(acc);
}

// Output rows of the bf16 P V below are kept with each 32 dims permuted (dwords of the unpacked
// pairs): dword 4L + i of the first 16 is dim 8L + i, of the second 16 dim 8L + 4 + i.
inline void unpermute_pairs(float* orow, int D) {
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int d = 0; d < D; d += 32) {
    const __m512 a = _mm512_loadu_ps(orow + d), b = _mm512_loadu_ps(orow + d + 16);
    _mm512_storeu_ps(orow + d, _mm512_permutex2var_ps(a, lo, b));
    _mm512_storeu_ps(orow + d + 16, _mm512_permutex2var_ps(a, hi, b));
  }
}

#ifdef __AVX512BF16__
// O[r] += sum over key pairs of P[r] (bf16 pairs, pp + r * ldp dwords) . V (bf16, rows in place),
// for RB rows and the 64 dims [d0, d0 + 64): each pair of V rows is interleaved into bf16 pairs
// once (4 unpacks) for all RB rows, two keys per vdpbf16ps. An odd last key pairs with itself
// under a 0 probability.
template <int RB>
inline void pv_pairs_bf16(const uint32_t* pp, int ldp, const c10::BFloat16* const* vrow, int n, int d0, float* o,
                          int D) {
  __m512 acc[RB][4];
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int x = 0; x < 4; ++x) acc[r][x] = _mm512_loadu_ps(o + r * D + d0 + 16 * x);
  for (int j = 0; j < n; j += 2) {
    const c10::BFloat16* v0 = vrow[j] + d0;
    const c10::BFloat16* v1 = (j + 1 < n ? vrow[j + 1] : vrow[j]) + d0;
    const __m512i a0 = _mm512_loadu_si512(v0), a1 = _mm512_loadu_si512(v0 + 32);
    const __m512i b0 = _mm512_loadu_si512(v1), b1 = _mm512_loadu_si512(v1 + 32);
    const __m512i il[4] = {_mm512_unpacklo_epi16(a0, b0), _mm512_unpackhi_epi16(a0, b0),
                           _mm512_unpacklo_epi16(a1, b1), _mm512_unpackhi_epi16(a1, b1)};
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const __m512bh pr = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pp[r * ldp + j / 2])));
#pragma GCC unroll 4
      for (int x = 0; x < 4; ++x) acc[r][x] = _mm512_dpbf16_ps(acc[r][x], pr, reinterpret_cast<__m512bh>(il[x]));
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int x = 0; x < 4; ++x) _mm512_storeu_ps(o + r * D + d0 + 16 * x, acc[r][x]);
}
#endif

template <typename T>
constexpr bool kBf16Of = !std::is_same_v<T, float>;

// Whether attend_small_512 takes this dtype and head_dim.
template <typename T>
constexpr bool small_512_dtype() {
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, c10::BFloat16>) return true;
#endif
  return std::is_same_v<T, float>;
}

// attend_small for fp32 and bf16 (with AVX512-BF16) at head_dim 64 or 128 (NQ: q's vectors, 16
// floats or 16 bf16 pairs each). K and V are read in place: a tile's scores 16 keys at a time
// (row_scores16: no horizontal sum per key), the online softmax on those vectors, then P V (bf16:
// P rounded to bf16, two keys per vdpbf16ps; fp32: pv_row). The next tile's slots (all of the
// item's KV heads, K and V) are prefetched while this one is computed: a slot's heads are one
// contiguous run, and reading them head by head left the hardware prefetchers behind (a
// decode over contexts in memory ran at ~11 GB/s).
template <typename T, int NQ>
void attend_small_512(const Problem<T>& p, const Item& it, float* out, float* lse) {
  constexpr bool kBf16 = kBf16Of<T>;
  const int D = p.dim;
  const int R = head_rows(it);  // rows of each KV head (< kGemmRows)
  const int NH = it.h1 - it.head;
  alignas(64) float qb[kMaxRows * kMaxDim];
  alignas(64) float s[kGemmRows * kChunk];           // fp32 probabilities of a head's rows
  alignas(64) uint32_t pp[kGemmRows * kChunk / 2];   // bf16 probability pairs
  const T* krow[kChunk];
  const T* vrow[kChunk];
  float m[kMaxRows], l[kMaxRows];
  int limit[kMaxRows];
  const Rows rows = start_rows(p, it, qb, m, l, limit, out, !kBf16);  // (bf16 reads q in place)
  const int64_t head_off = static_cast<int64_t>(it.head) * D;
  const int span = NH * D * static_cast<int>(sizeof(T));  // bytes of the item's heads in a slot
  auto slot_of = [&](int pos) {
    return static_cast<int64_t>(rows.pages[pos / p.page_size]) * p.page_size + pos % p.page_size;
  };
  // q per row as NQ vectors: fp32 scaled (start_rows), or the bf16 row unscaled (scores scaled below)
  const int heads = it.g1 - it.g0;
  const int qo_start = p.qo_indptr[it.seq];
  auto load_q = [&](int r, __m512* qv) {
    if constexpr (kBf16) {
      const int h = it.head + r / R, t = it.t0 + (r % R) / heads, g = it.g0 + (r % R) % heads;
      const T* src = p.q + (qo_start + t) * p.q_stride_t + (h * p.group + g) * p.q_stride_h;
      for (int x = 0; x < NQ; ++x) qv[x] = _mm512_castsi512_ps(_mm512_loadu_si512(src + 32 * x));
    } else {
      for (int x = 0; x < NQ; ++x) qv[x] = _mm512_loadu_ps(qb + r * D + 16 * x);
    }
  };
  const __m512 vscale = _mm512_set1_ps(kBf16 ? p.scale_log2 : 1.0f);
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  // The slots of the tile from key c on (K and V of the item's heads) into L1.
  auto prefetch_tile = [&](int c) {
    for (int pos = c; pos < std::min(rows.kend, c + kChunk); ++pos) {
      const int64_t off = slot_of(pos) * p.slot_stride + head_off;
      const char* kb = reinterpret_cast<const char*>(p.k + off);
      const char* vb = reinterpret_cast<const char*>(p.v + off);
      for (int b = 0; b < span; b += 64) {
        _mm_prefetch(kb + b, _MM_HINT_T0);
        _mm_prefetch(vb + b, _MM_HINT_T0);
      }
    }
  };
  prefetch_tile(it.k0);  // (the first tile too: an item, a split above all, starts cold)
  for (int c = it.k0; c < rows.kend; c += kChunk) {
    const int n = std::min(kChunk, rows.kend - c);
    prefetch_tile(c + kChunk);
    int64_t slot_base[kChunk];
    for (int j = 0; j < n; ++j) slot_base[j] = slot_of(c + j) * p.slot_stride + head_off;
    for (int h = 0; h < NH; ++h) {
      for (int j = 0; j < n; ++j) {
        krow[j] = p.k + slot_base[j] + static_cast<int64_t>(h) * D;
        vrow[j] = p.v + slot_base[j] + static_cast<int64_t>(h) * D;
      }
      // Rows are in token order, so those that see no key of the tile (a causal extend's first
      // tokens, in a context split) come first: P V runs over rows [0, live) with their P zeroed.
      int live = 0;
      for (int i = 0; i < R; ++i) {
        const int r = h * R + i;
        const int valid = std::min(n, limit[r] - c + 1);
        if (valid <= 0) {
          if constexpr (kBf16) std::memset(pp + i * (kChunk / 2), 0, sizeof(uint32_t) * (kChunk / 2));
          else std::memset(s + i * kChunk, 0, sizeof(float) * kChunk);
          continue;
        }
        live = i + 1;
        __m512 qv[NQ];
        load_q(r, qv);
        const __mmask16 m0 = tail_mask(valid), m1 = tail_mask(valid - 16);
        const __m512 s0 = _mm512_mask_mov_ps(neg_inf, m0, _mm512_mul_ps(row_scores16<T, NQ>(qv, krow, n), vscale));
        const __m512 s1 = n > 16 ? _mm512_mask_mov_ps(neg_inf, m1, _mm512_mul_ps(
                                                          row_scores16<T, NQ>(qv, krow + 16, n - 16), vscale))
                                 : neg_inf;
        __m512 e0, e1;
        online_softmax_tile(s0, s1, valid, D, m[r], l[r], out + r * D, e0, e1);
        if constexpr (kBf16) {
          _mm512_storeu_si512(pp + i * (kChunk / 2), reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e1, e0)));
        } else {
          _mm512_storeu_ps(s + i * kChunk, e0);
          _mm512_storeu_ps(s + i * kChunk + 16, e1);
        }
      }
      if (live == 0) continue;
      if constexpr (kBf16) {
#ifdef __AVX512BF16__
        for (int d0 = 0; d0 < D; d0 += 64)
          for (int i0 = 0; i0 < live; i0 += 4) {
            const uint32_t* pr = pp + i0 * (kChunk / 2);
            float* o = out + (h * R + i0) * D;
            switch (std::min(4, live - i0)) {
              case 1: pv_pairs_bf16<1>(pr, kChunk / 2, vrow, n, d0, o, D); break;
              case 2: pv_pairs_bf16<2>(pr, kChunk / 2, vrow, n, d0, o, D); break;
              case 3: pv_pairs_bf16<3>(pr, kChunk / 2, vrow, n, d0, o, D); break;
              default: pv_pairs_bf16<4>(pr, kChunk / 2, vrow, n, d0, o, D);
            }
          }
#endif
      } else {
        for (int i = 0; i < live; ++i)
          pv_row(s + i * kChunk, std::min(n, limit[h * R + i] - c + 1), reinterpret_cast<const float* const*>(vrow),
                 D, out + (h * R + i) * D);
      }
    }
  }
  if constexpr (kBf16)
    for (int r = 0; r < NH * R; ++r) unpermute_pairs(out + r * D, D);
  finish_rows(NH * R, D, m, l, out, lse);
}
#endif

// The products of the GEMM-tiled path, on the calling thread: S [R][kBlockN] = Q [R][D] K^T for a
// tile of n keys (K [n][D]), and O [R][D] += P [R][kBlockN] V (V [n][D]). With AVX-512, the
// register-blocked micro-kernel of avx512_gemm.h over K transposed into kt (MKL's sgemm, which
// these calls went to, runs its slow path on AMD CPUs, and each of its calls costs microseconds
// of its own at these sizes); else sgemm.
inline void scores(int R, int n, int D, const float* q, const float* k, float* s, float* kt) {
#if defined(RADIXSERVE_ATTENTION_GEMM_512)
  const int j16 = n / 16 * 16, d16 = D / 16 * 16;
  for (int j = 0; j < j16; j += 16)
    for (int d = 0; d < d16; d += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(k + (j + i) * D + d);
      radixserve::transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (d + i) * kBlockN + j, r[i]);
    }
  for (int j = 0; j < n; ++j)  // what the 16 x 16 blocks leave
    for (int d = j < j16 ? d16 : 0; d < D; ++d) kt[d * kBlockN + j] = k[j * D + d];
  for (int r0 = 0; r0 < R; r0 += 8)
    for (int j0 = 0; j0 < n; j0 += 32)
      radixserve::gemm_rows(std::min(8, R - r0), q + r0 * D, D, kt + j0, kBlockN, D, s + r0 * kBlockN + j0, kBlockN,
                            std::min(32, n - j0), false);
#else
  (void)kt;
  gemm('T', 'N', n, R, D, k, D, q, D, 0.0f, s, kBlockN);  // column-major S^T = K Q^T
#endif
}

inline void add_pv(int R, int n, int D, const float* p, const float* v, float* out) {
#if defined(RADIXSERVE_ATTENTION_GEMM_512)
  for (int r0 = 0; r0 < R; r0 += 8)
    for (int d0 = 0; d0 < D; d0 += 32)
      radixserve::gemm_rows(std::min(8, R - r0), p + r0 * kBlockN, kBlockN, v + d0, D, n, out + r0 * D + d0, D,
                            std::min(32, D - d0), true);
#else
  gemm('N', 'N', D, R, n, v, D, p, kBlockN, 1.0f, out, D);  // column-major O^T += V^T P^T
#endif
}

// The same for many rows: K/V tiles of kBlockN keys are gathered (widened to fp32) once and
// both products run on the calling thread (scores, add_pv).
template <typename T>
void attend_gemm(const Problem<T>& p, const Item& it, float* out, float* lse, Scratch& w) {
  const int D = p.dim;
  const int heads = it.g1 - it.g0;
  const int R = (it.t1 - it.t0) * heads;
  w.reserve();
  float* qb = w.q.data();
  float* kb = w.k.data();
  float* vb = w.v.data();
  float* sb = w.s.data();
  float m[kMaxRows], l[kMaxRows];
  int limit[kMaxRows];
  const Rows rows = start_rows(p, it, qb, m, l, limit, out);
  const int kv_len = rows.kv_len, kend = rows.kend;
  const int32_t* pages = rows.pages;
  for (int c = it.k0; c < kend; c += kBlockN) {
    const int n = std::min(kBlockN, kend - c);
    if (it.kv != nullptr) {
      kb = const_cast<float*>(it.kv) + static_cast<int64_t>(c) * D;
      vb = kb + static_cast<int64_t>(kv_len) * D;
    }
    for (int j = 0; it.kv == nullptr && j < n; ++j) {
      const int pos = c + j;
      const int64_t slot = static_cast<int64_t>(pages[pos / p.page_size]) * p.page_size + pos % p.page_size;
      const int64_t off = slot * p.slot_stride + static_cast<int64_t>(it.head) * D;
      load_row(p.k + off, kb + j * D, D);
      load_row(p.v + off, vb + j * D, D);
    }
    scores(R, n, D, qb, kb, sb, w.kt.data());
    for (int r = 0; r < R; ++r) {
      float* sr = sb + r * kBlockN;
      const int valid = std::max(0, std::min(n, limit[r] - c + 1));
      float mx = kNegInf;
      for (int j = 0; j < valid; ++j) mx = std::max(mx, sr[j]);
      float sum = 0.0f;
      if (valid > 0) {
        const float m_new = std::max(m[r], mx);
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < valid; ++j) {
          const float e = exp2_approx(sr[j] - m_new);
          sr[j] = e;
          sum += e;
        }
        if (m[r] != m_new) {
          const float alpha = m[r] == kNegInf ? 0.0f : exp2_approx(m[r] - m_new);
          l[r] *= alpha;
          float* orow = out + r * D;
#pragma omp simd
          for (int d = 0; d < D; ++d) orow[d] *= alpha;
          m[r] = m_new;
        }
        l[r] += sum;
      }
      std::fill(sr + valid, sr + n, 0.0f);
    }
    add_pv(R, n, D, sb, vb, out);
  }
  finish_rows(R, D, m, l, out, lse);
}

template <typename T>
void attend(const Problem<T>& p, const Item& it, float* out, float* lse, Scratch& w) {
  if (head_rows(it) >= kGemmRows) {  // (such items hold one KV head)
    attend_gemm(p, it, out, lse, w);
    return;
  }
#ifdef RADIXSERVE_DECODE_512
  if constexpr (small_512_dtype<T>()) {
    if (p.dim == 64) return attend_small_512<T, kBf16Of<T> ? 2 : 4>(p, it, out, lse);
    if (p.dim == 128) return attend_small_512<T, kBf16Of<T> ? 4 : 8>(p, it, out, lse);
  }
#endif
#ifdef RADIXSERVE_DECODE_VECTOR
  if (p.dim % 16 == 0) return attend_small_v(p, it, out, lse);
#endif
  attend_small(p, it, out, lse);
}

template <typename T>
void run(const Problem<T>& p, int num_seqs, int num_kv_heads, T* out, float* lse_out) {
  const int G = p.group, D = p.dim;
  const int hq = num_kv_heads * G;
  const int heads_per_item = std::min(G, kMaxRows);
  const int tokens_per_item = std::max(1, kMaxRows / heads_per_item);
  const int threads = at::get_num_threads();
  const int64_t target = 4LL * threads;

  // Items without splits first, to decide whether long contexts need splitting. A sequence with
  // fewer than kGemmRows rows per KV head (a decode, a short extend) takes one item for several
  // KV heads, all of them unless that leaves too few items to share out over the threads while
  // its context is too short to split.
  std::vector<Item> base;
  for (int s = 0; s < num_seqs; ++s) {
    const int qo_len = p.qo_indptr[s + 1] - p.qo_indptr[s];
    const int kv_len = kv_len_of(p.kv_indptr, p.last_page_len, p.page_size, s);
    if (qo_len == 0) continue;
    if (qo_len * G < kGemmRows) {
      int per = std::min(num_kv_heads, kMaxRows / (qo_len * G));
      if (kv_len < 2 * kMinSplitFewRows && static_cast<int64_t>(num_seqs) * num_kv_heads < target * per)
        per = static_cast<int>(std::max<int64_t>(1, static_cast<int64_t>(num_seqs) * num_kv_heads / target));
      for (int h = 0; h < num_kv_heads; h += per)
        base.push_back({s, h, std::min(num_kv_heads, h + per), 0, G, 0, qo_len, 0, kv_len, -1});
      continue;
    }
    for (int h = 0; h < num_kv_heads; ++h)
      for (int g0 = 0; g0 < G; g0 += heads_per_item)
        for (int t0 = 0; t0 < qo_len; t0 += tokens_per_item)
          base.push_back({s, h, h + 1, g0, std::min(G, g0 + heads_per_item), t0,
                          std::min(qo_len, t0 + tokens_per_item), 0, kv_len, -1});
  }
  std::vector<Item> items;
  std::vector<std::pair<int64_t, int64_t>> merges;  // (first item, count) of split rows
  int64_t partial_rows = 0;
  for (const Item& b : base) {
    const int qo_len = p.qo_indptr[b.seq + 1] - p.qo_indptr[b.seq];
    const int keys = b.k1 - b.k0;
    int splits = 1;
    if (static_cast<int64_t>(base.size()) < target && b.t1 - b.t0 == qo_len) {
      // few-row items (decodes) split into about one item per thread: each split starts its stream
      // of K/V afresh, which costs more than the balance that more items would buy
      const bool few = head_rows(b) < kGemmRows;
      const int min_keys = few ? kMinSplitFewRows : kMinSplit;
      const int64_t want = few ? threads : target;
      splits = static_cast<int>(std::min<int64_t>((want + base.size() - 1) / base.size(), keys / min_keys));
      // as many items as threads share evenly, where a split count short of this one makes them so
      // (3 items on 2 threads split into 6, not 9)
      for (int s = splits; s >= 2; --s)
        if (static_cast<int64_t>(base.size()) * s % threads == 0) {
          splits = s;
          break;
        }
    }
    if (splits <= 1) {
      items.push_back(b);
      continue;
    }
    const int rows = item_rows(b);
    const int per = (keys + splits - 1) / splits;
    merges.push_back({static_cast<int64_t>(items.size()), splits});
    for (int i = 0; i < splits; ++i) {
      Item it = b;
      it.merge = static_cast<int64_t>(merges.size()) - 1;
      it.k0 = b.k0 + i * per;
      it.k1 = std::min(b.k1, it.k0 + per);
      it.partial = partial_rows;
      partial_rows += rows;
      items.push_back(it);
    }
  }
  std::vector<float> part_out(partial_rows * D), part_lse(partial_rows);

  // (seq, head) pairs with several GEMM-path items (query blocks) over one context: gather their
  // K/V to fp32 once, instead of once per query block, up to kMaxGatherFloats in all.
  std::vector<int> gemm_items(static_cast<size_t>(num_seqs) * num_kv_heads, 0);
  for (const Item& it : items)
    if (head_rows(it) >= kGemmRows) ++gemm_items[it.seq * num_kv_heads + it.head];
  std::vector<int64_t> kv_off(gemm_items.size(), -1);
  std::vector<int> pairs;
  int64_t gathered = 0;
  for (size_t i = 0; i < gemm_items.size(); ++i) {
    if (gemm_items[i] < 2) continue;
    const int s = static_cast<int>(i) / num_kv_heads;
    const int64_t need = 2LL * kv_len_of(p.kv_indptr, p.last_page_len, p.page_size, s) * D;
    if (need == 0 || gathered + need > kMaxGatherFloats) continue;
    kv_off[i] = gathered;
    gathered += need;
    pairs.push_back(static_cast<int>(i));
  }
  std::vector<float> kv_buf(gathered);
  if (!pairs.empty()) {
    at::parallel_for(0, static_cast<int64_t>(pairs.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t pi = begin; pi < end; ++pi) {
        const int i = pairs[pi];
        const int s = i / num_kv_heads, h = i % num_kv_heads;
        const int kv_len = kv_len_of(p.kv_indptr, p.last_page_len, p.page_size, s);
        const int32_t* pages = p.kv_indices + p.kv_indptr[s];
        float* kd = kv_buf.data() + kv_off[i];
        float* vd = kd + static_cast<int64_t>(kv_len) * D;
        for (int pos = 0; pos < kv_len; ++pos) {
          const int64_t slot = static_cast<int64_t>(pages[pos / p.page_size]) * p.page_size + pos % p.page_size;
          const int64_t off = slot * p.slot_stride + static_cast<int64_t>(h) * D;
          load_row(p.k + off, kd + static_cast<int64_t>(pos) * D, D);
          load_row(p.v + off, vd + static_cast<int64_t>(pos) * D, D);
        }
      }
    });
    for (Item& it : items) {
      const int64_t o = kv_off[it.seq * num_kv_heads + it.head];
      if (o >= 0 && head_rows(it) >= kGemmRows) it.kv = kv_buf.data() + o;
    }
  }

  auto write = [&](const Item& it, const float* o, const float* ls) {
    const int heads = it.g1 - it.g0;
    const int qo_start = p.qo_indptr[it.seq];
    for (int h = it.head; h < it.h1; ++h)
      for (int t = it.t0; t < it.t1; ++t)
        for (int g = it.g0; g < it.g1; ++g) {
          const int r = ((h - it.head) * (it.t1 - it.t0) + (t - it.t0)) * heads + (g - it.g0);
          const int64_t row = static_cast<int64_t>(qo_start + t) * hq + h * G + g;
          store_row(o + r * D, out + row * D, D);
          lse_out[row] = ls[r];
        }
  };

  // A split context's merge, by LSE, into the item's rows (each merged by whichever thread finishes
  // its last split, in the same parallel region).
  auto merge = [&](int64_t mi, float* o, float* ls) {
    const auto [first, count] = merges[mi];
    const Item& head = items[first];
    const int rows = item_rows(head);
    for (int r = 0; r < rows; ++r) {
      float mx = kNegInf;
      for (int64_t i = 0; i < count; ++i) mx = std::max(mx, part_lse[items[first + i].partial + r]);
      float* orow = o + r * D;
      std::fill(orow, orow + D, 0.0f);
      if (mx == kNegInf) {
        ls[r] = kNegInf;
        continue;
      }
      float wsum = 0.0f;
      for (int64_t i = 0; i < count; ++i) {
        const int64_t pr = items[first + i].partial + r;
        const float w = exp2_approx(part_lse[pr] - mx);
        if (part_lse[pr] == kNegInf) continue;
        wsum += w;
        const float* src = part_out.data() + pr * D;
        for (int d = 0; d < D; ++d) orow[d] += w * src[d];
      }
      const float inv = 1.0f / wsum;
      for (int d = 0; d < D; ++d) orow[d] *= inv;
      ls[r] = mx + std::log2(wsum);
    }
    write(head, o, ls);
  };
  std::unique_ptr<std::atomic<int64_t>[]> splits_left(new std::atomic<int64_t>[merges.size()]);
  for (size_t mi = 0; mi < merges.size(); ++mi) splits_left[mi].store(merges[mi].second, std::memory_order_relaxed);

  // items handed out one at a time: their costs differ (a context's last split is shorter), and a
  // thread that a neighbour slows down takes fewer
  const int64_t n_items = static_cast<int64_t>(items.size());
  radixserve::parallel_tasks(n_items, [&](auto next) {
    Scratch w;
    const std::unique_ptr<float[]> o(new float[kMaxRows * kMaxDim]);  // (start_rows zeroes the rows it uses)
    float ls[kMaxRows];
    for (int64_t i = next(); i < n_items; i = next()) {
      const Item& it = items[i];
      if (it.partial < 0) {
        attend(p, it, o.get(), ls, w);
        write(it, o.get(), ls);
        continue;
      }
      attend(p, it, part_out.data() + it.partial * D, part_lse.data() + it.partial, w);
      // the last of its context's splits to finish merges them (acq_rel: the others' partials are seen)
      if (splits_left[it.merge].fetch_sub(1, std::memory_order_acq_rel) == 1) merge(it.merge, o.get(), ls);
    }
  });
}

}  // namespace

// q [T, Hq, D]; k_cache, v_cache [pages, page_size, Hkv, D]; returns (out [T, Hq, D], lse [T, Hq] fp32).
void paged_attention_into(const torch::Tensor& k_cache, const torch::Tensor& v_cache, const void* q,
                          int64_t q_stride_t, int64_t q_stride_h, int64_t hq, const torch::Tensor& qo_indptr,
                          const torch::Tensor& kv_indptr, const torch::Tensor& kv_indices,
                          const torch::Tensor& kv_last_page_len, double scale, bool causal, void* out, float* lse);

std::vector<torch::Tensor> paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                           torch::Tensor qo_indptr, torch::Tensor kv_indptr,
                                           torch::Tensor kv_indices, torch::Tensor kv_last_page_len,
                                           double scale, bool causal) {
  const radixserve::PagedShape shape = radixserve::check_paged_inputs(
      q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, kMaxDim);
  const int hq = shape.hq, D = shape.head_dim;
  auto out = torch::empty({q.size(0), hq, D}, q.options().memory_format(torch::MemoryFormat::Contiguous));
  auto lse = torch::empty({q.size(0), hq}, q.options().dtype(torch::kFloat32));
  if (q.size(0) == 0) return {out, lse};
  paged_attention_into(k_cache, v_cache, q.data_ptr(), q.stride(0), q.stride(1), hq, qo_indptr, kv_indptr,
                       kv_indices, kv_last_page_len, scale, causal, out.data_ptr(), lse.data_ptr<float>());
  return {out, lse};
}

// paged_attention's kernel with no tensor made, on the query rows at q (q_stride_t elements from
// token to token, q_stride_h from head to head: decode_layers passes the q block of a fused qkv
// output), into out [T, hq, head_dim] of the caches' dtype and lse [T, hq]. The caller has checked
// the caches and the metadata as check_paged_inputs does.
void paged_attention_into(const torch::Tensor& k_cache, const torch::Tensor& v_cache, const void* q,
                          int64_t q_stride_t, int64_t q_stride_h, int64_t hq, const torch::Tensor& qo_indptr,
                          const torch::Tensor& kv_indptr, const torch::Tensor& kv_indices,
                          const torch::Tensor& kv_last_page_len, double scale, bool causal, void* out, float* lse) {
  const int num_seqs = static_cast<int>(qo_indptr.size(0)) - 1, hkv = static_cast<int>(k_cache.size(2));
  const int D = static_cast<int>(k_cache.size(3));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_attention", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "float64 is not supported");
    } else {
      Problem<scalar_t> p{static_cast<const scalar_t*>(q), q_stride_t, q_stride_h,
                          k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                          static_cast<int64_t>(hkv) * D, qo_indptr.data_ptr<int32_t>(),
                          kv_indptr.data_ptr<int32_t>(), kv_indices.data_ptr<int32_t>(),
                          kv_last_page_len.data_ptr<int32_t>(), static_cast<int>(k_cache.size(1)),
                          static_cast<int>(hq) / hkv, D, static_cast<float>(scale * 1.4426950408889634), causal};
      run(p, num_seqs, hkv, static_cast<scalar_t*>(out), lse);
    }
  });
}

// Merge two attention states over disjoint KV sets: out [N, H, D], lse [N, H] (base 2, fp32).
torch::Tensor merge_state(torch::Tensor out_a, torch::Tensor lse_a, torch::Tensor out_b, torch::Tensor lse_b) {
  TORCH_CHECK(out_a.sizes() == out_b.sizes() && out_a.dim() == 3 && out_a.scalar_type() == out_b.scalar_type(),
              "outputs must be [N, H, D] of one shape and dtype");
  TORCH_CHECK(lse_a.scalar_type() == torch::kFloat32 && lse_b.scalar_type() == torch::kFloat32, "LSEs must be float32");
  out_a = out_a.contiguous();
  out_b = out_b.contiguous();
  lse_a = lse_a.contiguous();
  lse_b = lse_b.contiguous();
  const int64_t rows = out_a.size(0) * out_a.size(1);
  const int D = out_a.size(2);
  TORCH_CHECK(lse_a.numel() == rows && lse_b.numel() == rows, "LSEs must be [N, H]");
  auto out = torch::empty_like(out_a);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out_a.scalar_type(), "merge_state", [&] {
    const scalar_t* a = out_a.data_ptr<scalar_t>();
    const scalar_t* b = out_b.data_ptr<scalar_t>();
    const float* la = lse_a.data_ptr<float>();
    const float* lb = lse_b.data_ptr<float>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float mx = std::max(la[r], lb[r]);
        float wa = 0.0f, wb = 0.0f;
        if (mx != kNegInf) {
          wa = la[r] == kNegInf ? 0.0f : std::exp2(la[r] - mx);
          wb = lb[r] == kNegInf ? 0.0f : std::exp2(lb[r] - mx);
        }
        const float inv = wa + wb > 0.0f ? 1.0f / (wa + wb) : 0.0f;
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
        if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
          if (D <= kMaxDim) {  // (the scalar loop's sums, then rounded and stored 16 at a time)
            alignas(64) float row[kMaxDim];
            for (int d = 0; d < D; ++d)
              row[d] = wa * static_cast<float>(a[r * D + d]) + wb * static_cast<float>(b[r * D + d]);
            radixserve::scale_to_bf16(row, inv, o + r * D, D);
            continue;
          }
        }
#endif
        for (int d = 0; d < D; ++d)
          o[r * D + d] = static_cast<scalar_t>((wa * static_cast<float>(a[r * D + d]) +
                                                wb * static_cast<float>(b[r * D + d])) * inv);
      }
    });
  });
  return out;
}

// prefill.cpp
std::vector<torch::Tensor> prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                             torch::Tensor qo_indptr, torch::Tensor kv_indptr,
                                             torch::Tensor kv_indices, torch::Tensor kv_last_page_len,
                                             double scale, bool causal, const std::string& bf16_gemm);
bool bf16_brgemm();
bool bf16_dpbf16();

// Write a batch's new K and V rows into their cache slots: k_cache/v_cache [pages, page_size,
// Hkv, D] (contiguous), slots [T] int64 (flat slot = page * page_size + offset, all distinct), k/v
// [T, Hkv, D] with a contiguous last dimension (the strided views of the fused qkv output). One
// pass for both, in one OpenMP region (inline for small batches): what two index_copy_ calls did,
// without their TensorIterator setup and with the rows copied whole.
void store_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, torch::Tensor k, torch::Tensor v) {
  TORCH_CHECK(k_cache.device().is_cpu() && k_cache.dim() == 4 && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous(),
              "k_cache and v_cache must be contiguous CPU tensors [pages, page_size, kv_heads, head_dim] of one shape");
  const int64_t hkv = k_cache.size(2), D = k_cache.size(3), num_slots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.size(1) == hkv && k.size(2) == D && v.sizes() == k.sizes(),
              "k and v must be [tokens, kv_heads, head_dim] matching the cache");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k and v must have a contiguous last dimension");
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == dtype && k.scalar_type() == dtype && v.scalar_type() == dtype,
              "k, v and the caches must share one dtype");
  TORCH_CHECK(slots.device().is_cpu() && slots.dim() == 1 && slots.scalar_type() == torch::kInt64 &&
                  slots.is_contiguous() && slots.size(0) == k.size(0),
              "slots must be a contiguous int64 [tokens] tensor");
  const int64_t T = k.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " is outside the cache's ", num_slots, " slots");
  const int64_t esize = k.element_size(), row = hkv * D * esize;
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t ks0 = k.stride(0) * esize, ks1 = k.stride(1) * esize, vs0 = v.stride(0) * esize,
                vs1 = v.stride(1) * esize;
  const int64_t head = D * esize;
  // about 64 KiB of K+V per task: smaller batches copy inline, with no OpenMP region
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, 2 * row));
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      char* kd = kc + sp[t] * row;
      char* vd = vc + sp[t] * row;
      if (ks1 == head && vs1 == head) {
        std::memcpy(kd, kp + t * ks0, row);
        std::memcpy(vd, vp + t * vs0, row);
      } else {
        for (int64_t h = 0; h < hkv; ++h) {
          std::memcpy(kd + h * head, kp + t * ks0 + h * ks1, head);
          std::memcpy(vd + h * head, vp + t * vs0 + h * vs1, head);
        }
      }
    }
  });
}

// The attention module's ops (this file's, prefill.cpp's and decode.cpp's) as torch ops, like
// layers.cpp's and linear.cpp's: torch.ops.radixserve_attention.<op>. The namespace is a macro
// so that another version of these three files (bench/kernels.py --against) can load next to
// this one under a name of its own (-DRADIXSERVE_ATTENTION_NS=...).
#ifndef RADIXSERVE_ATTENTION_NS
#define RADIXSERVE_ATTENTION_NS radixserve_attention
#endif
#define RADIXSERVE_TORCH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)  // (expands the macro before TORCH_LIBRARY pastes it)

namespace {

std::tuple<torch::Tensor, torch::Tensor> out_and_lse(std::vector<torch::Tensor> v) {
  return {std::move(v[0]), std::move(v[1])};
}

std::tuple<torch::Tensor, torch::Tensor> paged_attention_op(
    torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor qo_indptr, torch::Tensor kv_indptr,
    torch::Tensor kv_indices, torch::Tensor kv_last_page_len, double scale, bool causal) {
  return out_and_lse(paged_attention(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                     scale, causal));
}

std::tuple<torch::Tensor, torch::Tensor> prefill_attention_op(
    torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor qo_indptr, torch::Tensor kv_indptr,
    torch::Tensor kv_indices, torch::Tensor kv_last_page_len, double scale, bool causal, std::string bf16_gemm) {
  return out_and_lse(prefill_attention(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                       scale, causal, bf16_gemm));
}

}  // namespace

RADIXSERVE_TORCH_LIBRARY(RADIXSERVE_ATTENTION_NS, m) {
  // Paged attention over FlashInfer-format metadata: (out, lse base 2)
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor qo_indptr, Tensor kv_indptr, "
        "Tensor kv_indices, Tensor kv_last_page_len, float scale, bool causal) -> (Tensor, Tensor)",
        &paged_attention_op);
  // Many-row (prefill/extend) paged attention through GEMMs, same arguments and results as
  // paged_attention; bf16_gemm: 'auto' (brgemm/AMX where cpublas::could_pack, else vdpbf16ps where
  // the CPU has AVX512-BF16, else widened to fp32), 'brgemm', 'dpbf16' or 'fp32'
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor qo_indptr, Tensor kv_indptr, "
        "Tensor kv_indices, Tensor kv_last_page_len, float scale, bool causal, str bf16_gemm=\"auto\") "
        "-> (Tensor, Tensor)",
        &prefill_attention_op);
  // Whether prefill_attention runs bf16 on brgemm (AMX) on this CPU
  m.def("bf16_brgemm() -> bool", &bf16_brgemm);
  // Whether prefill_attention can run bf16 on vdpbf16ps (AVX512-BF16; its path where there is no AMX)
  m.def("bf16_dpbf16() -> bool", &bf16_dpbf16);
  // Merge two attention states by base-2 LSE
  m.def("merge_state(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) -> Tensor", &merge_state);
  // Write new K/V rows [T, Hkv, D] into cache slots [T] of k_cache/v_cache (in place)
  m.def("store_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor k, Tensor v) -> ()", &store_kv);
  // decode_layers and its DecodeWeights: decode.cpp
}

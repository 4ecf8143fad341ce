// GGUF's quantized weights on the CPU, multiplied where they lie: no float copy of the weights.
//
// A GGUF tensor W [N, K] of a quantized type is N rows of K / B blocks of B weights (B = 32, or
// 256 for the K-quants), each block a few bytes of integer levels and fp16 scales (ggml's
// layouts, decoded below type by type). Every supported type reads as groups of 32 consecutive
// weights whose levels q map to weights by one scale s and one offset o per 16 weights:
// w = q s + o. The types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (B = 32), Q4_K, Q5_K, Q6_K (B = 256).
//
// Ops (TORCH_LIBRARY radixserve_quant):
// - dequantize(data, qtype, k, rows) -> fp32 [R, K]: the listed rows of W (all rows when `rows` is
//   empty; an embedding lookup otherwise), equal bit for bit to gguf's numpy `dequantize` (q s,
//   rounded, then + o: no fused multiply-add).
// - qlinear(x, weights, qtypes, row_maps, bias, impl) -> fp32 [M, N]: y = x W^T (+ b), W the rows
//   of the parts `weights` one after the other (a fused projection whose q, k and v, or gate and
//   up, each keep the type the file gave them). row_maps[i], int32 [Ni] or empty, names the row of
//   part i that each of its outputs reads: llama.cpp's q/k row permutation is undone so, with no
//   copy of the weights (a map over all of a part's rows reorders its outputs after the product,
//   which reads the rows in their stored order). x is fp32 [M, K] (rows may be strided, the last
//   dimension contiguous).
//   fp32 arithmetic throughout (each weight rounded to fp32 once, as gguf's dequantize does, but
//   with q s + o fused), so the results are those of dequantize-then-matmul up to summation order.
//   Two AVX-512 paths:
//   - up to kGemvMaxRows rows (decode steps): each thread walks its share of W's rows once, in
//     order, decoding each group of 32 weights into two fp32 vectors in registers and multiplying
//     them into every row of x. It reads W at its quantized size, once per call.
//   - more rows (prefill chunks): W's rows in tiles of kTileCols, each tile decoded once per call
//     into a [K][kTileCols] fp32 block (transposed through registers, kKc values of K at a time so
//     the block stays in L2), then an 8-row x 32-column register-blocked FMA micro-kernel over all
//     rows of x. Tiles are handed out one at a time (radixserve::parallel_tasks).
//   impl 1, and builds without AVX-512: a portable path (each group decoded into 32 floats, then
//   `omp simd` loops the compiler vectorises for the target, AVX2 included).
//   impl 4: as 0, except that up to kGemvMaxRows rows (decode batches), the parts of a type with
//   int8 kernels (csrc/quant_int8.cpp: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, on CPUs with AVX-512 VNNI and
//   VBMI) multiply x quantized to int8 per 32 values: not fp32 arithmetic but ggml's (about 1e-2
//   relative error). Prefill chunks stay fp32: per-32 int8 levels cannot hold a sink token's
//   massive activations, and a prompt's keys and values through int8 cost SmolLM2 most of its
//   greedy agreement with the dequantized model (205 of 512 tokens, against 512 with fp32 prefill).
// - has_avx512(), has_int8(): what this build has.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "aligned.h"
#include "parallel.h"
#include "quant.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)  // (the intrinsics used need all three)
#include "avx512_gemm.h"
#define RADIXSERVE_QUANT_AVX512 1
#endif

namespace {

using namespace radixserve::quant;

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes.
inline void scale_min_k4(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q6_K's group j: where its weights' low 4 bits (ql, from bit `shift`) and high 2 bits (qh, from
// bit `hshift`) lie, byte i of each for weight i.
struct Q6Group {
  const uint8_t *ql, *qh;
  int shift, hshift;
};

inline Q6Group q6_group(const uint8_t* b, int j) {
  const int r = j % 4;
  return {b + (j / 4) * 64 + (r % 2) * 32, b + 128 + (j / 4) * 32, 4 * (r / 2), 2 * r};
}

// ---- the scalar decoders: group j (32 weights) of a block as levels q and (s, o) per 16 ----------
// gguf's numpy dequantize computes q * s, then + o (where o is not 0), in fp32; so does Group::value.
struct Group {
  int32_t q[32];
  float s[2], o[2];
};

template <int64_t QT>
inline void decode_group(const uint8_t* b, int j, Group& g) {
  if constexpr (QT == kQ4_0 || QT == kQ4_1 || QT == kQ5_0 || QT == kQ5_1) {
    constexpr bool has_min = QT == kQ4_1 || QT == kQ5_1, five = QT == kQ5_0 || QT == kQ5_1;
    const float d = fp16_at(b);
    const float m = has_min ? fp16_at(b + 2) : 0.0f;
    const uint8_t* p = b + (has_min ? 4 : 2);
    const uint32_t qh = five ? u32_at(p) : 0;
    const uint8_t* qs = p + (five ? 4 : 0);
    const int bias = has_min ? 0 : five ? 16 : 8;
    for (int i = 0; i < 16; ++i) {
      g.q[i] = ((qs[i] & 0xF) | (five ? ((qh >> i) & 1) << 4 : 0)) - bias;
      g.q[i + 16] = ((qs[i] >> 4) | (five ? ((qh >> (i + 16)) & 1) << 4 : 0)) - bias;
    }
    g.s[0] = g.s[1] = d;
    g.o[0] = g.o[1] = m;
  } else if constexpr (QT == kQ8_0) {
    const float d = fp16_at(b);
    for (int i = 0; i < 32; ++i) g.q[i] = static_cast<int8_t>(b[2 + i]);
    g.s[0] = g.s[1] = d;
    g.o[0] = g.o[1] = 0.0f;
  } else if constexpr (QT == kQ4_K || QT == kQ5_K) {
    const float d = fp16_at(b), dmin = fp16_at(b + 2);
    int sc, mn;
    scale_min_k4(b + 4, j, sc, mn);
    const uint8_t* qh = b + 16;  // Q5_K only
    const uint8_t* qs = b + (QT == kQ5_K ? 48 : 16) + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    for (int i = 0; i < 32; ++i)
      g.q[i] = ((qs[i] >> shift) & 0xF) | (QT == kQ5_K ? ((qh[i] >> j) & 1) << 4 : 0);
    g.s[0] = g.s[1] = d * static_cast<float>(sc);
    g.o[0] = g.o[1] = -(dmin * static_cast<float>(mn));
  } else {
    static_assert(QT == kQ6_K, "a type without a decoder");
    const float d = fp16_at(b + 208);
    const Q6Group q = q6_group(b, j);
    for (int i = 0; i < 32; ++i) g.q[i] = (((q.ql[i] >> q.shift) & 0xF) | (((q.qh[i] >> q.hshift) & 3) << 4)) - 32;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    g.s[0] = d * static_cast<float>(sc[2 * j]);
    g.s[1] = d * static_cast<float>(sc[2 * j + 1]);
    g.o[0] = g.o[1] = 0.0f;
  }
}

// Weights of a decoded group into out[32]: q * s (rounded) + o, as gguf computes them. (This file
// builds with GCC's default -ffp-contract=fast, which may fuse a product and a sum into one FMA:
// the volatile keeps the product's rounding.)
inline void group_values(const Group& g, float* out) {
  for (int i = 0; i < 32; ++i) {
    volatile float prod = static_cast<float>(g.q[i]) * g.s[i / 16];
    out[i] = prod + g.o[i / 16];
  }
}

// Rows [r0, r1) of `rows` (or of W) dequantized into out[r - r0][K].
template <int64_t QT>
void dequantize_rows(const uint8_t* data, int64_t row_bytes, int64_t K, const int64_t* rows, int64_t r0, int64_t r1,
                     float* out) {
  constexpr Format f = format_of(QT);
  Group g;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = data + (rows ? rows[r] : r) * row_bytes;
    float* o = out + r * K;
    for (int64_t b = 0; b < K / f.block; ++b)
      for (int j = 0; j < f.block / 32; ++j) {
        decode_group<QT>(row + b * f.bytes, j, g);
        group_values(g, o + b * f.block + 32 * j);
      }
  }
}

template <int64_t QT>
using Type = Const<QT>;

// Calls fn(Type<QT>{}) for the runtime type `qtype` (fn reads QT as decltype(arg)::value).
template <typename Fn>
void dispatch(int64_t qtype, Fn&& fn) {
  switch (qtype) {
    case kQ4_0: return fn(Type<kQ4_0>{});
    case kQ4_1: return fn(Type<kQ4_1>{});
    case kQ5_0: return fn(Type<kQ5_0>{});
    case kQ5_1: return fn(Type<kQ5_1>{});
    case kQ8_0: return fn(Type<kQ8_0>{});
    case kQ4_K: return fn(Type<kQ4_K>{});
    case kQ5_K: return fn(Type<kQ5_K>{});
    case kQ6_K: return fn(Type<kQ6_K>{});
    default: TORCH_CHECK(false, "quant: unsupported GGUF type id ", qtype);
  }
}

// ---- the parts of a product: W as rows of several tensors ---------------------------------------
// The part holding output column n (parts are few: a linear scan).
inline const Part& part_of(const std::vector<Part>& parts, int64_t n) {
  size_t i = 0;
  while (i + 1 < parts.size() && parts[i + 1].first <= n) ++i;
  return parts[i];
}

// ---- portable path -----------------------------------------------------------------------------
// Columns [n0, n1) of y for all M rows: each group decoded into 32 floats, then multiplied into
// every row of x by loops the compiler vectorises.
template <int64_t QT>
void columns_portable(const Part& p, int64_t n0, int64_t n1, const float* x, int64_t ldx, int64_t M, int64_t K,
                      float* y, int64_t ldy) {
  constexpr Format f = format_of(QT);
  Group g;
  alignas(64) float w[32];
  std::vector<float> acc(static_cast<size_t>(M));
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = row_of(p, n);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t b = 0; b < K / f.block; ++b)
      for (int j = 0; j < f.block / 32; ++j) {
        decode_group<QT>(row + b * f.bytes, j, g);
        for (int i = 0; i < 32; ++i) w[i] = static_cast<float>(g.q[i]) * g.s[i / 16] + g.o[i / 16];
        const int64_t k0 = b * f.block + 32 * j;
        for (int64_t m = 0; m < M; ++m) {
          const float* xr = x + m * ldx + k0;
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int i = 0; i < 32; ++i) s += xr[i] * w[i];
          acc[m] += s;
        }
      }
    for (int64_t m = 0; m < M; ++m) y[m * ldy + n] = acc[m];
  }
}

#if defined(RADIXSERVE_QUANT_AVX512)
// ---- AVX-512 decoders: group j of a block as two vectors of 16 weights -------------------------
// Levels of at most 5 bits are looked up in a table of their weights (vpermps / vpermt2ps: 16 or
// 32 entries, a block's q s + o for every q), built once per group: a level costs a byte-to-dword
// expansion and a permute, with no conversion or scaling of its own, and the permutes read only an
// index's low 4 (5) bits, so a nibble needs no mask. The tables are built by a product and a sum
// with explicit rounding (GCC would fuse a plain vmulps and vaddps into one FMA), so every weight
// equals gguf's dequantized value bit for bit; Q8_0 and Q6_K (more levels) convert and scale.
struct W32 {
  __m512 lo, hi;  // weights 0-15 and 16-31 of the group
};

constexpr int kRn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

inline float fp16_fast(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// levels * s + o, rounded after the product and after the sum, as numpy computes it.
inline __m512 weights_of(__m512 levels, float s, float o) {
  const __m512 prod = _mm512_mul_round_ps(levels, _mm512_set1_ps(s), kRn);
  return o == 0.0f ? prod : _mm512_add_round_ps(prod, _mm512_set1_ps(o), kRn);
}

inline __m512 iota(float from) {
  return _mm512_add_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_ps(from));
}

// The dwords of 16 bytes (each byte in the low 8 bits of its lane).
inline __m512i bytes16(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

template <int64_t QT>
inline W32 decode_w32(const uint8_t* b, int j) {
  if constexpr (QT == kQ4_0 || QT == kQ4_1) {  // 16 levels: low nibbles are weights 0-15, high ones 16-31
    const float d = fp16_fast(b);
    const __m512 table = QT == kQ4_0 ? weights_of(iota(-8.0f), d, 0.0f) : weights_of(iota(0.0f), d, fp16_fast(b + 2));
    const __m512i e = bytes16(b + (QT == kQ4_0 ? 2 : 4));
    return {_mm512_permutexvar_ps(e, table), _mm512_permutexvar_ps(_mm512_srli_epi32(e, 4), table)};
  } else if constexpr (QT == kQ5_0 || QT == kQ5_1) {  // 32 levels: a nibble plus a fifth bit from qh
    constexpr bool has_min = QT == kQ5_1;
    const float d = fp16_fast(b), o = has_min ? fp16_fast(b + 2) : 0.0f;
    const float first = has_min ? 0.0f : -16.0f;
    const __m512 t0 = weights_of(iota(first), d, o), t1 = weights_of(iota(first + 16.0f), d, o);
    const uint8_t* p = b + (has_min ? 4 : 2);
    const uint32_t qh = u32_at(p);
    const __m512i e = bytes16(p + 4), sixteen = _mm512_set1_epi32(16);
    const __m512i lo = _mm512_and_si512(e, _mm512_set1_epi32(0xF)), hi = _mm512_srli_epi32(e, 4);
    return {_mm512_permutex2var_ps(t0, _mm512_mask_or_epi32(lo, static_cast<__mmask16>(qh), lo, sixteen), t1),
            _mm512_permutex2var_ps(t0, _mm512_mask_or_epi32(hi, static_cast<__mmask16>(qh >> 16), hi, sixteen), t1)};
  } else if constexpr (QT == kQ8_0) {
    const float d = fp16_fast(b);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18))));
    return {weights_of(lo, d, 0.0f), weights_of(hi, d, 0.0f)};
  } else if constexpr (QT == kQ4_K || QT == kQ5_K) {  // sub-block j: its scale and min; nibbles (j odd: high)
    int sc, mn;
    scale_min_k4(b + 4, j, sc, mn);
    const float s = fp16_fast(b) * static_cast<float>(sc), o = -(fp16_fast(b + 2) * static_cast<float>(mn));
    const uint8_t* qs = b + (QT == kQ5_K ? 48 : 16) + 32 * (j / 2);
    __m512i e0 = bytes16(qs), e1 = bytes16(qs + 16);
    if (j % 2) {
      e0 = _mm512_srli_epi32(e0, 4);
      e1 = _mm512_srli_epi32(e1, 4);
    }
    const __m512 t0 = weights_of(iota(0.0f), s, o);
    if constexpr (QT == kQ4_K) {
      return {_mm512_permutexvar_ps(e0, t0), _mm512_permutexvar_ps(e1, t0)};
    } else {
      const __m512 t1 = weights_of(iota(16.0f), s, o);
      const __mmask32 fifth = _mm256_test_epi8_mask(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)),
                                                    _mm256_set1_epi8(static_cast<char>(1 << j)));
      const __m512i mask = _mm512_set1_epi32(0xF), sixteen = _mm512_set1_epi32(16);
      e0 = _mm512_and_si512(e0, mask);
      e1 = _mm512_and_si512(e1, mask);
      return {_mm512_permutex2var_ps(t0, _mm512_mask_or_epi32(e0, static_cast<__mmask16>(fifth), e0, sixteen), t1),
              _mm512_permutex2var_ps(t0, _mm512_mask_or_epi32(e1, static_cast<__mmask16>(fifth >> 16), e1, sixteen), t1)};
    }
  } else {
    static_assert(QT == kQ6_K, "a type without a decoder");
    const float d = fp16_fast(b + 208);
    const Q6Group g = q6_group(b, j);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    auto half = [&](int i) {  // levels - 32 of weights 16i .. 16i + 15, as floats
      const __m512i l = _mm512_and_si512(_mm512_srli_epi32(bytes16(g.ql + 16 * i), g.shift), _mm512_set1_epi32(0xF));
      const __m512i h = _mm512_and_si512(_mm512_srli_epi32(bytes16(g.qh + 16 * i), g.hshift), _mm512_set1_epi32(3));
      const __m512i q = _mm512_or_si512(l, _mm512_slli_epi32(h, 4));
      return weights_of(_mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(32))), d * static_cast<float>(sc[2 * j + i]),
                        0.0f);
    };
    return {half(0), half(1)};
  }
}

// ---- small batches: each W row once, decoded in registers, into every row of x ------------------
// y[m][n] for MB rows of x (at most 8) and the output columns [n0, n1) of part p.
template <int64_t QT, int MB>
void columns_gemv(const Part& p, int64_t n0, int64_t n1, const float* x, int64_t ldx, int64_t K, float* y, int64_t ldy) {
  constexpr Format f = format_of(QT);
  constexpr int G = static_cast<int>(f.block / 32);
  // Accumulator sets: with one or two rows of x, successive groups alternate between two sets of
  // two accumulators per row, so the FMA latency does not pace the loop (a group's work is short).
  constexpr int U = MB <= 2 ? 2 : 1;
  const int64_t groups = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = row_of(p, n);
    __m512 a0[U][MB], a1[U][MB];
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u)
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) a0[u][m] = a1[u][m] = _mm512_setzero_ps();
    auto group = [&](int64_t g, int u) {
      const W32 w = decode_w32<QT>(row + (g / G) * f.bytes, static_cast<int>(g % G));
      const float* xk = x + 32 * g;
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        a0[u][m] = _mm512_fmadd_ps(_mm512_loadu_ps(xk + m * ldx), w.lo, a0[u][m]);
        a1[u][m] = _mm512_fmadd_ps(_mm512_loadu_ps(xk + m * ldx + 16), w.hi, a1[u][m]);
      }
    };
    int64_t g = 0;
    for (; g + U <= groups; g += U)
#pragma GCC unroll 2
      for (int u = 0; u < U; ++u) group(g + u, u);
    for (; g < groups; ++g) group(g, 0);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      __m512 sum = _mm512_add_ps(a0[0][m], a1[0][m]);
      if constexpr (U == 2) sum = _mm512_add_ps(sum, _mm512_add_ps(a0[1][m], a1[1][m]));
      y[m * ldy + n] = _mm512_reduce_add_ps(sum);
    }
  }
}

template <int64_t QT>
void columns_gemv_rows(const Part& p, int64_t n0, int64_t n1, const float* x, int64_t ldx, int64_t M, int64_t K,
                       float* y, int64_t ldy) {
  for_row_runs(M, [&](auto rows, int64_t m0) {
    columns_gemv<QT, decltype(rows)::value>(p, n0, n1, x + m0 * ldx, ldx, K, y + m0 * ldy, ldy);
  });
}

// ---- larger batches: tiles of W decoded once into [k][kTileCols] fp32 blocks ---------------------
constexpr int kTileCols = 32;   // W rows (output columns) per tile: two vectors of 16
constexpr int64_t kKc = 2048;   // values of K per decoded block (K x 32 fp32: 256 KiB at most, in L2)
constexpr int kMicroRows = 8;   // rows of x per micro-kernel call: 16 accumulators

// Decodes values [k0, k0 + kc) of `cols` (<= 32) output columns starting at n0 into
// wt[(k - k0) * 32 + c]; columns past `cols` are zero.
template <int64_t QT>
void decode_tile(const Part& p, int64_t n0, int cols, int64_t k0, int64_t kc, float* wt) {
  constexpr Format f = format_of(QT);
  for (int c0 = 0; c0 < kTileCols; c0 += 16) {
    const uint8_t* rows[16];
    for (int i = 0; i < 16; ++i) rows[i] = c0 + i < cols ? row_of(p, n0 + c0 + i) : nullptr;
    for (int64_t k = k0; k < k0 + kc; k += 32) {
      const int64_t b = k / f.block;
      const int j = static_cast<int>((k % f.block) / 32);
      __m512 lo[16], hi[16];
      for (int i = 0; i < 16; ++i) {
        if (rows[i]) {
          const W32 w = decode_w32<QT>(rows[i] + b * f.bytes, j);
          lo[i] = w.lo;
          hi[i] = w.hi;
        } else {
          lo[i] = hi[i] = _mm512_setzero_ps();
        }
      }
      radixserve::transpose16(lo);
      radixserve::transpose16(hi);
      float* out = wt + (k - k0) * kTileCols + c0;
      for (int i = 0; i < 16; ++i) {
        _mm512_store_ps(out + i * kTileCols, lo[i]);
        _mm512_store_ps(out + (16 + i) * kTileCols, hi[i]);
      }
    }
  }
}

// Output columns [n0, n0 + cols) of part p (cols <= 32) for all M rows.
template <int64_t QT>
void tile_gemm(const Part& p, int64_t n0, int cols, const float* x, int64_t ldx, int64_t M, int64_t K, float* y,
               int64_t ldy, float* wt) {
  for (int64_t k0 = 0; k0 < K; k0 += kKc) {
    const int64_t kc = std::min(kKc, K - k0);
    decode_tile<QT>(p, n0, cols, k0, kc, wt);
    for (int64_t m0 = 0; m0 < M; m0 += kMicroRows)
      radixserve::gemm_rows(std::min<int64_t>(kMicroRows, M - m0), x + m0 * ldx + k0, ldx, wt, kTileCols, kc,
                            y + m0 * ldy + n0, ldy, cols,
                 k0 > 0);
  }
}
#endif  // RADIXSERVE_QUANT_AVX512

// Most rows of x the register path takes; larger batches go to the tiles: on SmolLM2 Q4_1's shapes,
// weights from memory, the register path is ahead up to about 12 rows (the tiles' decoding and
// transposes cost most at few rows). `python -m bench roofline --model FILE.gguf --gemv`
// (bench/RESULTS.md section 40).
constexpr int64_t kGemvMaxRows = 12;

bool has_avx512() {
#if defined(RADIXSERVE_QUANT_AVX512)
  return true;
#else
  return false;
#endif
}

std::vector<Part> check_parts(const std::vector<torch::Tensor>& weights, const std::vector<int64_t>& qtypes,
                              const std::vector<torch::Tensor>& row_maps, int64_t K) {
  TORCH_CHECK(!weights.empty() && weights.size() == qtypes.size() && weights.size() == row_maps.size(),
              "qlinear: weights, qtypes and row_maps must be non-empty lists of one length");
  std::vector<Part> parts;
  int64_t first = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const auto& w = weights[i];
    const Format f = format_of(qtypes[i]);
    TORCH_CHECK(f.block > 0, "qlinear: unsupported GGUF type id ", qtypes[i]);
    TORCH_CHECK(K % f.block == 0, "qlinear: K=", K, " is not a multiple of the type's block of ", f.block);
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.stride(1) == 1 &&
                    w.size(1) == K / f.block * f.bytes,
                "qlinear: weight ", i, " must be a uint8 CPU tensor [N, ", K / f.block * f.bytes,
                "] (rows of blocks, last dimension contiguous), got ", w.sizes());
    const auto& map = row_maps[i];
    const int64_t rows = map.numel() ? map.numel() : w.size(0);
    // (a row map's entries are not range-checked here, on every call of a decode step: the
    // caller's, radixserve.kernels.quant.QuantTensor checks them once)
    TORCH_CHECK(!map.numel() || (map.scalar_type() == at::kInt && map.dim() == 1 && map.is_contiguous()),
                "qlinear: row_maps must be contiguous int32 vectors (or empty)");
    parts.push_back({w.data_ptr<uint8_t>(), map.numel() ? map.data_ptr<int32_t>() : nullptr, qtypes[i], rows,
                     w.stride(0), first, w.size(0)});
    first += rows;
  }
  return parts;
}

torch::Tensor dequantize(const torch::Tensor& data, int64_t qtype, int64_t k, const torch::Tensor& rows) {
  const Format f = format_of(qtype);
  TORCH_CHECK(f.block > 0, "dequantize: unsupported GGUF type id ", qtype);
  TORCH_CHECK(k > 0 && k % f.block == 0, "dequantize: K=", k, " is not a positive multiple of ", f.block);
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kByte && data.dim() == 2 && data.stride(1) == 1 &&
                  data.size(1) == k / f.block * f.bytes,
              "dequantize: data must be a uint8 CPU tensor [N, ", k / f.block * f.bytes, "], got ", data.sizes());
  torch::Tensor ids;
  if (rows.numel()) {
    ids = rows.to(at::kLong).contiguous();
    TORCH_CHECK(ids.dim() == 1, "dequantize: rows must be 1-D");
    const int64_t* ip = ids.data_ptr<int64_t>();  // (checked in place: aminmax and two item() calls
    for (int64_t i = 0; i < ids.numel(); ++i)      // cost more than a step's embedding lookup itself)
      TORCH_CHECK(ip[i] >= 0 && ip[i] < data.size(0), "dequantize: a row index is out of range [0, ", data.size(0), ")");
  }
  const int64_t R = rows.numel() ? ids.numel() : data.size(0);
  auto out = torch::empty({R, k}, data.options().dtype(at::kFloat));
  const uint8_t* src = data.data_ptr<uint8_t>();
  const int64_t* idx = rows.numel() ? ids.data_ptr<int64_t>() : nullptr;
  float* dst = out.data_ptr<float>();
  const int64_t row_bytes = data.stride(0);
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / k), [&](int64_t r0, int64_t r1) {
    dispatch(qtype, [&](auto t) { dequantize_rows<decltype(t)::value>(src, row_bytes, k, idx, r0, r1, dst); });
  });
  return out;
}

// The outputs of the permuted parts (computed in their data's order) put in their maps' order, then
// the bias added.
torch::Tensor finish(const std::vector<Part>& permuted, const torch::Tensor* bias, torch::Tensor& y) {
  const int64_t M = y.size(0), N = y.size(1);
  float* yp = y.data_ptr<float>();
  thread_local std::vector<float> in_order;  // (kept: a decode step finishes 60 of these)
  for (const Part& p : permuted) {
    in_order.resize(static_cast<size_t>(p.rows));
    for (int64_t m = 0; m < M; ++m) {
      float* row = yp + m * N + p.first;
      std::copy(row, row + p.rows, in_order.begin());
      for (int64_t n = 0; n < p.rows; ++n) row[n] = in_order[p.row_map[n]];
    }
  }
  if (bias) y.add_(*bias);
  return y;
}

// A part whose map permutes all its rows (llama.cpp's q/k order) is multiplied in the order of its
// data, then its outputs are put in the map's order (finish): read in the map's order, a head's rows
// are taken two apart, and int8 decode of Llama-2-7B's q/k/v ran at 20 GB/s against o's 32
// (bench/RESULTS.md section 45). Clears those parts' maps in `parts` and returns them as they were.
std::vector<Part> split_permuted(std::vector<Part>& parts) {
  std::vector<Part> permuted;
  for (Part& p : parts) {
    if (p.row_map && p.rows == p.data_rows) {
      permuted.push_back(p);
      p.row_map = nullptr;
    }
  }
  return permuted;
}

void check_x_and_impl(const torch::Tensor& x, int64_t impl) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "qlinear: x must be a float32 CPU tensor [M, K], last dimension contiguous");
  TORCH_CHECK(impl >= 0 && impl <= 4,
              "qlinear: impl must be 0 (auto), 1 (portable), 2 (AVX-512 rows), 3 (AVX-512 tiles) or 4 (auto, int8 activations)");
  TORCH_CHECK(impl < 2 || impl == 4 || has_avx512(), "qlinear: this build has no AVX-512 path");
}

// x W^T + b over checked parts as split_permuted leaves them: `parts` in the order of their data,
// `permuted` the ones whose outputs finish puts in their maps' order.
torch::Tensor product(const torch::Tensor& x, const std::vector<Part>& parts, const std::vector<Part>& permuted,
                      const c10::optional<torch::Tensor>& bias, int64_t impl) {
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t N = parts.back().first + parts.back().rows;
  const float* bp = nullptr;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.device().is_cpu() && b.dim() == 1 && b.numel() == N, "qlinear: bias must be [", N, "]");
    bp = b.data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  // Calls fn(part, lo, hi) for the output columns [n0, n1), part by part.
  auto for_parts = [&](int64_t n0, int64_t n1, auto&& fn) {
    for (const Part& p : parts) {
      const int64_t lo = std::max(n0, p.first), hi = std::min(n1, p.first + p.rows);
      if (lo < hi) fn(p, lo, hi);
    }
  };
  const bool avx512 = has_avx512() && impl != 1;
  const bool tiles = avx512 && (impl == 3 || (impl != 2 && M > kGemvMaxRows));
  // impl 4: up to kGemvMaxRows rows, the parts of a type with int8 kernels take them (x quantized
  // once for all); the others below.
  std::optional<Int8Activations> xq;
  if (impl == 4 && M <= kGemvMaxRows && std::any_of(parts.begin(), parts.end(), [](const Part& p) { return int8_supports(p.qtype); }))
    xq.emplace(xp, ldx, M, K, parts);
  auto int8_part = [&](const Part& p) { return xq.has_value() && int8_supports(p.qtype); };
  if (xq) {
    // blocks of about 256 columns, a multiple of the threads (at least 16 columns each, at most 64 or
    // one per thread), handed out one at a time: a thread that a neighbour slows down takes fewer,
    // rather than holding the call up with its equal share (bench/RESULTS.md section 45)
    const int64_t threads = at::get_num_threads();
    const int64_t per_thread = std::max<int64_t>(1, std::min<int64_t>(N / 256, 64) / threads);
    const int64_t blocks = std::max<int64_t>(1, std::min(threads * per_thread, N / 16));
    radixserve::parallel_tasks(blocks, [&](auto next) {
      for (int64_t t = next(); t < blocks; t = next()) {
        const int64_t n0 = N * t / blocks / 16 * 16, n1 = t + 1 == blocks ? N : N * (t + 1) / blocks / 16 * 16;
        for_parts(n0, n1, [&](const Part& p, int64_t lo, int64_t hi) {
          if (int8_part(p)) xq->columns(p, lo, hi, yp, N);
        });
      }
    });
    if (std::all_of(parts.begin(), parts.end(), int8_part)) return finish(permuted, bp ? &b : nullptr, y);
  }
  if (!avx512) {
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for_parts(n0, n1, [&](const Part& p, int64_t lo, int64_t hi) {
        if (int8_part(p)) return;
        dispatch(p.qtype, [&](auto t) { columns_portable<decltype(t)::value>(p, lo, hi, xp, ldx, M, K, yp, N); });
      });
    });
  }
#if defined(RADIXSERVE_QUANT_AVX512)
  else if (!tiles) {
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for_parts(n0, n1, [&](const Part& p, int64_t lo, int64_t hi) {
        if (int8_part(p)) return;
        dispatch(p.qtype, [&](auto t) { columns_gemv_rows<decltype(t)::value>(p, lo, hi, xp, ldx, M, K, yp, N); });
      });
    });
  } else {
    // tiles of 32 columns that never straddle two parts
    std::vector<std::pair<const Part*, int64_t>> tasks;
    for (const Part& p : parts)
      for (int64_t n = p.first; n < p.first + p.rows && !int8_part(p); n += kTileCols) tasks.emplace_back(&p, n);
    radixserve::parallel_tasks(static_cast<int64_t>(tasks.size()), [&](auto next) {
      radixserve::AlignedVector<float> wt(static_cast<size_t>(std::min(kKc, K) * kTileCols));
      for (int64_t t = next(); t < static_cast<int64_t>(tasks.size()); t = next()) {
        const Part& p = *tasks[t].first;
        const int64_t n0 = tasks[t].second;
        const int cols = static_cast<int>(std::min<int64_t>(kTileCols, p.first + p.rows - n0));
        dispatch(p.qtype, [&](auto t) { tile_gemm<decltype(t)::value>(p, n0, cols, xp, ldx, M, K, yp, N, wt.data()); });
      }
    });
  }
#endif
  return finish(permuted, bp ? &b : nullptr, y);
}

torch::Tensor qlinear(const torch::Tensor& x, const std::vector<torch::Tensor>& weights, const std::vector<int64_t>& qtypes,
                      const std::vector<torch::Tensor>& row_maps, const c10::optional<torch::Tensor>& bias, int64_t impl) {
  check_x_and_impl(x, impl);
  std::vector<Part> parts = check_parts(weights, qtypes, row_maps, x.size(1));
  const std::vector<Part> permuted = split_permuted(parts);
  return product(x, parts, permuted, bias, impl);
}

}  // namespace

namespace radixserve::quant {

QuantProduct::QuantProduct(std::vector<torch::Tensor> weights, const std::vector<int64_t>& qtypes,
                           std::vector<torch::Tensor> row_maps, int64_t impl_)
    : weights_(std::move(weights)), row_maps_(std::move(row_maps)), impl(impl_) {
  TORCH_CHECK(!weights_.empty() && weights_.size() == qtypes.size(), "QuantProduct: one type per weight");
  const Format f = format_of(qtypes[0]);
  TORCH_CHECK(f.block > 0, "qlinear: unsupported GGUF type id ", qtypes[0]);
  TORCH_CHECK(weights_[0].dim() == 2 && weights_[0].size(1) % f.bytes == 0, "qlinear: weight 0 must be rows of ",
              f.bytes, "-byte blocks");
  K = weights_[0].size(1) / f.bytes * f.block;
  parts = check_parts(weights_, qtypes, row_maps_, K);
  permuted = split_permuted(parts);
  N = parts.back().first + parts.back().rows;
}

torch::Tensor linear(const torch::Tensor& x, const QuantProduct& w, const c10::optional<torch::Tensor>& bias) {
  check_x_and_impl(x, w.impl);
  TORCH_CHECK(x.size(1) == w.K, "qlinear: x has ", x.size(1), " columns, the weight ", w.K);
  return product(x, w.parts, w.permuted, bias, w.impl);
}

}  // namespace radixserve::quant

// The namespace is a macro so that another version of this file can load next to this one under a
// name of its own (bench/kernels.py and bench/qlinear.py --against: -DRADIXSERVE_QUANT_NS=...).
#ifndef RADIXSERVE_QUANT_NS
#define RADIXSERVE_QUANT_NS radixserve_quant
#endif
#define RADIXSERVE_QUANT_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)  // (expands the macro before TORCH_LIBRARY pastes it)

RADIXSERVE_QUANT_LIBRARY(RADIXSERVE_QUANT_NS, m) {
  m.def("dequantize(Tensor data, int qtype, int k, Tensor rows) -> Tensor", &dequantize);
  m.def("qlinear(Tensor x, Tensor[] weights, int[] qtypes, Tensor[] row_maps, Tensor? bias, int impl=0) -> Tensor",
        &qlinear);
  m.def("has_avx512() -> bool", &has_avx512);
  m.def("has_int8() -> bool", &radixserve::quant::int8_built);
}

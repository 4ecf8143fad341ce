// Quantized weights times activations quantized to int8: integer dot products (AVX-512 VNNI), as
// llama.cpp computes its CPU products. At batch 1 on a big model, fp32 arithmetic after unpacking
// (quant.cpp) cannot keep up with the memory; these kernels can. quant.cpp calls them for decode
// batches (up to 12 rows; 8 rows of x per pass over blocks of 64 rows of W).
//
// The activations x [M, K] are quantized per 32 consecutive values as ggml's Q8_0 is: d = max|x| /
// 127, q = round(x / d). A weight group of levels u (unsigned, 0..2^b - 1) with scale s and offset
// o per group, w = s (u - c) or w = s u + o, then gives
//   sum_i w_i x_i ~ s d (sum_i u_i q_i - c sum_i q_i) + o sum_i x_i,
// the integer sum by vpdpbusd (unsigned weight bytes times signed activation bytes, four products
// per 32-bit lane), the rest in fp32. Q8_0's signed levels are made unsigned by adding 128 (c = 128).
//
// The weights are read as ggml stores them, 64 level bytes per vector, and the activations are
// arranged once per call so that their bytes line up with the weight bytes of each type's vectors
// (a layout per family of types, below); each 32-bit lane then holds 4 products of one weight group
// and one activation block, so its integer sum is scaled by one s d. Next to the bytes, per group
// of lanes under one weight scale: d, -sum q (the c term, times c by a shift) and sum x (the o
// term), over the group's values in all the vectors that share one integer accumulator.
//
// Types: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K (the others take quant.cpp's fp32 kernels).

#include "quant.h"

#include <algorithm>
#include <cmath>
#include <memory>

#include "aligned.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VBMI__)
#include <immintrin.h>
#define RADIXSERVE_QUANT_INT8 1
#endif

namespace radixserve::quant {

bool int8_built() {
#if defined(RADIXSERVE_QUANT_INT8)
  return true;
#else
  return false;
#endif
}

bool int8_supports(int64_t qtype) {
  return int8_built() && (qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0 || qtype == kQ4_K || qtype == kQ6_K);
}

namespace {

// ---- activation layouts -------------------------------------------------------------------------
// A layout cuts K into chunks of `chunk` values, each read as `vectors` vectors of 64 bytes; byte i
// of vector v of chunk c holds the activation at k = chunk c + offset(v, i). Lanes of 4 bytes hold
// 4 consecutive values of one 32-value block. `accs` integer accumulators per chunk: 1 when the
// vectors' lanes meet the same weight group (their sums add up before scaling), else one per vector.
enum Layout { kNibbles32, kBytes, kNibblesK, kSixBit, kLayouts };

struct LayoutShape {
  int64_t chunk;
  int vectors, accs;
  int group;  // lanes of an accumulator under one weight scale (and one activation block)
};

constexpr LayoutShape shape_of(Layout l) {
  switch (l) {
    case kNibbles32: return {128, 2, 1, 4};  // Q4_0 / Q4_1: 4 blocks; low nibbles (values 0-15 of each block), high (16-31)
    case kBytes: return {64, 1, 1, 8};       // Q8_0: 2 blocks, in order
    case kNibblesK: return {128, 2, 2, 8};   // Q4_K: 64 bytes = sub-blocks 4c, 4c+2 (low nibbles) and 4c+1, 4c+3 (high)
    default: return {128, 2, 2, 4};          // Q6_K: half a block, in order (64 values per vector); a scale per 16
  }
}

inline int64_t offset_of(Layout l, int v, int i) {
  switch (l) {
    case kNibbles32: return 32 * (i / 16) + i % 16 + 16 * v;
    case kBytes: return i;
    case kNibblesK: return 64 * (i / 32) + i % 32 + 32 * v;
    default: return 64 * v + i;
  }
}

Layout layout_of(int64_t qtype) {
  switch (qtype) {
    case kQ4_0:
    case kQ4_1: return kNibbles32;
    case kQ8_0: return kBytes;
    case kQ4_K: return kNibblesK;
    default: return kSixBit;
  }
}

// Whether a type's weights are w = s u + o (an offset per group, times sum x), not s (u - c) (c times -sum q).
constexpr bool has_offset(int64_t qtype) { return qtype == kQ4_1 || qtype == kQ4_K; }

// Activations are arranged once per layout and kind of record (below): two types of one layout
// that differ in has_offset read two arrangements.
constexpr int kArrangements = 2 * kLayouts;
int arrangement_of(int64_t qtype) { return 2 * layout_of(qtype) + (has_offset(qtype) ? 1 : 0); }

// One layout's arrays for all rows: row m's chunk c starts at bytes + (m * chunks + c) * vectors *
// 64, and its record per accumulator (8 x 32 bits) at groups + ((m * chunks + c) * accs + acc) * 8:
// per group of lanes (16 / group of them), d in words 0-3, then in words 4-7 what the type's
// constant term needs, summed over all the group's values: sum x (fp32) for a type with an offset,
// else -sum q (int32). A record, not lane vectors, and only the term that is read: x's working set
// must fit in L1 beside the streaming weights. At K = 11,008 (Llama-2-7B's down projection), lane
// vectors (64 + 192 bytes per 64 values) ran at 13-15 GB/s against 31 at K = 4,096; records of
// both terms (64 + 64 bytes) about 0.85x K = 4,096's GB/s; these (64 + 32) were x1.03-1.04 faster
// than those at K = 11,008 and 16,384 (bench/RESULTS.md section 45).
struct Arranged {
  int64_t chunks = 0;
  LayoutShape s{};
  radixserve::AlignedVector<int8_t> bytes;
  radixserve::AlignedVector<int32_t> groups;
};

}  // namespace

struct Int8Activations::Impl {
  int64_t M, K;
  Arranged layouts[kArrangements];
};

namespace {

#if defined(RADIXSERVE_QUANT_INT8)
// A byte (or word) index vector: idx[i] = f(i).
template <typename F>
inline __m512i byte_index(F f) {
  alignas(64) uint8_t idx[64];
  for (int i = 0; i < 64; ++i) idx[i] = static_cast<uint8_t>(f(i));
  return _mm512_load_si512(idx);
}
template <typename F>
inline __m512i word_index(F f) {
  alignas(64) uint16_t idx[32];
  for (int i = 0; i < 32; ++i) idx[i] = static_cast<uint16_t>(f(i));
  return _mm512_load_si512(idx);
}
template <typename F>
inline __m512i dword_index(F f) {
  alignas(64) int32_t idx[16];
  for (int i = 0; i < 16; ++i) idx[i] = f(i);
  return _mm512_load_si512(idx);
}

// The activations quantized, row by row in their own order, each row padded with zeros to Kp (a
// multiple of 128 values): q, d per 32 values (16 floats of slack at the end, for the lane picks),
// and per 4 values: -sum q and sum x.
struct Natural {
  int64_t Kp;
  radixserve::AlignedVector<int8_t> q;
  radixserve::AlignedVector<float> d, xs4;
  radixserve::AlignedVector<int32_t> nq4;
};

void quantize(const float* x, int64_t ldx, int64_t M, int64_t K, Natural& n) {
  n.Kp = (K + 127) / 128 * 128;
  n.q.assign(static_cast<size_t>(M * n.Kp), 0);
  n.d.assign(static_cast<size_t>(M * n.Kp / 32 + 16), 0.0f);
  n.xs4.assign(static_cast<size_t>(M * n.Kp / 4), 0.0f);
  n.nq4.assign(n.xs4.size(), 0);
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * ldx;
    int8_t* q = n.q.data() + m * n.Kp;
    for (int64_t b = 0; b < K / 32; ++b) {
      const __m512 v[2] = {_mm512_loadu_ps(xr + 32 * b), _mm512_loadu_ps(xr + 32 * b + 16)};
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
      n.d[m * n.Kp / 32 + b] = amax / 127.0f;
      const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      for (int h = 0; h < 2; ++h) {
        const __m128i qh = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v[h], inv)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * b + 16 * h), qh);
        // sums of 4: q by a dot product with ones, x by two in-lane swaps (each 4's sum in all 4 lanes)
        const __m512i s4 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_castsi128_si512(qh));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(n.nq4.data() + (m * n.Kp + 32 * b + 16 * h) / 4),
                         _mm_sub_epi32(_mm_setzero_si128(), _mm512_castsi512_si128(s4)));
        __m512 t = _mm512_add_ps(v[h], _mm512_permute_ps(v[h], _MM_SHUFFLE(2, 3, 0, 1)));
        t = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(1, 0, 3, 2)));
        _mm_storeu_ps(n.xs4.data() + (m * n.Kp + 32 * b + 16 * h) / 4, _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, t)));
      }
    }
  }
}

// The natural arrays arranged in layout l: each vector's bytes by a byte permute of the chunk's
// (vpermb), each accumulator's lanes picked from the chunk's sums of 4 (its vectors' added).
void arrange(Layout l, bool offset, const Natural& n, int64_t M, Arranged& a) {
  a.s = shape_of(l);
  a.chunks = n.Kp / a.s.chunk;
  const int64_t units = M * a.chunks;
  a.bytes.resize(static_cast<size_t>(units * a.s.vectors * 64));
  a.groups.assign(static_cast<size_t>(units * a.s.accs * 8), 0);
  __m512i bytes[2], group[2];  // per vector: its byte i's chunk offset; its lane's chunk group of 4
  for (int v = 0; v < a.s.vectors; ++v) {
    bytes[v] = byte_index([&](int i) { return offset_of(l, v, i); });
    group[v] = dword_index([&](int i) { return static_cast<int>(offset_of(l, v, 4 * i) / 4); });
  }
  const bool permute = l == kNibbles32 || l == kNibblesK;
  for (int64_t u = 0; u < units; ++u) {
    const int64_t k0 = (u / a.chunks) * n.Kp + (u % a.chunks) * a.s.chunk;  // the chunk's first value in n
    const int8_t* q = n.q.data() + k0;
    int8_t* out = a.bytes.data() + u * a.s.vectors * 64;
    if (permute) {
      const __m512i lo = _mm512_load_si512(q), hi = _mm512_load_si512(q + 64);
      for (int v = 0; v < 2; ++v) _mm512_store_si512(out + 64 * v, _mm512_permutex2var_epi8(lo, bytes[v], hi));
    } else {
      std::memcpy(out, q, static_cast<size_t>(a.s.vectors * 64));
    }
    const bool two = a.s.chunk == 128;  // the chunk's 32 groups of 4 in two vectors, else 16 in one
    const __m512i nq0 = _mm512_loadu_si512(n.nq4.data() + k0 / 4), nq1 = two ? _mm512_loadu_si512(n.nq4.data() + k0 / 4 + 16) : nq0;
    const __m512 xs0 = _mm512_loadu_ps(n.xs4.data() + k0 / 4), xs1 = two ? _mm512_loadu_ps(n.xs4.data() + k0 / 4 + 16) : xs0;
    const __m512 dv = _mm512_loadu_ps(n.d.data() + k0 / 32);
    for (int acc = 0; acc < a.s.accs; ++acc) {
      __m512i nq = _mm512_setzero_si512();
      __m512 xs = _mm512_setzero_ps();
      for (int v = acc; v < (a.s.accs == 1 ? a.s.vectors : acc + 1); ++v) {
        nq = _mm512_add_epi32(nq, _mm512_permutex2var_epi32(nq0, group[v], nq1));
        xs = _mm512_add_ps(xs, _mm512_permutex2var_ps(xs0, group[v], xs1));
      }
      alignas(64) int32_t nl[16];
      alignas(64) float xl[16], dl[16];
      _mm512_store_si512(nl, nq);
      _mm512_store_ps(xl, xs);
      _mm512_store_ps(dl, _mm512_permutexvar_ps(_mm512_srli_epi32(group[acc], 3), dv));
      int32_t* rec = a.groups.data() + (u * a.s.accs + acc) * 8;
      for (int g = 0; g < 16 / a.s.group; ++g) {
        int32_t n = 0;
        float x = 0.0f;
        for (int i = g * a.s.group; i < (g + 1) * a.s.group; ++i) n += nl[i], x += xl[i];
        std::memcpy(rec + g, dl + g * a.s.group, 4);
        if (offset) std::memcpy(rec + 4 + g, &x, 4);
        else rec[4 + g] = n;
      }
    }
  }
}

// ---- the kernels ---------------------------------------------------------------------------------
inline __m512i nibbles_low(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline __m512i nibbles_high(__m512i v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }

// The first n (<= 64) bytes at p, the rest zero.
inline __m512i load_first(const uint8_t* p, int64_t n) {
  if (n <= 0) return _mm512_setzero_si512();
  return _mm512_maskz_loadu_epi8(n >= 64 ? ~0ull : (1ull << n) - 1, p);
}

// fp16 words of v picked by a word index: 16 floats (lane l: word idx[l]).
inline __m512 halves(__m512i v, __m512i idx) { return _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(idx, v))); }

// The weights of one chunk of a W row, decoded as far as the rows of x share it: the level bytes of
// each vector (unsigned), and per accumulator, the lanes' weight scale s and offset o (o: types with one).
struct WChunk {
  __m512i u[2];
  __m512 s[2], o[2];
};

// Chunk c of a row of type QT (the chunk's blocks: `blocks` of them, fewer than a whole chunk at a
// row's end only for the 32-value types).
template <int64_t QT>
struct Decoder;

// Q4_0 and Q4_1: up to 4 blocks of kBytes (header, then 16 bytes of nibbles) from b; their levels
// (picked by qs) into w.u, low nibbles then high. Returns the first 64 bytes (for the headers).
template <int kBytes>
inline __m512i nibble_blocks(const uint8_t* b, int64_t blocks, __m512i qs, WChunk& w) {
  static_assert(4 * kBytes - 64 == 8 || 4 * kBytes - 64 == 16, "four blocks span 64 bytes and 8 or 16 more");
  __m512i lo, hi;
  if (blocks == 4) {
    lo = _mm512_loadu_si512(b);
    if constexpr (4 * kBytes - 64 == 8)
      hi = _mm512_castsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 64)));
    else
      hi = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 64)));
  } else {
    lo = load_first(b, blocks * kBytes);
    hi = load_first(b + 64, blocks * kBytes - 64);
  }
  const __m512i q = _mm512_permutex2var_epi8(lo, qs, hi);
  w.u[0] = nibbles_low(q);
  w.u[1] = nibbles_high(q);
  return lo;
}

template <>
struct Decoder<kQ4_0> {  // 4 blocks of 18 bytes: fp16 d, 16 bytes of nibbles
  __m512i qs = byte_index([](int i) { return 18 * (i / 16) + 2 + i % 16; });
  __m512i dw = word_index([](int i) { return 9 * (i / 4); });
  static constexpr int kShift = 3;  // c = 8
  inline void operator()(const uint8_t* b, int64_t blocks, WChunk& w) const {
    const __m512i lo = nibble_blocks<18>(b, blocks, qs, w);
    w.s[0] = halves(lo, dw);
  }
};

template <>
struct Decoder<kQ4_1> {  // 4 blocks of 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles
  __m512i qs = byte_index([](int i) { return 20 * (i / 16) + 4 + i % 16; });
  __m512i dw = word_index([](int i) { return 10 * (i / 4); });
  __m512i mw = word_index([](int i) { return 10 * (i / 4) + 1; });
  inline void operator()(const uint8_t* b, int64_t blocks, WChunk& w) const {
    const __m512i lo = nibble_blocks<20>(b, blocks, qs, w);
    w.s[0] = halves(lo, dw);
    w.o[0] = halves(lo, mw);
  }
};

template <>
struct Decoder<kQ8_0> {  // 2 blocks of 34 bytes: fp16 d, 32 signed bytes
  __m512i qs = byte_index([](int i) { return 34 * (i / 32) + 2 + i % 32; });
  __m512i dw = word_index([](int i) { return 17 * (i / 8); });
  static constexpr int kShift = 7;  // c = 128
  inline void operator()(const uint8_t* b, int64_t blocks, WChunk& w) const {
    __m512i lo, hi;
    if (blocks == 2) {
      lo = _mm512_loadu_si512(b);
      hi = _mm512_castsi128_si512(_mm_cvtsi32_si128(static_cast<int>(u32_at(b + 64))));
    } else {
      lo = load_first(b, blocks * 34);
      hi = _mm512_setzero_si512();
    }
    // levels + 128: unsigned; a missing block's zero levels become 128, against zero activations
    w.u[0] = _mm512_xor_si512(_mm512_permutex2var_epi8(lo, qs, hi), _mm512_set1_epi8(static_cast<char>(0x80)));
    w.s[0] = halves(lo, dw);
  }
};

// Q4_K and Q6_K: whole blocks of 256 values, two chunks each; the block's scales are decoded at its
// first chunk into `scales` (16 floats) and picked per lane at each chunk.
template <>
struct Decoder<kQ4_K> {  // fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
  // lane l of chunk c: sub-block 4c + 2 (l / 8) (low nibbles), + 1 (high); mins after the 8 scales
  __m512i pick[2][2] = {{dword_index([](int l) { return 2 * (l / 8); }), dword_index([](int l) { return 2 * (l / 8) + 1; })},
                        {dword_index([](int l) { return 4 + 2 * (l / 8); }), dword_index([](int l) { return 5 + 2 * (l / 8); })}};
  __m512i eight = _mm512_set1_epi32(8);
  inline void operator()(const uint8_t* b, int c, WChunk& w, __m512& scales) const {
    if (c == 0) {
      // sub-block j's 6-bit scale and min (see quant.cpp's scale_min_k4), four at a time
      const uint32_t a0 = u32_at(b + 4), a1 = u32_at(b + 8), a2 = u32_at(b + 12);
      const uint32_t sc03 = a0 & 0x3f3f3f3f, mn03 = a1 & 0x3f3f3f3f;
      const uint32_t sc47 = (a2 & 0x0f0f0f0f) | (((a0 >> 6) & 0x03030303) << 4);
      const uint32_t mn47 = ((a2 >> 4) & 0x0f0f0f0f) | (((a1 >> 6) & 0x03030303) << 4);
      const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_setr_epi32(static_cast<int>(sc03), static_cast<int>(sc47),
                                                                               static_cast<int>(mn03), static_cast<int>(mn47))));
      const __m512 dd = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(fp16_at(b)), _mm512_set1_ps(-fp16_at(b + 2)));
      scales = _mm512_mul_ps(v, dd);
    }
    const __m512i q = _mm512_loadu_si512(b + 16 + 64 * c);
    w.u[0] = nibbles_low(q);
    w.u[1] = nibbles_high(q);
    for (int v = 0; v < 2; ++v) {
      w.s[v] = _mm512_permutexvar_ps(pick[c][v], scales);
      w.o[v] = _mm512_permutexvar_ps(_mm512_add_epi32(pick[c][v], eight), scales);
    }
  }
};

template <>
struct Decoder<kQ6_K> {  // 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, fp16 d
  static constexpr int kShift = 5;  // c = 32
  // lane l of chunk c, vector v: values 64 v + 4 l, scale 8 c + 4 v + l / 4
  __m512i pick[2][2] = {{dword_index([](int l) { return l / 4; }), dword_index([](int l) { return 4 + l / 4; })},
                        {dword_index([](int l) { return 8 + l / 4; }), dword_index([](int l) { return 12 + l / 4; })}};
  // the high bits of byte i of vector v sit at bit 2 (2 v + i / 32) of its qh byte; moved to bits 4-5
  __m512i up = word_index([](int i) { return i < 16 ? 4 : 2; });
  __m512i down = word_index([](int i) { return i < 16 ? 0 : 2; });
  inline void operator()(const uint8_t* b, int c, WChunk& w, __m512& scales) const {
    if (c == 0)
      scales = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)))),
                             _mm512_set1_ps(fp16_at(b + 208)));
    const __m512i ql = _mm512_loadu_si512(b + 64 * c);
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * c)));
    const __m512i two = _mm512_set1_epi8(0x30);
    w.u[0] = _mm512_or_si512(nibbles_low(ql), _mm512_and_si512(_mm512_sllv_epi16(qh, up), two));
    w.u[1] = _mm512_or_si512(nibbles_high(ql), _mm512_and_si512(_mm512_srlv_epi16(qh, down), two));
    w.s[0] = _mm512_permutexvar_ps(pick[c][0], scales);
    w.s[1] = _mm512_permutexvar_ps(pick[c][1], scales);
  }
};

// f(Const<0>{}), ..., f(Const<N - 1>{}): a loop unrolled at compile time, whose index is a constant
// in each body (arrays of vectors indexed by it stay in registers).
template <typename F, int64_t... I>
inline __attribute__((always_inline)) void unrolled_impl(F&& f, std::integer_sequence<int64_t, I...>) {
  (f(Const<I>{}), ...);
}
template <int64_t N, typename F>
inline __attribute__((always_inline)) void unrolled(F&& f) {
  unrolled_impl(f, std::make_integer_sequence<int64_t, N>{});
}

// y[m][n] for MB rows of the arranged activations (starting at row m0) and columns [n0, n1), as R
// streams of W rows at once: step i takes rows n0 + i, n0 + span + i, ... (span = (n1 - n0) / R),
// each stream sequential in memory; the rows left over go one at a time. Two things gain: a core
// keeps R sequential streams in flight instead of one (one core's decode of a 4,096-column Q4_0
// weight went from 12-14 GB/s to 22-29 GB/s with 4), and each chunk of x (its vectors and record)
// is loaded once for R rows of W rather than once per row. bench/RESULTS.md section 44.
template <int64_t QT, int MB, int R>
void columns_int8(const Part& p, int64_t n0, int64_t n1, const Arranged& a, int64_t m0, int64_t K, float* y, int64_t ldy) {
  constexpr Format f = format_of(QT);
  constexpr bool k_quant = f.block == 256;
  constexpr LayoutShape s = shape_of(QT == kQ4_0 || QT == kQ4_1 ? kNibbles32 : QT == kQ8_0 ? kBytes : QT == kQ4_K ? kNibblesK : kSixBit);
  constexpr int64_t blocks_per_chunk = k_quant ? 1 : s.chunk / 32;
  constexpr bool offset = has_offset(QT);  // w = s u + o (else w = s (u - c))
  const Decoder<QT> decode;
  // plain constants for the lambdas below (GCC 12 fails to compile their use of the structs)
  constexpr int64_t kFBytes = f.bytes, kXBytes = s.vectors * 64, kRec = s.accs * 8;
  constexpr int kAccs = s.accs;
  constexpr bool kTwo = s.accs == 1 && s.vectors == 2;
  const int64_t chunks = a.chunks, blocks = K / f.block;
  const int8_t* xb = a.bytes.data() + m0 * chunks * s.vectors * 64;
  const int32_t* rec = a.groups.data() + m0 * chunks * s.accs * 8;
  // a record's words to lanes: d to every lane of its group; -sum q and sum x to the group's first
  // lane (its lanes' products share one scale and one offset, so one lane may carry the whole sum)
  constexpr int G = s.group;
  const __m512i to_d = dword_index([](int l) { return l / G; });
  const __m512i to_term = dword_index([](int l) { return 4 + l / G; });
  const __mmask16 first = static_cast<__mmask16>(G == 4 ? 0x1111 : 0x0101);
  const int64_t bstride = chunks * s.vectors * 64, lstride = chunks * s.accs * 8;  // per row of x
  const int64_t span = (n1 - n0) / R;  // R streams: row r of step i is n0 + r span + i
  for (int64_t i = 0; i < span; ++i) {
    const int64_t n = n0 + i;
    const uint8_t* row[R];
    __m512 acc[R * MB];
    WChunk w[R];
    __m512 scales[R];
    unrolled<R>([&](auto r) { row[r] = row_of(p, n + r * span), scales[r] = _mm512_setzero_ps(); });
    unrolled<R * MB>([&](auto i) { acc[i] = _mm512_setzero_ps(); });
    for (int64_t c = 0; c < chunks; ++c) {
      unrolled<R>([&](auto r) {
        if constexpr (k_quant) decode(row[r] + (c / 2) * kFBytes, static_cast<int>(c % 2), w[r], scales[r]);
        else decode(row[r] + c * blocks_per_chunk * kFBytes, std::min(blocks_per_chunk, blocks - c * blocks_per_chunk), w[r]);
      });
      unrolled<MB>([&](auto m) {
        const int8_t* xv = xb + m * bstride + c * kXBytes;
        const int32_t* rp = rec + m * lstride + c * kRec;
        unrolled<kAccs>([&](auto v) {  // accumulator v: vector v, or (one accumulator) both
          const __m512i g = _mm512_castsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(rp + 8 * v)));
          const __m512i x0 = _mm512_load_si512(xv + 64 * v);
          __m512i init;
          if constexpr (offset) init = _mm512_setzero_si512();
          else init = _mm512_slli_epi32(_mm512_maskz_permutexvar_epi32(first, to_term, g), Decoder<QT>::kShift);
          const __m512 dx = _mm512_permutexvar_ps(to_d, _mm512_castsi512_ps(g));
          __m512i x1;
          if constexpr (kTwo) x1 = _mm512_load_si512(xv + 64);
          unrolled<R>([&](auto r) {
            __m512i sum = _mm512_dpbusd_epi32(init, w[r].u[v], x0);
            if constexpr (kTwo) sum = _mm512_dpbusd_epi32(sum, w[r].u[1], x1);
            __m512& t = acc[r * MB + m];
            t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(w[r].s[v], dx), t);
            if constexpr (offset) t = _mm512_fmadd_ps(w[r].o[v], _mm512_maskz_permutexvar_ps(first, to_term, _mm512_castsi512_ps(g)), t);
          });
        });
      });
    }
    unrolled<R * MB>([&](auto j) { y[(j % MB) * ldy + n + (j / MB) * span] = _mm512_reduce_add_ps(acc[j]); });
  }
  if constexpr (R > 1) {
    const int64_t done = n0 + span * R;
    if (done < n1) columns_int8<QT, MB, 1>(p, done, n1, a, m0, K, y, ldy);
  }
}

// Columns [n0, n1) for all M rows: blocks of kColumnBlock columns (their weights stay in L2 while
// every 8 rows of x pass over them).
constexpr int64_t kColumnBlock = 64;

// Streams of W per call of columns_int8, by rows of x: as many as the registers hold beside the
// R x MB accumulators (more rows of x, each chunk of W serves more products already).
constexpr int streams_for(int64_t rows) { return rows <= 2 ? 4 : rows <= 4 ? 2 : 1; }

template <int64_t QT>
void columns_int8_rows(const Part& p, int64_t n0, int64_t n1, const Arranged& a, int64_t M, int64_t K, float* y, int64_t ldy) {
  if (M > 8 && n1 - n0 > kColumnBlock) {
    for (int64_t nb = n0; nb < n1; nb += kColumnBlock) columns_int8_rows<QT>(p, nb, std::min(n1, nb + kColumnBlock), a, M, K, y, ldy);
    return;
  }
  for_row_runs(M, [&](auto rows, int64_t m0) {
    constexpr int MB = decltype(rows)::value;
    columns_int8<QT, MB, streams_for(MB)>(p, n0, n1, a, m0, K, y + m0 * ldy, ldy);
  });
}
#endif  // RADIXSERVE_QUANT_INT8

}  // namespace

// A decode step constructs 120 of these one after another (SmolLM2), each on the calling thread:
// allocating each one's seven buffers afresh cost about a microsecond a product. So a thread keeps
// the buffers of its last one (its Impl and its quantized x) and the next reuses their capacity.
std::unique_ptr<Int8Activations::Impl>& Int8Activations::spare() {
  thread_local std::unique_ptr<Impl> impl;
  return impl;
}

Int8Activations::Int8Activations(const float* x, int64_t ldx, int64_t M, int64_t K, const std::vector<Part>& parts)
    : impl_(nullptr) {
#if defined(RADIXSERVE_QUANT_INT8)
  TORCH_CHECK(K % 32 == 0, "int8 activations: K=", K, " is not a multiple of 32");
  impl_ = spare() ? spare().release() : new Impl{};
  impl_->M = M;
  impl_->K = K;
  thread_local Natural natural;  // (filled afresh: quantize assigns every buffer)
  quantize(x, ldx, M, K, natural);
  bool done[kArrangements] = {};
  for (const Part& p : parts) {
    if (!int8_supports(p.qtype)) continue;
    const int i = arrangement_of(p.qtype);
    if (!done[i]) arrange(layout_of(p.qtype), has_offset(p.qtype), natural, M, impl_->layouts[i]);
    done[i] = true;
  }
#else
  (void)x, (void)ldx, (void)M, (void)K, (void)parts;
  TORCH_CHECK(false, "int8 activations: this build has no int8 kernels (AVX-512 VNNI and VBMI)");
#endif
}

Int8Activations::~Int8Activations() {
  if (spare()) delete impl_;
  else spare().reset(impl_);
}

void Int8Activations::columns(const Part& p, int64_t n0, int64_t n1, float* y, int64_t ldy) const {
#if defined(RADIXSERVE_QUANT_INT8)
  const Arranged& a = impl_->layouts[arrangement_of(p.qtype)];
  const int64_t M = impl_->M, K = impl_->K;
  switch (p.qtype) {
    case kQ4_0: return columns_int8_rows<kQ4_0>(p, n0, n1, a, M, K, y, ldy);
    case kQ4_1: return columns_int8_rows<kQ4_1>(p, n0, n1, a, M, K, y, ldy);
    case kQ8_0: return columns_int8_rows<kQ8_0>(p, n0, n1, a, M, K, y, ldy);
    case kQ4_K: return columns_int8_rows<kQ4_K>(p, n0, n1, a, M, K, y, ldy);
    case kQ6_K: return columns_int8_rows<kQ6_K>(p, n0, n1, a, M, K, y, ldy);
    default: break;
  }
#endif
  (void)n0, (void)n1, (void)y, (void)ldy;
  TORCH_CHECK(false, "int8 activations: no int8 kernel for GGUF type id ", p.qtype);
}

}  // namespace radixserve::quant

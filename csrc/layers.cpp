// Fused elementwise ops of a Llama-family decoder layer, fp32 and bf16 (arithmetic in fp32).
//
// Each op is one pass over its rows inside one at::parallel_for (one OpenMP region, none at all
// when the batch is small enough to run inline on the calling thread):
//   add_rms_norm  x += residual (optional, rounded to x's dtype as torch's add is); then
//                 out = rmsnorm(x) * weight, rounded like Hugging Face's RMSNorm: normalise in
//                 fp32, cast to the dtype, then multiply by the weight.
//   rope          neox-style rotary embedding applied in place to q [T, Hq, D] and k [T, Hk, D]
//                 (strided views of the fused qkv output), from half-width cos/sin [T, D/2].
//   silu_and_mul  out [N, I] = silu(gate) * up over the fused gate_up output [N, 2I].
//   argmax_rows   each fp32 row's index of its first maximum, or of its first NaN when it has one
//                 (torch.max(x, dim=-1).indices, which runs on one thread): the greedy sampler's.
// Registered as torch.ops.radixserve_layers.*, like every op of the extension.
//
// Inner loops have fixed-width blocks (16 floats) so -O3 -march=native vectorises them; bf16 is
// widened to fp32 by a shift and narrowed by round-to-nearest-even, as c10::BFloat16 does. With
// AVX-512 the bf16 loops are written with intrinsics instead (the compiler's code for the scalar
// rounding was 2-3x slower), narrowing with vcvtneps2bf16 where the CPU has AVX512-BF16.
// Contraction into FMA is off in this file so fp32 results equal torch's separate mul/add;
// -fno-trapping-math (no effect on results) lets the float->int conversion of exp vectorise.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "layers.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "avx512_math.h"
#endif

#pragma GCC optimize("fp-contract=off", "no-trapping-math")

namespace {

constexpr int kLanes = 16;
// Elements per task, about 50 us of work: smaller batches run inline, with no OpenMP region
// (waking the pool's passive threads costs more than it saves on less).
constexpr int64_t kGrainElems = 1 << 17;
constexpr int64_t kGrainElemsSilu = 1 << 16;  // exp costs more per element

template <typename T>
struct Cvt;

template <>
struct Cvt<float> {
  using raw = float;
  static inline float in(float v) { return v; }
  static inline float out(float v) { return v; }
};

template <>
struct Cvt<at::BFloat16> {
  using raw = uint16_t;
  static inline float in(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  static inline uint16_t out(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return f != f ? uint16_t{0x7fc0} : static_cast<uint16_t>(rounded);
  }
};

int64_t grain_rows(int64_t row_elems, int64_t grain = kGrainElems) {
  return std::max<int64_t>(1, grain / std::max<int64_t>(1, row_elems));
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D [rows, cols], got ", t.dim(), "-D");
  TORCH_CHECK(t.stride(1) == 1, name, " must have a contiguous last dimension");
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)  // (the intrinsics used need all three)
#define RADIXSERVE_LAYERS_AVX512 1
// 16 lanes in and out: fp32 as is, bf16 (raw 16-bit) widened by a shift and narrowed by
// round-to-nearest-even (NaN -> 0x7fc0), exactly as Cvt<at::BFloat16> does one value.
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
// v rounded to bf16 by integer arithmetic (nearest even; NaN -> 0x7fc0), in the low 16 bits of
// each lane: Cvt<at::BFloat16>::out on 16 lanes.
inline __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}
#if defined(__AVX512BF16__)
// One vcvtneps2bf16: the same rounding (nearest even) in one instruction instead of about eight;
// it treats fp32 denormals (below 1.2e-38) as zero and keeps a NaN's sign and payload (a NaN
// still). bench/RESULTS.md section 27: bf16 add_rms_norm 2-3x faster.
inline __m256i bf16_round(__m512 v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }
#else
inline __m256i bf16_round(__m512 v) { return _mm512_cvtepi32_epi16(bf16_bits(v)); }
#endif
// v rounded to the dtype of the pointer and widened back, in registers: what store16 and load16
// give, without the round trip (a masked store does not forward to the load that follows it).
inline __m512 round16(float*, __m512 v) { return v; }  // (fp32: nothing to round)
inline __m512 round16(uint16_t*, __m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_round(v)), 16));
}
inline void store16(uint16_t* p, __m512 v, __mmask16 m) {  // round to nearest even
  _mm256_mask_storeu_epi16(p, m, bf16_round(v));
}
#endif

#ifdef RADIXSERVE_LAYERS_AVX512
// add_rms_norm's rows [begin, end) on 16 lanes, with the scalar loop's arithmetic in the same order
// (lane l sums the squares of elements l, l + 16, ...; the lanes are then added 0..15; no FMAs),
// so results are bit-identical to it.
template <typename R>
void add_rms_norm_rows_avx512(R* xp, int64_t xs, const R* rp, int64_t rs, const R* wp, R* op, int64_t os, int64_t h,
                              float eps, int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    R* xr = xp + row * xs;
    R* orow = op + row * os;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < h; i += kLanes) {
      const __mmask16 m = radixserve::tail_mask(static_cast<int>(std::min<int64_t>(h - i, kLanes)));
      __m512 v = load16(xr + i, m);
      if (rp != nullptr) {
        v = round16(xr, _mm512_add_ps(v, load16(rp + row * rs + i, m)));  // the sum as stored, as the scalar loop squares it
        store16(xr + i, v, m);
      }
      acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    alignas(64) float lanes[kLanes];
    _mm512_store_ps(lanes, acc);
    float sum = 0.0f;
    for (int l = 0; l < kLanes; ++l) sum += lanes[l];
    const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(sum / static_cast<float>(h) + eps));
    for (int64_t i = 0; i < h; i += kLanes) {
      const __mmask16 m = radixserve::tail_mask(static_cast<int>(std::min<int64_t>(h - i, kLanes)));
      const __m512 normed = round16(orow, _mm512_mul_ps(load16(xr + i, m), scale));  // rounded to the dtype,
      store16(orow + i, _mm512_mul_ps(normed, load16(wp + i, m)), m);                  // then times the weight
    }
  }
}

// rope's items [begin, end) of (token, head) on 16 lanes: the scalar loop's products and sums
// (no FMAs), so results are bit-identical to it.
template <typename R>
void rope_items_avx512(R* qp, R* kp, const R* cp, const R* sp, int64_t qs0, int64_t qs1, int64_t ks0, int64_t ks1,
                       int64_t cs, int64_t ss, int64_t hq, int64_t heads, int64_t half, int64_t begin, int64_t end) {
  for (int64_t item = begin; item < end; ++item) {
    const int64_t tok = item / heads, head = item % heads;
    R* x = head < hq ? qp + tok * qs0 + head * qs1 : kp + tok * ks0 + (head - hq) * ks1;
    R* x2 = x + half;
    const R* c = cp + tok * cs;
    const R* sn = sp + tok * ss;
    for (int64_t i = 0; i < half; i += kLanes) {
      const __mmask16 m = radixserve::tail_mask(static_cast<int>(std::min<int64_t>(half - i, kLanes)));
      const __m512 a = load16(x + i, m), b = load16(x2 + i, m), ci = load16(c + i, m), si = load16(sn + i, m);
      store16(x + i, _mm512_sub_ps(_mm512_mul_ps(a, ci), _mm512_mul_ps(b, si)), m);
      store16(x2 + i, _mm512_add_ps(_mm512_mul_ps(b, ci), _mm512_mul_ps(a, si)), m);
    }
  }
}
#endif

template <typename T>
void add_rms_norm_impl(void* x, int64_t xs, const void* residual, int64_t rs, const void* weight, void* out, int64_t os,
                       int64_t n, int64_t h, double eps) {
  using C = Cvt<T>;
  using R = typename C::raw;
  R* xp = static_cast<R*>(x);
  const R* rp = static_cast<const R*>(residual);
  const R* wp = static_cast<const R*>(weight);
  R* op = static_cast<R*>(out);
  const int64_t blocks = h / kLanes * kLanes;
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, n, grain_rows(h), [&](int64_t begin, int64_t end) {
#ifdef RADIXSERVE_LAYERS_AVX512
    if constexpr (std::is_same_v<T, at::BFloat16>) {  // (fp32 auto-vectorises; bf16's scalar rounding did not)
      add_rms_norm_rows_avx512(xp, xs, rp, rs, wp, op, os, h, feps, begin, end);
      return;
    }
#endif
    for (int64_t row = begin; row < end; ++row) {
      R* xr = xp + row * xs;
      R* orow = op + row * os;
      float acc[kLanes] = {};
      if (rp != nullptr) {
        const R* rr = rp + row * rs;
        for (int64_t i = 0; i < blocks; i += kLanes)
          for (int l = 0; l < kLanes; ++l) {
            const float v = C::in(C::out(C::in(xr[i + l]) + C::in(rr[i + l])));
            xr[i + l] = C::out(v);
            acc[l] += v * v;
          }
        for (int64_t i = blocks; i < h; ++i) {
          const float v = C::in(C::out(C::in(xr[i]) + C::in(rr[i])));
          xr[i] = C::out(v);
          acc[i - blocks] += v * v;
        }
      } else {
        for (int64_t i = 0; i < blocks; i += kLanes)
          for (int l = 0; l < kLanes; ++l) {
            const float v = C::in(xr[i + l]);
            acc[l] += v * v;
          }
        for (int64_t i = blocks; i < h; ++i) {
          const float v = C::in(xr[i]);
          acc[i - blocks] += v * v;
        }
      }
      float sum = 0.0f;
      for (int l = 0; l < kLanes; ++l) sum += acc[l];
      const float scale = 1.0f / std::sqrt(sum / static_cast<float>(h) + feps);
      for (int64_t i = 0; i < blocks; i += kLanes)
        for (int l = 0; l < kLanes; ++l)
          orow[i + l] = C::out(C::in(C::out(C::in(xr[i + l]) * scale)) * C::in(wp[i + l]));
      for (int64_t i = blocks; i < h; ++i) orow[i] = C::out(C::in(C::out(C::in(xr[i]) * scale)) * C::in(wp[i]));
    }
  });
}

void add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
                  double eps, const at::Tensor& out) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(), "out must match x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [cols] tensor of x's dtype");
  if (residual) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must match x");
  }
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "add_rms_norm supports float32 and bfloat16, not ", x.scalar_type());
  radixserve::layers::add_rms_norm(x.scalar_type(), x.data_ptr(), x.stride(0), residual ? residual->data_ptr() : nullptr,
                                   residual ? residual->stride(0) : 0, weight.data_ptr(), out.data_ptr(), out.stride(0),
                                   x.size(0), x.size(1), eps);
}

template <typename T>
void rope_impl(void* q, int64_t qs0, int64_t qs1, void* k, int64_t ks0, int64_t ks1, const void* cos, int64_t cs,
               const void* sin, int64_t ss, int64_t t, int64_t hq, int64_t hk, int64_t half) {
  using C = Cvt<T>;
  using R = typename C::raw;
  const int64_t heads = hq + hk;
  R* qp = static_cast<R*>(q);
  R* kp = static_cast<R*>(k);
  const R* cp = static_cast<const R*>(cos);
  const R* sp = static_cast<const R*>(sin);
  at::parallel_for(0, t * heads, grain_rows(2 * half), [&](int64_t begin, int64_t end) {
#ifdef RADIXSERVE_LAYERS_AVX512
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      rope_items_avx512(qp, kp, cp, sp, qs0, qs1, ks0, ks1, cs, ss, hq, heads, half, begin, end);
      return;
    }
#endif
    for (int64_t item = begin; item < end; ++item) {
      const int64_t tok = item / heads, head = item % heads;
      R* x = head < hq ? qp + tok * qs0 + head * qs1 : kp + tok * ks0 + (head - hq) * ks1;
      const R* c = cp + tok * cs;
      const R* s = sp + tok * ss;
      R* x2 = x + half;
      for (int64_t i = 0; i < half; ++i) {
        const float a = C::in(x[i]), b = C::in(x2[i]), ci = C::in(c[i]), si = C::in(s[i]);
        const float ac = a * ci, bs = b * si, bc = b * ci, as = a * si;
        x[i] = C::out(ac - bs);
        x2[i] = C::out(bc + as);
      }
    }
  });
}

void rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu(), "q and k must be CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3, "q and k must be [tokens, heads, head_dim]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "q and k must have a contiguous last dimension");
  const int64_t t = q.size(0), d = q.size(2);
  TORCH_CHECK(k.size(0) == t && k.size(2) == d && d % 2 == 0, "k must match q's tokens and even head_dim");
  TORCH_CHECK(cos.dim() == 2 && sin.dim() == 2 && cos.size(0) == t && sin.size(0) == t && cos.size(1) == d / 2 &&
                  sin.size(1) == d / 2 && cos.stride(1) == 1 && sin.stride(1) == 1,
              "cos and sin must be [tokens, head_dim / 2] with a contiguous last dimension");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dtype && cos.scalar_type() == dtype && sin.scalar_type() == dtype,
              "q, k, cos and sin must share one dtype");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "rope supports float32 and bfloat16, not ", dtype);
  radixserve::layers::rope(dtype, q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
                           cos.data_ptr(), cos.stride(0), sin.data_ptr(), sin.stride(0), t, q.size(1), k.size(1), d / 2);
}

// e^x for x <= 88: x = n ln2 + r (Cody-Waite split of ln2, |r| <= ln2/2), e^r by a degree-7
// Taylor polynomial, times 2^n built in the exponent bits. Vectorises; ~1 ulp.
inline float exp_poly(float x) {
  x = x < 88.0f ? x : 88.0f;  // ternaries, not std::min/max (whose references block vectorising)
  x = x > -87.0f ? x : -87.0f;
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9841270e-4f;
  p = p * r + 1.3888889e-3f;
  p = p * r + 8.3333333e-3f;
  p = p * r + 4.1666667e-2f;
  p = p * r + 1.6666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#ifdef RADIXSERVE_LAYERS_AVX512
using radixserve::silu_mul_v;

#endif

template <typename T>
void silu_and_mul_impl(const void* gate_up, int64_t gs, void* out, int64_t os, int64_t n, int64_t inter) {
  using C = Cvt<T>;
  using R = typename C::raw;
  const R* gp = static_cast<const R*>(gate_up);
  R* op = static_cast<R*>(out);
  at::parallel_for(0, n, grain_rows(inter, kGrainElemsSilu), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const R* g = gp + row * gs;
      const R* u = g + inter;
      R* o = op + row * os;
#ifdef RADIXSERVE_LAYERS_AVX512
      for (int64_t i = 0; i < inter; i += 16) {
        const __mmask16 m = radixserve::tail_mask(static_cast<int>(std::min<int64_t>(inter - i, 16)));
        store16(o + i, silu_mul_v<std::is_same_v<T, at::BFloat16>>(load16(g + i, m), load16(u + i, m)), m);
      }
#else
      for (int64_t i = 0; i < inter; ++i) {
        const float x = C::in(g[i]);
        o[i] = C::out(x / (1.0f + exp_poly(-x)) * C::in(u[i]));
      }
#endif
    }
  });
}

void silu_and_mul(const at::Tensor& gate_up, const at::Tensor& out) {
  check_rows(gate_up, "gate_up");
  check_rows(out, "out");
  TORCH_CHECK(gate_up.size(0) == out.size(0) && gate_up.size(1) == 2 * out.size(1) &&
                  gate_up.scalar_type() == out.scalar_type(),
              "gate_up must be [rows, 2 * cols] of out's dtype");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16,
              "silu_and_mul supports float32 and bfloat16, not ", out.scalar_type());
  radixserve::layers::silu_and_mul(out.scalar_type(), gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(),
                                   out.stride(0), out.size(0), out.size(1));
}

// Index of the first maximum of p[0, n), or of the first NaN when there is one, as torch.max(dim)
// picks it (-0.0 equals 0.0, so the first of them). With AVX-512, two passes over the row (a 32k
// vocab's row is 128 KB, in L2 for the second): its maximum and whether it holds a NaN, then the
// first block of 16 holding that maximum (or a NaN); otherwise one scalar pass.
int64_t argmax_row(const float* p, int64_t n) {
#ifdef RADIXSERVE_LAYERS_AVX512
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = radixserve::tail_mask(static_cast<int>(std::min<int64_t>(n - i, kLanes)));
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, p + i);
    vmax = _mm512_max_ps(vmax, v);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  const __m512 target = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = radixserve::tail_mask(static_cast<int>(std::min<int64_t>(n - i, kLanes)));
    const __m512 v = _mm512_maskz_loadu_ps(m, p + i);
    // the first NaN when the row has one, else the first lane equal to the maximum
    const __mmask16 hit = nan ? _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q)
                              : _mm512_mask_cmp_ps_mask(m, v, target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  return 0;  // (not reached: the maximum is one of the row's values)
#else
  float best = p[0];
  int64_t at = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (p[i] != p[i]) return i;
    if (p[i] > best) {
      best = p[i];
      at = i;
    }
  }
  return at;
#endif
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "argmax_rows supports float32, not ", x.scalar_type());
  const int64_t rows = x.size(0), cols = x.size(1), stride = x.stride(0);
  TORCH_CHECK(cols > 0, "argmax_rows: rows must not be empty");
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) op[row] = argmax_row(xp + row * stride, cols);
  });
  return out;
}

}  // namespace

namespace radixserve::layers {

void add_rms_norm(c10::ScalarType dtype, void* x, int64_t xs, const void* residual, int64_t rs, const void* weight,
                  void* out, int64_t os, int64_t n, int64_t h, double eps) {
  if (dtype == at::kFloat)
    add_rms_norm_impl<float>(x, xs, residual, rs, weight, out, os, n, h, eps);
  else
    add_rms_norm_impl<at::BFloat16>(x, xs, residual, rs, weight, out, os, n, h, eps);
}

void rope(c10::ScalarType dtype, void* q, int64_t qs0, int64_t qs1, void* k, int64_t ks0, int64_t ks1, const void* cos,
          int64_t cs, const void* sin, int64_t ss, int64_t t, int64_t hq, int64_t hk, int64_t half) {
  if (dtype == at::kFloat)
    rope_impl<float>(q, qs0, qs1, k, ks0, ks1, cos, cs, sin, ss, t, hq, hk, half);
  else
    rope_impl<at::BFloat16>(q, qs0, qs1, k, ks0, ks1, cos, cs, sin, ss, t, hq, hk, half);
}

void silu_and_mul(c10::ScalarType dtype, const void* gate_up, int64_t gs, void* out, int64_t os, int64_t n,
                  int64_t inter) {
  if (dtype == at::kFloat)
    silu_and_mul_impl<float>(gate_up, gs, out, os, n, inter);
  else
    silu_and_mul_impl<at::BFloat16>(gate_up, gs, out, os, n, inter);
}

}  // namespace radixserve::layers

// The namespace is a macro so that another checkout's decode.cpp, which calls the functions above,
// can load with this file under a name of its own (bench/kernels.py --against).
#ifndef RADIXSERVE_LAYERS_NS
#define RADIXSERVE_LAYERS_NS radixserve_layers
#endif
#define RADIXSERVE_LAYERS_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)  // (expands the macro first)
#define RADIXSERVE_LAYERS_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

RADIXSERVE_LAYERS_LIBRARY(RADIXSERVE_LAYERS_NS, m) {
  m.def("add_rms_norm(Tensor(a!) x, Tensor? residual, Tensor weight, float eps, Tensor(b!) out) -> ()");
  m.def("rope(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  m.def("argmax_rows(Tensor x) -> Tensor");
}

RADIXSERVE_LAYERS_IMPL(RADIXSERVE_LAYERS_NS, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope", &rope);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
}

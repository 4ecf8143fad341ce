// AVX-512 helpers shared by the kernels of csrc/ (include after the AVX512F/BW/VL check).
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace radixserve {

// Lanes [0, left) of 16 (all for left >= 16, none for left <= 0).
inline __mmask16 tail_mask(int left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1u);
}

// 2^x for 16 lanes: 2^f on f = x - round(x) in [-0.5, 0.5] by the Taylor polynomial of 2^f of
// degree Degree (1..7; relative error ~4e-9 at 7, ~1.2e-7 at 6, ~2.4e-6 at 5), scaled by
// 2^round(x) with vscalefps (very negative x -> 0, very large -> inf). Callers clamp as they need.
template <int Degree>
inline __m512 exp2_poly(__m512 x) {
  static_assert(Degree >= 1 && Degree <= 7, "degree 1..7");
  constexpr float c[8] = {1.5252733804059841e-05f, 1.5403530393381608e-04f, 1.3333558146428443e-03f,
                          9.6181291076284772e-03f, 5.5504108664821580e-02f, 2.4022650695910071e-01f,
                          6.9314718055994531e-01f, 1.0f};
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(c[7 - Degree]);
  for (int i = 8 - Degree; i < 8; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  return _mm512_scalef_ps(p, n);
}

// 2^x for 16 lanes, x < 128: 2^f on f = x - floor(x) in [0, 1) by the degree-4 minimax polynomial
// of 2^f there (for relative error; fitted in double, rounded to fp32: 2.7e-6 at most evaluated in
// fp32, about as exp2_poly<5>'s 3.3e-6 with one FMA fewer), times 2^floor(x) by vscalefps, which
// floors its exponent operand itself: so vreduceps (f in one instruction) takes the place of the
// vrndscaleps and vsubps of exp2_poly. Very negative x -> 0.
inline __m512 exp2_minimax4(__m512 x) {
#ifdef __AVX512DQ__
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF);
#else
  const __m512 f = _mm512_sub_ps(x, _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
#endif
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.0135341492f), f, _mm512_set1_ps(0.052011475f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24144277f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693003833f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.00000262f));
  return _mm512_scalef_ps(p, x);
}

// 16 lanes of silu(g) * u with explicit FMAs: e^-x as 2^t, t = -x log2(e), by a degree-6
// polynomial of t - round(t) (relative error ~1.2e-7) scaled by vscalefps (x > 87: e^-x -> 0;
// x < -88.7: inf, so silu -> -0). About 2.5x faster than the scalar code's auto-vectorised
// loop; within a few ulps of it (6e-7 relative at most over [-6, 6]). NaN stays NaN.
// Reciprocal: with a bf16 output the division is a vrcp14ps estimate and one Newton step
// (relative error ~1e-7, far below bf16's 2^-9); fp32 keeps the exact vdivps. The division was
// about half of the op's time (bench/RESULTS.md section 27).
template <bool Reciprocal>
inline __m512 silu_mul_v(__m512 x, __m512 u) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), x), _mm512_set1_ps(-87.0f)),
                                 _mm512_set1_ps(1.44269504088896341f));
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), radixserve::exp2_poly<6>(t));
  if constexpr (Reciprocal) {
    __m512 r = _mm512_rcp14_ps(d);
    r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
    // d = inf (x < -88.7): the Newton step made NaN; 1/d is 0, so silu -> -0 as with the division
    r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(INFINITY), _CMP_EQ_OQ), r, _mm512_setzero_ps());
    return _mm512_mul_ps(_mm512_mul_ps(x, r), u);
  } else {
    return _mm512_mul_ps(_mm512_div_ps(x, d), u);
  }
}

#ifdef __AVX512BF16__
// dst[0, n) = bf16(src[i] * scale) (dst: bf16 bits), rounded to nearest even by vcvtneps2bf16, as
// c10::BFloat16's cast rounds, except that fp32 denormals (below 1.2e-38) become 0 and a NaN keeps
// its sign and payload. In place of the kernels' scalar cast loops (an output row's normalisation,
// the cascade merge): 0.96-1.00x the time of `python -m bench kernels --modes gemm --dtype bfloat16
// --threads 2` cases, against the scalar loops in the same process (bench/RESULTS.md section 36).
inline void scale_to_bf16(const float* src, float scale, void* dst, int n) {
  uint16_t* out = static_cast<uint16_t*>(dst);
  const __m512 vs = _mm512_set1_ps(scale);
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, src + i), vs);
    _mm256_mask_storeu_epi16(out + i, m, (__m256i)_mm512_cvtneps_pbh(v));
  }
}
#endif

}  // namespace radixserve

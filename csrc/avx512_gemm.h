// A small fp32 GEMM for AVX-512, shared by the kernels of csrc/ whose products are many short
// ones (quant.cpp's decoded weight tiles; attention.cpp's query blocks against key tiles): an
// 8-row x 32-column register-blocked micro-kernel, and a 16 x 16 in-register transpose. Include
// after the AVX512F/BW/VL check.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace radixserve {

// C[MB][cols] (+)= A[MB][kc] . B[kc][cols]: A's rows lda apart, B's rows ldb apart, C's rows ldc
// apart, cols <= 32 (nothing past a row's cols is read or written). Each C element is one FMA
// chain over k in order.
template <int MB>
void gemm_tile(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t kc, float* c, int64_t ldc, int cols,
               bool add) {
  const __mmask16 k0 = cols >= 16 ? 0xFFFF : cols <= 0 ? 0 : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 k1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  __m512 c0[MB], c1[MB];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) c0[m] = c1[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b0 = _mm512_maskz_loadu_ps(k0, b + k * ldb), b1 = _mm512_maskz_loadu_ps(k1, b + k * ldb + 16);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m512 x = _mm512_set1_ps(a[m * lda + k]);
      c0[m] = _mm512_fmadd_ps(x, b0, c0[m]);
      c1[m] = _mm512_fmadd_ps(x, b1, c1[m]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) {
    float* row = c + m * ldc;
    if (add) {
      c0[m] = _mm512_add_ps(c0[m], _mm512_maskz_loadu_ps(k0, row));
      c1[m] = _mm512_add_ps(c1[m], _mm512_maskz_loadu_ps(k1, row + 16));
    }
    _mm512_mask_storeu_ps(row, k0, c0[m]);
    _mm512_mask_storeu_ps(row + 16, k1, c1[m]);
  }
}

// gemm_tile for rows (1..8) rows of A and C.
inline void gemm_rows(int64_t rows, const float* a, int64_t lda, const float* b, int64_t ldb, int64_t kc, float* c,
                      int64_t ldc, int cols, bool add) {
  switch (rows) {
    case 1: return gemm_tile<1>(a, lda, b, ldb, kc, c, ldc, cols, add);
    case 2: return gemm_tile<2>(a, lda, b, ldb, kc, c, ldc, cols, add);
    case 3: return gemm_tile<3>(a, lda, b, ldb, kc, c, ldc, cols, add);
    case 4: return gemm_tile<4>(a, lda, b, ldb, kc, c, ldc, cols, add);
    case 5: return gemm_tile<5>(a, lda, b, ldb, kc, c, ldc, cols, add);
    case 6: return gemm_tile<6>(a, lda, b, ldb, kc, c, ldc, cols, add);
    case 7: return gemm_tile<7>(a, lda, b, ldb, kc, c, ldc, cols, add);
    default: return gemm_tile<8>(a, lda, b, ldb, kc, c, ldc, cols, add);
  }
}

// In-register transpose of 16 vectors of 16 floats: r[i][j] -> r[j][i].
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  // 128-bit lanes: rows i and i+4 exchange lanes, then i and i+8
  const __m512i lo4 = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), hi4 = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int i = 0; i < 16; ++i) t[i] = r[i];
  for (int g = 0; g < 16; g += 8)
    for (int i = 0; i < 4; ++i) {
      const __m512d a = _mm512_castps_pd(t[g + i]), b = _mm512_castps_pd(t[g + i + 4]);
      r[g + i] = _mm512_castpd_ps(_mm512_permutex2var_pd(a, lo4, b));
      r[g + i + 4] = _mm512_castpd_ps(_mm512_permutex2var_pd(a, hi4, b));
    }
  const __m512i lo8 = _mm512_setr_epi64(0, 1, 2, 3, 8, 9, 10, 11), hi8 = _mm512_setr_epi64(4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 16; ++i) t[i] = r[i];
  for (int i = 0; i < 8; ++i) {
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 8]);
    r[i] = _mm512_castpd_ps(_mm512_permutex2var_pd(a, lo8, b));
    r[i + 8] = _mm512_castpd_ps(_mm512_permutex2var_pd(a, hi8, b));
  }
}

}  // namespace radixserve

// layers.cpp's elementwise ops over raw rows, for callers that hold pointers rather than tensors
// (decode.cpp's decoder-layer loop, where making a tensor view and dispatching an op cost more than
// the op: bench/RESULTS.md section 48). The torch ops of layers.cpp check their tensors and call
// these; these check nothing. dtype: float32 or bfloat16 (raw 16-bit values); strides in elements
// between rows; each runs inline for small batches and in one OpenMP region for larger ones, with
// the arithmetic of the op.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace radixserve::layers {

// x [n, h] += residual (when not null), rounded to the dtype; out [n, h] = rmsnorm(x) * weight [h].
void add_rms_norm(c10::ScalarType dtype, void* x, int64_t xs, const void* residual, int64_t rs, const void* weight,
                  void* out, int64_t os, int64_t n, int64_t h, double eps);

// neox-style rotary embedding in place: q [t, hq, 2 * half] and k [t, hk, 2 * half] (row strides qs0 and
// ks0, head strides qs1 and ks1), from cos and sin [t, half] (row strides cs and ss).
void rope(c10::ScalarType dtype, void* q, int64_t qs0, int64_t qs1, void* k, int64_t ks0, int64_t ks1, const void* cos,
          int64_t cs, const void* sin, int64_t ss, int64_t t, int64_t hq, int64_t hk, int64_t half);

// out [n, inter] = silu(gate) * up over gate_up [n, 2 * inter].
void silu_and_mul(c10::ScalarType dtype, const void* gate_up, int64_t gs, void* out, int64_t os, int64_t n,
                  int64_t inter);

}  // namespace radixserve::layers

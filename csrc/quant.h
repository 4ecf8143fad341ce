// What csrc/quant.cpp and csrc/quant_int8.cpp share: ggml's block formats and the parts of a
// product (see quant.cpp's header for the ops and the layouts).
#pragma once

#include <torch/extension.h>

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace radixserve::quant {

// ggml's type ids (GGMLQuantizationType).
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;

struct Format {
  int64_t block;  // weights per block
  int64_t bytes;  // bytes per block
};

constexpr Format format_of(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kQ8_0: return {32, 34};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    default: return {0, 0};
  }
}

inline float fp16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The parts of a product: W as the rows of several tensors, one after the other.
struct Part {
  const uint8_t* data;
  const int32_t* row_map;  // nullptr: in order
  int64_t qtype, rows, row_bytes, first;  // first: this part's first output column
  int64_t data_rows;                       // rows of data (the map's entries lie below)
};

inline const uint8_t* row_of(const Part& p, int64_t n) {
  const int64_t r = n - p.first;
  return p.data + (p.row_map ? p.row_map[r] : r) * p.row_bytes;
}

// A compile-time constant carried as an argument type (read it as decltype(arg)::value).
template <int64_t V>
using Const = std::integral_constant<int64_t, V>;

// Calls fn(Const<R>{}, m0) for rows [m0, m0 + R) of M, in runs of 8 and one shorter last run: the
// kernels block their registers by R, so it must be a compile-time constant.
template <typename Fn>
inline void for_row_runs(int64_t M, Fn&& fn) {
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    switch (std::min<int64_t>(M - m0, 8)) {
      case 1: fn(Const<1>{}, m0); break;
      case 2: fn(Const<2>{}, m0); break;
      case 3: fn(Const<3>{}, m0); break;
      case 4: fn(Const<4>{}, m0); break;
      case 5: fn(Const<5>{}, m0); break;
      case 6: fn(Const<6>{}, m0); break;
      case 7: fn(Const<7>{}, m0); break;
      default: fn(Const<8>{}, m0); break;
    }
  }
}

// ---- csrc/quant.cpp: the product over weights checked once ----------------------------------------
// A linear layer's quantized weight as the qlinear op takes it (its parts' blocks, types and row
// maps), checked and taken apart once, for a caller that multiplies by it at every step
// (decode.cpp's layers): the op checks its lists at each call, about 1-2 us of a SmolLM2 layer's.
struct QuantProduct {
  QuantProduct(std::vector<torch::Tensor> weights, const std::vector<int64_t>& qtypes,
               std::vector<torch::Tensor> row_maps, int64_t impl);
  std::vector<torch::Tensor> weights_, row_maps_;  // (own the parts' data)
  std::vector<Part> parts;     // in the order of their data (the maps that permute a whole part cleared)
  std::vector<Part> permuted;  // those parts as checked: their outputs are put in their maps' order
  int64_t K = 0, N = 0, impl = 0;
};

// x [M, K] (fp32) times w, plus bias: what the qlinear op computes over w's lists.
torch::Tensor linear(const torch::Tensor& x, const QuantProduct& w, const c10::optional<torch::Tensor>& bias);

// ---- csrc/quant_int8.cpp: products against activations quantized to int8 -----------------------
// Whether this build has the int8 kernels (AVX-512 with VNNI and VBMI), and for which types.
bool int8_built();
bool int8_supports(int64_t qtype);

// Activations x [M, K] (fp32, rows ldx apart) quantized per 32 consecutive values (d = max|x| /
// 127, q = round(x / d)), as ggml's Q8_0 does, and arranged for the types that will read them.
class Int8Activations {
 public:
  Int8Activations(const float* x, int64_t ldx, int64_t M, int64_t K, const std::vector<Part>& parts);
  ~Int8Activations();
  Int8Activations(const Int8Activations&) = delete;
  Int8Activations& operator=(const Int8Activations&) = delete;
  // y[m][n] (m < M, rows ldy apart) for the output columns [n0, n1) of part p (an int8_supports type).
  void columns(const Part& p, int64_t n0, int64_t n1, float* y, int64_t ldy) const;

 private:
  struct Impl;
  Impl* impl_;
  static std::unique_ptr<Impl>& spare();  // the calling thread's buffers of its last one, for its next
};

}  // namespace radixserve::quant

// What the paged attention entry points of attention.cpp (decode) and prefill.cpp (many-row)
// share: the BLAS symbol they call and the checks of their common arguments (q, the KV pages and
// the FlashInfer-format metadata). Both entry points take the same arguments, so one function
// checks them.
#pragma once

#include <torch/extension.h>

// Fortran BLAS sgemm, exported by the MKL inside torch's CPU wheels (LP64: 32-bit ints). Called
// from inside parallel regions, where MKL runs sequentially on the calling thread.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

namespace radixserve {

inline void check_index(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kInt32 && t.dim() == 1 && t.is_contiguous(),
              name, " must be a contiguous 1-D int32 CPU tensor");
}

struct PagedShape {
  int num_seqs, hq, hkv, head_dim, page_size;
};

// q [T, Hq, D]; k_cache, v_cache [pages, page_size, Hkv, D]; the four int32 metadata tensors.
inline PagedShape check_paged_inputs(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                     const torch::Tensor& qo_indptr, const torch::Tensor& kv_indptr,
                                     const torch::Tensor& kv_indices, const torch::Tensor& kv_last_page_len,
                                     int max_head_dim) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.stride(2) == 1,
              "q must be a CPU [T, Hq, D] tensor, last dim contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "k_cache/v_cache must be contiguous [pages, page_size, Hkv, D] tensors of one shape");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the KV cache must have one dtype");
  check_index(qo_indptr, "qo_indptr");
  check_index(kv_indptr, "kv_indptr");
  check_index(kv_indices, "kv_indices");
  check_index(kv_last_page_len, "kv_last_page_len");
  TORCH_CHECK(qo_indptr.size(0) >= 1, "qo_indptr must hold at least one entry");
  const int num_seqs = qo_indptr.size(0) - 1;
  TORCH_CHECK(kv_indptr.size(0) == num_seqs + 1 && kv_last_page_len.size(0) == num_seqs, "metadata sizes disagree");
  const int hq = q.size(1), D = q.size(2);
  const int hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % 16 == 0 && D <= max_head_dim,
              "head_dim must match, be a multiple of 16 and <= ", max_head_dim);
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "query heads must be a multiple of KV heads");
  // (read in place: indexing the tensor and item() cost two dispatcher calls in each layer's attention)
  TORCH_CHECK(qo_indptr.data_ptr<int32_t>()[num_seqs] == q.size(0), "qo_indptr[-1] must equal the number of query rows");
  return {num_seqs, hq, hkv, D, static_cast<int>(k_cache.size(1))};
}

}  // namespace radixserve

// A decode step's decoder layers in one call: what the Python layers do for a decode batch, with
// the same kernels in the same order, minus about a dozen Python-level calls per layer.
//
// At batch 1 the kernels themselves are short: the linear kernel reads a layer's weights in about
// a third of a millisecond, and the norms, RoPE, KV store and attention take microseconds each.
// The Python around them (module calls, argument checks, views) added about a millisecond per
// step of the bench model's eight layers, a third of the bandwidth floor
// (``python -m bench roofline``). Here the layer loop runs in C++ and calls the same kernels:
// layers.cpp's norm, RoPE and SiLU over raw rows (layers.h), the decode attention kernel
// (attention.cpp's paged_attention_into), the radixserve_linear ops through the dispatcher and
// quant.cpp's qlinear, over weights checked once (DecodeWeights) and a batch checked once per call:
// inside the loop no tensor view is made and no small op dispatched (each cost about half a
// microsecond, a tenth of a SmolLM2 layer's non-weight time; bench/RESULTS.md section 48). The
// results are bit-identical to the layer-by-layer path, which tests/test_fused_decode.py checks.
//
// Per layer (Llama-family, no QK norm; radixserve/model/llama.py):
//   x += pending; h = rmsnorm(x) * ln1             add_rms_norm
//   q, k, v = split(h W_qkv^T + b_qkv)             linear (views of one output)
//   rotate q, k in place                           rope
//   write k, v to the cache slots; attend          (a copy), paged_attention's kernel; in
//                                                  cascade groups also prefill_attention over the
//                                                  shared prefix, then merge_state
//   x += o W_o^T + b_o; h = rmsnorm(x) * ln2      linear, add_rms_norm
//   pending = silu_and_mul(h W_gu^T + b_gu) W_down^T + b_down
// The caller adds the last layer's pending into x with the final norm.

#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include "layers.h"
#include "paged_common.h"
#include "quant.h"

#include <immintrin.h>

#include <cstring>
#include <optional>
#include <string>
#include <vector>

// attention.cpp
std::vector<torch::Tensor> paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                           torch::Tensor qo_indptr, torch::Tensor kv_indptr,
                                           torch::Tensor kv_indices, torch::Tensor kv_last_page_len,
                                           double scale, bool causal);
void paged_attention_into(const torch::Tensor& k_cache, const torch::Tensor& v_cache, const void* q,
                          int64_t q_stride_t, int64_t q_stride_h, int64_t hq, const torch::Tensor& qo_indptr,
                          const torch::Tensor& kv_indptr, const torch::Tensor& kv_indices,
                          const torch::Tensor& kv_last_page_len, double scale, bool causal, void* out, float* lse);
torch::Tensor merge_state(torch::Tensor out_a, torch::Tensor lse_a, torch::Tensor out_b, torch::Tensor lse_b);
// prefill.cpp
std::vector<torch::Tensor> prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                             torch::Tensor qo_indptr, torch::Tensor kv_indptr,
                                             torch::Tensor kv_indices, torch::Tensor kv_last_page_len,
                                             double scale, bool causal, const std::string& bf16_gemm);

namespace {

// The C++ signatures the ops were registered with (linear.cpp).
using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, bool, int64_t);
// torch's oneDNN product over a prepacked weight (aten/src/ATen/native/mkldnn/Linear.cpp)
using OnednnFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>);

template <typename Fn>
c10::TypedOperatorHandle<Fn> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

struct Ops {
  c10::TypedOperatorHandle<LinearFn> linear = find_op<LinearFn>("radixserve_linear::linear");
};

// The oneDNN op, looked up at its first use (only batches beyond the small-M kernel's rows need it).
const c10::TypedOperatorHandle<OnednnFn>& onednn_op() {
  static const c10::TypedOperatorHandle<OnednnFn> op = find_op<OnednnFn>("mkldnn::_linear_pointwise");
  return op;
}

// The AMX GEMM over pack_amx's tiles (linear.cpp), likewise.
using AmxFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, bool);
const c10::TypedOperatorHandle<AmxFn>& amx_op() {
  static const c10::TypedOperatorHandle<AmxFn> op = find_op<AmxFn>("radixserve_linear::amx_linear");
  return op;
}

// The AMX GEMM with SiLU-and-mul in its epilogue (gate_up's product and activation in one pass).
using AmxGluFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);
const c10::TypedOperatorHandle<AmxGluFn>& amx_glu_op() {
  static const c10::TypedOperatorHandle<AmxGluFn> op = find_op<AmxGluFn>("radixserve_linear::amx_linear_silu");
  return op;
}

const Ops& ops() {
  static const Ops instance;  // (looked up once; the ops are registered when the library loads)
  return instance;
}

// A bias slot: an empty tensor stands for "no bias" (Python cannot pass an undefined tensor in a list).
std::optional<at::Tensor> bias_of(const at::Tensor& b) {
  if (!b.defined() || b.numel() == 0) return std::nullopt;
  return b;
}

// Whether a prepacked weight is the AMX GEMM's tiles (else oneDNN's copy, or none: the small-M kernel).
bool amx_packed(const at::Tensor& packed) { return packed.defined() && packed.numel() > 0 && !packed.is_mkldnn(); }

// A linear layer's weight kept in GGUF blocks (quant.cpp's qlinear over its parts, their types and
// row maps, checked once); none: a dense weight.
using QuantWeight = std::optional<radixserve::quant::QuantProduct>;

// The KV slots a layer's store will write (each token's K and V rows), requested for writing at the
// layer's start, so that the store's read-for-ownership misses overlap the q/k/v product: with the
// pool's pages resident, the store took 0.9-1.1 us a layer without this and 0.3-0.5 with it
// (SmolLM2's shapes; bench/RESULTS.md section 47). (A page's first write faults: a prefetch cannot
// help there.)
void prefetch_slots(const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* slots, int64_t T) {
  const int64_t row = k_cache.stride(1) * k_cache.element_size();  // (check_paged_inputs: contiguous)
  const char* kc = static_cast<const char*>(k_cache.data_ptr());
  const char* vc = static_cast<const char*>(v_cache.data_ptr());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < row; b += 64) {
      _mm_prefetch(kc + slots[t] * row + b, _MM_HINT_ET0);
      _mm_prefetch(vc + slots[t] * row + b, _MM_HINT_ET0);
    }
}

// `quant` (DecodeWeights' argument) as one QuantWeight per linear layer: for each, an int64 tensor
// [parts, impl, qtype...] and then each part's data and row map; an empty list: every weight dense.
std::vector<QuantWeight> quant_weights(const std::vector<torch::Tensor>& quant, int64_t linears) {
  std::vector<QuantWeight> out(static_cast<size_t>(linears));
  if (quant.empty()) return out;
  size_t i = 0;
  for (auto& q : out) {
    TORCH_CHECK(i < quant.size() && quant[i].scalar_type() == at::kLong && quant[i].is_contiguous(),
                "DecodeWeights: quant must hold an int64 [parts, impl, qtypes...] tensor per linear layer");
    const int64_t* meta = quant[i].data_ptr<int64_t>();
    const int64_t parts = quant[i].numel() ? meta[0] : 0;  // (a dense weight's: [0])
    TORCH_CHECK(parts == 0 || quant[i].numel() == 2 + parts,
                "DecodeWeights: a linear layer's [parts, impl, qtypes...] tensor has the wrong length");
    ++i;
    if (parts == 0) continue;
    std::vector<at::Tensor> data, maps;
    std::vector<int64_t> qtypes;
    for (int64_t p = 0; p < parts; ++p) {
      TORCH_CHECK(i + 1 < quant.size(), "DecodeWeights: quant ends inside a linear layer's parts");
      qtypes.push_back(meta[2 + p]);
      data.push_back(quant[i++]);
      maps.push_back(quant[i++]);
    }
    q.emplace(std::move(data), qtypes, std::move(maps), meta[1]);
  }
  TORCH_CHECK(i == quant.size(), "DecodeWeights: quant has more tensors than its linear layers take");
  return out;
}

// x W^T + b as the layer-by-layer path computes it for x's rows. A quantized weight: quant.cpp's
// qlinear in fp32, as radixserve.kernels.quant.QuantLinear. A dense one, as
// radixserve.kernels.linear.linear: the small-M kernel, or the GEMM over the weight's prepacked copy
// ``packed`` (undefined or empty where the kernel runs): oneDNN's (a mkldnn tensor) or the AMX
// GEMM's (pack_amx's 4-D tiles).
at::Tensor product(const Ops& op, const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                   const at::Tensor& packed, const QuantWeight& qw) {
  if (qw) {
    const at::Tensor y =
        radixserve::quant::linear(x.scalar_type() == at::kFloat ? x : x.to(at::kFloat), *qw, bias_of(b));
    return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
  }
  if (!packed.defined() || packed.numel() == 0) return op.linear.call(x, w, bias_of(b), false, 0);
  if (amx_packed(packed)) return amx_op().call(x, packed, bias_of(b), false);
  return onednn_op().call(x, packed, bias_of(b), "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

// per layer: ln1, W_qkv, b_qkv, W_o, b_o, ln2, W_gu, b_gu, W_down, b_down
constexpr int64_t kPerLayer = 10;

// The weights of a model's decoder layers as decode_layers reads them, checked and taken apart once
// (a torch custom class that radixserve.kernels.fused_decode builds at a model's first decode
// batch). Passed as two lists at every step instead, their thousand-odd tensors (a 30-layer
// quantized model's) cost about 0.14 ms a step to convert and take apart, 2% of SmolLM2's batch-1
// step on 2 threads.
// params: kPerLayer tensors per layer in that order (empty tensors for absent biases). quant: empty,
// or for each layer's qkv, o, gate_up and down weights in turn an int64 tensor [parts, impl,
// qtype...] then each part's GGUF blocks and row map (no parts: that weight is dense), for weights
// held in their quantized blocks (radixserve.kernels.quant.QuantLinear: quant.cpp's qlinear, in
// fp32; impl 4 takes int8 activations where the types have kernels).
struct DecodeWeights : torch::CustomClassHolder {
  std::vector<at::Tensor> params;
  std::vector<QuantWeight> quant;  // one per linear layer
  int64_t layers;

  DecodeWeights(std::vector<at::Tensor> params_, const std::vector<at::Tensor>& quant_)
      : params(std::move(params_)), layers(static_cast<int64_t>(params.size()) / kPerLayer) {
    TORCH_CHECK(layers > 0 && static_cast<int64_t>(params.size()) == kPerLayer * layers,
                "DecodeWeights: need ", kPerLayer, " parameters per layer, got ", params.size());
    quant = quant_weights(quant_, 4 * layers);
  }
};

// x [T, hidden] (the embeddings; updated in place as the residual stream); weights: the layers'
// (DecodeWeights); packed: each layer's prepacked (oneDNN or AMX GEMM) qkv, o, gate_up and down
// weights, an empty tensor for a weight on the small-M kernel or quantized (an empty list: all of
// them); k_caches, v_caches: each layer's [pages, page_size, Hkv, D]; cos, sin [T, D/2] in x's
// dtype; slots [T] int64; the FlashInfer-format metadata of a batch that is all on the decode
// kernel. prefix: empty, or, for a batch of decodes whose first rows are in cascade groups (in row
// order), the groups' shared-prefix metadata (qo_indptr, kv_indptr, kv_indices, kv_last_page_len),
// the other four then being the members' own suffixes followed by the whole contexts of the
// decodes in no group: each layer attends to both and merges the grouped rows by LSE, as
// radixserve/attention/cpu_backend.py does. Returns the last layer's MLP output (the pending
// residual).
torch::Tensor decode_layers(const c10::intrusive_ptr<DecodeWeights>& weights, torch::Tensor x,
                            const std::vector<torch::Tensor>& packed, const std::vector<torch::Tensor>& k_caches,
                            const std::vector<torch::Tensor>& v_caches, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor slots, torch::Tensor qo_indptr, torch::Tensor kv_indptr,
                            torch::Tensor kv_indices, torch::Tensor kv_last_page_len, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                            const std::vector<torch::Tensor>& prefix) {
  const int64_t layers = weights->layers;
  const std::vector<torch::Tensor>& params = weights->params;
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == layers && static_cast<int64_t>(v_caches.size()) == layers,
              "decode_layers: need one K and one V cache per layer (", layers, ")");
  TORCH_CHECK(packed.empty() || static_cast<int64_t>(packed.size()) == 4 * layers,
              "decode_layers: packed must be empty or hold 4 prepacked weights per layer");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decode_layers: x must be a contiguous [tokens, hidden] tensor");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && head_dim > 0, "decode_layers: bad head counts");
  TORCH_CHECK(prefix.empty() || prefix.size() == 4,
              "decode_layers: prefix must be empty or (qo_indptr, kv_indptr, kv_indices, kv_last_page_len)");
  const Ops& op = ops();
  const int64_t T = x.size(0), H = x.size(1), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const c10::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "decode_layers: x must be float32 or bfloat16, not ", dtype);
  // The batch, checked once for every layer: the caches (one shape, x's dtype), the metadata
  // (check_paged_inputs, on a q of the query heads' shape), the slots, the RoPE tables.
  const at::Tensor& kc0 = k_caches[0];
  TORCH_CHECK(kc0.device().is_cpu() && kc0.dim() == 4 && kc0.size(2) == num_kv_heads && kc0.size(3) == head_dim &&
                  kc0.scalar_type() == dtype,
              "decode_layers: the caches must be [pages, page_size, num_kv_heads, head_dim] tensors of x's dtype");
  for (int64_t layer = 0; layer < layers; ++layer)
    TORCH_CHECK(k_caches[layer].is_contiguous() && v_caches[layer].is_contiguous() &&
                    k_caches[layer].sizes() == kc0.sizes() && v_caches[layer].sizes() == kc0.sizes() &&
                    k_caches[layer].scalar_type() == dtype && v_caches[layer].scalar_type() == dtype,
                "decode_layers: every layer's K and V cache must be contiguous, of one shape and dtype");
  const at::Tensor attn = at::empty({T, num_heads, head_dim}, x.options());  // each layer's attention output
  const at::Tensor lse = at::empty({T, num_heads}, x.options().dtype(at::kFloat));
  radixserve::check_paged_inputs(attn, kc0, v_caches[0], qo_indptr, kv_indptr, kv_indices, kv_last_page_len, 256);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() && slots.size(0) == T,
              "decode_layers: slots must be a contiguous int64 [tokens] tensor");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_slots = kc0.size(0) * kc0.size(1);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "decode_layers: slot ", sp[t], " is outside the caches' ", num_slots,
                " slots");
  TORCH_CHECK(cos.dim() == 2 && sin.dim() == 2 && cos.size(0) == T && sin.size(0) == T && cos.size(1) == head_dim / 2 &&
                  sin.size(1) == head_dim / 2 && cos.stride(1) == 1 && sin.stride(1) == 1 &&
                  cos.scalar_type() == dtype && sin.scalar_type() == dtype && head_dim % 2 == 0,
              "decode_layers: cos and sin must be [tokens, head_dim / 2] of x's dtype, last dimension contiguous");
  for (int64_t layer = 0; layer < layers; ++layer)
    for (int i : {0, 5}) {
      const at::Tensor& ln = params[layer * kPerLayer + i];
      TORCH_CHECK(ln.dim() == 1 && ln.size(0) == H && ln.is_contiguous() && ln.scalar_type() == dtype,
                  "decode_layers: the norms' weights must be contiguous [hidden] tensors of x's dtype");
    }
  // the rows in cascade groups (the first ones); 0 without a prefix level
  const int64_t grouped = prefix.empty() ? 0 : prefix[0][prefix[0].size(0) - 1].item<int64_t>();
  TORCH_CHECK(grouped >= 0 && grouped <= T, "decode_layers: the prefix level covers ", grouped, " of ", T, " rows");
  const std::vector<QuantWeight>& qws = weights->quant;
  std::optional<at::Tensor> pending;
  const at::Tensor none;  // (undefined: the small-M kernel)
  const at::Tensor h = at::empty_like(x);  // each norm's output, read by the product after it
  const at::Tensor attn_rows = attn.view({T, q_size});
  at::Tensor act;  // silu(gate) * up, once its width is known
  const int64_t esize = x.element_size(), slot_bytes = kv_size * esize;
  char* xp = static_cast<char*>(x.data_ptr());
  char* hp = static_cast<char*>(h.data_ptr());
  auto norm = [&](const at::Tensor* residual, const at::Tensor& weight) {
    TORCH_CHECK(residual == nullptr || (residual->sizes() == x.sizes() && residual->stride(1) == 1 &&
                                        residual->scalar_type() == dtype),
                "decode_layers: a product's output must be [tokens, hidden] of x's dtype");
    radixserve::layers::add_rms_norm(dtype, xp, H, residual ? residual->data_ptr() : nullptr,
                                     residual ? residual->stride(0) : 0, weight.data_ptr(), hp, H, T, H, eps);
  };
  for (int64_t layer = 0; layer < layers; ++layer) {
    const at::Tensor* w = params.data() + layer * kPerLayer;
    const at::Tensor* pk = packed.empty() ? nullptr : packed.data() + layer * 4;
    const auto pw = [&](int i) -> const at::Tensor& { return pk == nullptr ? none : pk[i]; };
    const QuantWeight* qw = qws.data() + layer * 4;
    const at::Tensor& k_cache = k_caches[layer];
    const at::Tensor& v_cache = v_caches[layer];
    prefetch_slots(k_cache, v_cache, sp, T);
    norm(pending ? &*pending : nullptr, w[0]);
    const at::Tensor qkv = product(op, h, w[1], w[2], pw(0), qw[0]);
    TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == q_size + 2 * kv_size && qkv.stride(1) == 1, "decode_layers: qkv_proj has ",
                qkv.size(1), " outputs, not (num_heads + 2 * num_kv_heads) * head_dim");
    // q, k and v: column blocks of qkv's rows
    char* qp = static_cast<char*>(qkv.data_ptr());
    const int64_t row = qkv.stride(0);  // (elements)
    char* kp = qp + q_size * esize;
    const char* vp = kp + kv_size * esize;
    radixserve::layers::rope(dtype, qp, row, head_dim, kp, row, head_dim, cos.data_ptr(), cos.stride(0), sin.data_ptr(),
                             sin.stride(0), T, num_heads, num_kv_heads, head_dim / 2);
    char* kd = static_cast<char*>(k_cache.data_ptr());
    char* vd = static_cast<char*>(v_cache.data_ptr());
    for (int64_t t = 0; t < T; ++t) {  // (slots checked above)
      std::memcpy(kd + sp[t] * slot_bytes, kp + t * row * esize, slot_bytes);
      std::memcpy(vd + sp[t] * slot_bytes, vp + t * row * esize, slot_bytes);
    }
    paged_attention_into(k_cache, v_cache, qp, row, head_dim, num_heads, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                         scale, true, attn.data_ptr(), lse.data_ptr<float>());
    if (grouped > 0) {  // level 0: each group's queries (the first rows) against its shared prefix, not causal
      const at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, head_dim});
      const std::vector<torch::Tensor> shared = prefill_attention(
          q.narrow(0, 0, grouped), k_cache, v_cache, prefix[0], prefix[1], prefix[2], prefix[3], scale, false, "auto");
      attn.narrow(0, 0, grouped)
          .copy_(merge_state(shared[0], shared[1], attn.narrow(0, 0, grouped), lse.narrow(0, 0, grouped)));
    }
    const at::Tensor o = product(op, attn_rows, w[3], w[4], pw(1), qw[1]);
    norm(&o, w[5]);
    // silu(gate) * up: on the AMX GEMM's packed copy in its epilogue, as
    // radixserve.kernels.linear.linear_silu_and_mul takes it; else the product, then the activation
    const at::Tensor& pgu = pw(2);
    if (amx_packed(pgu) && !qw[2]) {
      pending = product(op, amx_glu_op().call(h, pgu, bias_of(w[7])), w[8], w[9], pw(3), qw[3]);
      continue;
    }
    const at::Tensor gate_up = product(op, h, w[6], w[7], pgu, qw[2]);
    TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(0) == T && gate_up.size(1) % 2 == 0 && gate_up.stride(1) == 1,
                "decode_layers: gate_up_proj must have an even number of outputs");
    const int64_t inter = gate_up.size(1) / 2;
    if (!act.defined() || act.size(1) != inter) act = at::empty({T, inter}, x.options());
    radixserve::layers::silu_and_mul(dtype, gate_up.data_ptr(), gate_up.stride(0), act.data_ptr(), inter, T, inter);
    pending = product(op, act, w[8], w[9], pw(3), qw[3]);
  }
  return *pending;
}

}  // namespace

// Registered with the attention module's ops (attention.cpp), under the same namespace macro.
#ifndef RADIXSERVE_ATTENTION_NS
#define RADIXSERVE_ATTENTION_NS radixserve_attention
#endif
#define RADIXSERVE_STR_(x) #x
#define RADIXSERVE_STR(x) RADIXSERVE_STR_(x)
#define RADIXSERVE_TORCH_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)  // (expands the macro first)

RADIXSERVE_TORCH_FRAGMENT(RADIXSERVE_ATTENTION_NS, m) {
  m.class_<DecodeWeights>("DecodeWeights").def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>>());
  // A decode batch's decoder layers in one call: x updated in place as the residual stream, the
  // caches written; returns the last MLP output. (No defaults: a Tensor[] cannot have one.)
  m.def("decode_layers(__torch__.torch.classes." RADIXSERVE_STR(RADIXSERVE_ATTENTION_NS)
        ".DecodeWeights weights, Tensor(a!) x, Tensor[] packed, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, "
        "Tensor cos, Tensor sin, Tensor slots, Tensor qo_indptr, Tensor kv_indptr, Tensor kv_indices, "
        "Tensor kv_last_page_len, int num_heads, int num_kv_heads, int head_dim, float eps, float scale, "
        "Tensor[] prefix) -> Tensor",
        &decode_layers);
}

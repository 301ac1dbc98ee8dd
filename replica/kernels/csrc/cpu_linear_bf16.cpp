// Carpool's bf16 linear layers on prepacked weights (built by replica/cpu_kernels.py, with
// cpu_kernels.cpp, which defines the op library carpool_cpu): its own kernel on AVX512-BF16,
// else oneDNN's prepacked GEMM.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace {

// ---- bf16 linear on AVX512-BF16, any number of rows ---------------------------------------------
// The weight comes packed for the dot-product instruction vdpbf16ps (16 outputs x 2 k-values per
// 64-byte load, x's k-pair broadcast). The micro-kernel (gemv_rows) computes one block of up to 16
// rows x 16 outputs over the whole of K; rows are taken 16 at a time under each group of 16 outputs,
// so the group's packed weight is read from memory once and reused from L1/L2 for every row block.
// Each output is the sum over k in ascending pairs, accumulated in float32 and rounded to bf16
// once, whatever the number of rows: a row's result does not depend on its batch mates (the decode
// attention kernel, cpu_attention.cpp, keeps the same promise for a prompt's chunks). oneDNN's GEMM
// does not promise that: above 8 rows (where this kernel used to hand over to it), about one output in
// 10,000 of SmolLM2's MLP down projection (K = 1,536) came out one bf16 step away from the same row
// computed alone.
// Measured on the 2-core AMD EPYC machine (Zen 4), one thread: the 7 linears of a SmolLM2 layer,
// 30 layers of distinct weights (read from DRAM, as in a step), ms (oneDNN on its own prepacked
// weight; the script is in docs/bench/cpu-speed.md, "One bf16 kernel for every step"):
//   rows     1     4     8    14    16    32    64   128   256   512
//   oneDNN  20.6  17.8  20.1  25.1  26.4  43.1  77.7   141   270   549
//   this     9.9   9.9  12.1  18.7  20.2  36.2  69.8   139   269   551
// From about 16 rows both run near the core's bf16 peak (about 200 GFLOP/s); below, the weight
// stream bounds them, and the software prefetch keeps it going while a row block computes.
// oneDNN still serves other dtypes and CPUs without AVX512-BF16.
constexpr int64_t kRowBlock = 16;
// Weight lines (64 bytes) prefetched ahead of use (past a group's end: the next group's).
constexpr int64_t kPrefetchAhead = 64;

bool has_bf16_gemv() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// W [N, K] -> [ceil(N / 16), ceil(K / 2), 16, 2]: for each group of 16 outputs, its k-pairs.
at::Tensor pack_bf16_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "pack_bf16_weight: a 2-D bf16 weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  auto padded = at::constant_pad_nd(weight, {0, K % 2, 0, (16 - N % 16) % 16});  // [N16, K2]
  return padded.view({padded.size(0) / 16, 16, padded.size(1) / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

#if defined(__AVX512BF16__)
template <int M>
void gemv_rows(const uint32_t* __restrict x, int64_t pairs, const __m512bh* __restrict w, const float* __restrict bias,
               at::BFloat16* __restrict y, int64_t N, int64_t group) {
  __m512 acc[M];
  const int64_t n0 = group * 16;
  const __mmask16 mask = N - n0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (N - n0)) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const __m512bh* wp = w + group * pairs;
  for (int64_t p = 0; p < pairs; ++p) {
    // The address may lie past the packed weight: a prefetch never faults (computed as an integer).
    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(wp + p) + kPrefetchAhead * 64), _MM_HINT_T0);
    const __m512bh wv = wp[p];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_set1_epi32(x[m * pairs + p]));
  }
  for (int m = 0; m < M; ++m) {
    const __m256bh out = _mm512_cvtneps_pbh(bias ? _mm512_add_ps(acc[m], b) : acc[m]);
    _mm256_mask_storeu_epi16(y + m * N + n0, mask, (__m256i)out);
  }
}

at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16,
              "packed_linear: gemv_weight must come from pack_bf16_weight");
  const int64_t K = x.size(-1), rows = x.numel() / K, pairs = packed.size(1);
  TORCH_CHECK((K + 1) / 2 == pairs && packed.size(0) == (N + 15) / 16, "packed_linear: x [..., ", K,
              "] and out_features ", N, " do not match the packed weight ", packed.sizes());
  TORCH_CHECK(!bias.has_value() || !bias->defined() || bias->numel() == N, "packed_linear: bias must have ", N,
              " elements");
  auto x2 = x.reshape({rows, K});
  if (K % 2) x2 = at::constant_pad_nd(x2, {0, 1});
  x2 = x2.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  auto y = at::empty(shape, x.options());
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) bias_f = bias->to(at::kFloat).contiguous();
  const auto* xb = reinterpret_cast<const uint32_t*>(x2.data_ptr<at::BFloat16>());
  const auto* wb = reinterpret_cast<const __m512bh*>(packed.data_ptr<at::BFloat16>());
  const float* bb = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto* yb = y.data_ptr<at::BFloat16>();
  // Groups of 16 outputs in parallel (torch's threads); under each, the row blocks in order.
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t group = begin; group < end; ++group) {
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
        const uint32_t* xr = xb + r0 * pairs;
        at::BFloat16* yr = yb + r0 * N;
        switch (std::min<int64_t>(kRowBlock, rows - r0)) {
#define CARPOOL_ROWS(m) \
  case m:               \
    gemv_rows<m>(xr, pairs, wb, bb, yr, N, group); \
    break;
          CARPOOL_ROWS(1) CARPOOL_ROWS(2) CARPOOL_ROWS(3) CARPOOL_ROWS(4) CARPOOL_ROWS(5) CARPOOL_ROWS(6)
          CARPOOL_ROWS(7) CARPOOL_ROWS(8) CARPOOL_ROWS(9) CARPOOL_ROWS(10) CARPOOL_ROWS(11) CARPOOL_ROWS(12)
          CARPOOL_ROWS(13) CARPOOL_ROWS(14) CARPOOL_ROWS(15) CARPOOL_ROWS(16)
#undef CARPOOL_ROWS
        }
      }
    }
  });
  return y;
}
#endif

// x @ W.T + bias, on a weight prepacked for the bf16 kernel above (gemv_weight, from
// pack_bf16_weight) where this CPU has AVX512-BF16 and x is bf16, else for oneDNN (onednn_weight,
// from mkldnn::_reorder_linear_weight; an empty tensor when gemv_weight serves). oneDNN's op is
// called through the dispatcher from C++, so that a compiled graph reaches it without Python.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& onednn_weight, const std::optional<at::Tensor>& gemv_weight,
                         const std::optional<at::Tensor>& bias, int64_t out_features) {
  if (x.numel() == 0) {  // no rows (e.g. a prefill chunk that samples nothing keeps no logits)
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = out_features;
    return at::empty(shape, x.options());
  }
#if defined(__AVX512BF16__)
  if (gemv_weight.has_value() && gemv_weight->defined() && x.scalar_type() == at::kBFloat16) {
    return bf16_gemv(x, *gemv_weight, bias, out_features);
  }
#endif
  TORCH_CHECK(onednn_weight.numel() > 0,
              "packed_linear: the weight is packed for the bf16 kernel only, so x must be bf16 (got ",
              x.scalar_type(), ")");
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, onednn_weight, bias, std::string("none"),
                                 c10::List<std::optional<at::Scalar>>(), std::optional<std::string>()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(carpool_cpu, m) {
  m.def("packed_linear(Tensor x, Tensor onednn_weight, Tensor? gemv_weight, Tensor? bias, int out_features) -> Tensor");
  m.def("pack_bf16_weight(Tensor weight) -> Tensor");
  m.def("has_bf16_gemv() -> bool");
}

// The packed weight is an opaque oneDNN tensor (dispatch key MkldnnCPU), so the op is registered
// for every backend rather than only CPU.
TORCH_LIBRARY_IMPL(carpool_cpu, CompositeExplicitAutograd, m) {
  m.impl("packed_linear", &packed_linear);
  m.impl("pack_bf16_weight", &pack_bf16_weight);
  m.impl("has_bf16_gemv", &has_bf16_gemv);
}

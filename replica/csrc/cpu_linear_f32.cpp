// float32 linear layers on AVX2 + FMA (built with cpu_kernels.cpp by replica/cpu_kernels.py).
//
// Ops:
//   carpool_cpu::pack_f32_weight(weight [N, K] float32) -> [ceil(N / 16), K, 16]: for each group
//     of 16 outputs, its K columns in order (zero rows pad the last group).
//   carpool_cpu::f32_linear(x [..., K] float32, packed, bias [N] or None, N) -> [..., N]:
//     x @ weight.T + bias.
//   carpool_cpu::has_f32_gemv() -> whether the build has this kernel (AVX2 and FMA).
//
// Why our own: torch's float32 linear goes to MKL's sgemm, which on the 2-core AVX2 machine (AMD
// EPYC Zen 3, one thread) reads a decode step's weights far below the memory's speed once a step
// has a few rows: for SmolLM2's 30 layers and output embedding, about twice this kernel's time at
// 2 to 8 rows (oneDNN on prepacked weights was no better). It also gives a row other bits among 1
// to 3 rows than among 4 or more, so a request's tokens depended on its batch. Figures, and the
// script that measures them: docs/bench/cpu-speed.md, "One float32 kernel for AVX2 CPUs".
//
// The micro-kernel (f32_rows) computes a block of up to 6 rows x 16 outputs over the whole of K:
// 12 accumulators of 8 floats, 2 weight vectors and a broadcast of x, within AVX2's 16 registers
// (the register block of BLIS's Haswell sgemm, 6 x 16; Van Zee & van de Geijn 2015). Under each
// group of 16 outputs, rows are taken 6 at a time, so the group's weight panel is read from memory
// once per step and reused from cache for every row block. Each output is bias + the sum over k of
// x[k] * w[k], accumulated with one fused multiply-add per k in ascending order, in float32,
// whatever the number of rows: a row's result does not depend on the other rows of its step.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kGroup = 16;    // outputs per weight panel (two 8-float vectors)
constexpr int64_t kRowBlock = 6;  // rows per micro-kernel call
// Panel rows (64 bytes each) prefetched ahead of use; past a panel's end this is the next one's.
constexpr int64_t kPrefetchAhead = 32;

bool has_f32_gemv() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

at::Tensor pack_f32_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "pack_f32_weight: a 2-D float32 weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  auto padded = at::constant_pad_nd(weight, {0, 0, 0, (kGroup - N % kGroup) % kGroup});  // [N16, K]
  return padded.view({padded.size(0) / kGroup, kGroup, K}).permute({0, 2, 1}).contiguous();
}

#if defined(__AVX2__) && defined(__FMA__)
// Rows x[0..M) (each K floats, row stride K) times one panel w [K, 16] -> y[m][n0 .. n0 + 16)
// (row stride N; only the first `valid` outputs are stored).
template <int M>
void f32_rows(const float* __restrict x, int64_t K, const float* __restrict w, const float* __restrict bias,
              float* __restrict y, int64_t N, int64_t n0, int64_t valid) {
  // Every loop over m is unrolled, so that the accumulators stay in registers (with an indexed
  // epilogue GCC also stored all 12 to the stack on every k, at a third of the speed).
  __m256 lo[M], hi[M];
#pragma GCC unroll 6
  for (int m = 0; m < M; ++m) lo[m] = hi[m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    // The address may lie past the packed weight: a prefetch never faults (computed as an integer).
    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(w + k * kGroup) + kPrefetchAhead * 64),
                 _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(w + k * kGroup);
    const __m256 w1 = _mm256_loadu_ps(w + k * kGroup + 8);
#pragma GCC unroll 6
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_broadcast_ss(x + m * K + k);
      lo[m] = _mm256_fmadd_ps(xv, w0, lo[m]);
      hi[m] = _mm256_fmadd_ps(xv, w1, hi[m]);
    }
  }
  // Lanes below `valid` are stored (the last group may hold fewer than 16 outputs).
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask_lo = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), lane);
  const __m256i mask_hi = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid) - 8), lane);
  const __m256 b0 = bias ? _mm256_loadu_ps(bias + n0) : _mm256_setzero_ps();  // the bias is padded to whole groups
  const __m256 b1 = bias ? _mm256_loadu_ps(bias + n0 + 8) : _mm256_setzero_ps();
#pragma GCC unroll 6
  for (int m = 0; m < M; ++m) {
    float* row = y + m * N + n0;
    _mm256_maskstore_ps(row, mask_lo, bias ? _mm256_add_ps(lo[m], b0) : lo[m]);
    _mm256_maskstore_ps(row + 8, mask_hi, bias ? _mm256_add_ps(hi[m], b1) : hi[m]);
  }
}
#endif

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                      int64_t N) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "f32_linear: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kGroup && packed.is_contiguous() &&
                  packed.scalar_type() == at::kFloat,
              "f32_linear: the weight must come from pack_f32_weight");
  const int64_t K = x.size(-1), rows = K ? x.numel() / K : 0;
  TORCH_CHECK(packed.size(1) == K && packed.size(0) == (N + kGroup - 1) / kGroup, "f32_linear: x [..., ", K,
              "] and out_features ", N, " do not match the packed weight ", packed.sizes());
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || bias->numel() == N, "f32_linear: bias must have ", N, " elements");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  if (K == 0) {  // an empty sum: the bias alone
    auto y = at::zeros(shape, x.options());
    return has_bias ? y + bias->to(at::kFloat) : y;
  }
  auto y = at::empty(shape, x.options());
  if (rows == 0) return y;
#if defined(__AVX2__) && defined(__FMA__)
  auto x2 = x.reshape({rows, K}).contiguous();
  at::Tensor bias_padded;
  if (has_bias) bias_padded = at::constant_pad_nd(bias->to(at::kFloat).contiguous(), {0, packed.size(0) * kGroup - N});
  const float* xb = x2.data_ptr<float>();
  const float* wb = packed.data_ptr<float>();
  const float* bb = has_bias ? bias_padded.data_ptr<float>() : nullptr;
  float* yb = y.data_ptr<float>();
  // Groups of 16 outputs in parallel (torch's threads); under each, the row blocks in order.
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t group = begin; group < end; ++group) {
      const int64_t n0 = group * kGroup, valid = std::min(kGroup, N - n0);
      const float* panel = wb + group * K * kGroup;
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
        const float* xr = xb + r0 * K;
        float* yr = yb + r0 * N;
        switch (std::min(kRowBlock, rows - r0)) {
          case 1: f32_rows<1>(xr, K, panel, bb, yr, N, n0, valid); break;
          case 2: f32_rows<2>(xr, K, panel, bb, yr, N, n0, valid); break;
          case 3: f32_rows<3>(xr, K, panel, bb, yr, N, n0, valid); break;
          case 4: f32_rows<4>(xr, K, panel, bb, yr, N, n0, valid); break;
          case 5: f32_rows<5>(xr, K, panel, bb, yr, N, n0, valid); break;
          default: f32_rows<6>(xr, K, panel, bb, yr, N, n0, valid); break;
        }
      }
    }
  });
#else
  TORCH_CHECK(false, "f32_linear: this build has no AVX2 + FMA kernel (see has_f32_gemv)");
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(carpool_cpu, m) {
  m.def("f32_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("pack_f32_weight(Tensor weight) -> Tensor");
  m.def("has_f32_gemv() -> bool");
}

TORCH_LIBRARY_IMPL(carpool_cpu, CPU, m) {
  m.impl("f32_linear", &f32_linear);
  m.impl("pack_f32_weight", &pack_f32_weight);
}

TORCH_LIBRARY_IMPL(carpool_cpu, CompositeExplicitAutograd, m) { m.impl("has_f32_gemv", &has_f32_gemv); }

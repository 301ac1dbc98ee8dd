// Carpool's 8-bit linear layers (built by replica/kernels/cpu_kernels.py, with cpu_kernels.cpp, which
// defines the op library carpool_cpu): weights in blocks of 32 along K, each block of one output row
// with its own fp16 scale d, as GGUF's Q8_0 stores them (w = d * q, q a signed byte; Q5_0's values,
// -16..15, are read the same way), or, for Q6_K (w = d * sc * (q - 32)), an int8 scale per 16
// values under an fp16 one per super-block of 256 (cpu_linear_blocks.h: Scales); bf16
// activations on AVX512-BF16 (with AVX512BW), float32 activations on AVX512F. The sums, their order
// (two chains per block: even and odd k-pairs, or k for float32) and the batch invariance are
// those of cpu_linear_q4.cpp:
//
// y[r, n] = sum over blocks b of  d[n, b] * (sum over the block's k of x[r, k] * q[n, k])
//
// Packed layout (pack_weight in replica/quant/blocks.py makes it), for groups of 16 outputs:
//   qweight uint8 [G, B, 16, 16, 2]: for each block's 16 k-pairs p, output lane j and e in {0, 1},
//     the signed byte q[j, 2p + e]: the 32 bytes of a k-pair are the 16 lanes' pairs in the order
//     vdpbf16ps wants them (lane j's pair in elements 2j, 2j + 1).
//   scales fp16 [G, B, 16]; Q6_K: scales int8 [G, 2B, 16] (sub-block 2b + t holds k-pairs 8t .. 8t + 7 of
//     block b, summed and scaled on their own), super_scales fp16 [G, S, 16] (super-blocks of B / S blocks).
// A byte becomes float32 exactly (sign-extended, vcvtdq2ps); for bf16, two such halves are rounded to
// bf16 together (vcvtne2ps2bf16), exactly too: |q| <= 128 needs 8 significant bits.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include "cpu_linear_blocks.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

// As has_q4_gemv (cpu_linear_q4.cpp).
bool has_q8_gemv(at::ScalarType dtype) {
#if defined(__AVX512F__) || defined(CARPOOL_BLOCKS_AVX2)
  return dtype == at::kFloat || dtype == at::kBFloat16;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// One k-pair's 32 signed bytes (16 lanes' pairs) as bf16, exactly.
inline __m512bh pair_weights(const uint8_t* bytes) {
  const auto* src = reinterpret_cast<const __m128i*>(bytes);
  const __m512 lanes_lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src)));      // lanes 0-7
  const __m512 lanes_hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src + 1)));  // lanes 8-15
  return _mm512_cvtne2ps_pbh(lanes_hi, lanes_lo);
}

template <int M, int PB>
void q8_rows(const uint32_t* __restrict x, int64_t pairs, const uint8_t* __restrict q, const carpool_blocks::Scales& d,
             const float* __restrict bias, at::BFloat16* __restrict y, int64_t N, int64_t group, int64_t blocks) {
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const uint8_t* qg = q + group * blocks * 512;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* qb = qg + b * 512;
    for (int i = 0; i < 8; ++i)
      _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(qb) + 2048 + 64 * i), _MM_HINT_T0);
    for (int part = 0; part < PB; ++part) {
      __m512 even[M], odd[M];  // two chains per row: even and odd k-pairs (as cpu_linear_q4.cpp)
      for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm512_setzero_ps();
      for (int p = part * 16 / PB; p < (part + 1) * 16 / PB; p += 2) {
        const __m512bh w0 = pair_weights(qb + p * 32), w1 = pair_weights(qb + p * 32 + 32);
        for (int m = 0; m < M; ++m) {
          even[m] = _mm512_dpbf16_ps(even[m], w0, (__m512bh)_mm512_set1_epi32(x[m * pairs + b * 16 + p]));
          odd[m] = _mm512_dpbf16_ps(odd[m], w1, (__m512bh)_mm512_set1_epi32(x[m * pairs + b * 16 + p + 1]));
        }
      }
      carpool_blocks::add_block<M>(acc, even, odd, carpool_blocks::scale_of<PB>(d, group, blocks, b, part), nullptr, nullptr,
                                   blocks, b);
    }
  }
  carpool_blocks::store_rows<M>(acc, bias, y, N, group);
}
#endif

#if defined(__AVX512F__)
template <int M, int PB>
void q8_rows_f32(const float* __restrict x, int64_t K, const uint8_t* __restrict q, const carpool_blocks::Scales& d,
                 const float* __restrict bias, float* __restrict y, int64_t N, int64_t group, int64_t blocks) {
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const uint8_t* qg = q + group * blocks * 512;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* qb = qg + b * 512;
    for (int i = 0; i < 8; ++i)
      _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(qb) + 2048 + 64 * i), _MM_HINT_T0);
    for (int part = 0; part < PB; ++part) {
      __m512 even[M], odd[M];  // two chains per row: even and odd k
      for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm512_setzero_ps();
      for (int p = part * 16 / PB; p < (part + 1) * 16 / PB; ++p) {
        const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + p * 32)));
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24));  // e = 0, sign-extended
        const __m512 w1 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24));  // e = 1
        const int64_t k = b * 32 + p * 2;
        for (int m = 0; m < M; ++m) {
          even[m] = _mm512_fmadd_ps(w0, _mm512_set1_ps(x[m * K + k]), even[m]);
          odd[m] = _mm512_fmadd_ps(w1, _mm512_set1_ps(x[m * K + k + 1]), odd[m]);
        }
      }
      carpool_blocks::add_block<M>(acc, even, odd, carpool_blocks::scale_of<PB>(d, group, blocks, b, part), nullptr, nullptr,
                                   blocks, b);
    }
  }
  carpool_blocks::store_rows<M>(acc, bias, y, N, group);
}
#endif

#if defined(CARPOOL_BLOCKS_AVX2)
// As q8_rows_f32, on AVX2 (cpu_linear_blocks.h): half `half` of the group's 16 lanes, whose bytes
// are the second 16 of each k-pair's 32 for half 1.
template <int M, int PB>
void q8_rows_avx2(const float* __restrict x, int64_t K, const uint8_t* __restrict q, const carpool_blocks::Scales& d,
                  const float* __restrict bias, float* __restrict y, int64_t N, int64_t group, int64_t blocks) {
  for (int half = 0; half < 2; ++half) {
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    const uint8_t* qg = q + group * blocks * 512 + half * 16;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* qb = qg + b * 512;
      for (int part = 0; part < PB; ++part) {
        __m256 even[M], odd[M];  // two chains per row: even and odd k
        for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm256_setzero_ps();
        for (int p = part * 16 / PB; p < (part + 1) * 16 / PB; ++p) {
          const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + p * 32)));
          const __m256 w0 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24));  // e = 0, sign-extended
          const __m256 w1 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 24));  // e = 1
          const int64_t k = b * 32 + p * 2;
          for (int m = 0; m < M; ++m) {
            even[m] = _mm256_fmadd_ps(w0, _mm256_set1_ps(x[m * K + k]), even[m]);
            odd[m] = _mm256_fmadd_ps(w1, _mm256_set1_ps(x[m * K + k + 1]), odd[m]);
          }
        }
        const __m256 scale = carpool_blocks::scale_of_avx2<PB>(d, group, blocks, b, half, part);
        carpool_blocks::add_block_avx2<M>(acc, even, odd, scale, scale, nullptr, blocks, b);
      }
    }
    carpool_blocks::store_rows_avx2<M>(acc, bias, y, N, group, half);
  }
}
#endif

// x [..., K] (bf16 or float32) @ W.T (+ bias) -> [..., N] of x's dtype, W in the packed 8-bit layout above.
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                     const std::optional<at::Tensor>& bias, int64_t out_features,
                     const std::optional<at::Tensor>& super_scales) {
  TORCH_CHECK(x.dim() > 0, "q8_linear: x must have a feature dimension");
  if (x.numel() == 0 && x.size(-1) > 0) return carpool_blocks::empty_output(x, out_features);  // no rows: no outputs
  TORCH_CHECK(has_q8_gemv(x.scalar_type()), "q8_linear: this build has no 8-bit kernel for x of ", x.scalar_type(),
              " (bf16 and float32 need AVX512F, or AVX2 with FMA and F16C)");
#if !(defined(__AVX512BF16__) && defined(__AVX512BW__))
  if (x.scalar_type() == at::kBFloat16)  // no bf16 dot products here: the float32 kernel, rounded once
    return q8_linear(x.to(at::kFloat), qweight, scales, bias, out_features, super_scales).to(at::kBFloat16);
#endif
#if defined(__AVX512F__) || defined(CARPOOL_BLOCKS_AVX2)
  // Q6_K: an int8 scale per 16 values (two sub-blocks per block of 32) times an fp16 one per 256.
  const auto o = carpool_blocks::check_operands("q8_linear", x, qweight, 16, scales, super_scales, 2, at::kChar, bias,
                                                out_features);
  const bool k_quant = o.d.sub != nullptr;
  const int64_t K = o.K, rows = o.rows, groups = o.groups, blocks = o.blocks;
  const uint8_t* qp = o.q;
  const carpool_blocks::Scales& dp = o.d;
  const float* bb = o.bias;
  const at::Tensor& x2 = o.x2;
  const at::Tensor& y = o.y;
#endif
#if defined(CARPOOL_BLOCKS_AVX2)
  const float* xf = x2.data_ptr<float>();
  float* yf = y.data_ptr<float>();
  carpool_blocks::for_each_row_block<carpool_blocks::kRowBlockAvx2>(groups, rows, [&]<int M>(int64_t group, int64_t r0) {
    if (k_quant) q8_rows_avx2<M, 2>(xf + r0 * K, K, qp, dp, bb, yf + r0 * out_features, out_features, group, blocks);
    else q8_rows_avx2<M, 1>(xf + r0 * K, K, qp, dp, bb, yf + r0 * out_features, out_features, group, blocks);
  });
  return y;
#elif defined(__AVX512F__)
  if (x.scalar_type() == at::kFloat) {
    const float* xf = x2.data_ptr<float>();
    float* yf = y.data_ptr<float>();
    carpool_blocks::for_each_row_block(groups, rows, [&]<int M>(int64_t group, int64_t r0) {
      if (k_quant) q8_rows_f32<M, 2>(xf + r0 * K, K, qp, dp, bb, yf + r0 * out_features, out_features, group, blocks);
      else q8_rows_f32<M, 1>(xf + r0 * K, K, qp, dp, bb, yf + r0 * out_features, out_features, group, blocks);
    });
    return y;
  }
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const auto* xb = reinterpret_cast<const uint32_t*>(x2.data_ptr<at::BFloat16>());
  auto* yb = y.data_ptr<at::BFloat16>();
  const int64_t pairs = K / 2;
  carpool_blocks::for_each_row_block(groups, rows, [&]<int M>(int64_t group, int64_t r0) {
    if (k_quant) q8_rows<M, 2>(xb + r0 * pairs, pairs, qp, dp, bb, yb + r0 * out_features, out_features, group, blocks);
    else q8_rows<M, 1>(xb + r0 * pairs, pairs, qp, dp, bb, yb + r0 * out_features, out_features, group, blocks);
  });
#endif
  return y;
#else
  return at::Tensor();  // not reached: has_q8_gemv is false for every dtype without AVX512F or AVX2
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(carpool_cpu, m) {
  m.def("q8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias, int out_features, Tensor? super_scales=None) -> Tensor");
  m.def("has_q8_gemv(ScalarType dtype) -> bool");
}

TORCH_LIBRARY_IMPL(carpool_cpu, CompositeExplicitAutograd, m) {
  m.impl("q8_linear", &q8_linear);
  m.impl("has_q8_gemv", &has_q8_gemv);
}

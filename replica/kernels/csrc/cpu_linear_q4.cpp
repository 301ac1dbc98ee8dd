// Carpool's 4-bit linear layers (built by replica/kernels/cpu_kernels.py, with cpu_kernels.cpp, which
// defines the op library carpool_cpu): weights in blocks of 32 along K, each block of one output
// row with its own scale d and, optionally, minimum m (fp16), as GGUF's Q4_0 (w = d * (q - 8)) and
// Q4_1 (w = d * q + m) store them, or, for Q4_K (w = d * sc * q - dmin * m), an integer scale and
// minimum per block (uint8) under fp16 ones per super-block (of 256; an AWQ or GPTQ group: cpu_linear_blocks.h: Scales),
// or 5-bit values (Q5_0, Q5_1, Q5_K: as the 4-bit types, q in 0..31) with their fifth bits in a plane;
// bf16 activations on AVX512-BF16 (with AVX512BW for the
// nibbles), float32 activations on AVX512F.
//
// y[r, n] = sum over blocks b of  d[n, b] * (sum over the block's k of x[r, k] * (q[n, k] - offset))
//                               + m[n, b] * (sum over the block's k of x[r, k])
// bf16: each block's inner sum is exact bf16 products summed in float32 by vdpbf16ps (q - offset,
// an integer in [-8, 15], is exact in bf16), the even and the odd k-pairs each in ascending order,
// then the two added; float32: the same with fused multiply-adds on even and odd k. The block sums
// are scaled and added in ascending b, and the output is rounded to its dtype once. The order depends on nothing but the
// row's own values, so a row's result does not depend on its batch mates (as cpu_linear_bf16.cpp).
//
// Packed layout (pack_weight in replica/quant/blocks.py makes it), for groups of 16 outputs:
//   qweight uint8 [G, B, 8, 16, 2]: for each block's 8 quarters h (k = 4h .. 4h + 3), output lane
//     j and e in {0, 1}, the byte q[j, 4h + e] | q[j, 4h + 2 + e] << 4. Widened to 16 bits, the low
//     nibbles are the k-pair (4h, 4h + 1) of the 16 lanes as vdpbf16ps wants them (lane j's pair in
//     elements 2j, 2j + 1), the high nibbles the k-pair (4h + 2, 4h + 3).
//   scales, mins fp16 [G, B, 16] (mins absent for Q4_0); Q4_K: scales and mins uint8 [G, B, 16],
//     super_scales and super_mins fp16 [G, S, 16] (super-blocks of B / S blocks, a power of two).
//   qhigh int32 [G, B, 8, 2] for 5-bit values: word [g, b, h, t] holds in bit 2j + e the fifth bit of
//     q[j, 4h + 2t + e], the value whose low 4 bits are nibble t of byte [h, j, e]: as a mask over the
//     32 words of a quarter's widened bytes, it marks the words that get 16 added.
// A nibble (with its fifth bit: 5 bits) becomes bf16 through a 32-entry table (vpermw): entry i holds
// bf16(i - offset); for float32, a 16-entry table (vpermps, which reads an index's low 4 bits only)
// holds i - offset, and 16 is added where the fifth bit is set (exact).
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include "cpu_linear_blocks.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

// Whether this build's 5-bit path reads the plane of fifth bits at about the 4-bit speed (AVX512:
// a mask a quarter); on AVX2 each bit is moved into its lane with shifts, slower than the 8-bit
// kernel on the same values, so replica.quant.blocks.use_blocks gives Q5_0 to the 8-bit kernel there.
bool q4_planes_pay() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// Whether this build computes x of `dtype`: float32 on AVX512F or AVX2 (with FMA and F16C); bf16
// natively on AVX512-BF16 with AVX512BW, elsewhere through float32 (x widened, y rounded once).
bool has_q4_gemv(at::ScalarType dtype) {
#if defined(__AVX512F__) || defined(CARPOOL_BLOCKS_AVX2)
  return dtype == at::kFloat || dtype == at::kBFloat16;
#else
  return false;
#endif
}

#if defined(__AVX512F__)
// As q4_rows below, for float32 x: per quarter h of a block, the 32 bytes read as 16 words
// (lane j: byte e = 0 in bits 0-7, e = 1 in bits 8-15) give k = 4h, 4h + 1, 4h + 2, 4h + 3 in the
// nibbles at bits 0, 8, 4 and 12.
template <int M, bool Five>
void q4_rows_f32(const float* __restrict x, int64_t K, const float* __restrict xsum, const uint8_t* __restrict q,
                 const uint32_t* __restrict high, const carpool_blocks::Scales& d, const carpool_blocks::Scales& mins,
                 __m512 table, const float* __restrict bias, float* __restrict y, int64_t N, int64_t group, int64_t blocks) {
  // A 5-bit value's fifth bit, lane j: bit 2j (k = 4h, 4h + 2) or 2j + 1 (k = 4h + 1, 4h + 3) of
  // the quarter's words.
  const __m512i even_bit =
      _mm512_sllv_epi32(_mm512_set1_epi32(1), _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30));
  const __m512i odd_bit = _mm512_slli_epi32(even_bit, 1);
  const __m512 sixteen = _mm512_set1_ps(16.f);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const uint8_t* qg = q + group * blocks * 256;
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 even[M], odd[M];  // two chains per row: k = 4h, 4h + 2 and k = 4h + 1, 4h + 3
    for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm512_setzero_ps();
    const uint8_t* qb = qg + b * 256;
    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(qb) + 1024), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(qb) + 1088), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(qb) + 1152), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(qb) + 1216), _MM_HINT_T0);
    for (int h = 0; h < 8; ++h) {
      const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + h * 32)));
      __m512 w[4] = {
          _mm512_permutexvar_ps(v, table), _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8), table),
          _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table), _mm512_permutexvar_ps(_mm512_srli_epi32(v, 12), table)};
      if constexpr (Five) {  // + 16 where the fifth bit is set (exact)
        const uint32_t* hq = high + ((group * blocks + b) * 8 + h) * 2;
        const __m512i low_words = _mm512_set1_epi32(static_cast<int>(hq[0]));
        const __m512i high_words = _mm512_set1_epi32(static_cast<int>(hq[1]));
        w[0] = _mm512_mask_add_ps(w[0], _mm512_test_epi32_mask(low_words, even_bit), w[0], sixteen);
        w[1] = _mm512_mask_add_ps(w[1], _mm512_test_epi32_mask(low_words, odd_bit), w[1], sixteen);
        w[2] = _mm512_mask_add_ps(w[2], _mm512_test_epi32_mask(high_words, even_bit), w[2], sixteen);
        w[3] = _mm512_mask_add_ps(w[3], _mm512_test_epi32_mask(high_words, odd_bit), w[3], sixteen);
      }
      const int64_t k = b * 32 + h * 4;
      for (int m = 0; m < M; ++m) {
        even[m] = _mm512_fmadd_ps(w[0], _mm512_set1_ps(x[m * K + k]), even[m]);
        odd[m] = _mm512_fmadd_ps(w[1], _mm512_set1_ps(x[m * K + k + 1]), odd[m]);
        even[m] = _mm512_fmadd_ps(w[2], _mm512_set1_ps(x[m * K + k + 2]), even[m]);
        odd[m] = _mm512_fmadd_ps(w[3], _mm512_set1_ps(x[m * K + k + 3]), odd[m]);
      }
    }
    carpool_blocks::add_block_of<M>(acc, even, odd, d, mins, xsum, group, blocks, b);
  }
  carpool_blocks::store_rows<M>(acc, bias, y, N, group);
}
#endif

#if defined(CARPOOL_BLOCKS_AVX2)
// As q4_rows_f32, on AVX2 (cpu_linear_blocks.h): half `half` of the group's 16 lanes, whose
// bytes are the second 16 of each quarter's 32 for half 1.
template <int M, bool Five>
void q4_rows_avx2(const float* __restrict x, int64_t K, const float* __restrict xsum, const uint8_t* __restrict q,
                  const uint32_t* __restrict high, const carpool_blocks::Scales& d, const carpool_blocks::Scales& mins,
                  float offset, const float* __restrict bias, float* __restrict y, int64_t N, int64_t group, int64_t blocks) {
  const __m256i low = _mm256_set1_epi32(0x0F), bit4 = _mm256_set1_epi32(0x10);
  for (int half = 0; half < 2; ++half) {
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    const uint8_t* qg = q + group * blocks * 256 + half * 16;
    // A 5-bit value's fifth bit, lane j = 8 half + l, moved to bit 4: bit 2j (k = 4h, 4h + 2) or
    // 2j + 1 of the quarter's words.
    const __m256i even_shift = _mm256_add_epi32(_mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14), _mm256_set1_epi32(16 * half - 4));
    for (int64_t b = 0; b < blocks; ++b) {
      __m256 even[M], odd[M];  // two chains per row: k = 4h, 4h + 2 and k = 4h + 1, 4h + 3
      for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm256_setzero_ps();
      const uint8_t* qb = qg + b * 256;
      for (int h = 0; h < 8; ++h) {
        const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + h * 32)));
        __m256i idx[4] = {_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi32(v, 8), low),
                          _mm256_and_si256(_mm256_srli_epi32(v, 4), low), _mm256_srli_epi32(v, 12)};
        if constexpr (Five) {
          const uint32_t* hq = high + ((group * blocks + b) * 8 + h) * 2;
          for (int i = 0; i < 4; ++i) {
            // the word's bit 2j + (i & 1) moved to bit 4: shift right by 2j + (i & 1) - 4 (left where negative)
            const __m256i words = _mm256_set1_epi32(static_cast<int>(hq[i >> 1]));
            const __m256i shift = _mm256_add_epi32(even_shift, _mm256_set1_epi32(i & 1));
            const __m256i moved = _mm256_or_si256(_mm256_srlv_epi32(words, shift),
                                                  _mm256_sllv_epi32(words, _mm256_sub_epi32(_mm256_setzero_si256(), shift)));
            idx[i] = _mm256_or_si256(idx[i], _mm256_and_si256(moved, bit4));
          }
        }
        const __m256 w[4] = {_mm256_cvtepi32_ps(idx[0]), _mm256_cvtepi32_ps(idx[1]), _mm256_cvtepi32_ps(idx[2]),
                             _mm256_cvtepi32_ps(idx[3])};
        const int64_t k = b * 32 + h * 4;
        for (int m = 0; m < M; ++m) {
          even[m] = _mm256_fmadd_ps(w[0], _mm256_set1_ps(x[m * K + k]), even[m]);
          odd[m] = _mm256_fmadd_ps(w[1], _mm256_set1_ps(x[m * K + k + 1]), odd[m]);
          even[m] = _mm256_fmadd_ps(w[2], _mm256_set1_ps(x[m * K + k + 2]), even[m]);
          odd[m] = _mm256_fmadd_ps(w[3], _mm256_set1_ps(x[m * K + k + 3]), odd[m]);
        }
      }
      const __m256 scale = carpool_blocks::scale_of_avx2(d, group, blocks, b, half);
      __m256 low = _mm256_mul_ps(scale, _mm256_set1_ps(-offset));
      if (mins) low = _mm256_add_ps(low, carpool_blocks::scale_of_avx2(mins, group, blocks, b, half));
      carpool_blocks::add_block_avx2<M>(acc, even, odd, scale, low, xsum, blocks, b);
    }
    carpool_blocks::store_rows_avx2<M>(acc, bias, y, N, group, half);
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
template <int M, bool Five>
void q4_rows(const uint32_t* __restrict x, int64_t pairs, const float* __restrict xsum, const uint8_t* __restrict q,
             const uint32_t* __restrict high, const carpool_blocks::Scales& d, const carpool_blocks::Scales& mins,
             __m512i table, const float* __restrict bias, at::BFloat16* __restrict y, int64_t N, int64_t group,
             int64_t blocks) {
  const __m512i bit4 = _mm512_set1_epi16(0x10);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi16(0x0F);
  const uint8_t* qg = q + group * blocks * 256;
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 even[M], odd[M];  // two chains of dot products per row (cpu_linear_blocks.h)
    for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm512_setzero_ps();
    const uint8_t* qb = qg + b * 256;
    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(qb) + 1024), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(qb) + 1088), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(qb) + 1152), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(qb) + 1216), _MM_HINT_T0);
    for (int h = 0; h < 8; ++h) {
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + h * 32)));
      __m512i i0 = _mm512_and_si512(v, low), i1 = _mm512_srli_epi16(v, 4);
      if constexpr (Five) {  // word 2j + e's fifth bit is bit 2j + e of the quarter's two words
        const uint32_t* hq = high + ((group * blocks + b) * 8 + h) * 2;
        i0 = _mm512_mask_add_epi16(i0, _cvtu32_mask32(hq[0]), i0, bit4);  // 0..15 + 16
        i1 = _mm512_mask_add_epi16(i1, _cvtu32_mask32(hq[1]), i1, bit4);
      }
      const __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(i0, table);
      const __m512bh w1 = (__m512bh)_mm512_permutexvar_epi16(i1, table);
      const int64_t p = b * 16 + h * 2;
      for (int m = 0; m < M; ++m) {
        even[m] = _mm512_dpbf16_ps(even[m], w0, (__m512bh)_mm512_set1_epi32(x[m * pairs + p]));
        odd[m] = _mm512_dpbf16_ps(odd[m], w1, (__m512bh)_mm512_set1_epi32(x[m * pairs + p + 1]));
      }
    }
    carpool_blocks::add_block_of<M>(acc, even, odd, d, mins, xsum, group, blocks, b);
  }
  carpool_blocks::store_rows<M>(acc, bias, y, N, group);
}
#endif

// x [..., K] (bf16 or float32) @ W.T (+ bias) -> [..., N] of x's dtype, W in the packed 4-bit layout above.
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                     const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias, int64_t out_features,
                     int64_t offset, const std::optional<at::Tensor>& super_scales,
                     const std::optional<at::Tensor>& super_mins, const std::optional<at::Tensor>& qhigh) {
  TORCH_CHECK(x.dim() > 0, "q4_linear: x must have a feature dimension");
  if (x.numel() == 0 && x.size(-1) > 0) return carpool_blocks::empty_output(x, out_features);  // no rows: no outputs
  TORCH_CHECK(has_q4_gemv(x.scalar_type()), "q4_linear: this build has no 4-bit kernel for x of ", x.scalar_type(),
              " (bf16 and float32 need AVX512F, or AVX2 with FMA and F16C)");
#if !(defined(__AVX512BF16__) && defined(__AVX512BW__))
  if (x.scalar_type() == at::kBFloat16)  // no bf16 dot products here: the float32 kernel, rounded once
    return q4_linear(x.to(at::kFloat), qweight, scales, mins, bias, out_features, offset, super_scales, super_mins, qhigh)
        .to(at::kBFloat16);
#endif
#if defined(__AVX512F__) || defined(CARPOOL_BLOCKS_AVX2)
  const auto o = carpool_blocks::check_operands("q4_linear", x, qweight, 8, scales, super_scales, 1, at::kByte, bias,
                                                out_features);
  const int64_t K = o.K, rows = o.rows, groups = o.groups, blocks = o.blocks;
  const bool has_mins = mins.has_value() && mins->defined();
  const bool k_quant = o.d.sub != nullptr, has_super_mins = super_mins.has_value() && super_mins->defined();
  TORCH_CHECK(has_super_mins == (k_quant && has_mins), "q4_linear: super_mins go with K-quant scales and mins, and only there");
  carpool_blocks::Scales mp;
  if (has_super_mins) {
    mp = carpool_blocks::check_super("q4_linear", "mins", *mins, *super_mins, groups, blocks, 1, at::kByte);
    mp.negate = true;  // Q4_K: w = d * sc * q - dmin * m
  } else if (has_mins) {
    TORCH_CHECK(mins->sizes() == scales.sizes() && mins->is_contiguous() && mins->scalar_type() == at::kHalf,
                "q4_linear: mins must be shaped as scales");
    mp.d = reinterpret_cast<const uint16_t*>(mins->data_ptr<at::Half>());
  }
  TORCH_CHECK(offset >= 0 && offset <= 16, "q4_linear: offset must be in [0, 16]");
  const bool five = qhigh.has_value() && qhigh->defined();
  TORCH_CHECK(!five || (qhigh->sizes() == at::IntArrayRef({groups, blocks, 8, 2}) && qhigh->is_contiguous() &&
                        qhigh->scalar_type() == at::kInt),
              "q4_linear: qhigh must be int32 [", groups, ", ", blocks, ", 8, 2]");
  const auto* hp = five ? reinterpret_cast<const uint32_t*>(qhigh->data_ptr<int32_t>()) : nullptr;
  const uint8_t* qp = o.q;
  const carpool_blocks::Scales& dp = o.d;
  const float* bb = o.bias;
  const at::Tensor& x2 = o.x2;
  const at::Tensor& y = o.y;
  // Each row's block sums of x (for the minimum's term), in ascending k.
  auto xsum = at::empty({rows, blocks}, x.options().dtype(at::kFloat));
  float* xs = xsum.data_ptr<float>();
#endif
#if defined(CARPOOL_BLOCKS_AVX2)
  const float* xf = x2.data_ptr<float>();
  carpool_blocks::block_sums(xf, rows, K, xs);  // the offset's term needs them too
  float* yf = y.data_ptr<float>();
  const float* sums = has_mins || offset != 0 ? xs : nullptr;
  carpool_blocks::for_each_row_block<carpool_blocks::kRowBlockAvx2>(groups, rows, [&]<int M>(int64_t group, int64_t r0) {
    const float* s = sums ? sums + r0 * blocks : nullptr;
    float* yr = yf + r0 * out_features;
    if (five) q4_rows_avx2<M, true>(xf + r0 * K, K, s, qp, hp, dp, mp, static_cast<float>(offset), bb, yr, out_features, group, blocks);
    else q4_rows_avx2<M, false>(xf + r0 * K, K, s, qp, hp, dp, mp, static_cast<float>(offset), bb, yr, out_features, group, blocks);
  });
  return y;
#elif defined(__AVX512F__)
  if (has_mins) {
    if (x2.scalar_type() == at::kFloat) carpool_blocks::block_sums(x2.data_ptr<float>(), rows, K, xs);
    else carpool_blocks::block_sums(x2.data_ptr<at::BFloat16>(), rows, K, xs);
  }
  if (x.scalar_type() == at::kFloat) {
    alignas(64) float values[16];
    for (int i = 0; i < 16; ++i) values[i] = static_cast<float>(i - offset);
    const __m512 table = _mm512_load_ps(values);
    const float* xf = x2.data_ptr<float>();
    float* yf = y.data_ptr<float>();
    carpool_blocks::for_each_row_block(groups, rows, [&]<int M>(int64_t group, int64_t r0) {
      const float* s = xs + r0 * blocks;
      float* yr = yf + r0 * out_features;
      if (five) q4_rows_f32<M, true>(xf + r0 * K, K, s, qp, hp, dp, mp, table, bb, yr, out_features, group, blocks);
      else q4_rows_f32<M, false>(xf + r0 * K, K, s, qp, hp, dp, mp, table, bb, yr, out_features, group, blocks);
    });
    return y;
  }
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const at::BFloat16* xp = x2.data_ptr<at::BFloat16>();
  alignas(64) uint16_t entries[32];
  for (int i = 0; i < 32; ++i) entries[i] = at::BFloat16(static_cast<float>(i - offset)).x;
  const __m512i table = _mm512_load_si512(entries);
  const auto* xb = reinterpret_cast<const uint32_t*>(xp);
  auto* yb = y.data_ptr<at::BFloat16>();
  const int64_t pairs = K / 2;
  carpool_blocks::for_each_row_block(groups, rows, [&]<int M>(int64_t group, int64_t r0) {
    const float* s = xs + r0 * blocks;
    at::BFloat16* yr = yb + r0 * out_features;
    if (five) q4_rows<M, true>(xb + r0 * pairs, pairs, s, qp, hp, dp, mp, table, bb, yr, out_features, group, blocks);
    else q4_rows<M, false>(xb + r0 * pairs, pairs, s, qp, hp, dp, mp, table, bb, yr, out_features, group, blocks);
  });
#endif
  return y;
#else
  return at::Tensor();  // not reached: has_q4_gemv is false for every dtype without AVX512F or AVX2
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(carpool_cpu, m) {
  m.def(
      "q4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, Tensor? bias, int out_features, int offset, "
      "Tensor? super_scales=None, Tensor? super_mins=None, Tensor? qhigh=None) -> Tensor");
  m.def("has_q4_gemv(ScalarType dtype) -> bool");
  m.def("q4_planes_pay() -> bool");
}

TORCH_LIBRARY_IMPL(carpool_cpu, CompositeExplicitAutograd, m) {
  m.impl("q4_linear", &q4_linear);
  m.impl("has_q4_gemv", &has_q4_gemv);
  m.impl("q4_planes_pay", &q4_planes_pay);
}

// What the kernels for GGUF's blocks (cpu_linear_q4.cpp, cpu_linear_q8.cpp) share: the walk over
// groups of 16 outputs and blocks of rows, and the store of one group's outputs.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace carpool_blocks {

// Rows computed under one pass over a group's weights: three float32 accumulators per row (the
// total and the block's sum, kept as two chains) must stay in the 32 vector registers with the
// weights and tables. The block's sum is two chains of dot products (even and odd k-pairs, or k
// values for float32), added at the block's end: one chain waits on each dot product's latency
// (about six cycles), which bounded a step of few rows; the chains are the same for every number
// of rows, so a row's sum does not depend on its batch.
constexpr int64_t kRowBlock = 8;

template <int M, typename F>
void dispatch_rows(int64_t rows, F& f, int64_t group, int64_t r0) {
  if constexpr (M > 0) {
    if (rows == M) f.template operator()<M>(group, r0);
    else dispatch_rows<M - 1>(rows, f, group, r0);
  }
}

// f.template operator()<M>(group, r0) for every group of 16 outputs (split over torch's threads)
// and, under it in order, every block of M = min(kRowBlock, rows - r0) rows from row r0.
template <typename F>
void for_each_row_block(int64_t groups, int64_t rows, F&& f) {
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t group = begin; group < end; ++group)
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) dispatch_rows<kRowBlock>(std::min(kRowBlock, rows - r0), f, group, r0);
  });
}

#if defined(__AVX512F__)
// The end of block b for M rows: acc[m] += d * (even[m] + odd[m]), then, with minimums (Q4_1),
// acc[m] += m * xsum[m, b]; d and m are the group's 16 fp16 values for the block (d_block, m_block).
template <int M>
void add_block(__m512* acc, const __m512* even, const __m512* odd, const uint16_t* d_block, const uint16_t* m_block,
               const float* xsum, int64_t blocks, int64_t b) {
  const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d_block)));
  for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(scale, _mm512_add_ps(even[m], odd[m]), acc[m]);
  if (m_block) {
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m_block)));
    for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[m * blocks + b]), acc[m]);
  }
}

inline __mmask16 group_mask(int64_t N, int64_t group) {
  const int64_t left = N - group * 16;
  return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
}

// y[m, 16 group ...] = acc[m] (+ bias), for M rows of y (row length N).
template <int M>
void store_rows(const __m512* acc, const float* bias, float* y, int64_t N, int64_t group) {
  const __mmask16 mask = group_mask(N, group);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + group * 16) : _mm512_setzero_ps();
  for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(y + m * N + group * 16, mask, bias ? _mm512_add_ps(acc[m], bv) : acc[m]);
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// As above, each output rounded to bf16 once.
template <int M>
void store_rows(const __m512* acc, const float* bias, at::BFloat16* y, int64_t N, int64_t group) {
  const __mmask16 mask = group_mask(N, group);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + group * 16) : _mm512_setzero_ps();
  for (int m = 0; m < M; ++m) {
    const __m256bh out = _mm512_cvtneps_pbh(bias ? _mm512_add_ps(acc[m], bv) : acc[m]);
    _mm256_mask_storeu_epi16(y + m * N + group * 16, mask, (__m256i)out);
  }
}
#endif

}  // namespace carpool_blocks

// What the kernels for GGUF's blocks (cpu_linear_q4.cpp, cpu_linear_q8.cpp) share: their operands'
// checks and setup, where a block's scales are (fp16, or a K-quant's two levels), each row's block
// sums of x, the walk over groups of 16 outputs and blocks of rows, and the store of one group's
// outputs.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace carpool_blocks {

// The helpers a row kernel calls once per block: inlined always (left to itself, g++ called
// add_block_of out of line, spilling the block's 16 dot-product chains around each call).
#define CARPOOL_BLOCK_INLINE inline __attribute__((always_inline))

// The output of an x without rows: [..., out_features] of x's dtype.
inline at::Tensor empty_output(const at::Tensor& x, int64_t out_features) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  return at::empty(shape, x.options());
}

// Where a group's block scales (or minimums) are. GGUF's block types hold an fp16 value per block
// of 32 (`d` [G, B, 16]); its K-quants an integer per sub-block (`sub` [G, B * PB, 16]: uint8, or
// int8 where `sub_signed`; PB sub-blocks per block of 32) times an fp16 value per super-block of
// 2^shift blocks (`d` [G, B >> shift, 16]; GGUF's 256 values: shift 3; an AWQ or GPTQ group of
// 128: shift 2), whose product is exact in float32 (11 by at most 8 significant bits).
// `negate`: the value is subtracted (Q4_K's minimums: w = d * sc * q - dmin * m).
struct Scales {
  const uint16_t* d = nullptr;
  const uint8_t* sub = nullptr;
  bool sub_signed = false;
  bool negate = false;
  int shift = 3;
  explicit operator bool() const { return d != nullptr; }
};

// A block op's operands, checked: x [..., K] as `x2` [rows, K] (contiguous), the output `y`
// [..., out_features] of x's dtype, the bias in float32 (`bias_f`, undefined without one) and the
// raw pointers the row kernels read.
struct Operands {
  int64_t K, rows, groups, blocks;
  at::Tensor x2, y, bias_f;
  const uint8_t* q;
  Scales d;
  const float* bias;
};

// Checks a K-quant's scales (or minimums): `sub` [G, B * per_block, 16] of `sub_type` and `super`
// fp16 [G, S, 16], S = B >> shift for super-blocks of 2^shift blocks (the shift is read from S: B /
// S a power of two); `op` and `what` name them in the errors (RuntimeError).
inline Scales check_super(const char* op, const char* what, const at::Tensor& sub, const at::Tensor& super, int64_t groups,
                          int64_t blocks, int64_t per_block, at::ScalarType sub_type) {
  TORCH_CHECK(sub.sizes() == at::IntArrayRef({groups, blocks * per_block, 16}) && sub.is_contiguous() &&
                  sub.scalar_type() == sub_type,
              op, ": K-quant ", what, " must be ", sub_type, " [", groups, ", ", blocks * per_block, ", 16]");
  const int64_t supers = super.dim() == 3 ? super.size(1) : 0;
  const int64_t per_super = supers > 0 ? blocks / supers : 0;
  TORCH_CHECK(supers > 0 && blocks % supers == 0 && (per_super & (per_super - 1)) == 0 && super.size(0) == groups &&
                  super.size(2) == 16 && super.is_contiguous() && super.scalar_type() == at::kHalf,
              op, ": K-quant super-block ", what, " must be fp16 [", groups, ", S, 16], S dividing the ", blocks,
              " blocks into super-blocks of a power of two; got ", super.sizes());
  Scales s;
  s.shift = __builtin_ctzll(static_cast<unsigned long long>(per_super));
  s.d = reinterpret_cast<const uint16_t*>(super.data_ptr<at::Half>());
  s.sub = static_cast<const uint8_t*>(sub.data_ptr());
  s.sub_signed = sub_type == at::kChar;
  return s;
}

// Checks `qweight` ([G, B, steps, 16, 2] uint8 from replica.quant.blocks.pack_weight: steps 8
// quarters for 4 bits, 16 k-pairs for 8), `scales` (fp16 [G, B, 16], or with `super_scales` a
// K-quant's: check_super, `per_block` sub-blocks per block of `sub_type`) and `bias`
// (out_features values) against x and out_features; `op` names the op in the errors (RuntimeError).
inline Operands check_operands(const char* op, const at::Tensor& x, const at::Tensor& qweight, int64_t steps,
                               const at::Tensor& scales, const std::optional<at::Tensor>& super_scales, int64_t per_block,
                               at::ScalarType sub_type, const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(qweight.dim() == 5 && qweight.size(2) == steps && qweight.size(3) == 16 && qweight.size(4) == 2 &&
                  qweight.is_contiguous() && qweight.scalar_type() == at::kByte,
              op, ": qweight must come from replica.quant.blocks.pack_weight");
  Operands o;
  o.K = x.size(-1);
  o.groups = qweight.size(0);
  o.blocks = qweight.size(1);
  TORCH_CHECK(o.K == o.blocks * 32 && o.groups == (out_features + 15) / 16, op, ": x [..., ", o.K, "] and out_features ",
              out_features, " do not match the packed weight ", qweight.sizes());
  o.rows = 1;  // x's leading dimensions (K may be 0: each output is then its bias)
  for (int64_t i = 0; i + 1 < x.dim(); ++i) o.rows *= x.size(i);
  if (super_scales.has_value() && super_scales->defined()) {
    o.d = check_super(op, "scales", scales, *super_scales, o.groups, o.blocks, per_block, sub_type);
  } else {
    TORCH_CHECK(scales.sizes() == at::IntArrayRef({o.groups, o.blocks, 16}) && scales.is_contiguous() &&
                    scales.scalar_type() == at::kHalf,
                op, ": scales must be fp16 [", o.groups, ", ", o.blocks, ", 16]");
    o.d.d = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  }
  TORCH_CHECK(!bias.has_value() || !bias->defined() || bias->numel() == out_features, op, ": bias must have ",
              out_features, " elements");
  o.x2 = x.reshape({o.rows, o.K}).contiguous();
  o.y = empty_output(x, out_features);
  if (bias.has_value() && bias->defined()) o.bias_f = bias->to(at::kFloat).contiguous();
  o.q = qweight.data_ptr<uint8_t>();
  o.bias = o.bias_f.defined() ? o.bias_f.data_ptr<float>() : nullptr;
  return o;
}

// Each row's block sums of x [rows, K] (float32 or bf16), in ascending k: xsum [rows, K / 32].
template <typename T>
inline void block_sums(const T* x, int64_t rows, int64_t K, float* xsum) {
  const int64_t blocks = K / 32;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      float s = 0.f;
      for (int64_t k = 0; k < 32; ++k) s += static_cast<float>(x[r * K + b * 32 + k]);
      xsum[r * blocks + b] = s;
    }
}

// Rows computed under one pass over a group's weights: three float32 accumulators per row (the
// total and the block's sum, kept as two chains) must stay in the 32 vector registers with the
// weights and tables. The block's sum is two chains of dot products (even and odd k-pairs, or k
// values for float32), added at the block's end: one chain waits on each dot product's latency
// (about six cycles), which bounded a step of few rows; the chains are the same for every number
// of rows, so a row's sum does not depend on its batch.
constexpr int64_t kRowBlock = 8;

// With 16 vector registers (AVX2), fewer rows per pass: 3 accumulators a row, and the 4 weights of
// a quarter block.
constexpr int64_t kRowBlockAvx2 = 4;

template <int M, typename F>
void dispatch_rows(int64_t rows, F& f, int64_t group, int64_t r0) {
  if constexpr (M > 0) {
    if (rows == M) f.template operator()<M>(group, r0);
    else dispatch_rows<M - 1>(rows, f, group, r0);
  }
}

// f.template operator()<M>(group, r0) for every group of 16 outputs (split over torch's threads)
// and, under it in order, every block of M = min(R, rows - r0) rows from row r0.
template <int64_t R = kRowBlock, typename F>
void for_each_row_block(int64_t groups, int64_t rows, F&& f) {
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t group = begin; group < end; ++group)
      for (int64_t r0 = 0; r0 < rows; r0 += R) dispatch_rows<R>(std::min(R, rows - r0), f, group, r0);
  });
}

#if defined(__AVX512F__)
// The 16 lanes' scale (or minimum) of sub-block `part` of block b of `group` (`blocks` per row, PB
// sub-blocks per block): the fp16 value, or d * sub for a K-quant (exact), negated where asked.
template <int PB = 1>
CARPOOL_BLOCK_INLINE __m512 scale_of(const Scales& s, int64_t group, int64_t blocks, int64_t b, int part = 0) {
  if (!s.sub) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.d + (group * blocks + b) * 16)));
  const __m512 super =
      _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.d + (group * (blocks >> s.shift) + (b >> s.shift)) * 16)));
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s.sub + ((group * blocks + b) * PB + part) * 16));
  const __m512 value = _mm512_mul_ps(super, _mm512_cvtepi32_ps(s.sub_signed ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw)));
  return s.negate ? _mm512_sub_ps(_mm512_setzero_ps(), value) : value;
}

// The end of a block (or sub-block) for M rows: acc[m] += scale * (even[m] + odd[m]), then, with
// minimums (Q4_1, Q4_K), acc[m] += min * xsum[m, b].
template <int M>
CARPOOL_BLOCK_INLINE void add_block(__m512* acc, const __m512* even, const __m512* odd, __m512 scale, const __m512* min,
                                    const float* xsum, int64_t blocks, int64_t b) {
  for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(scale, _mm512_add_ps(even[m], odd[m]), acc[m]);
  if (min)
    for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(*min, _mm512_set1_ps(xsum[m * blocks + b]), acc[m]);
}

// add_block with block b's scale, and its minimum where `mins` is set, read from `d` and `mins`.
template <int M>
CARPOOL_BLOCK_INLINE void add_block_of(__m512* acc, const __m512* even, const __m512* odd, const Scales& d,
                                       const Scales& mins, const float* xsum, int64_t group, int64_t blocks, int64_t b) {
  const __m512 scale = scale_of(d, group, blocks, b);
  if (!mins) {
    add_block<M>(acc, even, odd, scale, nullptr, xsum, blocks, b);
    return;
  }
  const __m512 min = scale_of(mins, group, blocks, b);
  add_block<M>(acc, even, odd, scale, &min, xsum, blocks, b);
}

CARPOOL_BLOCK_INLINE __mmask16 group_mask(int64_t N, int64_t group) {
  const int64_t left = N - group * 16;
  return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
}

// y[m, 16 group ...] = acc[m] (+ bias), for M rows of y (row length N).
template <int M>
CARPOOL_BLOCK_INLINE void store_rows(const __m512* acc, const float* bias, float* y, int64_t N, int64_t group) {
  const __mmask16 mask = group_mask(N, group);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + group * 16) : _mm512_setzero_ps();
  for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(y + m * N + group * 16, mask, bias ? _mm512_add_ps(acc[m], bv) : acc[m]);
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// As above, each output rounded to bf16 once.
template <int M>
CARPOOL_BLOCK_INLINE void store_rows(const __m512* acc, const float* bias, at::BFloat16* y, int64_t N, int64_t group) {
  const __mmask16 mask = group_mask(N, group);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + group * 16) : _mm512_setzero_ps();
  for (int m = 0; m < M; ++m) {
    const __m256bh out = _mm512_cvtneps_pbh(bias ? _mm512_add_ps(acc[m], bv) : acc[m]);
    _mm256_mask_storeu_epi16(y + m * N + group * 16, mask, (__m256i)out);
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
// AVX2: a group of 16 outputs is computed as two halves of 8 (one register each), one after the
// other over all its blocks (the group's bytes stay in L1 between them). The sums are the AVX512
// float32 kernels' (two chains per block, blocks in ascending order), with the offset of the
// stored values folded into the block's minimum: d * sum x (q - offset) + m is computed as
// d * sum x q + (m - offset * d) * sum x.
#define CARPOOL_BLOCKS_AVX2 1

// As scale_of, for the 8 lanes of half `half` of the group.
template <int PB = 1>
CARPOOL_BLOCK_INLINE __m256 scale_of_avx2(const Scales& s, int64_t group, int64_t blocks, int64_t b, int half, int part = 0) {
  if (!s.sub) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s.d + (group * blocks + b) * 16 + half * 8)));
  const __m256 super =
      _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s.d + (group * (blocks >> s.shift) + (b >> s.shift)) * 16 + half * 8)));
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s.sub + ((group * blocks + b) * PB + part) * 16 + half * 8));
  const __m256 value = _mm256_mul_ps(super, _mm256_cvtepi32_ps(s.sub_signed ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw)));
  return s.negate ? _mm256_sub_ps(_mm256_setzero_ps(), value) : value;
}

// The end of a block (or sub-block) for M rows, 8 outputs: acc[m] += scale * (even[m] + odd[m]),
// then, where xsum is given, acc[m] += low * xsum[m, b] (low = m - offset * d).
template <int M>
CARPOOL_BLOCK_INLINE void add_block_avx2(__m256* acc, const __m256* even, const __m256* odd, __m256 scale, __m256 low,
                                         const float* xsum, int64_t blocks, int64_t b) {
  for (int m = 0; m < M; ++m) {
    acc[m] = _mm256_fmadd_ps(scale, _mm256_add_ps(even[m], odd[m]), acc[m]);
    if (xsum) acc[m] = _mm256_fmadd_ps(low, _mm256_set1_ps(xsum[m * blocks + b]), acc[m]);
  }
}

// y[m, 8 outputs of half `half` of the group] = acc[m] (+ bias), for M rows of y (row length N).
template <int M>
CARPOOL_BLOCK_INLINE void store_rows_avx2(const __m256* acc, const float* bias, float* y, int64_t N, int64_t group, int half) {
  const int64_t first = group * 16 + half * 8, left = std::min<int64_t>(8, N - first);
  if (left <= 0) return;
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256 bv = bias ? _mm256_maskload_ps(bias + first, mask) : _mm256_setzero_ps();
  for (int m = 0; m < M; ++m) _mm256_maskstore_ps(y + m * N + first, mask, bias ? _mm256_add_ps(acc[m], bv) : acc[m]);
}
#endif

}  // namespace carpool_blocks

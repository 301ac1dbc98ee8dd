// Linear layers accumulated in float32 on AVX2 + FMA, for float32 and bfloat16 weights (built with
// cpu_kernels.cpp by replica/cpu_kernels.py).
//
// Ops:
//   carpool_cpu::pack_f32_weight(weight [N, K] float32 or bfloat16) -> [ceil(N / 16), K, 16] of the
//     same dtype: for each group of 16 outputs, its K columns in order (zero rows pad the last group).
//   carpool_cpu::f32_linear(x [..., K], packed, bias [N] or None, N) -> [..., N] of x's dtype:
//     x @ weight.T + bias, x of the packed weight's dtype.
//   carpool_cpu::has_f32_gemv() -> whether the build has this kernel (AVX2 and FMA).
//
// Why our own: torch's float32 linear goes to MKL's sgemm, which on the 2-core AVX2 machine (AMD
// EPYC Zen 3, one thread) reads a decode step's weights far below the memory's speed once a step
// has a few rows: for SmolLM2's 30 layers and output embedding, about twice this kernel's time at
// 2 to 8 rows (oneDNN on prepacked weights was no better). It also gives a row other bits among 1
// to 3 rows than among 4 or more, so a request's tokens depended on its batch. Figures, and the
// script that measures them: docs/bench/cpu-speed.md, "One float32 kernel for AVX2 CPUs".
// bfloat16 weights go through the same kernel where the CPU has no AVX512-BF16 (where it has,
// cpu_linear_bf16.cpp's vdpbf16ps kernel serves them): each panel row of 16 bf16 weights is widened to
// float32 in registers (a bf16 is the upper half of a float32), x is widened once per call, and
// each output is rounded to bfloat16 once at the end (to nearest even, as torch rounds).
// Half the weight bytes of float32; oneDNN's bf16 GEMM on such CPUs (AVX512 without BF16) is
// slower and gives a row other bits in other batches. Figures: cpu-speed.md, "bfloat16 weights
// without AVX512-BF16".
//
// The micro-kernel (f32_rows) computes a block of up to 6 rows x 16 outputs over the whole of K:
// 12 accumulators of 8 floats, 2 weight vectors and a broadcast of x, within AVX2's 16 registers
// (the register block of BLIS's Haswell sgemm, 6 x 16; Van Zee & van de Geijn 2015). Under each
// group of 16 outputs, rows are taken 6 at a time, so the group's weight panel is read from memory
// once per step and reused from cache for every row block. Each output is bias + the sum over k of
// x[k] * w[k], accumulated with one fused multiply-add per k in ascending order, in float32,
// whatever the number of rows: a row's result does not depend on the other rows of its step.
// Built with AVX512F, the same sums run 16 lanes wide (rows_512): one accumulator per row, up to
// 12 rows a call, and with 1 to 4 rows 2 or 4 panels at once so that the FMAs' latency does not
// bound the weight stream; from 37 rows 2 panels at once, so that loads do not bound the FMAs
// (run_groups). Every lane computes the same FMAs in the same order: the AVX2 and
// AVX512 builds give the same bits.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kGroup = 16;    // outputs per weight panel (two 8-float vectors)
constexpr int64_t kRowBlock = 6;  // rows per micro-kernel call
// Prefetch distance in 64-byte lines (a float32 panel row is one line, a bf16 row half of one);
// past a panel's end this is the next one's.
constexpr int64_t kPrefetchAhead = 32;

// float32 -> bfloat16, rounded to nearest even; NaN -> 0x7FC0 (c10's scalar rule). Integer
// operations only: the kernels are built with -ffast-math, under which at::BFloat16's isnan check
// may be dropped.
inline at::BFloat16 round_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return at::BFloat16(0x7FC0, at::BFloat16::from_bits());
  return at::BFloat16(static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16), at::BFloat16::from_bits());
}

bool has_f32_gemv() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

at::Tensor pack_f32_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "pack_f32_weight: a 2-D float32 or bfloat16 weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  auto padded = at::constant_pad_nd(weight, {0, 0, 0, (kGroup - N % kGroup) % kGroup});  // [N16, K]
  return padded.view({padded.size(0) / kGroup, kGroup, K}).permute({0, 2, 1}).contiguous();
}

#if defined(__AVX2__) && defined(__FMA__)
// One panel row: 16 weights as two vectors of 8 floats.
inline void load16(const float* w, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(w);
  w1 = _mm256_loadu_ps(w + 8);
}

inline void load16(const at::BFloat16* w, __m256& w0, __m256& w1) {  // widened: the bf16 bits << 16
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), 16));
  w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1)), 16));
}

// Stores the first `valid` of 16 float32 results: as they are, or rounded to bfloat16.
inline void store16(float* y, __m256 lo, __m256 hi, __m256i mask_lo, __m256i mask_hi, int64_t) {
  _mm256_maskstore_ps(y, mask_lo, lo);
  _mm256_maskstore_ps(y + 8, mask_hi, hi);
}

inline void store16(at::BFloat16* y, __m256 lo, __m256 hi, __m256i, __m256i, int64_t valid) {
  alignas(32) float out[16];
  _mm256_store_ps(out, lo);
  _mm256_store_ps(out + 8, hi);
  for (int64_t n = 0; n < valid; ++n) y[n] = round_bf16(out[n]);
}

// Rows x[0..M) (each K floats, row stride K) times one panel w [K, 16] -> y[m][n0 .. n0 + 16)
// (row stride N; only the first `valid` outputs are stored).
template <int M, typename W>
void f32_rows(const float* __restrict x, int64_t K, const W* __restrict w, const float* __restrict bias,
              W* __restrict y, int64_t N, int64_t n0, int64_t valid) {
  // Every loop over m is unrolled, so that the accumulators stay in registers (with an indexed
  // epilogue GCC also stored all 12 to the stack on every k, at a third of the speed).
  __m256 lo[M], hi[M];
#pragma GCC unroll 6
  for (int m = 0; m < M; ++m) lo[m] = hi[m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    // The address may lie past the packed weight: a prefetch never faults (computed as an integer).
    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(w + k * kGroup) + kPrefetchAhead * 64),
                 _MM_HINT_T0);
    __m256 w0, w1;
    load16(w + k * kGroup, w0, w1);
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
    store16(y + m * N + n0, bias ? _mm256_add_ps(lo[m], b0) : lo[m], bias ? _mm256_add_ps(hi[m], b1) : hi[m],
            mask_lo, mask_hi, valid);
  }
}
#endif

#if defined(__AVX512F__)
// The same sums with AVX512: a panel row is one vector of 16 floats, so one accumulator per row and
// up to 12 rows per call (x's value folded into each FMA as a broadcast operand). Each lane still
// computes fma(x[k], w[k], acc) for k in ascending order: the bits equal the AVX2 kernel's.
constexpr int64_t kRowBlock512 = 12;
// From this many rows (4 row blocks of up to 12), two panels at a time, bf16 ones widened once
// (run_groups). Measured on SmolLM2's shapes: docs/bench/cpu-speed.md, "Faster long prefills".
constexpr int64_t kWideRows = 37;

inline __m512 load16_512(const float* w) { return _mm512_loadu_ps(w); }

inline __m512 load16_512(const at::BFloat16* w) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

inline void store16_512(float* y, __m512 v, int64_t valid) {
  _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << valid) - 1), v);
}

inline void store16_512(at::BFloat16* y, __m512 v, int64_t valid) {
  alignas(64) float out[16];
  _mm512_store_ps(out, v);
  for (int64_t n = 0; n < valid; ++n) y[n] = round_bf16(out[n]);
}

// P panels side by side (P consecutive groups of 16 outputs, each K x 16): with few rows, one
// accumulator per row would leave each k waiting on the previous FMA's latency (4 cycles); P
// independent panels give P times the chains. With many rows, P = 2 lets one broadcast of x feed
// two FMAs. Each output is still summed in the same order. W: the packed weight's type (float32
// where run_groups widened a bf16 pair); Y: the output's.
template <int M, int P, typename W, typename Y>
void rows_512(const float* __restrict x, int64_t K, const W* __restrict w, const float* __restrict bias,
              Y* __restrict y, int64_t N, int64_t n0) {
  __m512 acc[P * M];
#pragma GCC unroll 12
  for (int i = 0; i < P * M; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[P];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const W* wk = w + (p * K + k) * kGroup;
      _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(wk) + kPrefetchAhead * 64), _MM_HINT_T0);
      wv[p] = load16_512(wk);
    }
    // x[m][k] broadcast once for the P panels (with one panel, as the FMA's memory operand).
#pragma GCC unroll 12
    for (int m = 0; m < M; ++m) {
      if constexpr (P == 1) {
        acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + k]), wv[0], acc[m]);
      } else {
        const __m512 xv = _mm512_set1_ps(x[m * K + k]);
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) acc[p * M + m] = _mm512_fmadd_ps(xv, wv[p], acc[p * M + m]);
      }
    }
  }
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p) {
    const int64_t n = n0 + p * kGroup, valid = std::min(kGroup, N - n);
    const __m512 b = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();  // the bias is padded to whole groups
#pragma GCC unroll 12
    for (int m = 0; m < M; ++m) {
      store16_512(y + m * N + n, bias ? _mm512_add_ps(acc[p * M + m], b) : acc[p * M + m], valid);
    }
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// y [rows, N] = x [rows, K] (float32) @ the packed weight + bias (float32, padded to whole groups).
template <typename W>
void run_groups(const float* xb, int64_t rows, int64_t K, const W* wb, int64_t groups, const float* bb, W* yb,
                int64_t N) {
  // Groups of 16 outputs in parallel (torch's threads); under each, the row blocks in order.
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
#if defined(__AVX512F__)
    std::vector<float> widened;  // a pair of bf16 panels (or the last one) as float32, from kWideRows rows
#endif
    for (int64_t group = begin; group < end; ++group) {
      const int64_t n0 = group * kGroup;
      const W* panel = wb + group * K * kGroup;
#if defined(__AVX512F__)
      // 1 or 2 rows: 4 panels at a time; 3 or 4 rows: 2 (where that many groups remain).
      const int64_t few = rows <= 2 ? 4 : rows <= 4 ? 2 : 1;
      if (few > 1 && group + few <= end) {
        switch (rows) {
          case 1: rows_512<1, 4>(xb, K, panel, bb, yb, N, n0); break;
          case 2: rows_512<2, 4>(xb, K, panel, bb, yb, N, n0); break;
          case 3: rows_512<3, 2>(xb, K, panel, bb, yb, N, n0); break;
          default: rows_512<4, 2>(xb, K, panel, bb, yb, N, n0); break;
        }
        group += few - 1;
        continue;
      }
      // Row blocks of near-equal size (16 rows: 8 + 8, not 12 + 4, whose 4 would wait on latency).
      const int64_t blocks = (rows + kRowBlock512 - 1) / kRowBlock512;
      const int64_t panels = rows >= kWideRows && group + 2 <= end ? 2 : 1;
      // From kWideRows rows (long prefill chunks, many seats), two panels at a time: one broadcast
      // of x[m][k] feeds two FMAs, so loads (12 broadcasts and 2 weight rows per 24 FMAs, not 13
      // loads per 12) no longer bound the FMA ports. And a bf16 pair of panels is widened to
      // float32 once, not once per row block (a shuffle and a shift per k, on the FMA ports).
      // The values, and so every sum, are the same.
      const bool widen = std::is_same_v<W, at::BFloat16> && rows >= kWideRows;
      if (widen) {
        widened.resize(panels * K * kGroup);
        for (int64_t k = 0; k < panels * K; ++k) _mm512_storeu_ps(widened.data() + k * kGroup, load16_512(panel + k * kGroup));
      }
      for (int64_t b = 0, r0 = 0; b < blocks; ++b) {
        const int64_t block_rows = rows / blocks + (b < rows % blocks ? 1 : 0);
        const float* xr = xb + r0 * K;
        W* yr = yb + r0 * N;
        r0 += block_rows;
        auto run_block = [&](const auto* weights) {
          switch (block_rows) {
#define CARPOOL_ROWS(m)                                                           \
  case m:                                                                         \
    if (panels == 2) rows_512<m, 2>(xr, K, weights, bb, yr, N, n0);               \
    else rows_512<m, 1>(xr, K, weights, bb, yr, N, n0);                           \
    break;
            CARPOOL_ROWS(1) CARPOOL_ROWS(2) CARPOOL_ROWS(3) CARPOOL_ROWS(4) CARPOOL_ROWS(5) CARPOOL_ROWS(6)
            CARPOOL_ROWS(7) CARPOOL_ROWS(8) CARPOOL_ROWS(9) CARPOOL_ROWS(10) CARPOOL_ROWS(11) CARPOOL_ROWS(12)
#undef CARPOOL_ROWS
          }
        };
        if (widen) run_block(widened.data());
        else run_block(panel);
      }
      group += panels - 1;
#else
      const int64_t valid = std::min(kGroup, N - n0);
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
        const float* xr = xb + r0 * K;
        W* yr = yb + r0 * N;
        switch (std::min(kRowBlock, rows - r0)) {
          case 1: f32_rows<1>(xr, K, panel, bb, yr, N, n0, valid); break;
          case 2: f32_rows<2>(xr, K, panel, bb, yr, N, n0, valid); break;
          case 3: f32_rows<3>(xr, K, panel, bb, yr, N, n0, valid); break;
          case 4: f32_rows<4>(xr, K, panel, bb, yr, N, n0, valid); break;
          case 5: f32_rows<5>(xr, K, panel, bb, yr, N, n0, valid); break;
          default: f32_rows<6>(xr, K, panel, bb, yr, N, n0, valid); break;
        }
      }
#endif
    }
  });
}
#endif

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                      int64_t N) {
  const auto dtype = packed.scalar_type();
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kGroup && packed.is_contiguous() &&
                  (dtype == at::kFloat || dtype == at::kBFloat16),
              "f32_linear: the weight must come from pack_f32_weight");
  TORCH_CHECK(x.scalar_type() == dtype, "f32_linear: x must be ", dtype, " like the packed weight, got ",
              x.scalar_type());
  const int64_t K = x.size(-1), rows = K ? x.numel() / K : 0;
  TORCH_CHECK(packed.size(1) == K && packed.size(0) == (N + kGroup - 1) / kGroup, "f32_linear: x [..., ", K,
              "] and out_features ", N, " do not match the packed weight ", packed.sizes());
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->dim() == 1 && bias->numel() == N), "f32_linear: bias must have ", N,
              " elements in one dimension");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  if (K == 0) {  // an empty sum: the bias alone
    auto y = at::zeros(shape, x.options());
    if (has_bias) y.add_(bias->to(dtype));
    return y;
  }
  auto y = at::empty(shape, x.options());
  if (rows == 0) return y;
#if defined(__AVX2__) && defined(__FMA__)
  auto x2 = x.reshape({rows, K}).to(at::kFloat).contiguous();  // bf16 rows widened once per call
  at::Tensor bias_padded;
  if (has_bias) bias_padded = at::constant_pad_nd(bias->to(at::kFloat).contiguous(), {0, packed.size(0) * kGroup - N});
  const float* xb = x2.data_ptr<float>();
  const float* bb = has_bias ? bias_padded.data_ptr<float>() : nullptr;
  if (dtype == at::kFloat) {
    run_groups(xb, rows, K, packed.data_ptr<float>(), packed.size(0), bb, y.data_ptr<float>(), N);
  } else {
    run_groups(xb, rows, K, packed.data_ptr<at::BFloat16>(), packed.size(0), bb, y.data_ptr<at::BFloat16>(), N);
  }
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

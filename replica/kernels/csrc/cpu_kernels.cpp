// Carpool's CPU kernels (built by replica/cpu_kernels.py): the op library carpool_cpu is defined
// here, with greedy sampling's bf16 argmax; paged decode attention (cpu_attention.cpp), the linear
// layers (cpu_linear_bf16.cpp, cpu_linear_f32.cpp) and random sampling (cpu_sampling.cpp) add to it.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <cstdint>
#include <limits>

namespace {

#if defined(__AVX512F__)
inline __m512 bf16x16_to_f32(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

// Greedy sampling's argmax over a step's logits [rows, vocab] in bf16, without converting them to
// float32 first (torch's argmax on bf16 is about 4x slower than on float32, and the conversion
// writes twice the logits). The first index of the maximum, as torch.argmax.
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2, "argmax_rows: [rows, vocab] logits");
#if defined(__AVX512F__)
  if (logits.scalar_type() == at::kBFloat16) {
    auto x = logits.contiguous();
    const int64_t rows = x.size(0), vocab = x.size(1);
    auto out = at::empty({rows}, x.options().dtype(at::kLong));
    const at::BFloat16* base = x.data_ptr<at::BFloat16>();
    int64_t* o = out.data_ptr<int64_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const at::BFloat16* p = base + r * vocab;
        __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        __m512i best_i = _mm512_set1_epi32(0);
        __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i step = _mm512_set1_epi32(16);
        int64_t i = 0;
        for (; i + 16 <= vocab; i += 16) {
          const __m512 v = bf16x16_to_f32(p + i);
          const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
          best = _mm512_mask_blend_ps(gt, best, v);
          best_i = _mm512_mask_blend_epi32(gt, best_i, idx);
          idx = _mm512_add_epi32(idx, step);
        }
        float max_v = _mm512_reduce_max_ps(best);
        int64_t arg = vocab;
        alignas(64) float vals[16];
        alignas(64) int32_t ids[16];
        _mm512_store_ps(vals, best);
        _mm512_store_si512(ids, best_i);
        for (int l = 0; l < 16; ++l)
          if (vals[l] == max_v && ids[l] < arg) arg = ids[l];
        for (; i < vocab; ++i) {
          const float v = static_cast<float>(p[i]);
          if (v > max_v || arg == vocab) { max_v = v; arg = i; }
        }
        o[r] = arg;
      }
    });
    return out;
  }
#endif
  return logits.to(at::kFloat).argmax(-1);
}

}  // namespace

TORCH_LIBRARY(carpool_cpu, m) { m.def("argmax_rows(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(carpool_cpu, CompositeExplicitAutograd, m) { m.impl("argmax_rows", &argmax_rows); }

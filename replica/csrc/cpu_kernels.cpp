// Carpool's CPU kernels (built by replica/cpu_kernels.py).
//
// Paged decode attention for CPU: one query token per sequence, reading K/V in place through the
// sequence's block table (no gathered copy), GQA without repeating heads, softmax in float32.
//
// Op carpool_cpu::decode_attention (schema below) first writes the step's new K/V at
// slot_mapping, then, for every sequence s and KV head g, runs the online softmax of
// FlashAttention (Dao et al. 2022, arXiv:2205.14135; Milakov & Gimelshein 2018,
// arXiv:1805.02867) one block of block_size keys at a time: scores of the block for the G query
// heads that share g, the block's max, one rescale of the running sum and output, then the
// weighted values. Sequences x KV heads run in parallel under at::parallel_for (torch's threads).
//
// Shapes: query [S, H, D]; key, value [S, H_kv, D] (the new token of each sequence);
// key_cache, value_cache [slots, H_kv, D]; slot_mapping [S]; block_tables [S, W] (int64);
// seq_lens [S] (int64, keys to attend, the new one included). Returns [S, H, D] in query's dtype.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline void load_row(const T* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

// bf16 -> f32 is the 16 bits shifted up: written so that the compiler vectorizes it.
template <>
inline void load_row<at::BFloat16>(const at::BFloat16* __restrict src, float* __restrict dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) out[d] = static_cast<uint32_t>(bits[d]) << 16;
}

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

template <typename T, int D>
void attend(const T* __restrict q_all, const T* __restrict k_cache, const T* __restrict v_cache,
            const int64_t* __restrict tables, const int64_t* __restrict seq_lens, T* __restrict out,
            int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t width, int64_t block_size,
            int64_t head_dim_rt, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t dim = D > 0 ? D : head_dim_rt;
  const int64_t row = num_kv_heads * dim;  // elements per slot
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * dim), acc(group * dim), kf(dim), scores(group * block_size);
    std::vector<float> m(group), l(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / num_kv_heads, g = task % num_kv_heads;
      const int64_t len = seq_lens[s];
      for (int64_t r = 0; r < group; ++r) {
        const T* qs = q_all + (s * num_heads + g * group + r) * dim;
        for (int64_t d = 0; d < dim; ++d) q[r * dim + d] = to_float(qs[d]) * scale;
        m[r] = -std::numeric_limits<float>::infinity();
        l[r] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t num_blocks = (len + block_size - 1) / block_size;
      for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t block = tables[s * width + b];
        const int64_t n = std::min(block_size, len - b * block_size);
        for (int64_t t = 0; t < n; ++t) {
          load_row(k_cache + (block * block_size + t) * row + g * dim, kf.data(), dim);
          for (int64_t r = 0; r < group; ++r) {
            const float* qr = q.data() + r * dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < dim; ++d) dot += qr[d] * kf[d];
            scores[r * block_size + t] = dot;
          }
        }
        for (int64_t r = 0; r < group; ++r) {
          float* sr = scores.data() + r * block_size;
          float block_max = sr[0];
          for (int64_t t = 1; t < n; ++t) block_max = std::max(block_max, sr[t]);
          const float new_max = std::max(m[r], block_max);
          const float correction = std::exp(m[r] - new_max);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < n; ++t) {
            sr[t] = std::exp(sr[t] - new_max);
            sum += sr[t];
          }
          l[r] = l[r] * correction + sum;
          m[r] = new_max;
          float* ar = acc.data() + r * dim;
          if (correction != 1.f) {
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) ar[d] *= correction;
          }
        }
        for (int64_t t = 0; t < n; ++t) {
          load_row(v_cache + (block * block_size + t) * row + g * dim, kf.data(), dim);
          for (int64_t r = 0; r < group; ++r) {
            const float p = scores[r * block_size + t];
            float* ar = acc.data() + r * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) ar[d] += p * kf[d];
          }
        }
      }
      for (int64_t r = 0; r < group; ++r) {
        T* o = out + (s * num_heads + g * group + r) * dim;
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(acc[r * dim + d] * inv);
      }
    }
  });
}

template <typename T>
void dispatch_dim(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& tables,
                  const at::Tensor& lens, at::Tensor& out, int64_t block_size, double scale) {
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2), Hkv = kc.size(1), W = tables.size(1);
  auto args = std::make_tuple(q.data_ptr<T>(), kc.data_ptr<T>(), vc.data_ptr<T>(), tables.data_ptr<int64_t>(),
                              lens.data_ptr<int64_t>(), out.data_ptr<T>());
  auto run = [&](auto kernel) {
    kernel(std::get<0>(args), std::get<1>(args), std::get<2>(args), std::get<3>(args), std::get<4>(args),
           std::get<5>(args), S, H, Hkv, W, block_size, D, static_cast<float>(scale));
  };
  if (D == 64) run(attend<T, 64>);
  else if (D == 128) run(attend<T, 128>);
  else run(attend<T, 0>);
}

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slot_mapping,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
                            double scale) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && key_cache.dim() == 3, "decode_attention: bad ranks");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "decode_attention: caches must be contiguous");
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0, "decode_attention: heads must be a multiple of KV heads");
  key_cache.index_copy_(0, slot_mapping, key.to(key_cache.scalar_type()));
  value_cache.index_copy_(0, slot_mapping, value.to(value_cache.scalar_type()));
  auto q = query.to(key_cache.scalar_type()).contiguous();
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = seq_lens.to(at::kLong).contiguous();
  auto out = at::empty_like(q);
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_dim<float>(q, key_cache, value_cache, tables, lens, out, block_size, scale); break;
    case at::kBFloat16: dispatch_dim<at::BFloat16>(q, key_cache, value_cache, tables, lens, out, block_size, scale); break;
    case at::kHalf: dispatch_dim<at::Half>(q, key_cache, value_cache, tables, lens, out, block_size, scale); break;
    default: TORCH_CHECK(false, "decode_attention: unsupported dtype ", q.scalar_type());
  }
  return out.to(query.scalar_type());
}

// x @ W.T + bias with W prepacked by mkldnn::_reorder_linear_weight: mkldnn::_linear_pointwise
// called through the dispatcher from C++, so that a compiled graph reaches it without Python.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed_weight, const std::optional<at::Tensor>& bias,
                         int64_t out_features) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, packed_weight, bias, std::string("none"),
                                 c10::List<std::optional<at::Scalar>>(), std::optional<std::string>()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

TORCH_LIBRARY(carpool_cpu, m) {
  m.def(
      "decode_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int block_size, float scale) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(carpool_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }

// The packed weight is an opaque oneDNN tensor (dispatch key MkldnnCPU), so the op is registered
// for every backend rather than only CPU.
TORCH_LIBRARY_IMPL(carpool_cpu, CompositeExplicitAutograd, m) { m.impl("packed_linear", &packed_linear); }

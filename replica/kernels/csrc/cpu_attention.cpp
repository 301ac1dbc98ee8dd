// Paged decode attention for CPU (built by replica/cpu_kernels.py, with cpu_kernels.cpp, which
// defines the op library carpool_cpu): one query token per sequence, reading K/V in place through the
// sequence's block table (no gathered copy), GQA without repeating heads, softmax in float32. The
// engine also runs each token of a prefill chunk as such a "sequence": its sequence's block table,
// and seq_lens up to itself (causal attention one query at a time; all K/V written first). A
// query's result does not depend on the other queries of the call (kQueryTile below), so a prompt
// token gets the same bits however its prompt is chunked and whatever prefix was cached.
//
// Op carpool_cpu::decode_attention (schema below) first writes the step's new K/V at
// slot_mapping, then, for every sequence s and KV head g, runs the online softmax of
// FlashAttention (Dao et al. 2022, arXiv:2205.14135; Milakov & Gimelshein 2018,
// arXiv:1805.02867) one block of block_size keys at a time: scores of the block for the G query
// heads that share g, the block's max, one rescale of the running sum and output, then the
// weighted values. Tiles of consecutive queries run in parallel under at::parallel_for (torch's
// threads).
//
// Shapes: query [S, H, D]; key, value [S, H_kv, D] (the new token of each sequence);
// key_cache, value_cache [slots, H_kv, D]; slot_mapping [S]; block_tables [S, W] (int64);
// seq_lens [S] (int64, keys to attend, the new one included). Returns [S, H, D] in query's dtype.
// The bf16, head_dim 64 case runs on cpu_attention_avx512.cpp's kernel where AVX512 is built;
// cpu_attention.h holds what both share.
#include "cpu_attention.h"

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using carpool_attention::kQueryTile;
using carpool_attention::load_row;
using carpool_attention::query_tiles;

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
  const std::vector<int64_t> starts = query_tiles(tables, seq_lens, num_seqs, width);
  const int64_t num_tiles = static_cast<int64_t>(starts.size()) - 1;
  // One task per (tile of queries, KV head).
  at::parallel_for(0, num_tiles * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(kQueryTile * group * dim), acc(kQueryTile * group * dim), kf(dim), scores(group * block_size);
    std::vector<float> m(kQueryTile * group), l(kQueryTile * group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s0 = starts[task / num_kv_heads], g = task % num_kv_heads;
      const int64_t count = starts[task / num_kv_heads + 1] - s0;
      int64_t most_blocks = 0;
      for (int64_t i = 0; i < count; ++i) {
        const int64_t s = s0 + i;
        for (int64_t r = 0; r < group; ++r) {
          const T* qs = q_all + (s * num_heads + g * group + r) * dim;
          float* qi = q.data() + (i * group + r) * dim;
          for (int64_t d = 0; d < dim; ++d) qi[d] = to_float(qs[d]) * scale;
          m[i * group + r] = -std::numeric_limits<float>::infinity();
          l[i * group + r] = 0.f;
        }
        most_blocks = std::max(most_blocks, (seq_lens[s] + block_size - 1) / block_size);
      }
      std::fill(acc.begin(), acc.begin() + count * group * dim, 0.f);
      for (int64_t b = 0; b < most_blocks; ++b) {
        for (int64_t i = 0; i < count; ++i) {
          const int64_t s = s0 + i, len = seq_lens[s];
          if (b * block_size >= len) continue;  // this query's keys end before block b
          const int64_t block = tables[s * width + b];
          const int64_t n = std::min(block_size, len - b * block_size);
          float* const qi = q.data() + i * group * dim;
          float* const ai = acc.data() + i * group * dim;
          float* const mi = m.data() + i * group;
          float* const li = l.data() + i * group;
          for (int64_t t = 0; t < n; ++t) {
            load_row(k_cache + (block * block_size + t) * row + g * dim, kf.data(), dim);
            for (int64_t r = 0; r < group; ++r) {
              const float* qr = qi + r * dim;
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
            const float new_max = std::max(mi[r], block_max);
            const float correction = std::exp(mi[r] - new_max);
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n; ++t) {
              sr[t] = std::exp(sr[t] - new_max);
              sum += sr[t];
            }
            li[r] = li[r] * correction + sum;
            mi[r] = new_max;
            float* ar = ai + r * dim;
            if (correction != 1.f) {
#pragma omp simd
              for (int64_t d = 0; d < dim; ++d) ar[d] *= correction;
            }
          }
          for (int64_t t = 0; t < n; ++t) {
            load_row(v_cache + (block * block_size + t) * row + g * dim, kf.data(), dim);
            for (int64_t r = 0; r < group; ++r) {
              const float p = scores[r * block_size + t];
              float* ar = ai + r * dim;
#pragma omp simd
              for (int64_t d = 0; d < dim; ++d) ar[d] += p * kf[d];
            }
          }
        }
      }
      for (int64_t i = 0; i < count; ++i) {
        for (int64_t r = 0; r < group; ++r) {
          T* o = out + ((s0 + i) * num_heads + g * group + r) * dim;
          const float inv = l[i * group + r] > 0.f ? 1.f / l[i * group + r] : 0.f;
          const float* ar = acc.data() + (i * group + r) * dim;
          for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(ar[d] * inv);
        }
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
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (D == 64 && carpool_attention::attend_bf16_d64(q.data_ptr<T>(), kc.data_ptr<T>(), vc.data_ptr<T>(),
                                                      tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                                                      out.data_ptr<T>(), S, H, Hkv, W, block_size, static_cast<float>(scale)))
      return;
  }
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
  const int64_t num_seqs = q.size(0);
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == num_seqs && lens.dim() == 1 && lens.size(0) == num_seqs,
              "decode_attention: one block table row and one length per query");
  const int64_t* len_data = lens.data_ptr<int64_t>();
  for (int64_t s = 0; s < num_seqs; ++s)  // a longer one would read past its table
    TORCH_CHECK(len_data[s] >= 0 && len_data[s] <= tables.size(1) * block_size, "decode_attention: a length past its block table (",
                len_data[s], " keys, ", tables.size(1), " blocks of ", block_size, ")");
  auto out = at::empty_like(q);
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_dim<float>(q, key_cache, value_cache, tables, lens, out, block_size, scale); break;
    case at::kBFloat16: dispatch_dim<at::BFloat16>(q, key_cache, value_cache, tables, lens, out, block_size, scale); break;
    case at::kHalf: dispatch_dim<at::Half>(q, key_cache, value_cache, tables, lens, out, block_size, scale); break;
    default: TORCH_CHECK(false, "decode_attention: unsupported dtype ", q.scalar_type());
  }
  return out.to(query.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(carpool_cpu, m) {
  m.def(
      "decode_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int block_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(carpool_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }

// Shared by Carpool's paged attention kernels (cpu_attention.cpp: the op and the generic kernel;
// cpu_attention_avx512.cpp: bf16, head_dim 64 on AVX512): reading a row of K/V as float32, and
// which queries of a call share one walk over their blocks (query_tiles).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace carpool_attention {

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

// Queries per task at most. A task walks the KV blocks once, in order, and at each block runs
// every query of its tile that reaches it: the tokens of a prefill chunk, which share their
// sequence's blocks, then read each block from memory once between them instead of once each.
// A query's arithmetic does not depend on its tile: the same operations, in the same order, on
// its own state (its scaled query, running max, sum and output), whatever the other queries are.
// So a prompt token's attention is the same bits whether it comes alone, in a chunk of any size or
// after a cached prefix, and a decode's whatever its batch.
inline constexpr int64_t kQueryTile = 8;

// Where each tile starts (and S at the end): runs of at most kQueryTile consecutive queries of
// one sequence (a prefill chunk's tokens: the same first block, each one key longer than the one
// before). A decode is a tile of its own: other sequences share no blocks to read once.
inline std::vector<int64_t> query_tiles(const int64_t* tables, const int64_t* seq_lens, int64_t num_seqs, int64_t width) {
  std::vector<int64_t> starts;
  starts.reserve(num_seqs + 1);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const bool joins = s > 0 && s - starts.back() < kQueryTile && seq_lens[s] == seq_lens[s - 1] + 1 &&
                       tables[s * width] == tables[(s - 1) * width];
    if (!joins) starts.push_back(s);
  }
  starts.push_back(num_seqs);
  return starts;
}

// bf16 queries, caches and output with head_dim 64 and group = heads per KV head in 1..4, on the
// AVX512 kernel (cpu_attention_avx512.cpp); false (nothing done) where it is not built or does not
// apply. Arguments as the generic kernel's in cpu_attention.cpp.
bool attend_bf16_d64(const at::BFloat16* q_all, const at::BFloat16* k_cache, const at::BFloat16* v_cache,
                     const int64_t* tables, const int64_t* seq_lens, at::BFloat16* out, int64_t num_seqs,
                     int64_t num_heads, int64_t num_kv_heads, int64_t width, int64_t block_size, float scale);

}  // namespace carpool_attention

// Paged attention for bf16 queries and caches with head_dim 64 on AVX512 (Carpool's CPU kernels,
// built by replica/cpu_kernels.py): the kernel cpu_attention.cpp's op takes for that case. The
// same online softmax (FlashAttention; see cpu_attention.cpp), block by block and query by query,
// as the generic kernel there, with each query's arithmetic independent of its tile.
#include "cpu_attention.h"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace {

using carpool_attention::kQueryTile;
using carpool_attention::load_row;
using carpool_attention::query_tiles;

#if defined(__AVX512F__)
// bf16, head_dim 64, G <= 4 query heads per KV head (AVX512): while a KV head's rows of a block are
// read, the q and output accumulator of its G query heads live in four zmm registers each, and a
// key or value row is converted once to four zmm and used by all G heads. Same online softmax,
// block by block, as the generic kernel in cpu_attention.cpp.
// e^x for 16 floats: 2^(x log2 e) split as 2^n * 2^f, f in [-0.5, 0.5], with a degree-6 polynomial
// for 2^f (Cephes' exp2f coefficients; relative error about 2e-7). x below -87 gives 0.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __m512 bf16x16_to_f32(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// The sums of 16 vectors' lanes, lane t of the result for vector t (part holds them one after the
// other, 16 floats each). Four rounds of pairwise adds replace the 16 horizontal reductions that
// each cost four shuffles and four adds: round 1 adds each vector's upper 256 bits to its lower,
// round 2 its two remaining 128-bit quarters, rounds 3 and 4 the floats within a quarter. A
// vector's sum is the same tree of its own lanes whatever the other 15 hold, so a key's score does
// not depend on its neighbours or on how many keys a block has.
inline __m512 sum_lanes16(const float* part) {
  __m512 u[8], w[4], x[2];
  for (int k = 0; k < 8; ++k) {
    const __m512 a = _mm512_loadu_ps(part + 32 * k), b = _mm512_loadu_ps(part + 32 * k + 16);
    u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // u[k]'s quarters: vector 2k's two half-sums, then vector 2k+1's.
  for (int k = 0; k < 4; ++k)
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  // w[k]'s quarter j: four floats that sum to vector 4k+j.
  for (int k = 0; k < 2; ++k)
    x[k] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // x[k]'s quarter j: two floats of vector 8k+j, then two of vector 8k+4+j.
  const __m512 y = _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // y's float 4j+c is the sum of vector 4c+j.
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), y);
}

// Row t of one KV head of a block (64 values) as four zmm of float32: from the cache's bf16
// (Converted = false; stride: elements from one row to the next) or from a float32 copy of the
// block (Converted = true, rows of 64). bf16 -> f32 is exact, so both give the same values.
template <bool Converted>
inline void row64(const void* base, int64_t stride, int64_t t, __m512& r0, __m512& r1, __m512& r2, __m512& r3) {
  if constexpr (Converted) {
    const float* p = static_cast<const float*>(base) + t * 64;
    r0 = _mm512_loadu_ps(p), r1 = _mm512_loadu_ps(p + 16), r2 = _mm512_loadu_ps(p + 32), r3 = _mm512_loadu_ps(p + 48);
  } else {
    const at::BFloat16* p = static_cast<const at::BFloat16*>(base) + t * stride;
    r0 = bf16x16_to_f32(p), r1 = bf16x16_to_f32(p + 16), r2 = bf16x16_to_f32(p + 32), r3 = bf16x16_to_f32(p + 48);
  }
}

// One query's G heads (of one KV head) through n keys of one block: scores (16 keys at a time,
// each key's 16 lane products of q.k, then their sums), the block's max, one rescale of the
// running sum l and output acc, then the weighted values. q_state, acc_state: [G, 64] float32;
// m_state, l_state: [G]; scores: [G, block_size] and part: [G, 16, 16] scratch.
template <int G, bool Converted>
inline void attend_block(const float* q_state, float* acc_state, float* m_state, float* l_state, const void* keys,
                         const void* values, int64_t stride, int64_t n, int64_t block_size, float* scores, float* part) {
  __m512 q[G][4];
  for (int r = 0; r < G; ++r)
    for (int j = 0; j < 4; ++j) q[r][j] = _mm512_loadu_ps(q_state + r * 64 + 16 * j);
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int64_t live_keys = std::min<int64_t>(16, n - t0);
    for (int64_t t = 0; t < live_keys; ++t) {
      __m512 k0, k1, k2, k3;
      row64<Converted>(keys, stride, t0 + t, k0, k1, k2, k3);
      for (int r = 0; r < G; ++r) {
        __m512 d = _mm512_mul_ps(q[r][0], k0);
        d = _mm512_fmadd_ps(q[r][1], k1, d);
        d = _mm512_fmadd_ps(q[r][2], k2, d);
        d = _mm512_fmadd_ps(q[r][3], k3, d);
        _mm512_storeu_ps(part + (r * 16 + t) * 16, d);
      }
    }
    const __mmask16 live = static_cast<__mmask16>((1u << live_keys) - 1);
    for (int r = 0; r < G; ++r) {
      for (int64_t t = live_keys; t < 16; ++t) _mm512_storeu_ps(part + (r * 16 + t) * 16, _mm512_setzero_ps());
      _mm512_mask_storeu_ps(scores + r * block_size + t0, live, sum_lanes16(part + r * 256));
    }
  }
  float correction[G];
  for (int r = 0; r < G; ++r) {
    float* sr = scores + r * block_size;
    float block_max = -std::numeric_limits<float>::infinity();
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const __mmask16 live = n - t0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t0)) - 1);
      const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), live, sr + t0);
      block_max = std::max(block_max, _mm512_reduce_max_ps(v));
    }
    const float new_max = std::max(m_state[r], block_max);
    correction[r] = std::exp(m_state[r] - new_max);
    float sum = 0.f;
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const __mmask16 live = n - t0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t0)) - 1);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sr + t0), _mm512_set1_ps(new_max)));
      _mm512_mask_storeu_ps(sr + t0, live, e);
      sum += _mm512_mask_reduce_add_ps(live, e);
    }
    l_state[r] = l_state[r] * correction[r] + sum;
    m_state[r] = new_max;
  }
  __m512 acc[G][4];
  for (int r = 0; r < G; ++r) {
    const __m512 c = _mm512_set1_ps(correction[r]);
    for (int j = 0; j < 4; ++j) {
      acc[r][j] = _mm512_loadu_ps(acc_state + r * 64 + 16 * j);
      if (correction[r] != 1.f) acc[r][j] = _mm512_mul_ps(acc[r][j], c);
    }
  }
  for (int64_t t = 0; t < n; ++t) {
    __m512 v0, v1, v2, v3;
    row64<Converted>(values, stride, t, v0, v1, v2, v3);
    for (int r = 0; r < G; ++r) {
      const __m512 p = _mm512_set1_ps(scores[r * block_size + t]);
      acc[r][0] = _mm512_fmadd_ps(p, v0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(p, v1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(p, v2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(p, v3, acc[r][3]);
    }
  }
  for (int r = 0; r < G; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc_state + r * 64 + 16 * j, acc[r][j]);
}

template <int G>
void attend_bf16_d64_g(const at::BFloat16* __restrict q_all, const at::BFloat16* __restrict k_cache,
                     const at::BFloat16* __restrict v_cache, const int64_t* __restrict tables,
                     const int64_t* __restrict seq_lens, at::BFloat16* __restrict out, int64_t num_seqs,
                     int64_t num_heads, int64_t num_kv_heads, int64_t width, int64_t block_size, float scale) {
  constexpr int D = 64;
  const int64_t row = num_kv_heads * D;  // elements per slot: every KV head of one token
  const std::vector<int64_t> starts = query_tiles(tables, seq_lens, num_seqs, width);
  const int64_t num_tiles = static_cast<int64_t>(starts.size()) - 1;
  // One task per tile of queries (query_tiles). A tile walks its blocks in order, prefetching the
  // next one (blocks lie anywhere in a pool far larger than the caches, so memory bounds a decode).
  // At each block and KV head, a tile of more than one query converts the block's K and V rows to
  // float32 once for all its queries; a decode converts each row as it reads it. Either way every
  // query runs attend_block on the same values, so its bits do not depend on its tile.
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * block_size), part(G * 16 * 16);
    std::vector<float> k_f32(block_size * D), v_f32(block_size * D);
    std::vector<float> q_tile(kQueryTile * num_heads * D), acc_tile(kQueryTile * num_heads * D);
    std::vector<float> m_tile(kQueryTile * num_heads), l_tile(kQueryTile * num_heads);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s0 = starts[task], count = starts[task + 1] - s0;
      const int64_t last = s0 + count - 1;  // the tile's longest query: the others end before it
      for (int64_t i = 0; i < count; ++i) {
        const int64_t s = s0 + i;
        for (int64_t h = 0; h < num_heads; ++h) {
          for (int j = 0; j < 4; ++j) {
            _mm512_storeu_ps(&q_tile[(i * num_heads + h) * D + 16 * j],
                             _mm512_mul_ps(bf16x16_to_f32(q_all + (s * num_heads + h) * D + 16 * j), _mm512_set1_ps(scale)));
            _mm512_storeu_ps(&acc_tile[(i * num_heads + h) * D + 16 * j], _mm512_setzero_ps());
          }
          m_tile[i * num_heads + h] = -std::numeric_limits<float>::infinity();
          l_tile[i * num_heads + h] = 0.f;
        }
      }
      const int64_t most_blocks = (seq_lens[last] + block_size - 1) / block_size;
      for (int64_t b = 0; b < most_blocks; ++b) {
        const int64_t block = tables[last * width + b];
        if (b + 1 < most_blocks) {
          const char* nk = reinterpret_cast<const char*>(k_cache + tables[last * width + b + 1] * block_size * row);
          const char* nv = reinterpret_cast<const char*>(v_cache + tables[last * width + b + 1] * block_size * row);
          for (int64_t off = 0; off < block_size * row * 2; off += 64) {
            _mm_prefetch(nk + off, _MM_HINT_T0);
            _mm_prefetch(nv + off, _MM_HINT_T0);
          }
        }
        for (int64_t g = 0; g < num_kv_heads; ++g) {
          const at::BFloat16* k_rows = k_cache + block * block_size * row + g * D;
          const at::BFloat16* v_rows = v_cache + block * block_size * row + g * D;
          if (count > 1) {
            const int64_t rows = std::min(block_size, seq_lens[last] - b * block_size);
            for (int64_t t = 0; t < rows; ++t) {
              load_row(k_rows + t * row, k_f32.data() + t * D, D);
              load_row(v_rows + t * row, v_f32.data() + t * D, D);
            }
          }
          for (int64_t i = 0; i < count; ++i) {
            const int64_t len = seq_lens[s0 + i];
            if (b * block_size >= len) continue;  // this query's keys end before block b
            const int64_t n = std::min(block_size, len - b * block_size);
            const int64_t state = i * num_heads + g * G;
            float* const q_state = q_tile.data() + state * D;
            float* const acc_state = acc_tile.data() + state * D;
            // Tiles are runs of one sequence's tokens, but two sequences that share cached blocks
            // can meet in one: a query whose block b is another reads its own from the cache.
            const int64_t own = tables[(s0 + i) * width + b];
            if (count > 1 && own == block)
              attend_block<G, true>(q_state, acc_state, &m_tile[state], &l_tile[state], k_f32.data(), v_f32.data(), D, n,
                                    block_size, scores.data(), part.data());
            else
              attend_block<G, false>(q_state, acc_state, &m_tile[state], &l_tile[state], k_cache + own * block_size * row + g * D,
                                     v_cache + own * block_size * row + g * D, row, n, block_size, scores.data(), part.data());
          }
        }
      }
      for (int64_t i = 0; i < count; ++i) {
        for (int64_t h = 0; h < num_heads; ++h) {
          at::BFloat16* o = out + ((s0 + i) * num_heads + h) * D;
          const float l = l_tile[i * num_heads + h];
          const __m512 inv = _mm512_set1_ps(l > 0.f ? 1.f / l : 0.f);
          alignas(64) float tmp[D];
          for (int j = 0; j < 4; ++j)
            _mm512_store_ps(tmp + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(&acc_tile[(i * num_heads + h) * D + 16 * j]), inv));
          for (int d = 0; d < D; ++d) o[d] = static_cast<at::BFloat16>(tmp[d]);
        }
      }
    }
  });
}
#endif

}  // namespace

namespace carpool_attention {

bool attend_bf16_d64(const at::BFloat16* q_all, const at::BFloat16* k_cache, const at::BFloat16* v_cache,
                     const int64_t* tables, const int64_t* seq_lens, at::BFloat16* out, int64_t num_seqs,
                     int64_t num_heads, int64_t num_kv_heads, int64_t width, int64_t block_size, float scale) {
#if defined(__AVX512F__)
  const int64_t group = num_heads / num_kv_heads;
  if (group < 1 || group > 4) return false;
  auto kernel = group == 1 ? attend_bf16_d64_g<1> : group == 2 ? attend_bf16_d64_g<2> : group == 3 ? attend_bf16_d64_g<3> : attend_bf16_d64_g<4>;
  kernel(q_all, k_cache, v_cache, tables, seq_lens, out, num_seqs, num_heads, num_kv_heads, width, block_size, scale);
  return true;
#else
  (void)q_all, (void)k_cache, (void)v_cache, (void)tables, (void)seq_lens, (void)out, (void)num_seqs, (void)num_heads,
      (void)num_kv_heads, (void)width, (void)block_size, (void)scale;
  return false;
#endif
}

}  // namespace carpool_attention

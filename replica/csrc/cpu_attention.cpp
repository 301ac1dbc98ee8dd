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
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <cstdint>
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

// Queries per task at most. A task walks the KV blocks once, in order, and at each block runs
// every query of its tile that reaches it: the tokens of a prefill chunk, which share their
// sequence's blocks, then read each block from memory once between them instead of once each.
// A query's arithmetic does not depend on its tile: the same operations, in the same order, on
// its own state (its scaled query, running max, sum and output), whatever the other queries are.
// So a prompt token's attention is the same bits whether it comes alone, in a chunk of any size or
// after a cached prefix, and a decode's whatever its batch.
constexpr int64_t kQueryTile = 8;

// Where each tile starts (and S at the end): runs of at most kQueryTile consecutive queries of
// one sequence (a prefill chunk's tokens: the same first block, each one key longer than the one
// before). A decode is a tile of its own: other sequences share no blocks to read once.
std::vector<int64_t> query_tiles(const int64_t* tables, const int64_t* seq_lens, int64_t num_seqs, int64_t width) {
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

#if defined(__AVX512F__)
// bf16, head_dim 64, G <= 4 query heads per KV head (AVX512): while a KV head's rows of a block are
// read, the q and output accumulator of its G query heads live in four zmm registers each, and a
// key or value row is converted once to four zmm and used by all G heads. Same online softmax,
// block by block, as the generic kernel above.
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
void attend_bf16_d64(const at::BFloat16* __restrict q_all, const at::BFloat16* __restrict k_cache,
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
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const int64_t G = H / Hkv;
    if (D == 64 && G >= 1 && G <= 4) {
      auto fast = G == 1 ? attend_bf16_d64<1> : G == 2 ? attend_bf16_d64<2> : G == 3 ? attend_bf16_d64<3> : attend_bf16_d64<4>;
      fast(q.data_ptr<T>(), kc.data_ptr<T>(), vc.data_ptr<T>(), tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
           out.data_ptr<T>(), S, H, Hkv, W, block_size, static_cast<float>(scale));
      return;
    }
  }
#endif
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

// The shared-memory all-reduce and gather of a CPU tensor-parallel group's ranks, without Python
// in between (replica/worker/shm_all_reduce.py holds the protocol, the buffer and the Python
// fallbacks; this file is its per-call work). The buffer: one 64-byte line per rank holding the
// sequence number it last published, then two halves (call parity) of one slot of max_bytes per
// rank. A call copies x into this rank's slot of half seq % 2, publishes seq (a release store),
// waits until every peer has published seq (acquire loads, spinning with a pause, then yielding),
// and sums the slots in rank order (the same order on every rank: every rank gets the same
// bits) or concatenates them along the last dimension (the gather, on rank 0; the other ranks
// publish and return x). A wait longer than wait_s returns an empty tensor: the caller checks
// that the peers still live and calls again, with publish = false once its own number is out.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <immintrin.h>
#include <sched.h>
#include <time.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kFlagStride = 8;  // int64s per rank's line (64 bytes)

// Spin (a peer computing its share arrives within microseconds to a millisecond when each rank
// has its core), then yield, then, past 1 ms, sleep 20 µs between looks, so that ranks sharing
// cores with other work (or a long wait) do not take the CPU their peers need.
bool wait_for_peers(const int64_t* flags, int64_t rank, int64_t world, int64_t seq, double wait_s) {
  const auto start = std::chrono::steady_clock::now();
  for (int64_t peer = 0; peer < world; ++peer) {
    if (peer == rank) continue;
    const int64_t* flag = flags + peer * kFlagStride;
    int64_t spins = 0;
    bool napping = false;
    while (__atomic_load_n(flag, __ATOMIC_ACQUIRE) < seq) {
      if (++spins < 2048) {
        _mm_pause();
        continue;
      }
      if (napping || (spins & 63) == 0) {
        const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (waited > wait_s) return false;
        napping = waited > 1e-3;
      }
      if (napping) {
        const timespec nap{0, 20000};
        nanosleep(&nap, nullptr);
      } else {
        sched_yield();
      }
    }
  }
  return true;
}

template <typename T>
void sum_slots(const uint8_t* half, int64_t max_bytes, int64_t world, int64_t n, T* out) {
  const T* first = reinterpret_cast<const T*>(half);
  std::memcpy(out, first, n * sizeof(T));
  for (int64_t r = 1; r < world; ++r) {
    const T* part = reinterpret_cast<const T*>(half + r * max_bytes);
    int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      // 16 at a time: widen to float32, add, round to nearest even as c10::BFloat16 does (NaN to
      // 0x7FC0): the same bits as the scalar loop below and as torch's add of two bf16 tensors.
      const __m512i ones = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF), qnan = _mm512_set1_epi32(0x7FC00000);
      for (; i + 16 <= n; i += 16) {
        const __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(out + i))), 16));
        const __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(part + i))), 16));
        const __m512 sum = _mm512_add_ps(a, b);
        const __m512i bits = _mm512_castps_si512(sum);
        __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 16), ones), bias));
        rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(sum, sum, _CMP_UNORD_Q), qnan);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
      }
    }
#endif
    for (; i < n; ++i) out[i] = static_cast<T>(static_cast<float>(out[i]) + static_cast<float>(part[i]));
  }
}

// op: 0 = sum (all-reduce), 1 = gather along the last dimension.
at::Tensor shm_collective(const at::Tensor& x, const at::Tensor& buffer, int64_t rank, int64_t world, int64_t seq,
                          int64_t max_bytes, bool publish, double wait_s, int64_t op) {
  TORCH_CHECK(buffer.scalar_type() == at::kByte && buffer.is_contiguous(), "shm_collective: a uint8 buffer");
  auto xc = x.contiguous();
  const int64_t nbytes = xc.numel() * xc.element_size();
  TORCH_CHECK(nbytes <= max_bytes, "shm_collective: tensor larger than a slot");
  uint8_t* base = buffer.data_ptr<uint8_t>();
  int64_t* flags = reinterpret_cast<int64_t*>(base);
  uint8_t* half = base + 64 * world + (seq % 2) * world * max_bytes;
  if (publish) {
    // This half was last written at call seq - 2; every peer has read it once it has published
    // seq - 1 (a rank's calls run in order). Usually already true; after a gather, which ranks
    // other than 0 leave without waiting, this is what keeps them from writing too early.
    if (seq > 1 && !wait_for_peers(flags, rank, world, seq - 1, wait_s)) return at::empty({0}, xc.options());
    if (op != 1 || rank != 0)  // a gather's own part on rank 0 is read from x: no one else reads it
      std::memcpy(half + rank * max_bytes, xc.data_ptr(), nbytes);
    __atomic_store_n(flags + rank * kFlagStride, seq, __ATOMIC_RELEASE);
  }
  if (op == 1 && rank != 0) return xc;  // published; only rank 0 reads a gather
  if (!wait_for_peers(flags, rank, world, seq, wait_s)) return at::empty({0}, xc.options());
  if (op == 1) {
    std::vector<int64_t> shape(xc.sizes().begin(), xc.sizes().end());
    const int64_t cols = shape.empty() ? 1 : shape.back();
    const int64_t rows = cols ? xc.numel() / cols : 0;
    shape.back() = cols * world;
    auto out = at::empty(shape, xc.options());
    uint8_t* o = static_cast<uint8_t*>(out.data_ptr());
    const int64_t row_bytes = cols * xc.element_size();
    const uint8_t* own = static_cast<const uint8_t*>(xc.data_ptr());
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t r = 0; r < world; ++r) {
        const uint8_t* from = r == rank ? own : half + r * max_bytes;
        std::memcpy(o + (i * world + r) * row_bytes, from + i * row_bytes, row_bytes);
      }
    return out;
  }
  auto out = at::empty_like(xc);
  const int64_t n = xc.numel();
  switch (xc.scalar_type()) {
    case at::kFloat: sum_slots(half, max_bytes, world, n, out.data_ptr<float>()); break;
    case at::kBFloat16: sum_slots(half, max_bytes, world, n, out.data_ptr<at::BFloat16>()); break;
    case at::kHalf: sum_slots(half, max_bytes, world, n, out.data_ptr<at::Half>()); break;
    default: TORCH_CHECK(false, "shm_collective: float32, bfloat16 or float16, got ", xc.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(carpool_cpu, m) {
  m.def("shm_collective(Tensor x, Tensor buffer, int rank, int world, int seq, int max_bytes, bool publish, float wait_s, int op) -> Tensor");
}

TORCH_LIBRARY_IMPL(carpool_cpu, CPU, m) { m.impl("shm_collective", &shm_collective); }

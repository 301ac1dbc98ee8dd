"""The few tensor sizes a step is padded to on CPU, and its fewest float32 rows (plain Python, no torch)."""

from __future__ import annotations

EXACT_SIZES_UP_TO = 16
BUCKETS_PER_OCTAVE = 8
# On an AVX2 CPU (Zen 3, one thread, measured) torch's float32 linear gives 1 to 3 rows other bits
# than the same rows among 4 to 300, which agree: where Carpool's float32 kernel (batch-invariant)
# is not built, CPU float32 steps run 4 tokens and rows at least. (With 2 threads other small
# counts differ too: a replica runs one thread per core.)
FLOAT32_MIN_ROWS = 4


def padded_size(n: int) -> int:
    """The bucket a step of ``n`` rows is padded to on CPU: ``n`` itself up to 16, then the next of
    8 evenly spaced sizes per power of two (17 → 18, 100 → 104, 500 → 512; at most 12.5 % more).

    Why: oneDNN, which runs torch's bf16 matmuls on CPU (and the brgemm kernels of its 16-bit flash
    attention), builds (JIT-compiles) and caches one primitive per shape, and its cache holds up to
    1,024 of them (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``). Unpadded, every new token count is a new
    shape for each linear layer, and a server's memory grows with each (measured over ``make
    soak``: ``docs/engine.md``, "Step padding"). Buckets bound the shapes to 56 per linear layer
    shape for a 512-token budget; the same idea as the padded batch sizes of vLLM's CUDA graphs.
    """
    if n <= EXACT_SIZES_UP_TO:
        return n
    octave = (n - 1).bit_length() - 1  # 2**octave < n <= 2**(octave + 1)
    step = max(1, (1 << octave) // BUCKETS_PER_OCTAVE)
    return -(-n // step) * step

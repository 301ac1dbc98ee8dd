"""Carpool's CPU kernels against torch's own ops: the paged decode attention against SDPA over the
gathered contexts, the prepacked linear (Carpool's bf16 kernel on AVX512-BF16, oneDNN otherwise)
against F.linear, and a row's result independent of its batch."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from replica.kernels import cpu_kernels

BUILT = cpu_kernels.load()
needs_kernels = pytest.mark.skipif(not BUILT, reason="Carpool's CPU kernels could not be built (no C++ compiler)")
# Where neither Carpool's bf16 kernel nor oneDNN computes bf16 (an AVX2-only CPU), the packed
# linear has nothing to serve (prepack_linears sends bf16 layers to Carpool's float32-accumulating
# kernel where it is built, else leaves them to F.linear).
PACKS_BF16 = BUILT and (cpu_kernels.has_bf16_gemv() or torch.ops.mkldnn._is_mkldnn_bf16_supported())
needs_bf16_packing = pytest.mark.skipif(
    not PACKS_BF16, reason="this CPU's oneDNN computes no bf16 (needs AVX512 or AVX-NE-CONVERT)"
)


def test_the_kernels_build_where_a_compiler_is():
    """A build failure would silently cost the engine its fast paths: make it a test failure."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    assert BUILT, "the kernels in replica/kernels/csrc/ failed to build (see the warning logged by cpu_kernels.load)"


@needs_kernels
def test_the_build_lives_in_a_folder_of_this_cpus_instruction_sets():
    """Built with -march=native: a cache shared by nodes of different CPUs must not hand one the
    other's build, so the build folder is named after this CPU's flags."""
    import os

    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory(cpu_kernels.NAME, verbose=False)) / cpu_kernels.build_tag()
    assert (folder / f"{cpu_kernels.NAME}.so").is_file(), sorted(os.listdir(folder.parent))


def test_the_cpu_tag_follows_the_flags_not_their_order(tmp_path, monkeypatch):
    real_path = Path

    def tag_of(flags: str) -> str:
        info = tmp_path / "cpuinfo"
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        monkeypatch.setattr(cpu_kernels, "Path", lambda p: info if str(p) == "/proc/cpuinfo" else real_path(p))
        return cpu_kernels.cpu_tag()

    avx2 = tag_of("fpu sse avx avx2 fma")
    assert tag_of("avx2 fma fpu avx sse") == avx2
    assert tag_of("fpu sse avx avx2 fma avx512f avx512bw") != avx2


def _decode_case(dtype, num_seqs=7, heads=9, kv_heads=3, dim=64, block_size=16, num_blocks=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    key_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g).to(dtype)
    lens = torch.randint(1, 70, (num_seqs,), generator=g)
    width = int(-(-lens.max() // block_size))
    tables = torch.randperm(num_blocks, generator=g)[: num_seqs * width].view(num_seqs, width)
    query = torch.randn(num_seqs, heads, dim, generator=g).to(dtype)
    key = torch.randn(num_seqs, kv_heads, dim, generator=g).to(dtype)
    value = torch.randn(num_seqs, kv_heads, dim, generator=g).to(dtype)
    last = lens - 1
    slots = tables[torch.arange(num_seqs), last // block_size] * block_size + last % block_size
    return query, key, value, key_cache, value_cache, slots, tables, lens, block_size


def _sdpa_reference(query, key, value, key_cache, value_cache, slots, tables, lens, block_size, scale):
    kc, vc = key_cache.clone(), value_cache.clone()
    kc[slots], vc[slots] = key, value
    num_seqs, width = tables.shape
    k = kc.view(-1, block_size, *kc.shape[1:])[tables].reshape(num_seqs, width * block_size, *kc.shape[1:])
    v = vc.view(-1, block_size, *vc.shape[1:])[tables].reshape(num_seqs, width * block_size, *vc.shape[1:])
    mask = (torch.arange(width * block_size)[None, :] < lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(
        query.float().unsqueeze(2), k.float().transpose(1, 2), v.float().transpose(1, 2),
        attn_mask=mask, scale=scale, enable_gqa=True,
    )
    return out.squeeze(2), kc, vc


@needs_kernels
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("dim", [64, 48])
@pytest.mark.parametrize("block_size", [16, 5, 40])
def test_decode_attention_matches_sdpa_and_writes_the_cache(dtype, tolerance, dim, block_size):
    case = _decode_case(dtype, dim=dim, block_size=block_size, num_blocks=1024 // block_size)
    query, key, value, key_cache, value_cache, slots, tables, lens, block_size = case
    scale = 1 / math.sqrt(dim)
    expected, kc, vc = _sdpa_reference(*case, scale)
    out = torch.ops.carpool_cpu.decode_attention(
        query, key, value, key_cache, value_cache, slots, tables, lens, block_size, scale
    )
    assert out.dtype == dtype and out.shape == query.shape
    assert (out.float() - expected).abs().max().item() < tolerance
    assert torch.equal(key_cache, kc) and torch.equal(value_cache, vc)


@needs_kernels
def test_decode_attention_refuses_lengths_past_the_block_tables():
    """A length longer than its table would read past it (the warm-up once built such steps)."""
    query, key, value, key_cache, value_cache, slots, tables, lens, block_size = _decode_case(torch.float32)
    too_long = lens.clone()
    too_long[0] = tables.shape[1] * block_size + 1
    with pytest.raises(RuntimeError, match="a length past its block table"):
        torch.ops.carpool_cpu.decode_attention(query, key, value, key_cache, value_cache, slots, tables, too_long, block_size, 0.125)
    with pytest.raises(RuntimeError, match="one block table row and one length per query"):
        torch.ops.carpool_cpu.decode_attention(query, key, value, key_cache, value_cache, slots, tables[1:], lens, block_size, 0.125)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 2, 48), (8, 1, 128)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("block_size", [16, 5, 40])
def test_a_query_gets_the_same_bits_alone_and_among_a_chunks_tokens(dtype, heads, kv_heads, dim, threads, block_size):
    """The engine runs a prefill chunk's tokens as decode queries, and the kernel walks a tile of
    queries through the blocks together. A token's result must not depend on its tile: the tokens
    of a 45-token chunk after 37 cached ones (two sequences, beside two decodes), computed in one
    call, give the very bits each gets in a call of its own, the way a chunk of one token or a
    decode would. One more query, of a sequence that shares only its first block with the chunk's
    and is one key longer than the chunk's last token, lands in the chunk's last tile."""
    g = torch.Generator().manual_seed(dim)
    num_blocks = 4096 // block_size
    key_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g).to(dtype)
    chunk = [(0, 37 + j + 1) for j in range(45)] + [(4, 83), (1, 60)] + [(2, 5 + j + 1) for j in range(30)] + [(3, 100)]
    width = -(-100 // block_size)
    tables_of = torch.randperm(num_blocks, generator=g)[: 5 * width].view(5, width)
    tables_of[4, 0] = tables_of[0, 0]
    rows = torch.tensor([r for r, _ in chunk])
    lens = torch.tensor([n for _, n in chunk])
    tables = tables_of[rows]
    query = torch.randn(len(chunk), heads, dim, generator=g).to(dtype)
    empty = query.new_empty(0, kv_heads, dim)
    no_slots = torch.empty(0, dtype=torch.long)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        def attend(q, t, n):
            return torch.ops.carpool_cpu.decode_attention(q, empty, empty, key_cache, value_cache, no_slots, t, n, block_size, 0.125)

        together = attend(query, tables, lens)
        for i in range(len(chunk)):
            alone = attend(query[i : i + 1], tables[i : i + 1], lens[i : i + 1])
            assert torch.equal(together[i : i + 1], alone), i
        assert torch.equal(attend(query[40:], tables[40:], lens[40:]), together[40:])  # another tiling
    finally:
        torch.set_num_threads(before)


@needs_kernels
@needs_bf16_packing
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17, 40, 300])
@pytest.mark.parametrize("shape", [(576, 1536), (575, 1537), (64, 100)])
def test_packed_linear_equals_f_linear(rows, shape):
    in_features, out_features = shape
    g = torch.Generator().manual_seed(rows)
    weight = (torch.randn(out_features, in_features, generator=g) / 10).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16()
    x = torch.randn(1, rows, in_features, generator=g).bfloat16()
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight)
    gemv = torch.ops.carpool_cpu.pack_bf16_weight(weight) if cpu_kernels.has_bf16_gemv() else None
    for b in (None, bias):
        got = torch.ops.carpool_cpu.packed_linear(x, onednn, gemv, b, out_features).float()
        expected = F.linear(x, weight, b).float()
        # Both sum in float32 and round once to bf16; the orders of their partial sums may differ,
        # so a rare output lands one bf16 step (2**-7 relative) away.
        differ = got != expected
        assert differ.float().mean().item() <= 1e-3, (rows, shape)
        assert ((got - expected).abs() <= expected.abs() * 2**-7 + 1e-6)[differ].all(), (rows, shape)


@needs_kernels
@pytest.mark.skipif(not (BUILT and cpu_kernels.has_bf16_gemv()), reason="no AVX512-BF16: oneDNN serves bf16")
@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536), (575, 100)])
def test_bf16_linear_gives_a_row_the_same_bits_in_any_batch(shape):
    """Batch invariance at its root: a row's output is bit-identical whether the step has 1 row or
    hundreds (a decode alone, batched, or a long prefill chunk). With oneDNN above 8 rows, a
    1,536-wide input (SmolLM2's MLP down projection) gave about one output in 10,000 a bf16 step
    away from the same row computed alone."""
    in_features, out_features = shape
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(out_features, in_features, generator=g) / 10).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16()
    onednn = weight.new_empty(0)  # what prepack_linears keeps when the bf16 kernel serves
    gemv = torch.ops.carpool_cpu.pack_bf16_weight(weight)
    x = torch.randn(1, 300, in_features, generator=g).bfloat16()
    alone = torch.cat([torch.ops.carpool_cpu.packed_linear(x[:, i : i + 1], onednn, gemv, bias, out_features)
                       for i in range(x.shape[1])], dim=1)
    for rows in (2, 8, 9, 15, 16, 17, 33, 300):
        batched = torch.ops.carpool_cpu.packed_linear(x[:, :rows], onednn, gemv, bias, out_features)
        assert torch.equal(batched, alone[:, :rows]), rows


@needs_kernels
@needs_bf16_packing
@pytest.mark.parametrize("rows", [0, 1, 9])
def test_packed_linear_of_no_rows_is_empty(rows):
    """A prefill chunk that samples nothing keeps no logits: the output embedding then gets
    ``[1, 0, hidden]`` (the small-batch kernel once read past it and crashed the replica)."""
    weight = torch.randn(100, 64).bfloat16()
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight)
    gemv = torch.ops.carpool_cpu.pack_bf16_weight(weight) if cpu_kernels.has_bf16_gemv() else None
    x = torch.randn(1, rows, 64).bfloat16()
    got = torch.ops.carpool_cpu.packed_linear(x, onednn, gemv, None, 100)
    assert got.shape == (1, rows, 100)
    if rows:
        assert (got.float() - F.linear(x, weight).float()).abs().max().item() < 0.1


@needs_kernels
@pytest.mark.parametrize("rows, vocab", [(1, 49152), (5, 1000), (3, 37)])
def test_argmax_rows_equals_torch(rows, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=g).bfloat16()
    logits[0, vocab // 2] = logits[0, vocab // 3] = 50.0  # a tie: the first index wins, as in torch
    assert torch.equal(torch.ops.carpool_cpu.argmax_rows(logits), logits.float().argmax(-1))


@needs_kernels
@pytest.mark.parametrize("vocab", [1, 7, 512, 513, 49152])
def test_sample_rows_is_the_inversion_of_the_softmax(vocab):
    """Each row's token is the first whose running sum of softmax(logits) (float64 here) exceeds
    u times the total; a token at -inf is never drawn, whatever u."""
    g = torch.Generator().manual_seed(vocab)
    rows = 48
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[1::3, 1::2] = float("-inf")  # banned tokens, as truncation and masks leave them
    logits[2, :] = float("-inf")
    logits[2, vocab // 2] = 0.5  # a single allowed token
    uniforms = torch.rand(rows, dtype=torch.float64, generator=g)
    uniforms[3], uniforms[4] = 0.0, 1.0 - 2**-53  # both ends of [0, 1)
    tokens = torch.ops.carpool_cpu.sample_rows(logits, uniforms)
    cumulative = logits.double().softmax(-1).cumsum(-1)
    expected = torch.searchsorted(cumulative, (uniforms * cumulative[:, -1]).unsqueeze(1), right=True).squeeze(1)
    expected = expected.clamp(max=vocab - 1)  # u * total rounding up to the total
    last_allowed = torch.where(torch.isfinite(logits), torch.arange(vocab), -1).amax(-1)
    expected[4] = last_allowed[4]  # u just below 1: the last token with mass
    assert torch.equal(tokens, expected)
    assert torch.isfinite(logits[torch.arange(rows), tokens]).all()
    assert int(tokens[2]) == vocab // 2


@needs_kernels
def test_sample_rows_gives_a_plus_infinite_logit_its_row():
    """An overflow to +inf takes the row (as the race and argmax do), never a banned token."""
    inf = float("inf")
    logits = torch.tensor([[-inf, 0.0, inf, 1.0, inf], [-inf, -inf, -inf, -inf, -inf]])
    tokens = torch.ops.carpool_cpu.sample_rows(logits, torch.tensor([0.9, 0.5], dtype=torch.float64))
    assert tokens.tolist() == [2, 0]  # the first +inf; a row with nothing allowed gives 0


@needs_kernels
def test_sample_rows_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    n = 20_000
    uniforms = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    tokens = torch.ops.carpool_cpu.sample_rows(probs.log().expand(n, 5).contiguous(), uniforms)
    counts = torch.bincount(tokens, minlength=5) / n
    assert torch.allclose(counts, probs, atol=0.015)
    assert counts[4] == 0


@needs_kernels
def test_sample_rows_refuses_bad_input():
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.carpool_cpu.sample_rows(torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="uniform per row"):
        torch.ops.carpool_cpu.sample_rows(torch.zeros(2, 4), torch.zeros(3, dtype=torch.float64))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # bf16's own attention path, and the generic one
def test_the_kernels_give_the_same_bits_on_one_and_two_threads(dtype):
    """The kernels split their loops over torch's threads (at::parallel_for, built with OpenMP):
    each thread's share and scratch must not change a bit of the result."""
    query, key, value, key_cache, value_cache, slots, tables, lens, block_size = _decode_case(dtype, num_seqs=16)
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(576, 1536, generator=g) / 10).bfloat16()
    x = torch.randn(1, 40, 1536, generator=g).bfloat16()
    gemv = torch.ops.carpool_cpu.pack_bf16_weight(weight) if cpu_kernels.has_bf16_gemv() else None
    onednn = weight.new_empty(0) if gemv is not None or not PACKS_BF16 else torch.ops.mkldnn._reorder_linear_weight(weight)
    logits = torch.randn(64, 49152, generator=g) * 3
    uniforms = torch.rand(64, dtype=torch.float64, generator=g)
    f32 = torch.ops.carpool_cpu.pack_f32_weight(weight.float()) if cpu_kernels.has_f32_gemv() else None
    bf16_panels = torch.ops.carpool_cpu.pack_f32_weight(weight) if cpu_kernels.has_f32_gemv() else None

    def run() -> list[torch.Tensor]:
        kc, vc = key_cache.clone(), value_cache.clone()
        attention = torch.ops.carpool_cpu.decode_attention(query, key, value, kc, vc, slots, tables, lens, block_size, 0.125)
        sampled = torch.ops.carpool_cpu.sample_rows(logits, uniforms)
        out = [attention, kc, vc, sampled]
        if f32 is not None:  # Carpool's float32-accumulating linear (AVX2 + FMA), both dtypes
            out.append(torch.ops.carpool_cpu.f32_linear(x.float(), f32, None, 576))
            out.append(torch.ops.carpool_cpu.f32_linear(x, bf16_panels, None, 576))
        if PACKS_BF16:  # a packed bf16 linear exists on this CPU (see needs_bf16_packing)
            out.append(torch.ops.carpool_cpu.packed_linear(x, onednn, gemv, None, 576))
        return out

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def test_a_forced_arch_builds_in_a_folder_of_its_own(monkeypatch):
    """CARPOOL_CPU_ARCH (the AVX2 paths on an AVX512 machine) never shares the native build's folder."""
    monkeypatch.delenv("CARPOOL_CPU_ARCH", raising=False)
    native = cpu_kernels.build_tag()
    assert cpu_kernels.target_arch() == "native"
    monkeypatch.setenv("CARPOOL_CPU_ARCH", "haswell")
    assert cpu_kernels.target_arch() == "haswell"
    assert cpu_kernels.build_tag() == native + "-haswell"

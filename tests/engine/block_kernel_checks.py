"""Checks of Carpool's kernels for GGUF's blocks, importable without loading the native kernels:
``tests/engine/test_quantized_gguf.py`` runs them on this CPU's build, and, in a process of its
own, on a build for another ``-march`` (:func:`forced_arch_checks`: the AVX2 paths on an AVX512
CPU; the two builds' ops would clash in one process)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replica.quant.blocks import as_eight_bit, block_linear, dequantize, pack_weight, with_zero_points
from replica.quant.gguf_blocks import split_gguf_blocks

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
# The kernels' forms beyond GGUF's types: 4-bit values with a scale and zero point per group of 96
# or 128 inputs (GPTQ, AWQ; :func:`replica.quant.blocks.with_zero_points`).
FORMS = TYPES + ["ZP_G96", "ZP_G128"]


def ggml_blocks(weight: torch.Tensor, type_name: str) -> np.ndarray:
    """``weight`` [N, K] quantized: uint8 [N, bytes] in ggml's layout of ``type_name``, by the gguf
    package (ggml's reference quantizer) where it has one, else (K-quants) by :func:`k_quant_blocks`."""
    import gguf

    if type_name.endswith("_K"):
        return k_quant_blocks(weight, type_name)
    return gguf.quants.quantize(weight.float().numpy(), gguf.GGMLQuantizationType[type_name])


def k_quant_blocks(weight: torch.Tensor, type_name: str) -> np.ndarray:
    """A plain Q4_K, Q5_K or Q6_K quantizer (round to nearest per sub-block under scales rounded to
    the super-block's 6 or 8 bits; llama.cpp's own searches for better scales, which does not
    change the layout): ``weight`` [N, K] (K a multiple of 256) -> uint8 [N, K / 256 * (144, 176
    or 210)], in the byte layout ``gguf.quants`` de-quantizes (``replica.quant.gguf_blocks`` draws it)."""
    w = weight.detach().double().reshape(-1, 256)  # super-blocks
    supers = w.shape[0]
    if type_name in ("Q4_K", "Q5_K"):
        top = 15 if type_name == "Q4_K" else 31
        sub = w.reshape(supers, 8, 32)
        low = sub.amin(-1).clamp(max=0)  # the minimum is subtracted: m >= 0
        scale = (sub.amax(-1) - low) / top
        d, dmin = (scale.amax(-1) / 63).half(), (-low).amax(-1).div(63).half()
        sc = (scale / d.double().clamp(min=1e-30)[:, None]).round().clamp(0, 63).to(torch.uint8)
        m = (-low / dmin.double().clamp(min=1e-30)[:, None]).round().clamp(0, 63).to(torch.uint8)
        step = (d.double()[:, None] * sc.double()).clamp(min=1e-30)
        q = ((sub + (dmin.double()[:, None] * m.double())[..., None]) / step[..., None]).round().clamp(0, top).to(torch.uint8)
        packed_scales = torch.cat([
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6), (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4),
        ], dim=1)
        high = [sum(((q[:, s] >> 4) & 1) << s for s in range(8)).to(torch.uint8)] if top == 31 else []  # bit s of qh[i]: element 32s + i
        low4 = (q & 0x0F).reshape(supers, 4, 2, 32)
        body = [d.view(torch.uint8).reshape(supers, 2), dmin.view(torch.uint8).reshape(supers, 2), packed_scales,
                *high, (low4[:, :, 0] | (low4[:, :, 1] << 4)).reshape(supers, 128)]
    else:
        sub = w.reshape(supers, 16, 16)
        scale = sub.abs().amax(-1) / 32
        d = (scale.abs().amax(-1) / 127).half()
        sc = (scale / d.double().clamp(min=1e-30)[:, None]).round().clamp(-128, 127).to(torch.int8)
        step = (d.double()[:, None] * sc.double()).clamp(min=1e-30)
        q = ((sub / step[..., None]).round().clamp(-32, 31) + 32).to(torch.uint8).reshape(supers, 2, 128)  # [s, h, r]
        low, high = q & 0x0F, q >> 4
        ql = low[..., :64] | (low[..., 64:] << 4)  # nibble r // 64 of ql[64h + r % 64]
        qh = high[..., :32] | (high[..., 32:64] << 2) | (high[..., 64:96] << 4) | (high[..., 96:] << 6)  # bits 2 (r // 32) of qh[32h + r % 32]
        body = [ql.reshape(supers, 128), qh.reshape(supers, 64), sc.view(torch.uint8), d.view(torch.uint8).reshape(supers, 2)]
    return torch.cat(body, dim=1).reshape(weight.shape[0], -1).numpy()


def check_block_kernel(type_name: str, dtype: torch.dtype) -> None:
    """40 outputs (two full groups of 16 and a padded one), K = 96 (K-quants: 512), with a bias;
    against the de-quantized weights in float64, up to the output's rounding (bf16), or float32
    sums; every row alone is bit-equal to the same row in batches of 2 to 37 rows (row blocks of 8
    on AVX512 and 4 on AVX2, full and partial)."""
    torch.manual_seed(1)
    k = 512 if type_name.endswith("_K") else 384 if type_name.startswith("ZP_") else 96
    weight = _weight(type_name, k)
    packed = pack_weight(weight)
    bias = torch.randn(40).to(dtype)
    x = torch.randn(37, k).to(dtype)

    def run(rows: torch.Tensor) -> torch.Tensor:
        return block_linear(rows, packed, bias, 40, weight.offset, weight.bits)

    y = run(x)
    assert y.dtype == dtype
    expected = x.double() @ dequantize(weight).double().T + bias.double()
    tolerance = dict(rtol=2**-8, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(y.double(), expected, **tolerance)
    alone = torch.cat([run(x[i : i + 1]) for i in range(37)])
    for rows in (2, 3, 4, 5, 8, 9, 17, 37):
        assert torch.equal(run(x[:rows]), alone[:rows]), rows
    assert run(x[:0]).shape == (0, 40)
    if type_name == "Q5_0":  # the 8-bit kernel on the same values (what AVX2 builds run it on)
        eight = as_eight_bit(weight)
        assert eight.bits == 8 and torch.equal(dequantize(eight), dequantize(weight))
        torch.testing.assert_close(block_linear(x, pack_weight(eight), bias, 40, 128, 8).double(), expected, **tolerance)
    with pytest.raises(RuntimeError, match="do not match the packed weight"):
        run(x[:, :0])  # rows without features: not this weight's K
    if weight.bits == 8:  # a weight of no inputs: each output is its bias
        y0 = torch.ops.carpool_cpu.q8_linear(x[:, :0], torch.zeros(3, 0, 16, 16, 2, dtype=torch.uint8), torch.zeros(3, 0, 16).half(), bias, 40)
    else:
        y0 = torch.ops.carpool_cpu.q4_linear(x[:, :0], torch.zeros(3, 0, 8, 16, 2, dtype=torch.uint8), torch.zeros(3, 0, 16).half(), None, bias, 40, 8)
    assert torch.equal(y0, bias.expand(37, 40))
    with pytest.raises(RuntimeError, match="kernel for x of Half"):
        run(x.half())


def _weight(form: str, k: int):
    """40 rows of ``k`` random weights in ``form`` (:data:`FORMS`)."""
    if form.startswith("ZP_G"):
        group = int(form[4:])
        q = torch.randint(0, 16, (40, k), dtype=torch.uint8)
        scales = (torch.rand(40, k // group) * 0.05 + 1e-3).half()
        return with_zero_points(q, scales, torch.randint(0, 16, scales.shape, dtype=torch.uint8), group)
    return split_gguf_blocks(torch.from_numpy(ggml_blocks(torch.randn(40, k), form)), form)


def forced_arch_checks(arch: str) -> None:
    """Build the block kernels alone for ``arch`` (cached beside the native build) and run
    :func:`check_block_kernel` on every type and both dtypes."""
    from torch.utils.cpp_extension import load

    from replica.config.engine_config import cache_dir
    from replica.kernels import cpu_kernels

    source = cpu_kernels.SOURCE.parent
    build = cache_dir() / "torch_extensions" / "carpool_block_kernels" / f"{cpu_kernels.build_tag()}-{arch}"
    build.mkdir(parents=True, exist_ok=True)
    with cpu_kernels.build_lock(build):
        load(
            name=f"carpool_block_kernels_{arch}", sources=[str(source / "cpu_linear_q4.cpp"), str(source / "cpu_linear_q8.cpp")],
            build_directory=str(build), extra_cflags=["-O3", f"-march={arch}", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False,
        )
    checked = 0
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.ops.carpool_cpu.has_q4_gemv(dtype) and torch.ops.carpool_cpu.has_q8_gemv(dtype)
        for type_name in FORMS:
            check_block_kernel(type_name, dtype)
            checked += 1
    print(f"checked {checked}")

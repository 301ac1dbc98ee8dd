"""Checks of Carpool's kernels for GGUF's blocks, importable without loading the native kernels:
``tests/engine/test_quantized_gguf.py`` runs them on this CPU's build, and, in a process of its
own, on a build for another ``-march`` (:func:`forced_arch_checks`: the AVX2 paths on an AVX512
CPU; the two builds' ops would clash in one process)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replica.quant.blocks import block_linear, dequantize, pack_weight, split_gguf_blocks

TYPES = ["Q4_0", "Q4_1", "Q8_0"]


def ggml_blocks(weight: torch.Tensor, type_name: str) -> np.ndarray:
    """``weight`` [N, K] quantized by the gguf package (ggml's reference quantizer): uint8 [N, bytes]."""
    import gguf

    return gguf.quants.quantize(weight.float().numpy(), gguf.GGMLQuantizationType[type_name])


def check_block_kernel(type_name: str, dtype: torch.dtype) -> None:
    """40 outputs (two full groups of 16 and a padded one), K = 96, with a bias; against the
    de-quantized weights in float64, up to the output's rounding (bf16), or float32 sums; every row
    alone is bit-equal to the same row in batches of 2 to 37 rows (row blocks of 8 on AVX512 and 4
    on AVX2, full and partial)."""
    torch.manual_seed(1)
    weight = split_gguf_blocks(torch.from_numpy(ggml_blocks(torch.randn(40, 96), type_name)), type_name)
    packed = pack_weight(weight)
    bias = torch.randn(40).to(dtype)
    x = torch.randn(37, 96).to(dtype)

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
    with pytest.raises(RuntimeError, match="do not match the packed weight"):
        run(x[:, :0])  # rows without features: not this weight's K
    with pytest.raises(RuntimeError, match="kernel for x of Half"):
        run(x.half())


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
        for type_name in TYPES:
            check_block_kernel(type_name, dtype)
            checked += 1
    print(f"checked {checked}")

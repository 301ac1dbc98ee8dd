"""``dtype`` settings: names, and what ``auto`` becomes on this machine's CPU."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from replica.config.engine_config import EngineConfig
from replica.worker.model_loader import resolve_dtype


def cpu_flags() -> set[str]:
    """The flags of the first CPU in /proc/cpuinfo (Linux x86 only)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.parametrize(
    "name, dtype",
    [("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("float16", torch.float16), ("half", torch.float16),
     ("float32", torch.float32), ("fp32", torch.float32)],
)
def test_named_dtypes_are_taken_as_named_on_any_device(name, dtype):
    assert resolve_dtype(name, "cpu") == dtype
    assert resolve_dtype(name, "cuda") == dtype  # no CUDA needed: a named dtype is not checked against it


def test_unknown_dtype_is_refused_by_name():
    with pytest.raises(ValidationError, match="dtype must be one of"):
        EngineConfig(dtype="int8")
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("float64", "cpu")


@pytest.mark.skipif(
    not (platform.system() == "Linux" and platform.machine() == "x86_64"), reason="reads x86 flags from /proc/cpuinfo"
)
def test_auto_on_cpu_is_bfloat16_where_onednn_or_carpools_kernel_computes_it():
    """bfloat16 where oneDNN computes it (AVX512 BW, VL and DQ, or AVX-NE-CONVERT), or where
    Carpool's float32-accumulating linear kernel builds (AVX2 and FMA), which takes bf16 weights
    in place of torch's emulated bf16 matmuls; float32 elsewhere."""
    from replica.kernels import cpu_kernels

    flags = cpu_flags()
    native = {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
    kernel = {"avx2", "fma"} <= flags and cpu_kernels.load()
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if native or kernel else torch.float32), sorted(flags)


def test_auto_on_cpu_without_onednn_bf16_takes_bfloat16_only_with_carpools_kernel(monkeypatch):
    """The order of the CPU choice, on a torch without oneDNN (what an AVX2-only CPU looks like to
    the first test): Carpool's kernel built with AVX2 and FMA gives bfloat16; no kernel, float32."""
    from replica.kernels import cpu_kernels

    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    built = cpu_kernels.load() and cpu_kernels.has_f32_gemv()
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if built else torch.float32)
    monkeypatch.setitem(cpu_kernels._state, "ok", False)  # as where no compiler could build it
    assert resolve_dtype("auto", "cpu") == torch.float32


def test_auto_on_a_device_neither_cuda_nor_cpu_is_float32_without_building_cpu_kernels(monkeypatch):
    from replica.kernels import cpu_kernels

    def no_build(*args, **kwargs):
        raise AssertionError("resolve_dtype built CPU kernels for a non-CPU device")

    monkeypatch.setattr(cpu_kernels, "load", no_build)
    assert resolve_dtype("auto", "meta") == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_auto_on_cuda_without_cuda_says_so():
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_dtype("auto", "cuda")

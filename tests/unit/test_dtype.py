"""``dtype`` settings: names, and what ``auto`` becomes on this machine's CPU."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from replica.config import EngineConfig
from replica.model_loader import resolve_dtype


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
def test_auto_on_cpu_is_bfloat16_only_where_the_cpu_computes_it():
    """bfloat16 needs AVX512 (BW, VL and DQ) or AVX-NE-CONVERT for oneDNN to compute it; on an
    AVX2-only CPU torch emulates it (about 9x slower than float32 here), so auto is float32."""
    flags = cpu_flags()
    native = {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32), sorted(flags)

"""What a non-editable install (the deploy image's ``pip install .``) carries besides modules."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_the_wheel_carries_the_kernel_sources_and_templates(tmp_path):
    """Carpool's CPU kernels are built from their C++ sources on first use, so a wheel without
    them (package data the build leaves out unless listed) runs every CPU replica on the slower
    fallback paths; the tool template is read at start."""
    from replica.kernels.cpu_kernels import SOURCES

    source = tmp_path / "src"  # a copy, so that the build writes nothing into the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in ("cluster", "replica", "router"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(source)],
        check=True, capture_output=True, timeout=170,
    )
    [wheel] = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for source in SOURCES:
        assert f"replica/kernels/csrc/{source.name}" in names
    assert "router/request/templates/chatml_tools.jinja" in names
    assert "cluster/bench/__init__.py" in names

"""``replica.kernels.cpu_kernels.build_lock``: a builder killed mid-build no longer hangs every later start.

torch's extension loader marks a build with a ``lock`` file and waits for it without a timeout;
these tests stand in for builders with subprocesses that hold the lock (no compiler runs).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from replica.kernels.cpu_kernels import build_lock

ROOT = Path(__file__).resolve().parents[2]
BUILDER = """
import sys, time
from pathlib import Path
from replica.kernels.cpu_kernels import build_lock
directory, hold_s = sys.argv[1], float(sys.argv[2])
with build_lock(directory):
    (Path(directory) / "lock").touch()  # what torch's loader does while it builds
    print("building", flush=True)
    time.sleep(hold_s)
    (Path(directory) / "lock").unlink()
"""


def start_builder(directory: Path, hold_s: float) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", BUILDER, str(directory), str(hold_s)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "building"
    return proc


def test_a_lock_left_by_a_dead_build_is_removed(tmp_path):
    (tmp_path / "lock").touch()
    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert not (tmp_path / "lock").exists()


def test_a_live_build_is_waited_for_and_its_lock_kept(tmp_path):
    builder = start_builder(tmp_path, hold_s=1.5)
    started = time.monotonic()
    with build_lock(tmp_path):
        waited = time.monotonic() - started
        assert builder.wait(timeout=10) == 0  # it finished (and removed its lock) before we got in
    assert waited > 1.0, waited


def test_a_build_killed_midway_does_not_block_the_next(tmp_path):
    builder = start_builder(tmp_path, hold_s=600)
    assert (tmp_path / "lock").exists()
    os.kill(builder.pid, signal.SIGKILL)  # as a replica killed during its first start
    builder.wait(timeout=10)
    assert (tmp_path / "lock").exists()  # what used to hang torch's loader forever
    started = time.monotonic()
    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert time.monotonic() - started < 5

"""Freed heap memory goes back to the OS (``replica.worker.heap``), on glibc, with real allocations."""

from __future__ import annotations

import os
import platform

import pytest
import torch

from replica.worker.heap import release_freed_heap, resident_bytes

TUNABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
@pytest.mark.skipif(any(name in os.environ for name in TUNABLES), reason="glibc's malloc tunables are set")
def test_freed_weights_left_inside_the_heap_are_released():
    """As after prepacking: tensors of a few MiB freed below one still in use stay resident until
    :func:`release_freed_heap`, which returns them (and touches nothing in use)."""
    # Freeing a 16 MiB block that had its own mapping raises glibc's mmap threshold to 16 MiB, so
    # the 4 MiB blocks below come from the heap, as a model's weights do after its first ones.
    big = torch.ones(16 << 20, dtype=torch.uint8)
    del big
    blocks = [torch.ones(4 << 20, dtype=torch.uint8) for _ in range(40)]  # 160 MiB, touched
    top = torch.full((4 << 20,), 7, dtype=torch.uint8)  # holds the heap's top: no automatic trim
    resident = resident_bytes()
    del blocks
    if resident_bytes() < resident - (80 << 20):
        pytest.skip("this allocator returned the freed blocks by itself: nothing left to release")
    released = release_freed_heap()
    assert released > 100  # MiB, of the 160 freed
    assert resident_bytes() < resident - (100 << 20)
    assert bool((top == 7).all())  # memory in use is untouched

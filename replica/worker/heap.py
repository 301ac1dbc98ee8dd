"""Giving freed heap memory back to the operating system after an engine's start.

Loading a model allocates each weight with ``malloc``; prepacking copies the linears and frees
the originals, and compiling the decoder builds and drops large Python structures. glibc keeps
most of what is freed inside its heap for later allocations: it only shrinks the heap from its top
(``M_TRIM_THRESHOLD``), and after a large block is freed it serves blocks up to that size from the
heap instead of their own mappings (the dynamic ``M_MMAP_THRESHOLD``). So the freed weights stay
resident. ``malloc_trim(0)`` (glibc 2.8 and later) hands every whole free page back with
``madvise(MADV_DONTNEED)``. What it gives back on SmolLM2: ``docs/engine.md`` (the heap release).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)


def resident_bytes() -> int:
    """This process's resident set size, bytes (from ``/proc/self/statm``; 0 where that is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def release_freed_heap() -> float:
    """Return the pages that ``malloc`` holds free to the OS (glibc's ``malloc_trim(0)``).

    Returns the drop in resident set size, MiB (0.0 where the C library has no ``malloc_trim``:
    musl, macOS). Nothing in use is touched, so it is safe at any time; it costs a walk over the
    heap (a few ms).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return 0.0
    before = resident_bytes()
    trim(0)
    return max(0, before - resident_bytes()) / 2**20

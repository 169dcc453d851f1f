"""glibc's malloc keeps freed tensor memory for the next forward pass instead of handing it back to the OS.

PyTorch allocates every CPU tensor with malloc. By default glibc serves a block above its mmap threshold (128 KiB
at first, raised up to 32 MiB by what is freed) with a fresh mapping and gives the free top of the heap back once it
exceeds the trim threshold (twice the mmap threshold). A forward pass frees most of its activations, so the next one
faults their pages in again, zeroed by the kernel: on the shared 2-core VM a demo-preset forward (batch 8 x 128)
took 400-4,600 minor page faults and a FeatureGate one 2,400-9,300, 15-27% of its time
(benchmarks/allocator_speed.py measures it). Fixing the mmap threshold at glibc's own upper bound and the trim
threshold above it keeps those blocks in the heap: the same forwards then take no faults.

Applied once per process by every `fcaudit` command; a library user calls `keep_freed_memory()` (or sets
MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ in the environment, which is equivalent). Left alone: other C
libraries, a malloc setting of the user's own (MALLOC_*_ variables or GLIBC_TUNABLES), and FCAUDIT_MALLOC=default.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts: blocks up to 32 MiB come from the heap and are reused
TRIM_THRESHOLD = 128 << 20  # free memory kept at the top of the heap before any is returned
MALLOC = {True: "malloc: freed memory kept", False: "malloc: as configured (glibc defaults unless set)"}
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

_applied: list[bool] = []  # once per process


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (once per process); whether they are set (by this call or an earlier one).

    False, changing nothing, off glibc, under FCAUDIT_MALLOC=default, or where the user chose malloc settings."""
    if _applied:
        return _applied[0]
    _applied.append(False)
    if (os.environ.get("FCAUDIT_MALLOC") == "default" or platform.libc_ver()[0] != "glibc"
            or any(v in os.environ for v in USER_SETTINGS) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    except (OSError, AttributeError):
        ok = False
    _applied[0] = ok
    return ok

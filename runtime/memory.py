"""Keeping freed batch memory for the next batch (glibc malloc settings).

A batch returned by ``Archive.__getitems__`` is a fresh allocation, since the
caller may keep it. With glibc's defaults an allocation of a few tens of MB is
served by ``mmap`` and given back on free, so every batch pays first-touch page
faults (about 1 GB/s on the build machine: 3 ms per 28 MB ESC-50 batch, half
the DataLoader path's time). Raising the mmap threshold to its 32 MiB maximum
and the trim threshold lets freed batches be reused instead. This changes the
process's malloc behaviour; set ``DLOP_MALLOC_TUNING=0`` to leave it alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest accepted value on 64-bit
TRIM_THRESHOLD_BYTES = 512 << 20

_applied: bool | None = None


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The process's C library, or None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def keep_batch_memory() -> bool:
    """Applies the settings once per process; True when glibc accepted them."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    if not sys.platform.startswith("linux") or os.environ.get("DLOP_MALLOC_TUNING") == "0":
        return False
    mallopt = getattr(libc(), "mallopt", None)
    if mallopt is None:  # no C library to load, or not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok: bool = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    trimmed: bool = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    return ok and trimmed

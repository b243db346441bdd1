"""Keeping freed memory in the process for its next use (glibc malloc's thresholds).

Both halves of dlop turn memory over in blocks of one to tens of MB: a
compiling process frees each group of decoded clips, their padded copies,
frames, spectra and mel rows once the group's features are stored; the
runtime's ``Archive.__getitems__`` returns a fresh batch each time, since the
caller may keep it. With glibc's defaults such blocks are served by ``mmap``
at first, and a heap's freed top goes back to the kernel once it passes a
threshold that follows the largest block seen, so each group or batch faults
its pages in afresh (a one-worker compile of 2,000 ESC-50 clips took about 180
page faults per clip, 1.1 s of its 3.7 s in the kernel; the DataLoader path
paid 3 ms per 28 MB batch, half its time).

keep_freed_memory() sets both thresholds once per process: blocks below
MMAP_BELOW come from the heap, and up to KEEP_BYTES of freed heap stays with
the process, which then reuses the same pages. glibc has no way back to its
adaptive thresholds, so the setting outlives the compile or loader that made
it; keeping up to KEEP_BYTES that the process no longer uses is its cost.
``DLOP_MALLOC_TUNING=0`` in the environment leaves malloc alone, as does an
environment that sets malloc's thresholds itself (MALLOC_TRIM_THRESHOLD_,
MALLOC_MMAP_THRESHOLD_, MALLOC_TOP_PAD_, MALLOC_MMAP_MAX_, or the same
glibc.malloc tunables in GLIBC_TUNABLES), and a C library other than glibc.
An allocator preloaded in glibc's place (jemalloc, tcmalloc) keeps its own
behaviour whatever mallopt reports.
"""

from __future__ import annotations

import ctypes
import functools
import os

MMAP_BELOW = 32 << 20  # glibc's largest accepted mmap threshold on 64-bit systems
KEEP_BYTES = 512 << 20  # freed heap kept (M_TRIM_THRESHOLD)
OPT_OUT = "DLOP_MALLOC_TUNING"  # "0": leave malloc alone

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# What the environment may set of the same thresholds: glibc's variables and tunables
_USER_SETTINGS = (
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
)
_USER_TUNABLES = ("trim_threshold", "mmap_threshold", "top_pad", "mmap_max")


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The process's C library (``errno`` kept for ``ctypes.get_errno``), or None where
    it cannot be loaded: the symbols the process has loaded (``dlopen(NULL)``), which hold
    the C library's on Linux and macOS. Not ``ctypes.util.find_library("c")``: on Linux it
    runs ``ldconfig -p``, about 20 ms in each compile worker that asked first."""
    try:
        return ctypes.CDLL(None, use_errno=True)
    except (OSError, TypeError):  # TypeError: Windows wants a name
        return None


def is_glibc() -> bool:
    """Whether this process runs on the GNU C library."""
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (AttributeError, ValueError, OSError):  # no confstr, or not a GNU C library
        return False


def left_alone() -> bool:
    """Whether the environment asks dlop to leave malloc alone, or sets it itself."""
    if os.environ.get(OPT_OUT, "").strip() == "0":
        return True
    if any(v in os.environ for v in _USER_SETTINGS):
        return True
    tunables = os.environ.get("GLIBC_TUNABLES", "").replace(":", "=").split("=")
    return any(f"glibc.malloc.{t}" in tunables for t in _USER_TUNABLES)


@functools.cache
def keep_freed_memory() -> bool:
    """Applies the thresholds once per process; returns whether they are in force."""
    mallopt = getattr(libc(), "mallopt", None) if is_glibc() and not left_alone() else None
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success. Either call freezes glibc's adaptive thresholds, so
    # the mmap threshold goes first: where it is refused (a 32-bit system), the trim
    # threshold is never set and malloc stays as it was.
    mapped: int = mallopt(_M_MMAP_THRESHOLD, MMAP_BELOW)
    return mapped == 1 and int(mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES)) == 1

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
import errno
import functools
import math
import mmap
import os
import sys

import torch

from .errors import LoaderError

_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in at once
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest accepted value on 64-bit
TRIM_THRESHOLD_BYTES = 512 << 20

_applied: bool | None = None


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The process's C library (``errno`` kept for ``ctypes.get_errno``), or None where
    it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
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


def shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor in shared memory, its pages faulted in at once.

    A DataLoader worker's batch goes to the main process through shared
    memory: a tensor already there is sent as a handle instead of being
    copied into a fresh segment. Faulting the pages in at once (``populate``)
    costs far less than a fault per page as the gather first writes them, and
    finds out now, rather than by SIGBUS in the gather, when ``/dev/shm``
    cannot hold them: that raises ``LoaderError``.
    """
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    flat = shared_buffer(nbytes)
    if flat is None:
        raise LoaderError(
            f"/dev/shm has no room for a batch buffer of {nbytes} bytes ({list(shape)} "
            f"{dtype}) in shared memory; give the workers fewer buffers to keep "
            "(IterableArchive worker_buffers=, DataLoader prefetch_factor=), keep fewer "
            "batches in the training loop, or enlarge /dev/shm (docker run --shm-size=...)"
        )
    return flat.view(dtype).view(shape)


def populate(t: torch.Tensor) -> bool:
    """Faults a contiguous tensor's whole pages in at once; False when the system had no
    page to give (a full ``/dev/shm``), where a later write would kill the process with
    SIGBUS. True where the kernel lacks ``MADV_POPULATE_WRITE`` (nothing is known)."""
    madvise = getattr(libc(), "madvise", None)
    nbytes = t.numel() * t.element_size()
    start = -(-t.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (t.data_ptr() + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if madvise is None or end <= start:
        return True
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    if madvise(start, end - start, _MADV_POPULATE_WRITE) == 0:
        return True
    return ctypes.get_errno() not in (errno.EFAULT, errno.ENOMEM, errno.ENOSPC)


def shared_buffer(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` of shared memory (flat uint8), its pages faulted in now; None when the
    system cannot hold them (see ``populate``)."""
    storage = torch.UntypedStorage._new_shared(max(nbytes, 1))  # type: ignore[no-untyped-call]  # unannotated in torch
    t = torch.empty(0, dtype=torch.uint8).set_(storage)[:nbytes]
    return t if populate(t) else None

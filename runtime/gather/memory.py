"""The runtime's memory helpers: shared-memory batch buffers faulted in at once.

Keeping freed batches for the next one (glibc's malloc thresholds) and loading the
C library are dlop.formats.heap's, which the compiler shares.
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap

import torch

from dlop.formats.heap import libc

from ..errors import LoaderError

_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in at once


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

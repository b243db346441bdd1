"""Copies on a few threads, for gathers running off the main thread.

torch's OpenMP-parallel kernels (index_select, copy_) are an order of
magnitude slower when called from a background thread (measured on the 2-core
build machine: 13k vs 168k ESC-50 rows/s): the calling thread starts its own
OpenMP team, which fights the main thread's spinning one for the cores. A
thread that sets ``torch.set_num_threads(1)`` (a per-thread setting under
OpenMP) runs the kernels serially at full speed, and they release the GIL. So
the copier's threads run single-threaded torch kernels on shares of a batch
(``parallel``: 134k rows/s on two threads against 105k for the main thread's
OpenMP index_select), and byte runs with libc ``memcpy`` through ctypes
(``copy``), which also releases the GIL.

Addresses are computed only from offsets and shapes that ``dlop.formats``
validated when the shard was opened, and from buffers this process allocated.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import itertools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch


def _libc_functions() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """glibc's memcpy and memset (they release the GIL when called through CDLL).

    memcpy, not memmove: sources are archive mappings and destinations are this
    process's own buffers, which never overlap. On the build machine libc memcpy
    copies 110 KB rows at 13.4 GB/s per thread against 10.9 for ctypes.memmove.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        memcpy, memset = libc.memcpy, libc.memset
        memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        memcpy.restype = memset.restype = ctypes.c_void_p
        return memcpy, memset
    except (OSError, AttributeError):
        return ctypes.memmove, ctypes.memset


_memmove, _memset = _libc_functions()


_PARALLEL_MIN_BYTES = 1 << 20  # below this, one thread: handing work over costs more


def _copy_runs(dst: list[int], src: list[int], nbytes: list[int]) -> None:
    for d, s, n in zip(dst, src, nbytes, strict=True):
        _memmove(d, s, n)


def _call_all(jobs: list[Callable[[], object]]) -> None:
    for job in jobs:
        job()


def _zero_runs(dst: list[int], nbytes: list[int]) -> None:
    for d, n in zip(dst, nbytes, strict=True):
        _memset(d, 0, n)


class _Helper(threading.Thread):
    """A persistent copy thread: one job at a time, handed over with two semaphores."""

    def __init__(self) -> None:
        super().__init__(name="dlop-copy", daemon=True)
        self.job: Callable[[], object] | None = None
        self.error: BaseException | None = None
        self.go = threading.Semaphore(0)
        self.done = threading.Semaphore(0)
        self.start()

    def run(self) -> None:
        torch.set_num_threads(1)  # this thread only: serial kernels, no OpenMP team
        while True:
            self.go.acquire()
            if self.job is None:
                return
            try:
                self.job()
            except BaseException as e:
                self.error = e
            self.done.release()

    def submit(self, job: Callable[[], object]) -> None:
        self.job = job
        self.go.release()

    def wait(self) -> None:
        self.done.acquire()
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def stop(self) -> None:
        self.job = None
        self.go.release()


class Copier:
    """Copies lists of (dst, src, nbytes) runs using ``threads`` threads, the caller's included."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = max(1, threads or min(2, os.cpu_count() or 1))
        self.helpers: list[_Helper] = []
        self.lock = threading.Lock()  # one batch at a time uses the helpers
        self._collected: list[list[Callable[[], object]]] | None = None

    def copy(self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> None:
        """memcpy(dst[i], src[i], nbytes[i]) for all i; int64 arrays of addresses and sizes."""
        self._spread(_copy_runs, dst, src, nbytes)

    def zero(self, dst: np.ndarray, nbytes: np.ndarray) -> None:
        keep = nbytes > 0
        self._spread(_zero_runs, dst[keep], nbytes[keep])

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Within the block, ``parallel`` only collects jobs; they run at its end, the
        i-th job of every call on thread i, so a batch of several fields meets one
        barrier rather than one per field."""
        if self._collected is not None:  # already collecting: the outer block runs them
            yield
            return
        self._collected = [[] for _ in range(self.threads)]
        try:
            yield
            parts = [p for p in self._collected if p]
        finally:
            self._collected = None
        self.parallel([functools.partial(_call_all, p) for p in parts])

    def parallel(self, jobs: list[Callable[[], object]]) -> None:
        """Runs up to ``threads`` jobs at once: the first on the calling thread, the rest on helpers.

        The calling thread should have set ``torch.set_num_threads(1)`` if the
        jobs run torch kernels (the Loader's gather thread does).
        """
        if len(jobs) > self.threads:
            raise ValueError(f"{len(jobs)} jobs for {self.threads} threads")
        if self._collected is not None:
            for part, job in zip(self._collected, jobs, strict=False):
                part.append(job)
            return
        if len(jobs) <= 1:
            for job in jobs:
                job()
            return
        with self.lock:
            while len(self.helpers) < self.threads - 1:
                self.helpers.append(_Helper())
            used = []
            for helper, job in zip(self.helpers, jobs[1:], strict=False):
                helper.submit(job)
                used.append(helper)
            try:
                jobs[0]()
            finally:
                for helper in used:
                    helper.wait()

    def _spread(self, fn: Callable[..., object], *columns: np.ndarray) -> None:
        """fn over the rows of ``columns``, split into up to ``threads`` shares balanced by
        bytes (the last column); small totals stay in one share, as handing over costs more."""
        n = len(columns[0])
        if n == 0:
            return
        lists = [c.tolist() for c in columns]
        total = int(columns[-1].sum())
        bounds = [0, n]
        if self.threads > 1 and n > 1 and total >= _PARALLEL_MIN_BYTES:
            weights = np.cumsum(columns[-1])
            cuts = np.searchsorted(weights, total * np.arange(1, self.threads) / self.threads)
            bounds = [0, *cuts.tolist(), n]
        self.parallel(
            [
                functools.partial(fn, *(col[a:b] for col in lists))
                for a, b in itertools.pairwise(bounds)
                if b > a
            ]
        )

    def close(self) -> None:
        """Stops the helpers and waits for them: a helper still exiting (and running
        torch's per-thread teardown) while the interpreter shuts down can abort it."""
        with self.lock:
            for helper in self.helpers:
                helper.stop()
            for helper in self.helpers:
                if helper is not threading.current_thread():
                    helper.join(timeout=10)
            self.helpers.clear()

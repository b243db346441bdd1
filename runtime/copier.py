"""Copies on a few threads, for batch gathers.

Two ways of copying, chosen per process:

- The compiled copier (``runtime/_copy.c``, built at install when a C compiler
  is present): one call copies a list of byte runs without the GIL, and can
  write with non-temporal stores (``streaming``). A batch buffer that has
  left the cache costs a read of every line before it is overwritten; stores
  that go around the cache skip that read. On the build machine a gather into
  rotating batch-sized buffers runs at 0.7-0.8x of one into a single reused,
  cache-warm buffer with ordinary stores, and at 1.0-1.07x with streaming
  stores. ``DLOP_NATIVE_COPY=0`` turns the compiled copier off.
- Without it, torch kernels and libc ``memcpy`` through ctypes. torch's
  OpenMP-parallel kernels (index_select, copy_) are an order of magnitude
  slower when called from a background thread (13k vs 168k ESC-50 rows/s on
  the build machine): the calling thread starts its own OpenMP team, which
  fights the main thread's spinning one for the cores. A thread that sets
  ``torch.set_num_threads(1)`` (a per-thread setting under OpenMP) runs them
  serially at full speed, and they release the GIL, so the copier's threads
  run single-threaded kernels on shares of a batch (``parallel``).

Addresses are computed only from offsets and shapes that ``dlop.formats``
validated when the shard was opened, from indices checked against the shard,
and from buffers this process allocated.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import importlib
import itertools
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import numpy as np
import torch

from .memory import libc


def _libc_functions() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """glibc's memcpy and memset (they release the GIL when called through CDLL).

    memcpy, not memmove: sources are archive mappings and destinations are this
    process's own buffers, which never overlap. On the build machine libc memcpy
    copies 110 KB rows at 13.4 GB/s per thread against 10.9 for ctypes.memmove.
    """
    lib = libc()
    try:
        memcpy, memset = lib.memcpy, lib.memset  # type: ignore[union-attr]
        memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        memcpy.restype = memset.restype = ctypes.c_void_p
        return memcpy, memset
    except AttributeError:  # no C library loaded
        return ctypes.memmove, ctypes.memset


_memmove, _memset = _libc_functions()

_compiled: ModuleType | None
try:
    _compiled = importlib.import_module("._copy", __package__)
except ImportError:  # built without a C compiler: the torch/ctypes paths serve
    _compiled = None


def native() -> ModuleType | None:
    """The compiled copier, or None when it was not built or ``DLOP_NATIVE_COPY=0``."""
    if _compiled is None or os.environ.get("DLOP_NATIVE_COPY") == "0":
        return None
    return _compiled


HELPER_NICE = 5  # nice value added to copy helper threads (see _Helper)
_PARALLEL_MIN_BYTES = 1 << 20  # below this, one thread: handing work over costs more
# Smaller copies stay in cache until they are read: streaming them only costs.
_STREAMING_MIN_BYTES = 4 << 20
# A few threads reach a machine's copy bandwidth; more only compete with training.
_MAX_THREADS = 4


def default_threads() -> int:
    """Copy threads for this process: torch's intra-op thread count (1 inside
    DataLoader workers), at most ``_MAX_THREADS``."""
    return max(1, min(_MAX_THREADS, torch.get_num_threads(), os.cpu_count() or 1))


def _copy_runs(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> None:
    for d, s, n in zip(dst.tolist(), src.tolist(), nbytes.tolist(), strict=True):
        _memmove(d, s, n)


def _native_runs(
    lib: ModuleType, streaming: bool, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray
) -> None:
    lib.copy_runs(dst.ctypes.data, src.ctypes.data, nbytes.ctypes.data, len(dst), streaming)


def _native_rows(
    lib: ModuleType,
    streaming: bool,
    dst: int,
    src: int,
    rows: np.ndarray,
    row_bytes: int,
    num_rows: int,
) -> None:
    # ``rows`` travels as the array, not its address, so it outlives a queued job.
    lib.copy_rows(dst, src, rows.ctypes.data, len(rows), row_bytes, num_rows, streaming)


def _call_all(jobs: list[Callable[[], object]]) -> None:
    for job in jobs:
        job()


def _zero_runs(dst: np.ndarray, nbytes: np.ndarray) -> None:
    for d, n in zip(dst.tolist(), nbytes.tolist(), strict=True):
        _memset(d, 0, n)


def _lower_priority() -> None:
    """Copies yield the CPU to the gather and training threads (see _Helper)."""
    try:
        nice = int(os.environ.get("DLOP_COPY_NICE", HELPER_NICE))
    except ValueError:
        nice = HELPER_NICE
    if nice > 0 and hasattr(os, "setpriority"):
        with contextlib.suppress(OSError):
            tid = threading.get_native_id()
            os.setpriority(
                os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice)
            )


# Every JobThread started and not yet seen to end: interpreter exit waits for them
# all (_close_all), including one whose owner was collected on that very thread.
_threads: set[JobThread] = set()
_threads_lock = threading.Lock()


def _wait_native_exit(native_id: int | None, deadline: float) -> None:
    """Polls until the native thread is gone from /proc/self/task (Linux), or ``deadline``."""
    if native_id is None or not sys.platform.startswith("linux"):
        return
    task = f"/proc/self/task/{native_id}"
    while os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.0005)


class JobThread(threading.Thread):
    """A persistent daemon thread running submitted jobs in order until ``stop``.

    torch kernels it runs are serial: ``torch.set_num_threads(1)`` holds for
    this thread only (see the module docstring). ``lower_priority`` makes it
    yield the CPU to the process's other threads (see _Helper).
    """

    def __init__(self, name: str, lower_priority: bool = False) -> None:
        super().__init__(name=name, daemon=True)
        self.jobs: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self.lower_priority = lower_priority
        self.pid = os.getpid()
        with _threads_lock:
            # Threads that ended without being waited for (their owner let go of
            # them on the thread itself) and are gone: nothing left to wait for.
            for t in [t for t in _threads if not t.is_alive() and t.pid == self.pid]:
                if t.native_id is None or not os.path.exists(f"/proc/self/task/{t.native_id}"):
                    _threads.discard(t)
            _threads.add(self)
        self.start()

    def run(self) -> None:
        torch.set_num_threads(1)
        if self.lower_priority:
            _lower_priority()
        while True:
            job = self.jobs.get()
            if job is None:
                return
            self.execute(job)
            del job  # not held (with what it refers to) while waiting for the next

    def execute(self, job: Callable[[], object]) -> None:
        job()

    def submit(self, job: Callable[[], object]) -> None:
        self.jobs.put(job)

    def stop(self, timeout: float | None = None) -> None:
        """Ends the thread after the jobs already submitted; with ``timeout``, waits
        that long for it to be gone (never when called from the thread itself)."""
        self.jobs.put(None)
        if timeout is not None and threading.current_thread() is not self:
            self.finish(timeout)

    def finish(self, timeout: float) -> None:
        """Waits until the thread has ended, down to the operating system's thread.

        ``join`` returns once the thread has let go of the interpreter, but the
        native thread still runs its thread-local destructors (torch's, OpenMP's)
        after that. An interpreter that exits meanwhile runs the libraries'
        static destructors under it, which can abort the process ("terminate
        called without an active exception"). On Linux the thread's entry in
        /proc/self/task goes when it has fully ended.
        """
        if self.pid != os.getpid():  # a forked child: the thread stayed in the parent
            return
        deadline = time.monotonic() + timeout
        self.join(timeout)
        if not self.is_alive():
            with _threads_lock:
                _threads.discard(self)
            _wait_native_exit(self.native_id, deadline)


class _Helper(JobThread):
    """A copy thread; ``wait`` returns (or raises) the outcome of the oldest job not
    yet waited for.

    Helpers run at a lower priority (``HELPER_NICE``, or ``DLOP_COPY_NICE``;
    0 keeps the process's): when the copies fill every core, the thread that
    prepares the next batch, or the training loop, still gets a core the
    moment it needs one, instead of waiting out a copy's time slice. On the
    build machine (2 cores) that took the Loader from 0.84-0.91x to
    0.92-0.93x of a bare gather.
    """

    def __init__(self) -> None:
        self.outcomes: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        super().__init__("dlop-copy", lower_priority=True)

    def execute(self, job: Callable[[], object]) -> None:
        try:
            job()
            self.outcomes.put(None)
        except BaseException as e:
            self.outcomes.put(e)

    def wait(self) -> None:
        error = self.outcomes.get()
        if error is not None:
            raise error


def _wait_all(helpers: list[_Helper]) -> None:
    """Waits for every helper, then raises the first one's error, if any."""
    errors = []
    for helper in helpers:
        try:
            helper.wait()
        except BaseException as e:
            errors.append(e)
    if errors:
        raise errors[0]


class Pending:
    """Copies running on helper threads (``Copier.start``); ``wait`` joins them once.
    Pendings of one copier are waited for in the order they were started."""

    def __init__(self, lock: Any = None, helpers: Sequence[_Helper] = ()) -> None:
        self._lock = lock  # the copier's lock, held until wait() (None: nothing started)
        self.helpers = list(helpers)

    def wait(self) -> None:
        lock, self._lock = self._lock, None
        if lock is None:
            return
        try:
            _wait_all(self.helpers)
        finally:
            lock.release()  # even when a copy failed


_live: weakref.WeakSet[Copier] = weakref.WeakSet()


class Copier:
    """Copies lists of (dst, src, nbytes) runs using ``threads`` threads, the caller's included.

    ``streaming``: write large copies around the cache (see the module
    docstring); right for buffers that are refilled after they have left the
    cache, wrong for one buffer refilled while still warm. It applies only to
    the compiled copier.
    """

    def __init__(self, threads: int | None = None, streaming: bool = False) -> None:
        self.threads = max(1, threads or default_threads())
        self.streaming = streaming
        self._reset()
        _live.add(self)

    def _reset(self) -> None:
        self.helpers: list[_Helper] = []
        # One thread at a time uses the helpers; it may start several batches (start()).
        self.lock = threading.RLock()
        self.local = threading.local()  # per calling thread: jobs collected by batched()
        self.pid = os.getpid()

    def copy(self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> None:
        """memcpy(dst[i], src[i], nbytes[i]) for all i; arrays of addresses and sizes that
        the caller has checked (the runs must lie inside memory it owns or maps)."""
        dst, src, nbytes = (np.ascontiguousarray(a, dtype=np.int64) for a in (dst, src, nbytes))
        lib = native()
        if lib is None:
            self._spread(_copy_runs, dst, src, nbytes)
        else:
            total = int(nbytes.sum())
            job = functools.partial(_native_runs, lib, self._streams(total))
            self._spread(job, dst, src, nbytes, total=total)

    def rows(self, dst: int, src: int, rows: np.ndarray, row_bytes: int, num_rows: int) -> None:
        """Rows ``rows`` of the array at ``src`` (``num_rows`` rows of ``row_bytes``) to
        consecutive rows at ``dst``, in shares over the threads; compiled copier only.
        Every row number is checked against ``num_rows`` before it is read."""
        lib = native()
        if lib is None:
            raise RuntimeError("Copier.rows needs the compiled copier (runtime/_copy.c)")
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        total = len(rows) * row_bytes
        streaming = self._streams(total)
        bounds = self._bounds(len(rows), total)
        self.parallel(
            [
                functools.partial(
                    _native_rows,
                    lib,
                    streaming,
                    dst + a * row_bytes,
                    src,
                    rows[a:b],
                    row_bytes,
                    num_rows,
                )
                for a, b in itertools.pairwise(bounds)
                if b > a
            ]
        )

    def zero(self, dst: np.ndarray, nbytes: np.ndarray) -> None:
        keep = nbytes > 0
        self._spread(_zero_runs, dst[keep], nbytes[keep])

    @contextlib.contextmanager
    def collecting(self) -> Iterator[list[list[Callable[[], object]]]]:
        """Within the block ``parallel`` only collects jobs, the i-th job of every call
        into part i; the caller runs the parts (``batched``, ``start``). Nested
        blocks add to the outermost one's parts."""
        outer = getattr(self.local, "collected", None)
        if outer is not None:
            yield outer
            return
        collected: list[list[Callable[[], object]]] = [[] for _ in range(self.threads)]
        self.local.collected = collected
        try:
            yield collected
        finally:
            self.local.collected = None

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Collects the block's jobs and runs them at its end, so a batch of several
        fields meets one barrier rather than one per field."""
        if getattr(self.local, "collected", None) is not None:  # the outer block runs them
            yield
            return
        with self.collecting() as parts:
            yield
        self.parallel([functools.partial(_call_all, p) for p in parts if p])

    def parallel(self, jobs: list[Callable[[], object]]) -> None:
        """Runs up to ``threads`` jobs at once: the first on the calling thread, the rest on helpers.

        The calling thread should have set ``torch.set_num_threads(1)`` if the
        jobs run torch kernels (the Loader's gather thread does).
        """
        if len(jobs) > self.threads:
            raise ValueError(f"{len(jobs)} jobs for {self.threads} threads")
        collected = getattr(self.local, "collected", None)
        if collected is not None:
            for part, job in zip(collected, jobs, strict=False):
                part.append(job)
            return
        if len(jobs) <= 1:
            for job in jobs:
                job()
            return
        pending = self._start(jobs[1:])
        try:
            jobs[0]()
        finally:
            pending.wait()

    def start(self, parts: list[list[Callable[[], object]]]) -> Pending:
        """Starts collected parts on helper threads and returns at once, so the caller
        can prepare the next batch meanwhile; ``Pending.wait`` joins them. A helper
        runs what it is given in order: a batch started while the previous one is
        still copying follows it without a gap."""
        return self._start([functools.partial(_call_all, p) for p in parts if p])

    def _start(self, jobs: list[Callable[[], object]]) -> Pending:
        """Each job on a helper thread of its own. The copier's lock is held (one
        thread at a time uses the helpers) until the returned Pending is waited for."""
        if not jobs:
            return Pending()
        if self.pid != os.getpid():  # a forked child: the parent's helpers did not come along
            self._reset()
        self.lock.acquire()
        try:
            while len(self.helpers) < len(jobs):
                self.helpers.append(_Helper())
        except BaseException:
            self.lock.release()
            raise
        helpers = self.helpers[: len(jobs)]
        for helper, job in zip(helpers, jobs, strict=True):
            helper.submit(job)
        return Pending(self.lock, helpers)

    def _streams(self, total_bytes: int) -> bool:
        return self.streaming and total_bytes >= _STREAMING_MIN_BYTES

    def _bounds(self, n: int, total: int, nbytes: np.ndarray | None = None) -> list[int]:
        """Cuts of ``n`` items into up to ``threads`` consecutive shares, equal in count or,
        given each item's ``nbytes``, in bytes; one share when ``total`` bytes are too
        few to be worth handing over."""
        parts = self.threads if n > 1 and total >= _PARALLEL_MIN_BYTES else 1
        if parts == 1:
            return [0, n]
        if nbytes is None:
            return [n * i // parts for i in range(parts + 1)]
        cuts = np.searchsorted(np.cumsum(nbytes), total * np.arange(1, parts) / parts)
        return [0, *cuts.tolist(), n]

    def _spread(
        self, fn: Callable[..., object], *columns: np.ndarray, total: int | None = None
    ) -> None:
        """fn over the rows of ``columns`` in shares over the threads, balanced by bytes
        (the last column, whose sum ``total`` is when known)."""
        n = len(columns[0])
        if n == 0:
            return
        total = int(columns[-1].sum()) if total is None else total
        bounds = self._bounds(n, total, columns[-1])
        self.parallel(
            [
                functools.partial(fn, *(col[a:b] for col in columns))
                for a, b in itertools.pairwise(bounds)
                if b > a
            ]
        )

    def close(self) -> None:
        """Stops the helpers and waits for them: a helper still exiting (and running
        torch's per-thread teardown) while the interpreter shuts down can abort it."""
        if self.pid != os.getpid():
            self._reset()
            return
        with self.lock:
            for helper in self.helpers:
                helper.stop()
            for helper in self.helpers:
                if helper is not threading.current_thread():
                    helper.finish(timeout=10)
            self.helpers.clear()


@atexit.register
def _close_all() -> None:
    """At exit, copiers still open (an Archive's own) stop their helpers, then every
    runtime thread still running is stopped and waited for, so none is still
    ending while the interpreter shuts down. Registered before runtime.loader's
    hook, so it runs after it (atexit runs hooks last-in, first-out)."""
    for copier in list(_live):
        copier.close()
    with _threads_lock:
        threads = [t for t in _threads if t.pid == os.getpid()]
    for thread in threads:
        thread.stop()
    for thread in threads:
        if thread is not threading.current_thread():
            thread.finish(timeout=10)

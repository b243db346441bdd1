"""The copy engine: the one executor of copy plans (runtime.gather.plan), and owner of the copy threads.

Two ways of copying, chosen per process:

- The compiled copier (``runtime/gather/_copy.c``, built at install when a C compiler
  is present): one call copies a list of rows or byte runs without the GIL,
  with every row number checked first, and can write with non-temporal stores
  (``streaming``). A batch buffer that has left the cache costs a read of
  every line before it is overwritten; stores that go around the cache skip
  that read (docs/runtime.md gives the measured effect). ``DLOP_NATIVE_COPY=0``
  turns it off.
- Without it, a serial ``torch.index_select`` per share of rows and libc
  ``memcpy`` through ctypes. Helper threads set
  ``torch.set_num_threads(1)`` (runtime.gather.threads): torch's OpenMP-parallel
  kernels called from a second thread are an order of magnitude slower.

Work reaches helpers one way: ``start(plan)`` cuts the plan into shares, one
per helper, queues them and returns a ``Ticket`` (a small plan it copies
itself first); ``Ticket.wait()`` is the one
way to wait, and raises the first error a share met. A helper runs what it is
given in order, so a plan started while the previous one is still copying
follows it without a gap. ``run(plan)`` is ``start`` with the calling thread
taking a share itself, then waiting.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import itertools
import os
import threading
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import torch

from dlop.formats.heap import libc
from dlop.formats.reader import mapped_at

from ..errors import ShardChangedError, shard_shrank
from .plan import CopyPlan, Rows, Runs, Step
from .threads import JobThread, at_exit

PARALLEL_MIN_BYTES = 1 << 20  # below this, one share: handing work over costs more
# A plan this small is copied by the thread that starts it: waking a helper and waiting
# for it costs more than the copy.
INLINE_MAX_BYTES = 64 << 10
# Smaller plans stay in cache until they are read: streaming them only costs.
STREAMING_MIN_BYTES = 4 << 20
# A few threads reach a machine's copy bandwidth; more only compete with training.
MAX_THREADS = 4


def _libc_function() -> Callable[..., Any]:
    """glibc's memcpy (it releases the GIL when called through CDLL).
    memcpy, not memmove: sources are archive mappings or decoded values, and
    destinations this process's own buffers, which never overlap."""
    lib = libc()
    try:
        memcpy = lib.memcpy  # type: ignore[union-attr]
        memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        memcpy.restype = ctypes.c_void_p
        return memcpy
    except AttributeError:  # no C library loaded
        return ctypes.memmove


_memcpy = _libc_function()

_compiled: ModuleType | None
try:
    _compiled = importlib.import_module("._copy", __package__)
except ImportError:  # built without a C compiler: the torch/ctypes copies serve
    _compiled = None


def built() -> bool:
    """Whether the compiled copier was built at install."""
    return _compiled is not None


def compiled() -> ModuleType | None:
    """The compiled copier, or None when it was not built or ``DLOP_NATIVE_COPY=0``."""
    if _compiled is None or os.environ.get("DLOP_NATIVE_COPY") == "0":
        return None
    return _compiled


def default_threads() -> int:
    """Copy threads for this process: torch's intra-op thread count (1 inside
    DataLoader workers), at most ``MAX_THREADS``."""
    return max(1, min(MAX_THREADS, torch.get_num_threads(), os.cpu_count() or 1))


def private_copy(view: np.ndarray) -> np.ndarray:
    """``view`` (an array of a mapped shard) copied into this process's memory by the one
    copy step, so that a shard truncated under it is ShardChangedError naming the shard
    where the compiled copier runs, never SIGBUS: what Python then reads batch after
    batch is the copy. ``view`` is one contiguous run of bytes (a region of a shard)."""
    if not view.flags.c_contiguous:
        raise ValueError("private_copy copies a C-contiguous array")
    out = torch.empty(view.nbytes, dtype=torch.uint8)
    if view.nbytes:
        step = Runs(
            out,
            np.zeros(1, np.int64),
            np.array([view.ctypes.data], np.int64),
            np.array([view.nbytes], np.int64),
            (view,),
        )
        execute_step(step, streaming=False)
    return out.numpy().view(view.dtype).reshape(view.shape)


def execute_step(step: Step, streaming: bool) -> None:
    """Copies one step, with the compiled copier where it is on: a read past the end of a
    shard file that shrank under its mapping is then ShardChangedError, not SIGBUS."""
    lib = compiled()
    if lib is None:
        _execute(step, streaming, None)
        return
    try:
        _execute(step, streaming, lib)
    except lib.MappingFault as e:
        reader = mapped_at(e.address)  # set by _copy.c with every MappingFault
        if reader is not None:  # named, with its sizes, as a check before the read names it
            raise shard_shrank(reader.path, reader.mapped_span()[1], reader.mapped_size()) from None
        raise ShardChangedError(
            f"{e}; a shard file was truncated while it was read: nothing but dlop should "
            "write shards or the files in its cache (rewrite a shard as a new file, then "
            "os.replace it)"
        ) from None


def _execute(step: Step, streaming: bool, lib: ModuleType | None) -> None:
    if isinstance(step, Rows):
        if not len(step.rows):
            return
        t = step.table
        if lib is not None:  # arrays passed as addresses: the step keeps them alive
            lib.copy_rows(
                step.dst.data_ptr(),
                t.bases.ctypes.data,
                t.nums.ctypes.data,
                len(t),
                0 if step.shards is None else step.shards.ctypes.data,
                step.rows.ctypes.data,
                len(step.rows),
                t.row_bytes,
                streaming,
            )
        else:
            _index_rows(step)
    else:
        dst = step.dst_offsets + step.dst.data_ptr()
        if lib is not None:
            lib.copy_runs(
                dst.ctypes.data, step.src.ctypes.data, step.sizes.ctypes.data, len(dst), streaming
            )
        else:
            for d, s, n in zip(dst.tolist(), step.src.tolist(), step.sizes.tolist(), strict=True):
                _memcpy(d, s, n)


def _index_rows(step: Rows) -> None:
    """``Rows`` without the compiled copier: the same checks, then one
    ``torch.index_select`` per source the step reads."""
    t, rows = step.table, step.rows
    shards = np.zeros(len(rows), np.int64) if step.shards is None else step.shards
    bad = np.flatnonzero((shards < 0) | (shards >= len(t)))
    if len(bad):
        i = int(bad[0])
        raise IndexError(f"table {shards[i]} out of range 0..{len(t) - 1} (position {i})")
    bad = np.flatnonzero((rows < 0) | (rows >= t.nums[shards]))
    if len(bad):
        i, k = int(bad[0]), int(shards[bad[0]])
        raise IndexError(
            f"row {rows[i]} out of range 0..{t.nums[k] - 1} of table {k} (position {i})"
        )
    out = step.dst.view(len(rows), t.row_bytes)
    if step.shards is None or len(t) == 1:
        torch.index_select(t.sources[0], 0, torch.from_numpy(rows), out=out)
        return
    by_source = np.argsort(shards, kind="stable")
    firsts = np.flatnonzero(np.diff(shards[by_source], prepend=-1))
    for a, b in itertools.pairwise([*firsts.tolist(), len(rows)]):
        where = by_source[a:b]
        got = torch.index_select(t.sources[int(shards[where[0]])], 0, torch.from_numpy(rows[where]))
        out.index_copy_(0, torch.from_numpy(where), got)


def run_share(share: list[Step], streaming: bool) -> None:
    for step in share:
        execute_step(step, streaming)


class Ticket:
    """Shares of a started plan; ``wait`` returns once all are done, raising the
    first error one met (the others still finish first)."""

    def __init__(self, shares: int) -> None:
        self._left = shares
        self._waiting = shares  # shares no helper has begun yet
        self._errors: list[BaseException] = []
        self._cond = threading.Condition()

    def began(self) -> None:
        """A helper has begun a share (it holds the GIL until its copy call lets go of it)."""
        with self._cond:
            self._waiting -= 1
            if not self._waiting:
                self._cond.notify_all()

    def wait_begun(self, helpers: list[JobThread]) -> None:
        """Returns once every share has begun (or a helper ended without its share).

        A helper needs the GIL to begin a share: while the thread that started the plan
        runs Python (planning the next batch), the helper waits for it, and the copies
        it should overlap wait too. Waiting here hands the GIL over: the copies run
        without it while that thread plans."""
        with self._cond:
            while self._waiting and all(h.is_alive() for h in helpers):
                self._cond.wait(0.1)

    def done(self, error: BaseException | None) -> None:
        with self._cond:
            self._left -= 1
            if error is not None:
                self._errors.append(error)
            if not self._left:
                self._cond.notify_all()

    def wait(self) -> None:
        with self._cond:
            while self._left:
                self._cond.wait()
        if self._errors:
            raise self._errors[0]


def _run_and_report(ticket: Ticket, share: list[Step], streaming: bool) -> None:
    ticket.began()
    try:
        run_share(share, streaming)
    except BaseException as e:
        ticket.done(e)
    else:
        ticket.done(None)


_live: weakref.WeakSet[CopyEngine] = weakref.WeakSet()


class CopyEngine:
    """Executes copy plans on ``threads`` threads (helpers at a lower priority).

    ``streaming``: write large plans around the cache; right for buffers that
    are refilled after they have left the cache, wrong for one buffer refilled
    while still warm. It applies to the compiled copier only.
    """

    def __init__(self, threads: int | None = None, streaming: bool = False) -> None:
        self.threads = max(1, threads or default_threads())
        self.streaming = streaming
        self._helpers: list[JobThread] = []
        self._lock = threading.Lock()  # guards _helpers
        self.pid = os.getpid()  # the process that made it
        self._helpers_pid = self.pid
        _live.add(self)

    @property
    def kind(self) -> str:
        """Which copies run here, for reports: compiled (and its stores) or the fallback."""
        lib = compiled()
        what = f"compiled, {lib.STREAMING} streaming stores" if lib is not None else "torch/ctypes"
        return f"{what}, {self.threads} threads"

    def helpers(self) -> list[JobThread]:
        """The helper threads started so far (at most ``threads``)."""
        return list(self._helpers)

    def _streams(self, plan: CopyPlan) -> bool:
        return self.streaming and plan.nbytes >= STREAMING_MIN_BYTES

    def start(self, plan: CopyPlan) -> Ticket:
        """Queues the plan's shares on the helpers and returns once they have begun
        (``Ticket.wait_begun``: behind the copies queued before them); a plan below
        ``INLINE_MAX_BYTES`` is copied first, here."""
        if plan.nbytes < INLINE_MAX_BYTES:
            ticket = Ticket(1)
            _run_and_report(ticket, plan.steps, self._streams(plan))
            return ticket
        shares = plan.shares(self.threads, PARALLEL_MIN_BYTES)
        ticket, helpers = self._submit(shares, self._streams(plan))
        ticket.wait_begun(helpers)
        return ticket

    def run(self, plan: CopyPlan) -> None:
        """Executes the plan, the calling thread taking the first share; a plan below
        ``INLINE_MAX_BYTES`` all here (waking a helper costs more than its copies)."""
        if plan.nbytes < INLINE_MAX_BYTES:
            run_share(plan.steps, self._streams(plan))
            return
        shares = plan.shares(self.threads, PARALLEL_MIN_BYTES)
        if not shares:
            return
        streaming = self._streams(plan)
        ticket, _ = self._submit(shares[1:], streaming)
        try:
            run_share(shares[0], streaming)
        except BaseException:
            # The helpers' shares still finish first; this thread's own error is the one raised.
            with contextlib.suppress(BaseException):
                ticket.wait()
            raise
        ticket.wait()

    def _submit(self, shares: list[list[Step]], streaming: bool) -> tuple[Ticket, list[JobThread]]:
        """The ticket of ``shares``, queued one a helper, and the helpers that took them."""
        ticket = Ticket(len(shares))
        helpers: list[JobThread] = []
        if shares:
            # queued under the lock: a close() meanwhile stops the helpers after these jobs
            # (its stop comes behind them), never before them with the jobs left unrun
            with self._lock:
                helpers = self._ensure_helpers(len(shares))
                for helper, share in zip(helpers, shares, strict=False):
                    helper.submit(functools.partial(_run_and_report, ticket, share, streaming))
        return ticket, helpers

    def _ensure_helpers(self, count: int) -> list[JobThread]:
        """``count`` helpers, started as needed; call with ``_lock`` held."""
        if self._helpers_pid != os.getpid():  # a forked child: the parent's helpers stayed
            self._helpers, self._helpers_pid = [], os.getpid()
        while len(self._helpers) < count:
            self._helpers.append(JobThread("dlop-copy", low_priority=True))
        return self._helpers[:count]

    def close(self) -> None:
        """Stops the helpers and waits for them, down to the operating system's thread."""
        with self._lock:
            helpers, self._helpers = self._helpers, []
            if self._helpers_pid != os.getpid():
                self._helpers_pid = os.getpid()
                return
        for helper in helpers:
            helper.stop()
        for helper in helpers:
            if helper is not threading.current_thread():
                helper.finish(timeout=10)


def _close_all() -> None:
    for engine in list(_live):
        engine.close()


at_exit(_close_all)

"""The first items of a user's compile (the probe), computed where the user's code cannot
take the compile down: a process of its own that answers one item at a time. An item
that kills that process (an exit, a signal, a crash in a C library) or runs past the
item time limit (then it is killed) is answered as failed, with what happened, and the
next item goes to a new process; the compile's own process, its working directory and
its random generators are left as they were.

Where the code cannot reach another process (the driver runs threads, so its workers
come from a fork server, and the Dataset cannot be pickled), the probe runs in this
process, as a one-worker compile then does, and says so on stderr.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..corpus.records import Item
from ..errors import CompileError
from ..run import processes
from ..run.units import by_value
from .samples import SampleError
from .work import UserWork, reason, sample_leaves


@dataclass
class Answer:
    """What one item gave: ``sample`` (its structure and leaves), ``none`` (it gave None),
    ``raised`` (the user's exception, as errors.jsonl words it), ``died`` (its process
    ended or was killed: ``text`` says how) or ``bad`` (a sample no archive can hold)."""

    kind: str
    text: str = ""
    shape: dict[str, Any] = field(default_factory=dict)
    leaves: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def answer(work: UserWork, item: Item) -> Answer:
    """One item's answer, computed in this process."""
    name = work.name(item)
    begun = time.perf_counter()
    here = os.getcwd()
    try:
        with processes.time_limit(work.timeout):  # ends a guarded process, not this one
            sample = work.call(item)
    except (Exception, SystemExit) as e:  # the user's code
        return Answer("raised", f"{name}: {reason(e)}", seconds=time.perf_counter() - begun)
    finally:
        if os.getcwd() != here:  # an item that changed directory: the next starts here
            os.chdir(here)
    took = time.perf_counter() - begun
    if sample is None:
        return Answer("none", seconds=took)
    try:
        shape, leaves = sample_leaves(sample, name)
    except SampleError as e:
        return Answer("bad", str(e), seconds=took)
    return Answer("sample", shape=shape, leaves=leaves, seconds=took)


class Prober:
    """Answers items from a guarded process (or, where none can run the code, from this
    one); ``close`` ends the process."""

    def __init__(self, work: UserWork, limit: float | None) -> None:
        self.work, self.limit = work, limit
        self.ctx: Any = processes.worker_context()
        self.sent: Any = work
        self.here = False
        if self.ctx.get_start_method() != "fork":
            try:
                self.sent = by_value(work)
            except CompileError as e:
                self.here = True
                print(
                    f"dlop-compile: {e}; its first items run in this process (an item that "
                    "exits or hangs there stops the compile)",
                    file=sys.stderr,
                    flush=True,
                )
        self.proc: Any = None
        self.conn: Any = None
        self.exitcode: int | None = None
        self.answered = 0  # items the running process has answered

    def answer(self, item: Item) -> Answer:
        if self.here:
            return answer(self.work, item)
        try:
            got, took = self._asked(item)
        except processes.WorkerStartFailed:
            if not self.answered:
                raise  # its start failed: no new process would do better
            # it died idle, between items (a thread an earlier item left, the OOM
            # killer): this item was never begun, and goes to a new process
            self.close()
            got, took = self._asked(item)
        self.answered += 1
        if got is not None:
            return unspilled(got)
        self.close()  # killed when still running; the next item gets a new process
        why = processes.how_it_ended(self.exitcode, took, self.limit)
        return Answer("died", f"{self.work.name(item)}: {why}", seconds=took)

    def _asked(self, item: Item) -> tuple[Any, float]:
        if self.proc is None:
            self._start()
        with contextlib.suppress(EOFError, OSError):
            self.conn.send(item)
        return processes.answer_of(self.conn, self.limit)

    def _start(self) -> None:
        processes.check_can_start("the process that runs your code's first items")
        here, there = self.ctx.Pipe(duplex=True)
        with processes.main_module_hidden():
            self.proc = self.ctx.Process(
                target=_serve, args=(there, self.sent, os.getpid()), daemon=True
            )
            self.proc.start()
        there.close()
        self.conn, self.answered = here, 0

    def close(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            self.conn.close()
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self.exitcode = self.proc.exitcode
        self.proc = self.conn = None


def _serve(conn: Any, sent: Any, driver: int) -> None:
    """The guarded process: answers each item it is sent, until the pipe closes."""
    processes.die_with_driver(driver)
    processes.arm_item_limits()
    work = pickle.loads(sent) if isinstance(sent, bytes) else sent
    while True:
        try:
            item = conn.recv()
        except (EOFError, OSError):
            break
        conn.send(processes.STARTED)  # the item's time counts from here
        conn.send(_spilled(answer(work, item)))
    os._exit(0)  # threads an item left behind are not waited for


# Leaves this large go to the driver through a file it maps, not the pipe: a pickle would
# hold a multi-gigabyte item twice there (its bytes, then the array).
SPILL_BYTES = 1 << 20


@dataclass(frozen=True)
class _Spilled:
    offset: int
    size: int
    dtype: str | None  # None: bytes
    shape: tuple[int, ...]


def _spilled(got: Answer) -> Answer:
    """``got`` with its large leaves written to a file (``text``: the file)."""
    big = {
        name: leaf
        for name, leaf in got.leaves.items()
        if isinstance(leaf.value, np.ndarray | bytes) and _size(leaf.value) >= SPILL_BYTES
    }
    if not big:
        return got
    fd, path = tempfile.mkstemp(prefix="dlop-probe-")
    offset = 0
    with os.fdopen(fd, "wb") as f:
        for name, leaf in big.items():
            value = leaf.value
            data = value if isinstance(value, bytes) else np.ascontiguousarray(value).data
            f.write(data)
            size = _size(value)
            kind = None if isinstance(value, bytes) else value.dtype.str
            shape = () if isinstance(value, bytes) else tuple(value.shape)
            got.leaves[name] = replace(leaf, value=_Spilled(offset, size, kind, shape))
            offset += size
    return replace(got, text=path)


def _size(value: np.ndarray | bytes) -> int:
    return len(value) if isinstance(value, bytes) else int(value.nbytes)


def unspilled(got: Answer) -> Answer:
    """``got`` with its spilled leaves back, as views of the file mapped (its pages the
    file's, not this process's memory); the file is removed at once."""
    spilled = {n: lf for n, lf in got.leaves.items() if isinstance(lf.value, _Spilled)}
    if not spilled:
        return got
    with open(got.text, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    os.unlink(got.text)
    for name, leaf in spilled.items():
        at: _Spilled = leaf.value
        if at.dtype is None:
            value: Any = memoryview(mapped)[at.offset : at.offset + at.size]
        else:
            count = at.size // np.dtype(at.dtype).itemsize
            value = np.frombuffer(mapped, at.dtype, count, at.offset).reshape(at.shape)
        got.leaves[name] = replace(leaf, value=value)
    return replace(got, text="")

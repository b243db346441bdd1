"""The runtime's threads: persistent job threads, their priority, and their end at exit.

Every thread the runtime starts is a ``JobThread``: the copy engine's helpers
(runtime.gather.engine) and a prefetching Loader's producer (runtime.pipeline.prefetch).
``live_threads()`` lists those of this process not yet seen to end, and at
interpreter exit every one is stopped and waited for, down to the operating
system's thread (see ``JobThread.finish``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import sys
import threading
import time
from collections.abc import Callable

import torch

HELPER_NICE = 5  # nice value added to copy helper threads (runtime.gather.engine)

# Every JobThread started and not yet seen to end: interpreter exit waits for them
# all, including one whose owner was collected on that very thread.
_threads: set[JobThread] = set()
# Reentrant: a Loader collected while a thread holds it (the garbage collector runs
# anywhere, JobThread.__init__ included) stops its own threads, which takes it again.
_threads_lock = threading.RLock()
# Run at exit before the threads are stopped: owners close what they hold first.
_exit_hooks: list[Callable[[], None]] = []


def live_threads() -> list[JobThread]:
    """This process's runtime threads that have not been seen to end (Linux: their
    ``/proc/self/task`` entry may still be there after ``join``)."""
    with _threads_lock:
        return [t for t in _threads if t.pid == os.getpid()]


def lower_priority() -> None:
    """Lowers the calling thread's priority by ``HELPER_NICE`` (or ``DLOP_COPY_NICE``;
    0 keeps the process's), so it yields the CPU to the gather and training threads."""
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


def native_thread_gone(native_id: int | None) -> bool:
    """Whether the operating system's thread has ended (always True off Linux)."""
    if native_id is None or not sys.platform.startswith("linux"):
        return True
    return not os.path.exists(f"/proc/self/task/{native_id}")


class JobThread(threading.Thread):
    """A persistent daemon thread running submitted jobs in order until ``stop``.

    torch kernels it runs are serial: ``torch.set_num_threads(1)`` holds for
    this thread only (torch's OpenMP kernels called from a second thread fight
    the main thread's team for the cores). ``low_priority`` makes it yield the
    CPU to the process's other threads (``lower_priority``).
    """

    def __init__(self, name: str, low_priority: bool = False) -> None:
        super().__init__(name=name, daemon=True)
        self.jobs: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self.low_priority = low_priority
        self.pid = os.getpid()
        with _threads_lock:
            # Threads that ended without being waited for (their owner let go of
            # them on the thread itself) and are gone: nothing left to wait for.
            for t in [t for t in _threads if not t.is_alive() and t.pid == self.pid]:
                if native_thread_gone(t.native_id):
                    _threads.discard(t)
            _threads.add(self)
        self.start()

    def run(self) -> None:
        torch.set_num_threads(1)
        if self.low_priority:
            lower_priority()
        while True:
            job = self.jobs.get()
            if job is None:
                return
            job()
            del job  # not held (with what it refers to) while waiting for the next

    def submit(self, job: Callable[[], object]) -> None:
        self.jobs.put(job)

    def usable(self) -> bool:
        """Alive and of this process (a forked child does not inherit threads)."""
        return self.pid == os.getpid() and self.is_alive()

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
            while not native_thread_gone(self.native_id) and time.monotonic() < deadline:
                time.sleep(0.0005)


def at_exit(hook: Callable[[], None]) -> None:
    """Runs ``hook`` at interpreter exit, before the runtime's threads are stopped."""
    _exit_hooks.append(hook)


_exiting = threading.Event()


def exiting() -> bool:
    """The interpreter is exiting: the runtime's exit hooks have started."""
    return _exiting.is_set()


@atexit.register
def _stop_all() -> None:
    """Owners close first (newest first), then every runtime thread still running is
    stopped and waited for, so none is still ending while the interpreter shuts down."""
    _exiting.set()
    for hook in reversed(_exit_hooks):
        hook()
    threads = live_threads()
    for thread in threads:
        thread.stop()
    for thread in threads:
        if thread is not threading.current_thread():
            thread.finish(timeout=10)

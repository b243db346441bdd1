"""Where a local compile's worker processes come from, and starting them early.

Workers fork from the driver when it runs a single thread (they start at once, with
what the driver imported); otherwise they come from a fork server, since forking a
threaded process can copy a lock another thread holds. A fork server is a process of
its own that imports the compile's modules (torch, the decoders) before it forks
anything: about as long as the driver's own imports. ``start_fork_server`` starts
it while the driver is still importing and listing the corpus, where the workers
will come from it: an object-store SOURCE read through an asynchronous filesystem
(s3, gcs, http: it runs a thread of its own by the time the pool starts), a driver
already running threads (a notebook, a user's program), or CUDA in use. Forked
workers need no head start: a fork takes milliseconds.

Nothing here imports torch: the command line calls ``start_fork_server`` before it
loads the compile pipeline.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from dlop.formats.urls import is_url

from ..errors import CompileError

# The module the fork server imports first: it runs _init_worker and the chunks.
PIPELINE = "dlop.compiler.run.pipeline"
# What the fork server imports once, besides the pipeline, so that each compile's
# workers start with the decoders loaded instead of importing them on their first
# input (a tenth of a second or more each, every compile). Missing ones are passed over.
FORKSERVER_PRELOAD = (
    "dlop.compiler.vision.video",
    "dlop.compiler.vision.image",
    "av",
    "PIL.Image",
    "PIL.JpegImagePlugin",
    "PIL.PngImagePlugin",
)


def cuda_in_use() -> bool:
    """Whether this process has started CUDA (a user's Dataset can, when the compile first
    computes a few items here): a forked child could not use it, so workers start from
    the fork server instead."""
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    return bool(cuda is not None and cuda.is_initialized())


def local_workers(workers: int | None) -> int:
    """The worker processes of a local compile asked for ``workers`` (None: every core)."""
    return max(1, workers or os.cpu_count() or 1)


def _linux() -> bool:
    return sys.platform.startswith("linux")


def mkl_on_another_path() -> bool:
    """Whether MKL already ran in this process on another code path than the COMPATIBLE
    one a compile needs (a torch matrix product before the featurizers were imported): a
    forked worker would inherit it and refuse to featurize (numerics.require), so workers
    start from the fork server instead, whose processes take the COMPATIBLE path as they
    import."""
    if "torch" not in sys.modules:  # nothing has run MKL; and torch is not loaded for this
        return False
    from ..audio import numerics

    numerics.prefer()  # where MKL has not run yet, it takes the COMPATIBLE path now
    return numerics.mkl_mode() not in (None, "COMPATIBLE")


def _forks() -> bool:
    return (
        _linux()
        and threading.active_count() == 1
        and not cuda_in_use()
        and not mkl_on_another_path()
    )


def _forkserver() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([PIPELINE, *FORKSERVER_PRELOAD])
    return ctx


def worker_context() -> multiprocessing.context.BaseContext:
    """fork when this process runs a single thread (workers start at once, torch
    already imported); otherwise forkserver, since forking a threaded process can
    copy a lock that another thread holds. Workers use no CUDA either way, and
    forkserver too where this process's MKL is past choosing its code path."""
    return multiprocessing.get_context("fork") if _forks() else _forkserver()


def start_fork_server(source: str, workers: int | None, dask: str | None) -> bool:
    """Starts the fork server now, without waiting for its imports, where the pool of a
    compile of ``source`` on ``workers`` local processes will come from it; True if so.
    A server already running is left as it is."""
    if dask is not None or local_workers(workers) == 1 or not _linux():
        return False
    if _forks() and not _threaded_filesystem(source):
        return False
    _forkserver()
    with main_module_hidden(), _interrupts_ignored():
        multiprocessing.forkserver.ensure_running()
    return True


def _threaded_filesystem(source: str) -> bool:
    """Whether ``source`` is read through an fsspec filesystem that runs an event-loop
    thread of its own (s3, gcs, http): once it has listed the corpus, the driver runs
    two threads and the pool comes from the fork server. Synchronous ones (memory,
    hf) leave the driver single-threaded, and its workers fork."""
    if not is_url(source):
        return False
    try:
        import fsspec
        from fsspec.asyn import AsyncFileSystem

        protocol = source.split("://", 1)[0].lower()
        return issubclass(fsspec.get_filesystem_class(protocol), AsyncFileSystem)
    except (ImportError, ValueError):  # no fsspec, or no backend: the listing reports it
        return False


@contextlib.contextmanager
def _interrupts_ignored() -> Iterator[None]:
    """Ctrl-C is ignored by the fork server from its start (it inherits the setting), not
    only once its imports are done: an interrupted compile ends without a second
    traceback from a server still importing. The driver's own handler is back as soon
    as the server is spawned (a few milliseconds). Left alone off the main thread, or
    where the handler was not set from Python (it could not be put back)."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """Workers run only dlop code: keep them from re-importing the caller's __main__.

    A forkserver or spawn child re-runs the parent's main script unless it is
    guarded by ``if __name__ == "__main__"``, and fails outright for ``<stdin>``
    or notebooks. Hiding the main module's file and spec while the pool (or its
    fork server) starts avoids both.
    """
    main = sys.modules.get("__main__")
    saved: dict[str, Any] = {
        a: main.__dict__[a]
        for a in ("__file__", "__spec__")
        if main is not None and a in main.__dict__
    }
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__dict__["__spec__"] = None
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)
            if "__spec__" not in saved:
                main.__dict__.pop("__spec__", None)


def how_it_ended(exitcode: int | None, took: float, limit: float | None) -> str:
    """Why a worker process gave no answer for an input, as errors.jsonl records it: past
    the item time limit (it was killed then), killed by a signal, or exited."""
    if limit is not None and (took >= limit or exitcode == -signal.SIGALRM):
        why = f"did not finish within the item time limit of {limit:g} s; its worker was killed"
    elif exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        why = f"its worker process was killed by {name}"
    else:
        why = f"its worker process exited with status {exitcode} before the item ended"
    return why  # no times: errors.jsonl is the same bytes on every engine and machine


def die_with_driver(driver: int = 0) -> None:
    """Asks Linux to kill this worker when the driver dies (kill -9 included).

    Without it, workers of a killed compile keep decoding until their queue
    drains, holding memory and CPU that a --resume run needs. The parent of a
    forkserver's worker is the fork server, which lives as long as any of its
    workers does (each holds the server's keep-alive pipe, and its task queue's
    both ends): such a worker watches the driver's pid, or neither would ever exit.
    """
    if not sys.platform.startswith("linux"):
        return
    if driver and os.getppid() != driver:
        threading.Thread(target=_exit_with, args=(driver,), daemon=True).start()
    import ctypes

    pr_set_pdeathsig = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return  # best effort: the compile is correct either way


def _exit_with(pid: int) -> None:
    """Kills this process once process ``pid`` has exited."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        fd = -1  # gone already
    except OSError:  # no pidfd (Linux before 5.3): poll
        while _alive(pid):
            time.sleep(1.0)
        fd = -1
    if fd >= 0:
        select.select([fd], [], [])
    os.kill(os.getpid(), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process under that pid: alive
    return True


# Whether this process runs inputs for a compile it is not (a pool's worker, a guarded
# process, a Dask worker process): only there may an input's time limit end the process.
_ARMED = [False]


def arm_item_limits() -> None:
    """Lets ``time_limit`` end this process: called where a compile's inputs run in a
    process of their own, never in the compiling process."""
    _ARMED[0] = True
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGALRM, signal.SIG_DFL)


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Ends this process (SIGALRM, whose default action stops a process hung in C code
    too) when the block runs past ``seconds``; its driver then records which input it
    was. Does nothing in the compiling process itself, or with ``seconds`` None. One
    block at a time per process (the timer is the process's)."""
    if seconds is None or not _ARMED[0]:
        yield
        return
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


# How long past an input's time limit the driver waits for its process: the process's own
# timer (time_limit) ends it at the limit; this only covers a process that cannot be.
LIMIT_GRACE_S = 5.0
# How long a worker process may take to begin an input (its imports, unpickling the work)
# before it is taken for one whose start hangs: generous, since a loaded machine can take
# tens of seconds to import torch and a user's modules, but bounded.
START_LIMIT_S = 300.0
STARTED = "started"  # what a guarded process sends as it begins an input


def check_can_start(what: str) -> None:
    """Refuses, naming why, to start ``what`` (a process for a compile's inputs) from a
    daemonic process, which multiprocessing does not let start any (a DataLoader worker,
    a multiprocessing.Pool worker): its bare AssertionError named no compile."""
    if multiprocessing.current_process().daemon:
        raise CompileError(
            f"cannot start {what}: this is a daemonic process (a DataLoader or "
            "multiprocessing.Pool worker, say), which may start none; compile from the main "
            "process or a process of your own (multiprocessing.Process(daemon=False))"
        )


class WorkerStartFailed(CompileError):
    """A worker process ended, or hung, before it began an input: its start failed (an
    import, the numeric environment, the work that could not be unpickled), or it died
    idle between inputs, which is no input's fault either."""


def answer_of(conn: Any, limit: float | None) -> tuple[Any, float]:
    """(the answer a guarded process sends on ``conn`` for one input, or None when it
    ended or ran past ``limit`` + LIMIT_GRACE_S without one; the seconds since it began
    the input). Its start (imports, unpickling the work) is not counted: it sends
    STARTED first; ending, or sending nothing for START_LIMIT_S, before that raises
    WorkerStartFailed (the input was never begun)."""
    try:
        if not conn.poll(START_LIMIT_S):
            raise WorkerStartFailed(
                f"a worker process did not begin its input within {START_LIMIT_S:g} s: its "
                "start hangs (an import, or the work being unpickled); nothing is recorded "
                "against the inputs. Fix it, then run again with --resume"
            )
        first = conn.recv()
    except (EOFError, OSError):
        raise WorkerStartFailed(
            "a worker process ended before it began its input: its start failed (see the "
            "messages above); nothing is recorded against the inputs. Fix it, then run "
            "again with --resume"
        ) from None
    if first != STARTED:
        raise WorkerStartFailed(f"a worker process sent {first!r} before it began its input")
    begun = time.monotonic()
    wait = None if limit is None else limit + LIMIT_GRACE_S
    try:
        if conn.poll(wait):
            return conn.recv(), time.monotonic() - begun
    except (EOFError, OSError):
        pass
    return None, time.monotonic() - begun

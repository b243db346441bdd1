"""The runtime's errors: a call given what it cannot use, and shards changed under it.

Each also subclasses the built-in error that code catching Python's own
would expect (``ValueError``, ``TypeError``, ``IndexError``).
"""

from __future__ import annotations

import operator
import threading
import traceback

from dlop.formats import DlopError


class UsageError(DlopError, ValueError):
    """An argument or a state outside what a runtime call allows; the message names
    the argument, what arrived and what is allowed."""


class UsageTypeError(DlopError, TypeError):
    """An argument of a type a runtime call does not take."""


class SampleIndexError(DlopError, IndexError):
    """A sample number outside the archive."""


class LoaderError(DlopError):
    """A batch the Loader could not make (in its producer thread, or buffers it could
    not allocate), raised in the training loop naming the archive, batch and epoch."""


class ShardChangedError(DlopError):
    """A shard file shrank after the archive mapped it: reading its mapped pages past
    the new end would kill the process (SIGBUS), so the read is refused."""


def shard_shrank(path: object, size: int, now: int) -> ShardChangedError:
    """The error for a shard at ``path`` mapped at ``size`` bytes and ``now`` smaller."""
    return ShardChangedError(
        f"{path}: shard shrank from {size} to {now} bytes after the archive opened it; "
        "rewrite shards under a new name and os.replace them, never in place, while a "
        "job reads them"
    )


RAISED_IN = "--- raised in "


def kept(e: BaseException, note: bool = True) -> BaseException:
    """``e``, to be kept and raised later (in another thread, or by each batch that reads a
    failed shard), without its traceback or those of the errors it chains to. A traceback's
    frames hold views of mapped shards and the very objects that keep the error, and a
    cleared frame still holds its function, whose closure (a comprehension's) may hold
    the shard readers: a cycle that would keep a closed Loader's shards mapped, and their
    descriptors open, until Python's collector happens to run. Where an error that is no
    DlopError (a defect, not a failure the message explains) was raised stays readable:
    its trace is kept as a note (once), unless ``note`` is False (the caller keeps the text)."""
    seen: set[int] = set()
    todo: list[BaseException] = [e]
    while todo:
        err = todo.pop()
        if id(err) in seen:
            continue
        seen.add(id(err))
        tb = err.__traceback__
        told = any(str(n).startswith(RAISED_IN) for n in getattr(err, "__notes__", ()))
        if tb is not None and note and not told and not isinstance(err, DlopError):
            lines = "".join(traceback.format_tb(tb)).rstrip()
            err.add_note(f"{RAISED_IN}{threading.current_thread().name}:\n{lines}")
        err.__traceback__ = None
        todo.extend(x for x in (err.__cause__, err.__context__) if x is not None)
    return e


def check_int(name: str, value: object, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int (bool refused) within [low, high], or a Usage(Type)Error naming ``name``."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise UsageTypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    n = operator.index(value)
    if (low is not None and n < low) or (high is not None and n > high):
        allowed = (
            f"{low}..{high}"
            if low is not None and high is not None
            else f"at least {low}"
            if low is not None
            else f"at most {high}"
        )
        raise UsageError(f"{name} must be {allowed}, got {n}")
    return n

"""Limits of the process that reading an archive meets: every mapped shard file keeps
one open descriptor (a memory map keeps its own) and is one memory map.

An archive of more shards than the soft limit on open files allows (1024 on many
Linux machines) would fail partway through; opening it raises the soft limit toward
the hard one instead (``room_for_files``), and a file that meets it all the same
raises it again (``with_room``), as far as the hard limit lets. A limit still too
low is named, with how to raise it (``too_many_files``, ``too_many_maps``).
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from .errors import ResourceLimitError

try:
    import resource
except ImportError:  # no resource limits to read or set on this platform
    resource = None  # type: ignore[assignment]

# Descriptors kept free beside the mapped shards: sockets, the cache's lock files,
# DataLoader pipes, the interpreter's and torch's own.
SPARE_FILES = 256
# The errors of a descriptor table that is full: this process's, or the system's.
FILE_LIMITS = (errno.EMFILE, errno.ENFILE)
# macOS refuses a soft limit above this when the hard one is unlimited.
OPEN_MAX = 10240
T = TypeVar("T")


def open_files() -> int | None:
    """Descriptors this process has open now (None where that cannot be read); its
    limit when the table is full (listing it takes one more)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError as e:
        limits = file_limits()
        return limits[0] if e.errno in FILE_LIMITS and limits and limits[0] >= 0 else None


def file_limits() -> tuple[int, int] | None:
    """This process's (soft, hard) limit on open files; -1 for unlimited, None where
    there is none to read."""
    if resource is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = resource.RLIM_INFINITY
    return (-1 if soft == unlimited else soft, -1 if hard == unlimited else hard)


_lock = threading.Lock()  # one change of the limit at a time


def room_for_files(count: int) -> None:
    """Raises this process's soft limit on open files when it is lower than the files
    open now, ``count`` more and SPARE_FILES: as far as needed, at most to the hard
    limit. Nothing happens where the limits cannot be read or set. Archives read as one
    open one after another, each before the one before it has mapped its shards: a file
    that then meets the limit raises it further (``with_room``)."""
    if count > 0:
        _raise_soft((open_files() or 64) + count + SPARE_FILES)


def _raise_soft(want: int) -> bool:
    """Sets the soft limit on open files to ``want``, or as near as the hard limit (and
    the platform: macOS caps it at OPEN_MAX) allows; True when it rose. Never lowers it."""
    if resource is None:
        return False
    with _lock:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY or soft >= want:
            return False
        for raised in (want if hard == resource.RLIM_INFINITY else min(hard, want), OPEN_MAX):
            if raised <= soft:
                continue
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
                return True
            except (ValueError, OSError):  # above the platform's cap
                continue
        return False


def with_room(opening: Callable[[], T], path: object) -> T:
    """``opening()``, an open or a map of ``path``; when the process's table of open files
    is full, tried once more after raising the soft limit (doubled, at most to the hard
    limit), then ResourceLimitError (``too_many_files``), never the bare OSError."""
    soft = (file_limits() or (-1, -1))[0]  # before the try: a rise since is room
    for last in (False, True):
        try:
            return opening()
        except OSError as e:
            if e.errno not in FILE_LIMITS:
                raise
            if last or e.errno != errno.EMFILE or soft < 0:
                raise too_many_files(path, e) from None
            now = (file_limits() or (-1, -1))[0]
            if not (_raise_soft(max(2 * soft, soft + 1024)) or now > soft):
                raise too_many_files(path, e) from None
    raise AssertionError("unreachable")


def too_many_files(path: object, e: BaseException) -> ResourceLimitError:
    """The error for ``path`` that could not be opened or mapped because a table of open
    files is full (``e``'s errno in FILE_LIMITS): which one, and how to make room."""
    if getattr(e, "errno", None) == errno.ENFILE:
        return ResourceLimitError(
            f"{path}: the system's table of open files is full (ENFILE): raise fs.file-max "
            "(sysctl), or run fewer readers on this machine"
        )
    limits = file_limits()
    soft, hard = (
        ("unknown",) * 2 if limits is None else (str(v) if v >= 0 else "unlimited" for v in limits)
    )
    return ResourceLimitError(
        f"{path}: this process has as many files open as its limit allows ({soft}; at most "
        f"{hard}, `ulimit -Hn`): each mapped shard keeps one or two open (a cached one "
        "two). Raise the limit where the job starts (`ulimit -n`, LimitNOFILE= for a "
        "systemd service, nofile in /etc/security/limits.conf), read fewer archives at "
        "once, or compile larger shards (shard_bytes)"
    )


def too_many_maps(path: object) -> ResourceLimitError | None:
    """The error for ``path`` whose mapping failed for want of memory (ENOMEM) when the
    cause is this process's count of memory maps at the system's cap
    (vm.max_map_count), else None (memory itself ran out)."""
    try:
        cap = int(Path("/proc/sys/vm/max_map_count").read_text())
        with open("/proc/self/maps", "rb") as f:
            maps = sum(1 for _ in f)
    except (OSError, ValueError):
        return None
    if maps < cap - SPARE_FILES:
        return None
    return ResourceLimitError(
        f"{path}: this process holds {maps} memory maps, the system's cap "
        f"(vm.max_map_count) is {cap}: each mapped shard is one. Raise the cap (`sysctl -w "
        "vm.max_map_count=...`), read fewer archives at once, or compile larger shards "
        "(shard_bytes)"
    )

"""Limits of the process that reading an archive meets: every mapped shard file keeps
one open descriptor (a memory map keeps its own) and is one memory map.

An archive of more shards than the soft limit on open files allows (1024 on many
Linux machines) would fail partway through; opening it raises the soft limit toward
the hard one instead (``room_for_files``), as far as the hard limit lets. A limit
still too low is named, with how to raise it (``too_many_files``, ``too_many_maps``).
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from .errors import ResourceLimitError

# Descriptors kept free beside the mapped shards: sockets, the cache's lock files,
# DataLoader pipes, the interpreter's and torch's own.
SPARE_FILES = 256
# The errors of a descriptor table that is full: this process's, or the system's.
FILE_LIMITS = (errno.EMFILE, errno.ENFILE)


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
    try:
        import resource
    except ImportError:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = resource.RLIM_INFINITY
    return (-1 if soft == unlimited else soft, -1 if hard == unlimited else hard)


def room_for_files(count: int) -> None:
    """Raises this process's soft limit on open files when it is lower than the files
    open now, ``count`` more and SPARE_FILES: as far as needed, at most to the hard
    limit. Nothing happens where the limits cannot be read or set; a file that then
    cannot be opened or mapped says why (``too_many_files``)."""
    try:
        import resource
    except ImportError:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = (open_files() or 64) + count + SPARE_FILES
    if count <= 0 or soft == resource.RLIM_INFINITY or soft >= need:
        return
    raised = need if hard == resource.RLIM_INFINITY else min(hard, need)
    if raised > soft:
        with contextlib.suppress(ValueError, OSError):  # a platform cap (macOS's OPEN_MAX)
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))


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

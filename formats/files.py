"""Opening archive files safely (SPEC.md §8): regular files only, links kept inside
the archive folder, bounded reads, and JSON of bounded nesting.

An archive may come from anywhere; none of its files may make a reader block
(a FIFO), read without end (a device), read outside its folder (a link), or
recurse without bound (deeply nested JSON).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import numpy as np

from .constants import MAX_JSON_DEPTH
from .errors import FormatError

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def open_regular(path: str | os.PathLike[str], *, root: Path | None = None) -> int:
    """Opens ``path`` read-only as a regular file and returns the descriptor.

    With ``root`` (the archive folder) a path that is, or passes through, a
    symbolic link resolving outside ``root`` is refused before anything is
    opened. The open never blocks (O_NONBLOCK: a FIFO cannot stall it) and the
    descriptor's own fstat must show a regular file; anything else raises
    FormatError naming ``path``. A missing file raises FileNotFoundError.
    """
    path = Path(path)
    target = path
    if root is not None:
        target = Path(os.path.realpath(path))
        base = Path(os.path.realpath(root))
        if target != base and base not in target.parents:
            # Name the link, never where it points: the target is not the archive's to show.
            raise FormatError(
                path,
                "is a symbolic link that leaves the archive folder; links must resolve "
                "inside it (copy the file into the archive instead)",
            )
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        before = os.stat(target)
        if not stat.S_ISREG(before.st_mode):
            raise FormatError(path, f"is {_kind(before.st_mode)}, not a regular file")
        # The link was resolved above: the final component must not turn into a link now.
        fd = os.open(target, flags | (os.O_NOFOLLOW if root is not None else 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        raise FormatError(path, f"cannot open: {e.strerror or e}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise FormatError(path, f"is {_kind(mode)}, not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_capped(
    path: str | os.PathLike[str], cap: int, *, root: Path | None = None, what: str = "file"
) -> bytes:
    """The whole of a regular file of at most ``cap`` bytes (see open_regular).

    The cap holds for the bytes actually read, not for what stat says: at most
    ``cap + 1`` bytes are read, and one more than ``cap`` is an error.
    """
    fd = open_regular(path, root=root)
    try:
        chunks: list[bytes] = []
        total = 0
        while total <= cap:
            chunk = os.read(fd, min(cap + 1 - total, 16 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as e:
        raise FormatError(path, f"cannot read: {e.strerror or e}") from None
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    if total > cap:
        raise FormatError(path, f"{what} is larger than its {cap}-byte cap")
    return b"".join(chunks)


# A JSON string: quotes around anything but quotes and backslashes, or escapes.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_CHUNK = 1 << 20


def json_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text, without parsing it.

    String contents are skipped; on malformed text the figure is only an
    estimate, and the parser reports the real error.
    """
    brackets = _JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    if len(brackets) <= 1:
        return len(brackets)
    arr = np.frombuffer(brackets, np.uint8)
    deepest = depth = 0
    for start in range(0, len(arr), _DEPTH_CHUNK):
        part = arr[start : start + _DEPTH_CHUNK]
        steps = np.where((part == ord("[")) | (part == ord("{")), 1, -1).astype(np.int32)
        running = np.cumsum(steps, dtype=np.int64) + depth
        deepest = max(deepest, int(running.max()))
        depth = int(running[-1])
    return deepest


def loads_bounded(path: object, data: bytes, what: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` of UTF-8 text nested at most ``max_depth`` deep; FormatError otherwise."""
    depth = json_depth(data)
    if depth > max_depth:
        raise FormatError(
            path, f"{what} nests arrays and objects {depth} deep; the limit is {max_depth}"
        )
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        # ValueError covers JSONDecodeError and integers past Python's digit limit.
        raise FormatError(path, f"{what} is not valid UTF-8 JSON: {str(e)[:200]}") from None

"""Opening archive files safely (SPEC.md §8): regular files only, links kept inside
the archive folder, bounded reads, and JSON whose parse cost is bounded
before it is parsed (nesting, number of values, length of numbers).

An archive may come from anywhere; none of its files may make a reader block
(a FIFO), read without end (a device), read outside its folder (a link), or
recurse without bound (deeply nested JSON), or parse without bound (millions
of tiny values, integers of thousands of digits).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .constants import MAX_JSON_DEPTH, MAX_JSON_NUMBER_CHARS, MAX_JSON_VALUES
from .errors import FormatError
from .limits import with_room

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
        nofollow = os.O_NOFOLLOW if root is not None else 0
        fd = with_room(lambda: os.open(target, flags | nofollow), path)
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
# Outside strings, a run of these is a number token (or broken text the parser refuses).
_LONG_NUMBER = re.compile(rb"[-+.0-9eE]{%d,}" % (MAX_JSON_NUMBER_CHARS + 1))
_DEPTH_CHUNK = 1 << 20


@dataclass(frozen=True)
class JsonScan:
    """What parsing a JSON text would cost, found without parsing it (SPEC.md §8).

    ``values`` bounds the values and object keys the text holds from above:
    in valid JSON each one but the outermost follows its own ``[``, ``{``,
    ``,`` or ``:``. ``longest_number`` is the longest run of number characters
    outside strings. On malformed text the figures are estimates, and the
    parser reports the real error.
    """

    depth: int
    values: int
    longest_number: int


def scan_json(data: bytes) -> JsonScan:
    """Nesting depth, value count and longest number token of JSON text, in a few C-speed passes."""
    bare = _JSON_STRING.sub(b"", data)
    longest = max((len(m) for m in _LONG_NUMBER.findall(bare)), default=0)
    values = 1 + bare.count(b",") + bare.count(b":") + bare.count(b"[") + bare.count(b"{")
    brackets = bare.translate(None, _NOT_BRACKETS)
    del bare
    if len(brackets) <= 1:
        return JsonScan(len(brackets), values, longest)
    arr = np.frombuffer(brackets, np.uint8)
    deepest = depth = 0
    for start in range(0, len(arr), _DEPTH_CHUNK):
        part = arr[start : start + _DEPTH_CHUNK]
        steps = np.where((part == ord("[")) | (part == ord("{")), 1, -1).astype(np.int32)
        running = np.cumsum(steps, dtype=np.int64) + depth
        deepest = max(deepest, int(running.max()))
        depth = int(running[-1])
    return JsonScan(deepest, values, longest)


def json_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text, without parsing it."""
    return scan_json(data).depth


def check_scan(
    path: object,
    scan: JsonScan,
    what: str,
    max_depth: int = MAX_JSON_DEPTH,
    max_values: int = MAX_JSON_VALUES,
) -> None:
    """FormatError unless ``scan`` is within the nesting, value and number bounds."""
    if scan.longest_number > MAX_JSON_NUMBER_CHARS:
        raise FormatError(
            path,
            f"{what} holds a number {scan.longest_number} characters long; numbers are at most "
            f"{MAX_JSON_NUMBER_CHARS} characters (SPEC.md §8)",
        )
    if scan.depth > max_depth:
        raise FormatError(
            path, f"{what} nests arrays and objects {scan.depth} deep; the limit is {max_depth}"
        )
    if scan.values > max_values:
        raise FormatError(
            path,
            f"{what} holds up to {scan.values} JSON values and keys; the limit is {max_values} "
            "(SPEC.md §8)",
        )


def loads_bounded(
    path: object,
    data: bytes,
    what: str,
    max_depth: int = MAX_JSON_DEPTH,
    max_values: int = MAX_JSON_VALUES,
) -> Any:
    """``json.loads`` of UTF-8 text within the bounds of SPEC.md §8; FormatError otherwise.

    The text is scanned first (nesting, value count, number length), so the
    parse never starts on text whose cost the bounds do not cover; numbers are
    bounded here, whatever the interpreter's own integer-digit limit is set to.
    """
    check_scan(path, scan_json(data), what, max_depth, max_values)
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(path, f"{what} is not valid UTF-8 JSON: {str(e)[:200]}") from None


def atomic_write(path: Path, data: bytes) -> None:
    """Writes to a temporary name, fsyncs, renames into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)

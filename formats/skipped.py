"""errors.jsonl: the inputs a compile skipped, one flat JSON object per line (SPEC.md §6, §8).

Reading is lazy and bounded by the record, not only by the file: a chunk of
lines is scanned once for nesting and number length, each line is parsed on
its own (at most MAX_ERROR_RECORD_BYTES), and reading stops at the first line
past the index's skipped count. A caller that wants the first few records
reads only the chunks that hold them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Generator, Iterator, Mapping
from pathlib import Path
from typing import Any

from .constants import (
    ERRORS_NAME,
    MAX_ERROR_RECORD_BYTES,
    MAX_ERROR_RECORD_KEYS,
    MAX_ERRORS_BYTES,
    MAX_ERRORS_RECORDS,
    MAX_JSON_NUMBER_CHARS,
)
from .errors import FormatError, SchemaError
from .files import check_scan, open_regular, scan_json

_CHUNK_BYTES = 256 << 10
_SCALARS = (str, int, float, bool, type(None))
_REQUIRED = ("path", "reason")
_LONGEST_INT = 10 ** (MAX_JSON_NUMBER_CHARS - 1)  # and a sign


def record_problem(record: Any) -> str | None:
    """Why ``record`` is not a valid errors.jsonl record, or None when it is."""
    if not isinstance(record, dict):
        return f"is a JSON {type(record).__name__}, not an object"
    if len(record) > MAX_ERROR_RECORD_KEYS:
        return f"has {len(record)} keys; a record has at most {MAX_ERROR_RECORD_KEYS}"
    for key in _REQUIRED:
        if not isinstance(record.get(key), str):
            return f"{key!r} is {record.get(key)!r}, expected a string"
    for key, value in record.items():
        if not isinstance(key, str) or not isinstance(value, _SCALARS):
            return (
                f"{key!r} holds a {type(value).__name__}; values are strings, numbers, "
                "booleans or null"
            )
    return None


def encode_record(record: Mapping[str, Any], number: int) -> bytes:
    """One errors.jsonl line for skipped input ``number`` (0-based); SchemaError past a bound."""
    if number >= MAX_ERRORS_RECORDS:
        raise SchemaError(
            f"more than {MAX_ERRORS_RECORDS} skipped inputs; errors.jsonl holds at most that "
            "many (SPEC.md §8): check the corpus and the decoders before compiling it"
        )
    problem = record_problem(dict(record))
    line = json.dumps(dict(record), sort_keys=True).encode() + b"\n"
    if problem is None and len(line) > MAX_ERROR_RECORD_BYTES:
        problem = f"is {len(line)} bytes as JSON; a record is at most {MAX_ERROR_RECORD_BYTES}"
    if problem is None and any(
        isinstance(v, int) and abs(v) >= _LONGEST_INT for v in record.values()
    ):  # a float's repr is at most 24 characters
        problem = f"holds a number of more than {MAX_JSON_NUMBER_CHARS} characters"
    if problem is not None:
        raise SchemaError(f"skipped input record {dict(record)!r:.200}: {problem}")
    return line


def read_skipped(
    directory: Path, count: int, name: str = ERRORS_NAME
) -> Generator[dict[str, Any], None, None]:
    """The records of ``directory``'s errors file ``name``, in order, checked one by one.

    ``count`` is the index's skipped count: the file must hold exactly that
    many records (a missing file holds none). Every breach raises FormatError
    naming the file and the line.
    """
    path = directory / name
    try:
        fd = open_regular(path, root=directory)
    except FileNotFoundError:
        if count:
            raise FormatError(
                path, f"is missing; index.json counts {count} skipped inputs recorded in it"
            ) from None
        return
    try:
        yield from _records(path, fd, count)
    finally:
        os.close(fd)


def _records(path: Path, fd: int, count: int) -> Iterator[dict[str, Any]]:
    line_no = 0  # lines parsed so far
    pending = b""  # the start of a line whose end is not read yet
    total = 0
    while True:
        try:
            chunk = os.read(fd, _CHUNK_BYTES)
        except OSError as e:
            raise FormatError(path, f"cannot read: {e.strerror or e}") from None
        total += len(chunk)
        if total > MAX_ERRORS_BYTES:
            raise FormatError(path, f"{path.name} is larger than its {MAX_ERRORS_BYTES}-byte cap")
        if chunk:
            data = pending + chunk
            cut = data.rfind(b"\n") + 1
            block, pending = data[:cut], data[cut:]
        else:
            block, pending = pending, b""
        if block:
            for record in _parse_block(path, block, line_no, count):
                line_no += 1
                yield record
        if len(pending) > MAX_ERROR_RECORD_BYTES:
            raise FormatError(
                path,
                f"{path.name} line {line_no + 1} is longer than {MAX_ERROR_RECORD_BYTES} "
                "bytes; a record is one short JSON object per line",
            )
        if not chunk:
            break
    if line_no != count:
        raise FormatError(
            path, f"holds {line_no} records; index.json counts {count} skipped inputs"
        )


def _parse_block(path: Path, block: bytes, line_no: int, count: int) -> Iterator[dict[str, Any]]:
    """The records of whole lines ``block`` (lines ``line_no + 1``...), checked one by one."""
    lines = block.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    # Lines past the count are never parsed: the first of them is the error.
    lines = lines[: max(count - line_no + 1, 0)]
    breach = _scan_block(path, block, lines, line_no)
    for n, line in enumerate(lines, line_no + 1):
        where = f"{path.name} line {n}"
        if breach is not None and breach[0] == n:
            raise breach[1]
        if n > count:
            raise FormatError(
                path, f"{where}: more records than the {count} skipped inputs index.json counts"
            )
        if len(line) > MAX_ERROR_RECORD_BYTES:
            raise FormatError(path, f"{where} is longer than {MAX_ERROR_RECORD_BYTES} bytes")
        try:
            record = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise FormatError(path, f"{where} is not a UTF-8 JSON object: {str(e)[:200]}") from None
        problem = record_problem(record)
        if problem is not None:
            raise FormatError(path, f"{where}: the record {problem}")
        yield record


def _scan_block(
    path: Path, block: bytes, lines: list[bytes], line_no: int
) -> tuple[int, FormatError] | None:
    """One scan of a chunk of lines for nesting and long numbers; on a breach, its line and error.

    The records before that line are still good: the error is raised when it is reached.
    """
    scan = scan_json(block)
    if scan.depth <= 1 and scan.longest_number <= MAX_JSON_NUMBER_CHARS:
        return None
    for n, line in enumerate(lines, line_no + 1):
        try:
            what = f"{path.name} line {n} (records are flat objects)"
            check_scan(path, scan_json(line), what, max_depth=1, max_values=len(line) + 1)
        except FormatError as e:
            return n, e
    return None  # the chunk's figures were thrown off by malformed text: the parse names it

"""What every corpus layout lists with: names as keys, media kinds, CSV and text lines,
fingerprints.

Layouts reach the corpus's files through ``compiler.corpus.place`` (a ``Place``, its
storage chosen once where SOURCE enters) and read them with the helpers here, so a layout
lists a local folder and a bucket alike.
"""

from __future__ import annotations

import contextlib
import csv
import gc
import hashlib
import io
import os
import posixpath
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from dlop.formats.urls import is_url

from ..errors import CompileError
from .place import LocalPlace, Place

AUDIO_EXTS = (
    ".wav",
    ".flac",
    ".ogg",
    ".oga",
    ".mp3",
    ".m4a",
    ".aac",
    ".opus",
    ".webm",
    ".mp4",
    ".mkv",
    ".aif",
    ".aiff",
)
VIDEO_EXTS = (".mp4", ".avi", ".mkv", ".webm", ".mov", ".m4v", ".mpg", ".mpeg", ".ts", ".flv")
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".tif", ".tiff", ".bmp")
MEDIA = ("audio", "video", "image")
MEDIA_EXTS = {"audio": AUDIO_EXTS, "video": VIDEO_EXTS, "image": IMAGE_EXTS}
ALL_MEDIA_EXTS = frozenset(AUDIO_EXTS + VIDEO_EXTS + IMAGE_EXTS)
I64 = range(-(2**63), 2**63)

# -- names ---------------------------------------------------------------------------

_TO_ESCAPE = re.compile("[\\\\\udc80-\udcff]")
_ESCAPED = re.compile(r"\\(\\|x[0-9a-f]{2})")


def name_key(name: str) -> str:
    """A file name (as os.fsdecode gives it) as a key that is valid UTF-8, reversibly.

    Bytes that are not UTF-8 become ``\\xNN`` (two lowercase hex digits) and a
    backslash becomes ``\\\\``; every other character stays. key_name reverses it.
    """
    if name.isascii() and "\\" not in name:  # nothing to escape: no pass over the name
        return name
    text = os.fsencode(name).decode("utf-8", "surrogateescape")
    return _TO_ESCAPE.sub(
        lambda m: "\\\\" if m[0] == "\\" else f"\\x{ord(m[0]) - 0xDC00:02x}", text
    )


def path_key(path: str) -> str:
    """The key of an input a listing names by ``path`` (relative to its corpus, or
    absolute): the path with ``.`` parts and doubled slashes taken out, so that one file
    spelt two ways (``a.wav``, ``./a.wav``) is one input; a URL as written."""
    if not path or is_url(path):
        return name_key(path)
    if _NORMAL.fullmatch(path):  # nothing for normpath to take out (most paths listed)
        return name_key(path)
    return name_key(posixpath.normpath(path))


# A path posixpath.normpath gives back unchanged: no empty, "." or ".." part (no "//", no
# part that starts with a dot: a rare name like ".x" takes the long way), no "/" at the end
_NORMAL = re.compile(r"/?[^/.][^/]*(?:/[^/.][^/]*)*")
# Lines each a name of one part that _NORMAL takes as a part, with no "\\" in it
_PLAIN_NAMES = re.compile(r"(?:[^/.\\\n][^/\\\n]*\n)*[^/.\\\n][^/\\\n]*")


def plain_names(names: Sequence[str]) -> bool:
    """Whether each of ``names`` is its own key under a folder whose path is its own key:
    ``path_key(f"{folder}/{name}") == f"{folder}/{name}"``, found for all of them in one
    pass (a listing's thousands of names, without a call each). True for ASCII names of
    one part (no "/": nothing to normalize, no URL) that do not start with a dot (no "." or
    ".." part) and hold no "\\" or line end (nothing name_key escapes); False may still
    be a name path_key leaves as it is."""
    joined = "\n".join(names)
    return joined.isascii() and _PLAIN_NAMES.fullmatch(joined) is not None


def key_name(key: str) -> str:
    """The file name a name_key key was made from."""
    raw = _ESCAPED.sub(
        lambda m: "\\" if m[1] == "\\" else chr(0xDC00 + int(m[1][1:], 16)), key
    ).encode("utf-8", "surrogateescape")
    return os.fsdecode(raw)


def text_path(path: str) -> str:
    """A path for records and messages: itself when it is text, else its name_key form."""
    return path if is_text(path) else name_key(path)


def is_text(value: str) -> bool:
    """Whether a str holds only characters UTF-8 can store (no lone surrogates)."""
    if value.isascii():  # a flag CPython keeps on the string: no pass over its characters
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def name_bytes(name: str) -> bytes:
    try:
        return os.fsencode(name)
    except UnicodeEncodeError:  # a lone surrogate from a JSON escape, not from a file name
        return name.encode("utf-8", "surrogatepass")


def media_of(paths: Iterable[str | Place]) -> str:
    """audio, video or image, by the files' extensions (.mp4 and friends count as video)."""
    exts = [(p if isinstance(p, Place) else Path(p)).suffix.lower() for p in paths]
    images = sum(e in IMAGE_EXTS for e in exts)
    videos = sum(e in VIDEO_EXTS for e in exts)
    audio_only = sum(e in AUDIO_EXTS and e not in VIDEO_EXTS for e in exts)
    if images and images >= max(videos, audio_only):
        return "image"
    return "video" if videos > audio_only else "audio"


# -- listing files: CSV and text lines ---------------------------------------------------


@dataclass(slots=True)
class CsvRow:
    """One record of a corpus CSV: its (last) line number and fields, or why it is bad."""

    line: int
    fields: dict[str, str]
    error: str | None = None


def read_csv(
    path: Place, root: Place, need: set[str], raw: bytes | None = None
) -> tuple[bytes, list[CsvRow]]:
    """A corpus CSV's records (file order). A bad record (not UTF-8, too few or too many
    fields, unparseable) comes back with its error, its fields as read (bytes that are not
    UTF-8 as surrogates; name_key makes them a key); a file whose header is not UTF-8 text
    with the ``need`` columns is a CompileError. ``raw``: the file's bytes, when read
    already."""
    raw = path.read_bytes() if raw is None else raw
    rel = path.relative_to(root) if path.is_relative_to(root) else path
    text = raw.decode("utf-8-sig", "surrogateescape")
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, [])
    except csv.Error as e:
        raise CompileError(f"{path}: line 1 is not a CSV header ({e})") from None
    if not all(is_text(h) for h in header):
        try:
            raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise CompileError(
                f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8"
            ) from None
    if not need <= set(header):
        raise CompileError(f"{path}: needs columns {sorted(need)}, has {sorted(header)}")
    rows: list[CsvRow] = []
    columns = len(header)
    while True:  # each pass reads on from a record the csv module could not parse
        try:
            for values in reader:
                if not values:
                    continue  # a blank line
                row = CsvRow(reader.line_num, dict(zip(header, values, strict=False)))
                if len(values) != columns:
                    row.error = (
                        f"{rel} line {row.line}: has {len(values)} columns, the header has "
                        f"{columns}"
                    )
                # ASCII first: a flag on each string, asked without a Python call per field
                elif not all(map(str.isascii, values)) and not all(map(is_text, values)):
                    row.error = f"{rel} line {row.line}: not UTF-8 text; save the file as UTF-8"
                rows.append(row)
        except csv.Error as e:
            rows.append(CsvRow(reader.line_num, {}, f"{rel} line {reader.line_num}: {e}"))
            continue
        break
    return raw, rows


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block (a corpus's listing: open_corpus): a
    listing makes a few objects per input (a CSV row's fields, its facts), all alive as
    long as the listing, and with the collector on every few thousand of them set off a
    scan of those made before; at 80,000 ESC-50 rows those scans were about a sixth of an
    append that added nothing. A collector the caller turned off stays off."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def plain_csv(raw: bytes) -> tuple[list[str], list[list[str]]] | None:
    """A corpus CSV's header and records, when it is plain: ASCII text (after a UTF-8 byte
    order mark) with no quote, no NUL, no carriage return but in ``\\r\\n`` line ends, no
    blank line (but its last line's end), every record of the header's width and each line
    within the csv module's field limit. The records (lines 2, 3, ...) are then its lines
    split at commas, as read_csv reads them, at a fraction of its cost: one Python call per
    line, no dict, no check per field. None for any other file (read_csv reads it)."""
    body = raw[3:] if raw.startswith(b"\xef\xbb\xbf") else raw
    if not body.isascii() or b'"' in body or b"\0" in body:
        return None
    text = body.decode("ascii")
    if "\r" in text:
        text = text.replace("\r\n", "\n")
        if "\r" in text:
            return None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the last line's end
    if not lines or max(map(len, lines)) > csv.field_size_limit() or "" in lines:
        return None
    header, *records = (line.split(",") for line in lines)
    if records and set(map(len, records)) != {len(header)}:
        return None
    return header, records


MAX_LINE_BYTES = 64 << 20  # a manifest line (one input, or one document's segments)


def lines(raw: bytes, path: object = "") -> Iterator[tuple[int, int, bytes]]:
    """(line number from 1, byte offset, line without its end) of a text file's bytes.

    Only \\n (and \\r\\n) end a line, as JSON lines and transcripts mean; a UTF-8 byte
    order mark at the start is dropped. A line longer than MAX_LINE_BYTES is a
    CompileError naming ``path``: a manifest line describes one input (or one
    document), and parsing a longer one would take several times its size in memory.
    """
    offset = 3 if raw.startswith(b"\xef\xbb\xbf") else 0
    n = 0
    while offset <= len(raw):  # one line at a time: no list of every line of a long manifest
        end = raw.find(b"\n", offset)
        end = len(raw) if end < 0 else end
        n += 1
        if end - offset > MAX_LINE_BYTES:
            raise CompileError(
                f"{path}: line {n} (byte {offset}) is longer than {MAX_LINE_BYTES} bytes; a "
                "manifest line describes one input: the file is damaged or not a manifest"
            )
        line = raw[offset:end]
        yield n, offset, line[:-1] if line.endswith(b"\r") else line
        offset = end + 1


def utf8(line: bytes, where: str, offset: int) -> tuple[str, str | None]:
    """The line as text, or (its text with surrogates, why it is not UTF-8)."""
    try:
        return line.decode("utf-8"), None
    except UnicodeDecodeError as e:
        return line.decode("utf-8", "surrogateescape"), (
            f"{where} (byte {offset + e.start}): not UTF-8 text ({e.reason}); save it as UTF-8"
        )


# -- fingerprint -------------------------------------------------------------------------


def fingerprint(
    inputs: Iterable[tuple[str, str | None, float, float | None]],
    extra: bytes,
    root: Place | None = None,
) -> str:
    """sha256 over every input's (key, path, offset, duration), the path as its size, after
    ``extra`` (the corpus's listing files). Under a URL ``root`` the sizes come from the
    bucket listing (one per folder, never a request per input)."""
    here = root if root is not None else LocalPlace(Path("."))
    h = hashlib.sha256(extra)
    for key, path, offset, duration in inputs:
        size = -1 if path is None else here.size_of(path)
        h.update(name_bytes(key) + f"\0{size}\0{offset}\0{duration}\n".encode())
    return h.hexdigest()


def bytes_fingerprint(raw: bytes, layout: str) -> str:
    """sha256 of a listing file that names every input and all the corpus says of it (a
    manifest): no input is asked its size here; work units record their inputs' sizes
    instead (Corpus.unit_sizes)."""
    return hashlib.sha256(f"dlop {layout}\0".encode() + raw).hexdigest()

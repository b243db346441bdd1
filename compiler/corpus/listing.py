"""What every corpus layout lists with: names as keys, walks, CSV and text lines, fingerprints.

Layouts read the corpus's files only through the functions here (walk_files,
files_below, subfolders, read_bytes, file_size, like) and the Path methods a
``compiler.urls.UrlPath`` has too, so the storage they list from (local files or
a URL) is decided in one place.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import io
import os
import posixpath
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlop.formats.constants import ARCHIVE_FORMAT, INDEX_NAME, JOURNAL_NAME
from dlop.formats.urls import local_path

from ..errors import CompileError

# What layouts use of compiler.urls, offered here (layouts import only listing, corpus, errors).
from ..urls import UrlPath as UrlPath
from ..urls import is_url as is_url
from ..urls import size_of
from ..urls import url_path as url_path


def source_path(text: str, storage_options: dict[str, Any] | None = None) -> Path:
    """A location as the path layouts list and open, resolved once where it enters: a
    local Path (a ``file://`` URL is the path it names), or a UrlPath over its storage."""
    if is_url(text):
        return url_path(text, storage_options)
    return Path(local_path(text))


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
# The progress journal of an interrupted compile (the pipeline's JOURNAL): its folder is output.
PROGRESS_NAME = JOURNAL_NAME
I64 = range(-(2**63), 2**63)

# -- names ---------------------------------------------------------------------------

_TO_ESCAPE = re.compile("[\\\\\udc80-\udcff]")
_ESCAPED = re.compile(r"\\(\\|x[0-9a-f]{2})")


def name_key(name: str) -> str:
    """A file name (as os.fsdecode gives it) as a key that is valid UTF-8, reversibly.

    Bytes that are not UTF-8 become ``\\xNN`` (two lowercase hex digits) and a
    backslash becomes ``\\\\``; every other character stays. key_name reverses it.
    """
    text = os.fsencode(name).decode("utf-8", "surrogateescape")
    return _TO_ESCAPE.sub(
        lambda m: "\\\\" if m[0] == "\\" else f"\\x{ord(m[0]) - 0xDC00:02x}", text
    )


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


# -- where a corpus's own paths may lead ------------------------------------------------

ALLOW_HINT = "pass --allow-path DIR (allow_paths in a recipe) to read from a folder outside it"


def confined(root: Path, text: str, allowed: tuple[str, ...] = ()) -> str:
    """The file a corpus's listing names by ``text``, resolved against ``root`` (its folder,
    or its storage for a URL SOURCE). A path that leads outside ``root`` (absolute, climbing
    with ``..``, through a link pointing out, or a URL) is refused with ValueError unless it
    lies in one of the ``allowed`` folders or URL prefixes the user named. Nothing is read
    before the check, and its message is the same whether the path exists or not."""
    if isinstance(root, UrlPath) and is_url(text) and _url_within(text, str(root)):
        return text  # a URL inside SOURCE's own storage folder
    rooted = not (is_url(text) or posixpath.isabs(text) or os.path.isabs(text))
    rel = posixpath.normpath(text.replace(os.sep, "/")) if rooted else ""
    if rooted and rel != ".." and not rel.startswith("../"):
        full = _joined(root, text)
        if isinstance(root, UrlPath) or _within(_real_path(full), _real_folder(str(root))):
            return full
        if _allowed(full, allowed):
            return full
        raise ValueError(f"path {text!r} leads out of the corpus through a link; {ALLOW_HINT}")
    target = text if not rooted or isinstance(root, UrlPath) else str(root / text)
    if _allowed(target, allowed):
        return target
    raise ValueError(f"path {text!r} lies outside the corpus; {ALLOW_HINT}")


def _joined(root: Path, text: str) -> str:
    """``str(root / text)``: for a plain relative name under a local folder (no empty,
    ``.`` or trailing part for pathlib to drop) the same string joined directly, which
    costs a fraction of making a path object for each of a manifest's lines."""
    if (
        os.sep == "/"
        and not isinstance(root, UrlPath)
        and text
        and "//" not in text
        and "/./" not in text
        and not text.startswith("./")
        and not text.endswith(("/", "/."))
        and text != "."
    ):
        folder = str(root)
        if folder != ".":
            return folder + text if folder.endswith("/") else f"{folder}/{text}"
    return str(root / text)


@functools.lru_cache(maxsize=64)
def _real_folder(folder: str) -> str:
    """Where a corpus root or an allowed folder leads: asked once per folder, not once
    for each of the millions of paths a manifest may name."""
    return os.path.realpath(folder)


def _real_path(path: str) -> str:
    """``os.path.realpath(path)`` at the cost of one lstat for a file whose folder was asked
    about recently: the folder's real path (_real_folder) joined with the name, unless the
    name is itself a link (then resolved in full). A manifest names its files folder by
    folder, and resolving each one's every parent took longer than decoding a short clip.
    The folders' answers last one listing (forget_real_paths)."""
    folder, name = os.path.split(path)
    if name in ("", ".", "..") or os.path.islink(path):
        return os.path.realpath(path)
    return os.path.join(_real_folder(folder), name)


def forget_real_paths() -> None:
    """Drops the folders' real paths asked so far: a listing, or a unit's inputs streamed,
    starts from where the folders lead now, never from a link made since an earlier
    compile in this process (a notebook, a Dask worker) was listed."""
    _real_folder.cache_clear()


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _allowed(target: str, allowed: tuple[str, ...]) -> bool:
    """Whether ``target`` (a local path or a URL) lies in an allowed folder or URL prefix; a
    local one by where its links lead."""
    for folder in allowed:
        if is_url(folder) or is_url(target):
            if is_url(folder) and is_url(target) and _url_within(target, folder):
                return True
            continue
        if _within(os.path.realpath(target), _real_folder(folder)):
            return True
    return False


def _url_within(url: str, prefix: str) -> bool:
    """Whether ``url`` lies below the URL ``prefix`` once ``..`` and ``.`` are resolved."""
    (scheme, _, rest), (want, _, base) = url.partition("://"), prefix.partition("://")
    path, folder = posixpath.normpath("/" + rest), posixpath.normpath("/" + base)
    return scheme == want and (path == folder or path.startswith(folder.rstrip("/") + "/"))


# -- the corpus's files (archives are never input) -------------------------------------


def is_archive(folder: Path) -> bool:
    """A dlop archive (its index.json) or an interrupted compile's output (its progress journal)."""
    if (folder / PROGRESS_NAME).exists():
        return True
    if isinstance(folder, UrlPath) and not (folder / INDEX_NAME).is_file():
        return False  # answered by the listing, without a request
    try:
        with (folder / INDEX_NAME).open("rb") as f:
            head = f.read(4096)  # "format" is the index's first key (SPEC.md)
    except OSError:
        return False
    return f'"{ARCHIVE_FORMAT}"'.encode() in head


def like(source: Path, text: str) -> Path:
    """``text`` (a path or URL) as a path of the same kind as ``source``."""
    return source.with_url(text) if isinstance(source, UrlPath) else Path(text)


def _walk_url(root: UrlPath, exts: tuple[str, ...] | frozenset[str] | None) -> Iterator[Path]:
    files = list(root.files_below())
    marks = {f.parent for f in files if f.name in (PROGRESS_NAME, INDEX_NAME)}
    archives = [d for d in marks if is_archive(d)]
    for path in files:
        if exts is not None and path.suffix.lower() not in exts:
            continue
        if not any(a in path.parents and a != root for a in archives):
            yield path


def walk_files(
    root: Path,
    exts: tuple[str, ...] | frozenset[str] | None = None,
    *,
    corpus: Path | None = None,
    allowed: tuple[str, ...] | None = None,
) -> Iterator[Path]:
    """Files below ``root`` (by extension, any case), in no set order, never inside a dlop archive.

    Links are followed where they lead inside ``corpus`` (the corpus's folder; ``root`` by
    default), so a subset made of links to another folder of the corpus lists; a folder
    reached twice (two links to it, or a loop) is walked once. A link that leads out of
    the corpus is refused with CompileError, naming it, unless it leads into one of the
    ``allowed`` folders (--allow-path); ``allowed=None`` is a probe (layout detection),
    which passes such links over and leaves the refusal to the listing."""
    if isinstance(root, UrlPath):
        yield from _walk_url(root, exts)
        return
    inside = _real_folder(str(corpus if corpus is not None else root))
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        here = Path(dirpath)
        real = os.path.realpath(here)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames.sort()  # the same first name for a folder reached twice, run after run
        dirnames[:] = [
            d for d in dirnames if _followed(here / d, inside, allowed) and not is_archive(here / d)
        ]
        # the extension first (os.path.splitext's, which is Path.suffix's for every name
        # but dots before an extension): a Path and a stat only for a match
        for f in filenames:
            if exts is not None and os.path.splitext(f)[1].lower() not in exts:
                continue
            path = here / f
            if path.is_file() and _followed(path, inside, allowed):
                yield path


def _followed(path: Path, inside: str, allowed: tuple[str, ...] | None) -> bool:
    """Whether the walk goes on through ``path``: always unless it is a link out of the
    corpus (``inside``, a real path), which a listing refuses and a probe passes over."""
    if not path.is_symlink():
        return True
    target = os.path.realpath(path)
    if _within(target, inside) or (allowed and _allowed(str(path), allowed)):
        return True
    if allowed is None:
        return False
    raise CompileError(f"{path}: a link that leads out of the corpus (to {target}); {ALLOW_HINT}")


def files_below(
    root: Path,
    exts: tuple[str, ...] | frozenset[str] | None = None,
    *,
    corpus: Path | None = None,
    allowed: tuple[str, ...] | None = None,
) -> list[Path]:
    """walk_files in sorted path order."""
    return sorted(walk_files(root, exts, corpus=corpus, allowed=allowed))


def subfolders(root: Path, allowed: tuple[str, ...] | None = None) -> list[Path]:
    """The folders directly inside ``root`` that are not dlop archives, sorted; none if no
    folder. A link to a folder counts where walk_files would follow it (inside ``root``,
    or an ``allowed`` folder; refused otherwise, or passed over when ``allowed`` is None)."""
    if not root.is_dir():
        return []
    inside = _real_folder(str(root)) if not isinstance(root, UrlPath) else ""
    return sorted(
        p
        for p in root.iterdir()
        if p.is_dir()
        and (isinstance(root, UrlPath) or _followed(p, inside, allowed))
        and not is_archive(p)
    )


def read_bytes(path: Path) -> bytes:
    """A listing file's bytes (a CSV, a manifest, a transcript)."""
    return path.read_bytes()


def file_size(path: Path) -> int:
    """A file's size in bytes, -1 when it cannot be told (missing, unreadable, or a URL
    that cannot be listed); a URL's comes from its folder's listing."""
    if isinstance(path, UrlPath):
        return path.size()
    try:
        return path.stat().st_size
    except OSError:
        return -1


def media_of(paths: Iterable[str | Path]) -> str:
    """audio, video or image, by the files' extensions (.mp4 and friends count as video)."""
    exts = [Path(p).suffix.lower() for p in paths]
    images = sum(e in IMAGE_EXTS for e in exts)
    videos = sum(e in VIDEO_EXTS for e in exts)
    audio_only = sum(e in AUDIO_EXTS and e not in VIDEO_EXTS for e in exts)
    if images and images >= max(videos, audio_only):
        return "image"
    return "video" if videos > audio_only else "audio"


# -- listing files: CSV and text lines ---------------------------------------------------


@dataclass
class CsvRow:
    """One record of a corpus CSV: its (last) line number and fields, or why it is bad."""

    line: int
    fields: dict[str, str]
    error: str | None = None


def read_csv(path: Path, root: Path, need: set[str]) -> tuple[bytes, list[CsvRow]]:
    """A corpus CSV's records (file order). A bad record (not UTF-8, too few or too many
    fields, unparseable) comes back with its error, its fields as read (bytes that are not
    UTF-8 as surrogates; name_key makes them a key); a file whose header is not UTF-8 text
    with the ``need`` columns is a CompileError."""
    raw = read_bytes(path)
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
    while True:
        try:
            values = next(reader, None)
        except csv.Error as e:
            rows.append(CsvRow(reader.line_num, {}, f"{rel} line {reader.line_num}: {e}"))
            continue
        if values is None:
            break
        if not values:
            continue  # a blank line
        where = f"{rel} line {reader.line_num}"
        fields = dict(zip(header, values, strict=False))
        row = CsvRow(reader.line_num, fields)
        if len(values) != len(header):
            row.error = f"{where}: has {len(values)} columns, the header has {len(header)}"
        elif not all(is_text(v) for v in values):
            row.error = f"{where}: not UTF-8 text; save the file as UTF-8"
        rows.append(row)
    return raw, rows


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
    root: Path | None = None,
) -> str:
    """sha256 over every input's (key, path, offset, duration), the path as its size, after
    ``extra`` (the corpus's listing files). Under a URL ``root`` the sizes come from the
    bucket listing (one per folder, never a request per input)."""
    h = hashlib.sha256(extra)
    for key, path, offset, duration in inputs:
        size = -1 if path is None else size_of(path, root or Path("."))
        h.update(name_bytes(key) + f"\0{size}\0{offset}\0{duration}\n".encode())
    return h.hexdigest()


def bytes_fingerprint(raw: bytes, layout: str) -> str:
    """sha256 of a listing file that names every input and all the corpus says of it (a
    manifest): no input is asked its size here; work units record their inputs' sizes
    instead (Corpus.unit_sizes)."""
    return hashlib.sha256(f"dlop {layout}\0".encode() + raw).hexdigest()

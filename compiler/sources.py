"""Corpus layouts (REFERENCE §5): each turns a SOURCE into an ordered list of items.

Order is deterministic (sorted paths, or file order for CSV, manifests and
tars), so the same corpus always compiles to the same shard bytes.
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
import math
import os
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlop.formats.constants import ARCHIVE_FORMAT, INDEX_NAME

from .errors import CompileError

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
LAYOUTS = ("esc50", "folder", "librispeech", "manifest", "webdataset", "charades", "segmentation")
MEDIA = ("audio", "video", "image")
MEDIA_EXTS = {"audio": AUDIO_EXTS, "video": VIDEO_EXTS, "image": IMAGE_EXTS}
ALL_MEDIA_EXTS = frozenset(AUDIO_EXTS + VIDEO_EXTS + IMAGE_EXTS)
# The progress journal of an interrupted compile (the pipeline's JOURNAL): its folder is output.
PROGRESS_NAME = ".dlop-progress.json"
ESC50_CLASSES = 50
MAX_LABEL = 2**31 - 1  # largest single class index a corpus may give
MAX_MULTI_LABELS = 1 << 16  # widest multi-hot ``labels`` vector (one byte per class per sample)
_I64 = range(-(2**63), 2**63)

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
    return path if _is_text(path) else name_key(path)


def _is_text(value: str) -> bool:
    """Whether a str holds only characters UTF-8 can store (no lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _name_bytes(name: str) -> bytes:
    try:
        return os.fsencode(name)
    except UnicodeEncodeError:  # a lone surrogate from a JSON escape, not from a file name
        return name.encode("utf-8", "surrogatepass")


# -- archives are never input ----------------------------------------------------------


def is_archive(folder: Path) -> bool:
    """A dlop archive (its index.json) or an interrupted compile's output (its progress journal)."""
    if (folder / PROGRESS_NAME).exists():
        return True
    try:
        with open(folder / INDEX_NAME, "rb") as f:
            head = f.read(4096)  # "format" is the index's first key (SPEC.md)
    except OSError:
        return False
    return f'"{ARCHIVE_FORMAT}"'.encode() in head


def walk_files(root: Path, exts: tuple[str, ...] | frozenset[str] | None = None) -> Iterator[Path]:
    """Files below ``root`` (by extension, any case), in no set order, never inside a dlop archive."""
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if not is_archive(here / d)]
        for f in filenames:
            path = here / f
            if (exts is None or path.suffix.lower() in exts) and path.is_file():
                yield path


def files_below(root: Path, exts: tuple[str, ...] | frozenset[str] | None = None) -> list[Path]:
    """walk_files in sorted path order."""
    return sorted(walk_files(root, exts))


@dataclass
class Item:
    """One input: where its audio is, and what the corpus says about it."""

    key: str
    path: str | None = None  # file on disk
    member: tuple[str, str] | None = None  # webdataset: (tar path, audio extension)
    label: int | None = None
    text: str | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    offset: float = 0.0
    duration: float | None = None
    error: str | None = None  # known bad before decoding (e.g. a malformed manifest line)
    data: dict[str, bytes] | None = None  # webdataset: the sample's members by extension
    labels: list[int] | None = None  # multi-label classes (Charades actions, manifest "labels")
    masks: dict[str, str | None] | None = None  # segmentation: mask field -> file (None: missing)
    # webdataset: listing stopped at damage in this sample's tar, so the tar stream may not
    # hold it (it is bad either way)
    unread: bool = False


@dataclass
class Corpus:
    layout: str
    root: str
    items: list[Item]
    has_label: bool
    has_text: bool
    extra_fields: dict[str, str]  # name -> "i64" | "str"
    metadata: dict[str, Any]
    fingerprint: str
    media: str = "audio"
    num_labels: int = 0  # multi-hot width when items carry ``labels``
    mask_names: tuple[str, ...] = ()


def detect_layout(source: Path) -> str:
    if source.is_file() or "{" in str(source):
        if source.suffix in (".jsonl", ".json"):
            return "manifest"
        if source.suffix == ".tar" or "{" in str(source):
            return "webdataset"
        raise CompileError(f"{source}: a file SOURCE must be a .jsonl manifest or a .tar shard")
    if not source.is_dir():
        raise CompileError(f"{source}: no such file or directory")
    if is_archive(source):
        raise CompileError(
            f"{source}: is a dlop archive (or an interrupted compile's output), not a corpus; "
            "to rebuild it, pass it as --recipe"
        )
    from .sources_vision import is_charades, is_segmentation

    found = []
    if (source / "meta" / "esc50.csv").is_file():
        found.append("esc50")
    if is_charades(source):
        found.append("charades")
    if is_segmentation(source):
        found.append("segmentation")
    if any(f.name.endswith(".trans.txt") for f in walk_files(source)):
        found.append("librispeech")
    if next(source.glob("*.tar"), None) is not None:
        found.append("webdataset")
    if len(found) > 1:
        raise CompileError(
            f"{source}: layout is ambiguous ({' and '.join(found)} both match); pass --layout"
        )
    if found:
        return found[0]
    if _class_folders(source, ALL_MEDIA_EXTS):
        return "folder"
    raise CompileError(
        f"{source}: cannot tell the layout (no meta/esc50.csv, Charades_v1_*.csv, images + mask "
        "folders, *.trans.txt, *.tar or class subfolders holding media); pass --layout"
    )


def media_of(paths: list[str]) -> str:
    """audio, video or image, by the files' extensions (.mp4 and friends count as video)."""
    exts = [Path(p).suffix.lower() for p in paths]
    images = sum(e in IMAGE_EXTS for e in exts)
    videos = sum(e in VIDEO_EXTS for e in exts)
    audio_only = sum(e in AUDIO_EXTS and e not in VIDEO_EXTS for e in exts)
    if images and images >= max(videos, audio_only):
        return "image"
    return "video" if videos > audio_only else "audio"


def layout_media(layout: str, source: Path) -> str:
    """The media a layout holds; folder and manifest corpora are told by their files."""
    if layout in ("charades",):
        return "video"
    if layout == "segmentation":
        return "image"
    if layout == "folder" and source.is_dir():
        return media_of([str(f) for f in walk_files(source, ALL_MEDIA_EXTS)])
    if layout == "manifest" and source.is_file():
        with open(source, encoding="utf-8", errors="replace") as f:
            for line in f:  # the first line that parses (the manifest reader reports bad ones)
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(obj, dict) and "video_filepath" in obj:
                    return "video"
                break
    return "audio"


def open_corpus(
    source: str,
    layout: str | None,
    media: str | None = None,
    images: str | None = None,
    masks: tuple[str, ...] | None = None,
) -> Corpus:
    from .sources_vision import charades, segmentation

    path = Path(source)
    layout = layout or detect_layout(path)
    if layout not in LAYOUTS:
        raise CompileError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    media = media or layout_media(layout, path)
    if layout == "folder":
        return _folder(path, media)
    if layout == "manifest":
        return _manifest(path, media)
    if layout == "segmentation":
        return segmentation(path, images, masks)
    if media != "audio" and layout != "charades":
        raise CompileError(f"layout {layout} holds audio, not {media}")
    build = {
        "esc50": _esc50,
        "librispeech": _librispeech,
        "webdataset": _webdataset,
        "charades": charades,
    }[layout]
    return build(path)


def _fingerprint(root: Path, items: list[Item], extra: bytes = b"") -> str:
    """sha256 over every input's key and size plus the corpus's metadata files."""
    h = hashlib.sha256(extra)
    for it in items:
        size = -1
        if it.path is not None:
            try:
                size = Path(it.path).stat().st_size
            except OSError:
                size = -1
        h.update(_name_bytes(it.key) + f"\0{size}\0{it.offset}\0{it.duration}\n".encode())
    return h.hexdigest()


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
    raw = path.read_bytes()
    rel = path.relative_to(root) if path.is_relative_to(root) else path
    text = raw.decode("utf-8-sig", "surrogateescape")
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, [])
    except csv.Error as e:
        raise CompileError(f"{path}: line 1 is not a CSV header ({e})") from None
    if not all(_is_text(h) for h in header):
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
        elif not all(_is_text(v) for v in values):
            row.error = f"{where}: not UTF-8 text; save the file as UTF-8"
        rows.append(row)
    return raw, rows


def _esc50(root: Path) -> Corpus:
    meta = root / "meta" / "esc50.csv"
    if not meta.is_file():
        raise CompileError(f"{root}: esc50 layout needs meta/esc50.csv")
    raw, rows = read_csv(meta, root, {"filename", "fold", "target", "category"})
    categories = {row.fields.get("category") for row in rows if row.error is None}
    num_classes = max(ESC50_CLASSES, len(categories))
    items: list[Item] = []
    by_target: dict[int, tuple[str, int]] = {}  # target -> (category, line that set it)
    by_category: dict[str, tuple[int, int]] = {}  # category -> (target, line that set it)
    for row in rows:
        name = row.fields.get("filename", "")
        key = name_key(f"audio/{name}") if name else f"meta/esc50.csv line {row.line}"
        where = f"meta/esc50.csv line {row.line}"
        error = row.error
        target = fold = -1
        category = row.fields.get("category", "")
        if error is None:
            try:
                target, fold = int(row.fields["target"]), int(row.fields["fold"])
            except ValueError:
                error = f"{where}: fold/target not integers"
        if error is None and not 0 <= target < num_classes:
            error = (
                f"{where}: target {target} is not a class index (0 to {num_classes - 1}: the "
                f"CSV names {len(categories)} categories, ESC-50 has {ESC50_CLASSES})"
            )
        elif error is None and fold not in _I64:
            error = f"{where}: fold {fold} does not fit a 64-bit integer"
        elif error is None and target in by_target and by_target[target][0] != category:
            first, line = by_target[target]
            error = f"{where}: target {target} is {category!r} here but {first!r} on line {line}"
        elif error is None and category in by_category and by_category[category][0] != target:
            first_target, line = by_category[category]
            error = (
                f"{where}: category {category!r} is target {target} here but {first_target} "
                f"on line {line}"
            )
        if error is not None:
            items.append(Item(key=key, error=error))
            continue
        by_target.setdefault(target, (category, row.line))
        by_category.setdefault(category, (target, row.line))
        items.append(
            Item(
                key=key,
                path=str(root / "audio" / name),
                label=target,
                extras={"fold": fold, "category": category},
            )
        )
    names = [by_target.get(i, ("", 0))[0] for i in range(max(by_target) + 1)] if by_target else []
    return Corpus(
        "esc50",
        str(root),
        items,
        True,
        False,
        {"fold": "i64", "category": "str"},
        {"classes": names},
        _fingerprint(root, items, raw),
    )


def _class_folders(root: Path, exts: tuple[str, ...] | frozenset[str]) -> list[Path]:
    """Subfolders that hold media (at any depth); hidden folders and archives are no classes."""
    return sorted(
        p
        for p in root.iterdir()
        if p.is_dir()
        and not p.name.startswith(".")
        and not is_archive(p)
        and next(walk_files(p, exts), None) is not None
    )


def _folder(root: Path, media: str = "audio") -> Corpus:
    if not root.is_dir():
        raise CompileError(f"{root}: folder layout needs a folder")
    if is_archive(root):
        raise CompileError(f"{root}: is a dlop archive, not a corpus")
    folders = _class_folders(root, MEDIA_EXTS[media])
    if not folders:
        raise CompileError(f"{root}: folder layout needs one subfolder of {media} files per class")
    classes = [name_key(p.name) for p in folders]
    items = []
    for label, folder in enumerate(folders):
        for f in files_below(folder, MEDIA_EXTS[media]):
            items.append(Item(key=name_key(str(f.relative_to(root))), path=str(f), label=label))
    return Corpus(
        "folder",
        str(root),
        items,
        True,
        False,
        {},
        {"classes": classes},
        _fingerprint(root, items),
        media=media,
    )


def _lines(raw: bytes) -> Iterator[tuple[int, int, bytes]]:
    """(line number from 1, byte offset, line without its end) of a text file's bytes.

    Only \\n (and \\r\\n) end a line, as JSON lines and transcripts mean; a UTF-8 byte
    order mark at the start is dropped.
    """
    offset = 3 if raw.startswith(b"\xef\xbb\xbf") else 0
    for n, line in enumerate(raw[offset:].split(b"\n"), 1):
        yield n, offset, line[:-1] if line.endswith(b"\r") else line
        offset += len(line) + 1


def _utf8(line: bytes, where: str, offset: int) -> tuple[str, str | None]:
    """The line as text, or (its text with surrogates, why it is not UTF-8)."""
    try:
        return line.decode("utf-8"), None
    except UnicodeDecodeError as e:
        return line.decode("utf-8", "surrogateescape"), (
            f"{where} (byte {offset + e.start}): not UTF-8 text ({e.reason}); save it as UTF-8"
        )


def _librispeech(root: Path) -> Corpus:
    items, meta = [], hashlib.sha256()
    for trans in files_below(root):
        if not trans.name.endswith(".trans.txt"):
            continue
        raw = trans.read_bytes()
        meta.update(raw)
        rel = name_key(str(trans.relative_to(root)))
        for n, offset, data in _lines(raw):
            line, error = _utf8(data, f"{rel} line {n}", offset)
            if not line.strip():
                continue
            utt, _, text = line.strip().partition(" ")
            audio = trans.parent / f"{utt}.flac"
            key = name_key(str(audio.relative_to(root)))
            parts = utt.split("-")
            if error is None and (
                len(parts) != 3
                or not all(p.isascii() and p.isdigit() and len(p) < 19 for p in parts)
            ):
                error = f"{rel} line {n}: utterance id {name_key(utt)!r} is not SPK-CHAP-UTT"
            if error is not None:
                items.append(Item(key=key, error=error))
                continue
            items.append(
                Item(
                    key=key,
                    path=str(audio),
                    text=text,
                    extras={"speaker": int(parts[0]), "chapter": int(parts[1])},
                )
            )
    items.sort(key=lambda it: it.key)
    return Corpus(
        "librispeech",
        str(root),
        items,
        False,
        True,
        {"speaker": "i64", "chapter": "i64"},
        {},
        _fingerprint(root, items, meta.digest()),
    )


def _manifest_line(line: str, path_key: str) -> tuple[dict[str, Any], str, float, float | None]:
    """One parsed JSON line: (object, media path, offset, duration); ValueError/TypeError if bad."""
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise TypeError(f"not a JSON object but {type(obj).__name__}")
    audio = obj[path_key]
    if not isinstance(audio, str):
        raise TypeError(f"{path_key} is not a string")
    for name in ("id", "text"):
        if isinstance(obj.get(name), str) and not _is_text(obj[name]):
            raise ValueError(f"{name} holds an unpaired surrogate escape, which is no text")
    if "labels" in obj and not isinstance(obj["labels"], list):
        raise TypeError("labels is not a list")
    offset = float(obj.get("offset", 0.0) or 0.0)
    duration = obj.get("duration")
    duration = None if duration is None else float(duration)
    for name, value in (("offset", offset), ("duration", duration)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} {value} is not a finite number of seconds >= 0")
    return obj, audio, offset, duration


def _label_kind(value: Any) -> str | None:
    """A label's kind: ``int`` (a class index), ``name`` (a class name) or None (a bad label)."""
    if type(value) is int:
        return "int"
    if isinstance(value, str) and _is_text(value):
        return "name"
    return None


def _label_error(value: Any, kind: str, limit: int, first: str) -> str | None:
    got = _label_kind(value)
    if got is None:
        return f"{value!r} is neither a class index nor a class name"
    if got != kind:
        return f"{value!r} is a class {'index' if got == 'int' else 'name'} but {first}"
    if got == "int" and not 0 <= value < limit:
        return f"{value} is not a class index from 0 to {limit - 1}"
    return None


def _manifest(path: Path, media: str = "audio") -> Corpus:
    if not path.is_file():
        raise CompileError(f"{path}: manifest file not found")
    raw = path.read_bytes()
    base = path.parent
    items: list[Item] = []
    path_key = "video_filepath" if media == "video" else "audio_filepath"
    first_error: str | None = None
    kinds: dict[str, tuple[str, int]] = {}  # "label"/"labels" -> (kind, line deciding it)
    for n, offset, data in _lines(raw):
        where = f"{path.name} line {n}"
        line, error = _utf8(data, where, offset)
        if not line.strip():
            continue
        if error is None:
            try:
                obj, audio, start, duration = _manifest_line(line, path_key)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                error = f"{where} (byte {offset}): {type(e).__name__}: {e}"
        if error is not None:
            first_error = first_error or error
            items.append(Item(key=where, error=error))
            continue
        key = str(obj.get("id") or name_key(audio if not start else f"{audio}@{start:g}"))
        item = Item(key=key, path=str(base / audio), offset=start, duration=duration)
        if "text" in obj:
            item.text = str(obj["text"])
        for name in ("label", "labels"):
            if name not in obj:
                continue
            values = obj[name] if name == "labels" else [obj[name]]
            for v in values:
                kind = _label_kind(v)
                if kind is not None:
                    kinds.setdefault(name, (kind, n))
                    break
            item.extras[f"_{name}"] = obj[name]
        items.append(item)
    if first_error is not None and all(it.error is not None for it in items):
        raise CompileError(
            f"{path}: not a JSON-lines manifest (one JSON object per line, UTF-8); no line "
            f"parses, the first: {first_error}"
        )
    has_text = any(it.text is not None for it in items)
    limits = {"label": MAX_LABEL + 1, "labels": MAX_MULTI_LABELS}
    present = {name: any(f"_{name}" in it.extras for it in items) for name in limits}
    # Every line is checked before any class list is made, so a bad line adds no class.
    for name, limit in limits.items():
        if not present[name]:
            continue
        kind, first_line = kinds.get(name, ("int", 0))  # no usable value anywhere: all are bad
        first = f"line {first_line} gives class {'indices' if kind == 'int' else 'names'}"
        for it in items:
            if it.error is not None:
                continue
            if f"_{name}" not in it.extras:
                it.error = f"{it.key}: no {name}, while other manifest lines have them"
                continue
            value = it.extras[f"_{name}"]
            values = value if name == "labels" else [value]
            why = next((w for v in values if (w := _label_error(v, kind, limit, first))), None)
            if why is not None:
                it.error = f"{it.key}: {name} {why}"
    metadata: dict[str, Any] = {}
    good = [it for it in items if it.error is None]
    classes: list[str] = []
    if present["label"]:
        if kinds.get("label", ("int", 0))[0] == "name":
            classes = sorted({it.extras["_label"] for it in good})
            metadata["classes"] = classes
        for it in good:
            value = it.extras["_label"]
            it.label = classes.index(value) if classes else value
    num_labels = 0
    if present["labels"]:
        names: list[str] = []
        if kinds.get("labels", ("int", 0))[0] == "name":
            names = sorted({v for it in good for v in it.extras["_labels"]})
            metadata["label_classes"] = names
        for it in good:
            got = it.extras["_labels"]
            it.labels = [names.index(v) for v in got] if names else list(got)
        width = max((v for it in good for v in it.labels or []), default=-1) + 1
        num_labels = len(names) if names else width
    for it in items:
        it.extras.pop("_label", None)
        it.extras.pop("_labels", None)
    return Corpus(
        "manifest",
        str(path),
        items,
        present["label"],
        has_text,
        {},
        metadata,
        _fingerprint(base, items, raw),
        media=media,
        num_labels=num_labels,
    )


def _tar_paths(source: Path) -> list[Path]:
    if source.is_dir():
        return sorted(source.glob("*.tar"))
    if "{" in str(source):
        import braceexpand  # a webdataset dependency

        return [Path(p) for p in braceexpand.braceexpand(str(source))]
    return [source]


def _webdataset(source: Path) -> Corpus:
    """Tar shards of raw audio members plus .cls / .txt / .json, grouped by key (webdataset rules)."""
    tars = _tar_paths(source)
    if not tars:
        raise CompileError(f"{source}: no .tar shards found")
    items: list[Item] = []
    h = hashlib.sha256()
    has_label = has_text = False
    for tar in tars:
        if not tar.is_file():
            raise CompileError(f"{tar}: tar shard not found")
        h.update(_name_bytes(tar.name) + f"\0{tar.stat().st_size}\n".encode())
        for key, members, damage in _group_members(tar):
            exts = [m[len(key) + 1 :].lower() for m in members]
            audio = [e for e in exts if f".{e}" in AUDIO_EXTS]
            # every item names its tar, so the stream reads each tar on its own
            item = Item(key=name_key(key), member=(str(tar), audio[0] if len(audio) == 1 else ""))
            if damage is not None:
                item.error, item.unread = damage, True
            elif len(audio) != 1:
                item.error = (
                    f"{name_key(tar.name)}: sample {item.key!r} has {len(audio)} audio members"
                )
            has_label |= "cls" in exts or "json" in exts
            has_text |= "txt" in exts
            items.append(item)
    return Corpus("webdataset", str(source), items, has_label, has_text, {}, {}, h.hexdigest())


def _group_members(tar: Path) -> Iterator[tuple[str, list[str], str | None]]:
    """Consecutive members sharing a key (everything before the first '.' of the basename),
    each group with the damage that ended the tar's listing inside it, if any.

    A tar that cannot be read at all is one damaged group named for the tar; one whose
    member's header claims more bytes than the file holds, or that breaks off, ends there
    with the group it broke off in marked damaged.
    """
    current: str | None = None
    group: list[str] = []
    where = name_key(tar.name)
    try:
        size = tar.stat().st_size
        tf = tarfile.open(tar)  # noqa: SIM115 - closed by the with below, once it opened
    except (tarfile.TarError, OSError, EOFError) as e:
        yield tar.name, [], f"{where}: not a readable tar file ({e})"
        return
    with tf:
        members = iter(tf)
        while True:
            try:
                m = next(members, None)
            except (tarfile.TarError, OSError, EOFError) as e:
                damage = f"{where}: broken off after byte {tf.offset} ({e})"
                yield (current or tar.name), group, damage
                return
            if m is None:
                break
            if not m.isfile():
                continue
            slash = m.name.rfind("/")
            dot = m.name.find(".", slash + 1)
            key = m.name if dot < 0 else m.name[:dot]
            if key != current and group:
                yield current or "", group, None
                group = []
            current = key
            group.append(m.name)
            if m.offset_data + m.size > size:
                damage = (
                    f"{where}: member {name_key(m.name)!r} at byte {m.offset_data} claims "
                    f"{m.size} bytes, but the file ends at byte {size} (truncated tar)"
                )
                yield key, group, damage
                return
    if group:
        yield current or "", group, None


def stream_webdataset(corpus: Corpus, start: int = 0) -> Iterator[Item]:
    """The corpus's items from ``start`` on, each with its members' bytes, read with webdataset.

    Samples come back as raw bytes: nothing is decoded here, so no member is
    ever unpickled or executed. Each tar is read on its own; a sample the
    listing found damaged is passed on as the bad input it is, and one the tar
    stream cannot deliver becomes a bad input naming the stream's error.
    """
    import webdataset as wds

    numbered = enumerate(corpus.items)
    for tar, run in itertools.groupby(numbered, key=lambda p: (p[1].member or ("", ""))[0]):
        todo = list(run)
        if todo[-1][0] < start:
            continue  # a tar wholly behind a resumed compile is not read again
        failures: list[BaseException] = []

        def stop(e: BaseException, failures: list[BaseException] = failures) -> bool:
            failures.append(e)
            return False  # stop reading this tar; its undelivered samples are bad inputs

        stream = iter(wds.WebDataset([tar], shardshuffle=False, empty_check=False, handler=stop))
        held: dict[str, Any] | None = None
        for n, item in todo:
            sample = held if held is not None else next(stream, None)
            held = None
            got = None if sample is None else name_key(str(sample.get("__key__")))
            if got != item.key:
                if item.unread:
                    held = sample  # the damaged sample never came; this one is the next's
                elif sample is None and failures:
                    item.error = (
                        f"{name_key(Path(tar).name)}: the tar stream stopped ({failures[0]})"
                    )
                else:
                    raise CompileError(
                        f"{tar}: tar stream gave sample {got!r} where {item.key!r} was listed"
                    )
            elif not item.unread:
                item.data = {
                    k: v
                    for k, v in (sample or {}).items()
                    if not k.startswith("__") and isinstance(v, bytes)
                }
            if n >= start:
                yield item


def webdataset_fields(item: Item) -> None:
    """Fills label/text from the item's cls/txt/json member bytes; a bad one sets item.error."""
    data = item.data or {}
    try:
        cls = data["cls"].decode("utf-8").strip() if "cls" in data else None
        txt = data["txt"].decode("utf-8").strip() if "txt" in data else None
    except UnicodeDecodeError as e:
        item.error = f"{item.key}: a .cls or .txt member is not UTF-8 text (byte {e.start})"
        return
    if cls is not None:
        try:
            item.label = int(cls)
        except ValueError:
            item.error = f"{item.key}.cls: {cls[:40]!r} is not an integer class"
            return
    item.text = txt
    if "json" in data:
        try:
            obj = json.loads(data["json"])
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            item.error = f"{item.key}.json: not JSON ({e})"
            return
        if isinstance(obj, dict):
            if item.label is None and type(obj.get("label")) is int:
                item.label = obj["label"]
            if item.text is None and isinstance(obj.get("text"), str):
                item.text = obj["text"]
    if item.label is not None and not 0 <= item.label <= MAX_LABEL:
        item.error = f"{item.key}: label {item.label} is not a class index from 0 to {MAX_LABEL}"
    elif item.text is not None and not _is_text(item.text):
        item.error = f"{item.key}: text holds an unpaired surrogate escape, which is no text"

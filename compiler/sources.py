"""Corpus layouts (REFERENCE §5): each turns a SOURCE into an ordered list of items.

Order is deterministic (sorted paths, or file order for CSV, manifests and
tars), so the same corpus always compiles to the same shard bytes.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    from .sources_vision import is_charades, is_segmentation

    found = []
    if (source / "meta" / "esc50.csv").is_file():
        found.append("esc50")
    if is_charades(source):
        found.append("charades")
    if is_segmentation(source):
        found.append("segmentation")
    if next(source.rglob("*.trans.txt"), None) is not None:
        found.append("librispeech")
    if next(source.glob("*.tar"), None) is not None:
        found.append("webdataset")
    if len(found) > 1:
        raise CompileError(
            f"{source}: layout is ambiguous ({' and '.join(found)} both match); pass --layout"
        )
    if found:
        return found[0]
    if any(p.is_dir() for p in source.iterdir()):
        return "folder"
    raise CompileError(
        f"{source}: cannot tell the layout (no meta/esc50.csv, Charades_v1_*.csv, images + mask "
        "folders, *.trans.txt, *.tar or class subfolders); pass --layout"
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
        return media_of([str(f) for f in source.rglob("*") if f.is_file()])
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
        h.update(f"{it.key}\0{size}\0{it.offset}\0{it.duration}\n".encode())
    return h.hexdigest()


def _esc50(root: Path) -> Corpus:
    meta = root / "meta" / "esc50.csv"
    if not meta.is_file():
        raise CompileError(f"{root}: esc50 layout needs meta/esc50.csv")
    raw = meta.read_bytes()
    rows = list(csv.DictReader(io.StringIO(raw.decode("utf-8-sig"))))
    need = {"filename", "fold", "target", "category"}
    if not rows or not need <= set(rows[0]):
        raise CompileError(
            f"{meta}: needs columns {sorted(need)}, has {sorted(rows[0]) if rows else 'no rows'}"
        )
    items, classes = [], {}
    for n, row in enumerate(rows, 2):
        try:
            target, fold = int(row["target"]), int(row["fold"])
        except ValueError:
            items.append(
                Item(
                    key=f"audio/{row['filename']}",
                    error=f"{meta.name} line {n}: fold/target not integers",
                )
            )
            continue
        classes[target] = row["category"]
        items.append(
            Item(
                key=f"audio/{row['filename']}",
                path=str(root / "audio" / row["filename"]),
                label=target,
                extras={"fold": fold, "category": row["category"]},
            )
        )
    names = [classes.get(i, "") for i in range(max(classes) + 1)] if classes else []
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


def _folder(root: Path, media: str = "audio") -> Corpus:
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise CompileError(f"{root}: folder layout needs one subfolder per class")
    items = []
    for label, name in enumerate(classes):
        for f in sorted((root / name).rglob("*")):
            if f.is_file() and f.suffix.lower() in MEDIA_EXTS[media]:
                items.append(Item(key=str(f.relative_to(root)), path=str(f), label=label))
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


def _librispeech(root: Path) -> Corpus:
    items, meta = [], hashlib.sha256()
    for trans in sorted(root.rglob("*.trans.txt")):
        raw = trans.read_bytes()
        meta.update(raw)
        for n, line in enumerate(raw.decode("utf-8").splitlines(), 1):
            if not line.strip():
                continue
            utt, _, text = line.strip().partition(" ")
            audio = trans.parent / f"{utt}.flac"
            key = str(audio.relative_to(root))
            parts = utt.split("-")
            if len(parts) != 3 or not all(p.isdigit() for p in parts):
                items.append(
                    Item(
                        key=key,
                        error=f"{trans.name} line {n}: utterance id {utt!r} is not SPK-CHAP-UTT",
                    )
                )
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


def _manifest(path: Path, media: str = "audio") -> Corpus:
    if not path.is_file():
        raise CompileError(f"{path}: manifest file not found")
    raw = path.read_bytes()
    base = path.parent
    items: list[Item] = []
    labels: set[str] = set()
    multi: set[str] = set()
    has_text = has_label = has_labels = False
    path_key = "video_filepath" if media == "video" else "audio_filepath"
    for n, line in enumerate(raw.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path.name} line {n}"
        try:
            obj = json.loads(line)
            audio = obj[path_key]
            if not isinstance(audio, str):
                raise TypeError(f"{path_key} is not a string")
            if "labels" in obj and not isinstance(obj["labels"], list):
                raise TypeError("labels is not a list")
            offset = float(obj.get("offset", 0.0) or 0.0)
            duration = obj.get("duration")
            duration = None if duration is None else float(duration)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            items.append(Item(key=where, error=f"{where}: {type(e).__name__}: {e}"))
            continue
        key = str(obj.get("id") or (audio if not offset else f"{audio}@{offset:g}"))
        item = Item(key=key, path=str(base / audio), offset=offset, duration=duration)
        if "text" in obj:
            item.text, has_text = str(obj["text"]), True
        if "label" in obj:
            has_label = True
            item.extras["_label"] = obj["label"]
            labels.add(str(obj["label"]))
        if "labels" in obj:
            has_labels = True
            item.extras["_labels"] = obj["labels"]
            multi.update(str(v) for v in obj["labels"])
        items.append(item)
    classes: list[str] = []
    if has_label:
        ints = all(
            isinstance(it.extras.get("_label"), int) for it in items if "_label" in it.extras
        )
        classes = [] if ints else sorted(labels)
        for it in items:
            if "_label" in it.extras:
                value = it.extras.pop("_label")
                it.label = value if ints else classes.index(str(value))
            elif it.error is None:
                it.error = f"{it.key}: no label, while other manifest lines have one"
    metadata: dict[str, Any] = {"classes": classes} if classes else {}
    num_labels = 0
    if has_labels:
        values = [v for it in items for v in it.extras.get("_labels", [])]
        ints = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)
        names = [] if ints else sorted(multi)
        num_labels = (max(values, default=-1) + 1) if ints else len(names)
        if names:
            metadata["label_classes"] = names
        for it in items:
            if "_labels" in it.extras:
                got = it.extras.pop("_labels")
                it.labels = list(got) if ints else [names.index(str(v)) for v in got]
            elif it.error is None:
                it.error = f"{it.key}: no labels, while other manifest lines have them"
    return Corpus(
        "manifest",
        str(path),
        items,
        has_label,
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
        h.update(f"{tar.name}\0{tar.stat().st_size}\n".encode())
        for key, members in _group_members(tar):
            exts = [m[len(key) + 1 :].lower() for m in members]
            audio = [e for e in exts if f".{e}" in AUDIO_EXTS]
            item = Item(key=key)
            if len(audio) != 1:
                item.error = f"{tar.name}: sample {key!r} has {len(audio)} audio members"
            else:
                item.member = (str(tar), audio[0])
            has_label |= "cls" in exts or "json" in exts
            has_text |= "txt" in exts
            items.append(item)
    return Corpus("webdataset", str(source), items, has_label, has_text, {}, {}, h.hexdigest())


def _group_members(tar: Path) -> Iterator[tuple[str, list[str]]]:
    """Consecutive members sharing a key (everything before the first '.' of the basename)."""
    current: str | None = None
    group: list[str] = []
    with tarfile.open(tar) as tf:
        for m in tf:
            if not m.isfile():
                continue
            slash = m.name.rfind("/")
            dot = m.name.find(".", slash + 1)
            key = m.name if dot < 0 else m.name[:dot]
            if key != current and group:
                yield current or "", group
                group = []
            current = key
            group.append(m.name)
    if group:
        yield current or "", group


def stream_webdataset(corpus: Corpus, start: int = 0) -> Iterator[Item]:
    """The corpus's items from ``start`` on, each with its members' bytes, read with webdataset.

    Samples come back as raw bytes: nothing is decoded here, so no member is
    ever unpickled or executed.
    """
    import webdataset as wds

    urls = [str(p) for p in _tar_paths(Path(corpus.root))]
    stream = iter(wds.WebDataset(urls, shardshuffle=False, empty_check=False))
    for n, item in enumerate(corpus.items):
        sample = next(stream, None)
        if sample is None or sample.get("__key__") != item.key:
            got = None if sample is None else sample.get("__key__")
            raise CompileError(
                f"{corpus.root}: tar stream gave sample {got!r} where {item.key!r} was listed"
            )
        if n < start:
            continue
        item.data = {
            k: v for k, v in sample.items() if not k.startswith("__") and isinstance(v, bytes)
        }
        yield item


def webdataset_fields(item: Item) -> None:
    """Fills label/text from the item's cls/txt/json member bytes."""
    data = item.data or {}
    if "cls" in data:
        text = data["cls"].decode("utf-8", "replace").strip()
        try:
            item.label = int(text)
        except ValueError:
            item.error = f"{item.key}.cls: {text[:40]!r} is not an integer class"
    if "txt" in data:
        item.text = data["txt"].decode("utf-8", "replace").strip()
    if "json" in data:
        try:
            obj = json.loads(data["json"])
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            item.error = f"{item.key}.json: not JSON ({e})"
            return
        if isinstance(obj, dict):
            if item.label is None and isinstance(obj.get("label"), int):
                item.label = obj["label"]
            if item.text is None and isinstance(obj.get("text"), str):
                item.text = obj["text"]

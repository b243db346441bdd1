"""NeMo-style JSON-lines manifests: one object per line, media paths relative to the manifest
(or URLs, read as written)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..corpus import MAX_LABEL, MAX_MULTI_LABELS, Corpus, Item, ListOptions, fingerprint
from ..errors import CompileError
from ..listing import is_text, is_url, lines, name_key, read_bytes, utf8

NAME = "manifest"
MEDIA = ("audio", "video", "image")
SIGNS = ".jsonl manifest"
SUFFIXES = (".jsonl", ".json")


def detect(source: Path) -> bool:
    return source.suffix in SUFFIXES and source.is_file()


def source_media(source: Path) -> str:
    """video when the first line that parses names a ``video_filepath``, else audio."""
    if not source.is_file():
        return "audio"
    with source.open(encoding="utf-8", errors="replace") as f:
        for line in f:  # the first line that parses (the manifest reader reports bad ones)
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and "video_filepath" in obj:
                return "video"
            break
    return "audio"


def _manifest_line(line: str, path_key: str) -> tuple[dict[str, Any], str, float, float | None]:
    """One parsed JSON line: (object, media path, offset, duration); ValueError/TypeError if bad."""
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise TypeError(f"not a JSON object but {type(obj).__name__}")
    audio = obj[path_key]
    if not isinstance(audio, str):
        raise TypeError(f"{path_key} is not a string")
    for name in ("id", "text"):
        if isinstance(obj.get(name), str) and not is_text(obj[name]):
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
    if isinstance(value, str) and is_text(value):
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


def list_corpus(path: Path, options: ListOptions) -> Corpus:
    media = options.media
    if not path.is_file():
        raise CompileError(f"{path}: manifest file not found")
    raw = read_bytes(path)
    base = path.parent
    items: list[Item] = []
    path_key = "video_filepath" if media == "video" else "audio_filepath"
    first_error: str | None = None
    kinds: dict[str, tuple[str, int]] = {}  # "label"/"labels" -> (kind, line deciding it)
    for n, offset, data in lines(raw):
        where = f"{path.name} line {n}"
        line, error = utf8(data, where, offset)
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
        media_path = audio if is_url(audio) else str(base / audio)  # a URL stays as written
        item = Item(key=key, path=media_path, offset=start, duration=duration)
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
        fingerprint(items, raw, path),
        media=media,
        num_labels=num_labels,
    )

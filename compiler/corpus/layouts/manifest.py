"""NeMo-style JSON-lines manifests: one object per line, media paths relative to the manifest
(or URLs, read as written)."""

from __future__ import annotations

import json
import math
import re
from array import array
from collections.abc import Iterator
from typing import Any

import numpy as np

from dlop.formats.generations import Listed, listed_file

from ...errors import CompileError
from ..listing import I64, bytes_fingerprint, is_text, lines, path_key, utf8
from ..place import Place
from ..records import MAX_LABEL, MAX_MULTI_LABELS, Corpus, Item, ListOptions, OnDemand

NAME = "manifest"
MEDIA = ("audio", "video", "image")
SIGNS = ".jsonl manifest"
SUFFIXES = (".jsonl", ".json")


def detect(source: Place) -> bool:
    return source.suffix in SUFFIXES and source.is_file()


def source_media(source: Place) -> str:
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


# -- the compact listing ------------------------------------------------------------------

# Label kinds per input, as the listing stores them (one byte an input).
_ABSENT, _INT, _NAME, _BAD, _HUGE = 0, 1, 2, 3, 4  # _HUGE: an integer outside int64


class _Labels:
    """One label field's values as the listing met them: per input its kind and value (an
    int, or a name's code in order of first sight), flattened for ``labels`` lists."""

    def __init__(self) -> None:
        self.has = array("b")  # per input: whether its line has the field
        self.first = array("q")  # per input: where its values start in kind/value
        self.kind = array("b")
        self.value = array("q")
        self.codes: dict[str, int] = {}
        self.absent = 0  # inputs before the first line with the field (not in has/first)
        self.decided: tuple[str, int] | None = None  # (kind, line deciding it)

    def add(self, values: list[Any] | None, n: int) -> None:
        if values is None and not self.has:  # a field no line has so far costs nothing
            self.absent += 1
            return
        if self.absent:
            self.has.extend(bytes(self.absent))
            self.first.extend(array("q", bytes(8 * self.absent)))
            self.absent = 0
        self.first.append(len(self.kind))
        self.has.append(values is not None)
        for v in values or ():
            if type(v) is int:
                kind, value = (_INT, v) if v in I64 else (_HUGE, 0)
            elif isinstance(v, str) and is_text(v):
                kind, value = _NAME, self.codes.setdefault(v, len(self.codes))
            else:
                kind, value = _BAD, 0
            if self.decided is None and kind != _BAD:
                self.decided = ("int" if kind != _NAME else "name", n)
            self.kind.append(kind)
            self.value.append(value)

    def skip(self) -> None:
        """An input whose line does not parse."""
        self.add(None, 0)

    def present(self) -> bool:
        """Whether any line that parses has the field."""
        return bool(self.has.count(1))

    def finish(self) -> None:
        """After the last line (only called when the field is present)."""
        self.add([], 0)  # brings ``has`` and ``first`` up to every input
        self.has.pop()
        self.first.pop()


class ManifestItems(OnDemand):
    """A manifest's inputs as Items made on demand from the manifest's bytes (the line of
    each input, found by its byte offset) and a few numpy columns: a long manifest costs
    a few dozen bytes an input besides its bytes. Slices are lists of Items (what a work
    unit carries), so no task holds the whole listing."""

    def __init__(
        self, raw: bytes, base: Place, path_key: str, allow_paths: tuple[str, ...] = ()
    ) -> None:
        self.raw, self.base, self.path_key = raw, base, path_key
        self.allow_paths = allow_paths  # where paths outside the manifest's folder may lead
        self.starts = np.zeros(0, np.int64)  # per input: its line's byte offset
        self.offset = np.zeros(0, np.float64)  # seconds
        self.duration = np.zeros(0, np.float64)  # seconds; NaN: none given
        self.label = np.zeros(0, np.int64)  # class index of a good input's label, else -1
        self.labels: tuple[np.ndarray, np.ndarray] | None = None  # (first, class values)
        # input -> (its key when its line does not parse, else None; the error)
        self.bad: dict[int, tuple[str | None, str]] = {}

    def __len__(self) -> int:
        return len(self.starts)

    def line(self, i: int) -> str:
        start = int(self.starts[i])
        end = self.raw.find(b"\n", start)
        data = self.raw[start : len(self.raw) if end < 0 else end]
        return data.removesuffix(b"\r").decode("utf-8")

    def parsed(self, i: int) -> tuple[dict[str, Any], str, float, float | None, str]:
        """Input ``i``'s line, parsed (it is not one of ``bad``): its object, media path,
        offset, duration and key."""
        obj, audio, start, duration = _manifest_line(self.line(i), self.path_key)
        key = str(obj.get("id") or path_key(audio) + (f"@{start:g}" if start else ""))
        return obj, audio, start, duration, key

    def keys(self) -> Iterator[str]:
        for i in range(len(self)):
            where, _ = self.bad.get(i, (None, None))
            yield where if where is not None else self.parsed(i)[4]

    def item(self, i: int) -> Item:
        where, error = self.bad.get(i, (None, None))
        if where is not None:
            return Item(key=where, error=error)
        obj, audio, start, duration, key = self.parsed(i)
        media_path: str | None = None
        if error is None:
            try:
                media_path = self.base.confine(audio, self.allow_paths)  # a URL as written
            except ValueError as e:
                error = f"{key}: {e}"
        item = Item(key=key, path=media_path, offset=start, duration=duration, error=error)
        if "text" in obj:
            item.text = str(obj["text"])
        if error is None and self.label[i] >= 0:
            item.label = int(self.label[i])
        if error is None and self.labels is not None:
            first, values = self.labels
            item.labels = values[first[i] : first[i + 1]].tolist()
        return item


def list_corpus(path: Place, options: ListOptions) -> Corpus:
    """The manifest's lines in file order. For an append (``options.known``) whose archive
    listed the manifest as it begins now, the lines after those only (_tail)."""
    if not path.is_file():
        raise CompileError(f"{path}: manifest file not found")
    raw = path.read_bytes()
    path_key = "video_filepath" if options.media == "video" else "audio_filepath"
    if options.known is not None:
        tail = _tail(path, raw, path_key, options)
        if tail is not None:
            return tail
    items = ManifestItems(raw, path.parent, path_key, options.allow_paths)
    fields = {"label": _Labels(), "labels": _Labels()}
    has_text, first_error = _scan(items, path.name, fields)
    if first_error is not None and len(items.bad) == len(items):
        raise CompileError(
            f"{path}: not a JSON-lines manifest (one JSON object per line, UTF-8); no line "
            f"parses, the first: {first_error}"
        )
    metadata, num_labels = _classes(items, fields)
    return _corpus(
        path,
        raw,
        items,
        fields["label"].present(),
        has_text,
        metadata,
        num_labels,
        options,
        listed_file(raw, len(items)),
    )


def _corpus(
    path: Place,
    raw: bytes,
    items: ManifestItems,
    has_label: bool,
    has_text: bool,
    metadata: dict[str, Any],
    num_labels: int,
    options: ListOptions,
    listed: Listed | None,
    after: Listed | None = None,
) -> Corpus:
    return Corpus(
        "manifest",
        str(path),
        items,
        has_label,
        has_text,
        {},
        metadata,
        bytes_fingerprint(raw, "manifest"),  # paths, offsets, durations, texts: all in it
        media=options.media,
        num_labels=num_labels,
        unit_sizes=True,
        listed=listed,
        after=after,
    )


_BLANK_LINE = re.compile(rb"(?:^|\n)[ \t\r\f\v]*\n")
_ESCAPED_ASCII = re.compile(rb"\\u00[0-7]")  # an ASCII character escaped (writers do so rarely)


def _tail(path: Place, raw: bytes, path_key: str, options: ListOptions) -> Corpus | None:
    """The lines after those the archive appended to listed (Corpus.after), when the
    manifest begins with the very bytes it listed, every line after them parses, and
    neither the archive nor those lines give labels (whose kind, classes and width the
    whole manifest decides). None otherwise, and the whole manifest is listed."""
    known = options.known
    assert known is not None
    size = known.listed.size
    head = known.listed.head_of(raw)
    if (
        head is None
        # no blank line: each line is an input, so the record's count is checked against
        # its bytes (an index may come from anywhere)
        or _BLANK_LINE.search(head.removeprefix(b"\xef\xbb\xbf"))
        or head.count(b"\n") != known.listed.inputs
        # labels anywhere before, even where the archive has no field for them (empty or
        # bad ones): whether a new line lacks them only the whole manifest tells
        or {"label", "labels"} & set(known.fields)
        or {"classes", "label_classes"} & set(known.metadata)
        or b"label" in head
        or _ESCAPED_ASCII.search(head)  # a key spelt with escapes ("\u006cabel")
        or raw.startswith(b"\xef\xbb\xbf", size)  # a mark only the file's start drops
    ):
        return None
    before = known.listed.inputs
    items = ManifestItems(raw[size:], path.parent, path_key, options.allow_paths)
    fields = {"label": _Labels(), "labels": _Labels()}
    has_text, _ = _scan(items, path.name, fields)
    if items.bad or any(labels.present() for labels in fields.values()):
        return None
    # the new lines' places in the whole manifest: each Item reads its line from it
    items.raw, items.starts = raw, items.starts + size
    listed = listed_file(raw, before + len(items))
    has_text = has_text or "text" in known.fields
    return _corpus(path, raw, items, False, has_text, {}, 0, options, listed, after=known.listed)


def _scan(items: ManifestItems, name: str, fields: dict[str, _Labels]) -> tuple[bool, str | None]:
    """One pass over the manifest's lines: each input's line offset, offset and duration,
    its labels as met, and the lines that do not parse. Returns (has text, first error)."""
    starts, offsets, durations = array("q"), array("d"), array("d")
    has_text, first_error = False, None
    for n, at, data in lines(items.raw, name):
        where = f"{name} line {n}"
        line, error = utf8(data, where, at)
        if not line.strip():
            continue
        if error is None:
            try:
                obj, _, start, duration = _manifest_line(line, items.path_key)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                error = f"{where} (byte {at}): {type(e).__name__}: {e}"
        starts.append(at)
        if error is not None:
            first_error = first_error or error
            items.bad[len(starts) - 1] = (where, error)
            offsets.append(0.0)
            durations.append(math.nan)
            for labels in fields.values():
                labels.skip()
            continue
        offsets.append(start)
        durations.append(math.nan if duration is None else duration)
        has_text = has_text or "text" in obj
        for field, labels in fields.items():
            if field not in obj:
                labels.add(None, n)
            else:
                labels.add(obj[field] if field == "labels" else [obj[field]], n)
    items.starts = np.frombuffer(starts, np.int64)
    items.offset = np.frombuffer(offsets, np.float64)
    items.duration = np.frombuffer(durations, np.float64)
    items.label = np.full(len(starts), -1, np.int64)
    return has_text, first_error


def _check(items: ManifestItems, bad: np.ndarray, field: str, labels: _Labels) -> None:
    """Marks bad (in ``bad`` and ``items.bad``) the good inputs without ``field``, or with
    a value of another kind than the first usable one, or out of range."""
    limit = MAX_LABEL + 1 if field == "label" else MAX_MULTI_LABELS
    kind, first_line = labels.decided or ("int", 0)  # no usable value anywhere: all are bad
    first = f"line {first_line} gives class {'indices' if kind == 'int' else 'names'}"
    kinds, values = np.frombuffer(labels.kind, np.int8), np.frombuffer(labels.value, np.int64)
    wrong = kinds != (_INT if kind == "int" else _NAME)
    if kind == "int":
        wrong |= (values < 0) | (values >= limit)
    firsts = np.append(np.frombuffer(labels.first, np.int64), len(kinds))
    owner = np.repeat(np.arange(len(items)), np.diff(firsts))
    wrong_input = np.bincount(owner[wrong], minlength=len(items)) > 0
    has = np.frombuffer(labels.has, np.int8).astype(bool)
    for i in np.flatnonzero(~bad & (~has | wrong_input)).tolist():
        key = items.item(i).key
        if not has[i]:
            items.bad[i] = (None, f"{key}: no {field}, while other manifest lines have them")
        else:
            value = json.loads(items.line(i))[field]
            got = value if field == "labels" else [value]
            why = next(w for v in got if (w := _label_error(v, kind, limit, first)))
            items.bad[i] = (None, f"{key}: {field} {why}")
        bad[i] = True


def _classes(items: ManifestItems, fields: dict[str, _Labels]) -> tuple[dict[str, Any], int]:
    """Checks the labels of every line before any class list is made (so a bad line adds
    no class), then gives the good inputs their class indices. Returns (metadata,
    num_labels)."""
    bad = np.zeros(len(items), bool)
    bad[list(items.bad)] = True
    present = [f for f, labels in fields.items() if labels.present()]
    for field in present:
        fields[field].finish()
    for field in present:
        _check(items, bad, field, fields[field])
    metadata: dict[str, Any] = {}
    num_labels = 0
    for field in present:
        labels = fields[field]
        sizes = np.diff(np.append(np.frombuffer(labels.first, np.int64), len(labels.kind)))
        values = np.frombuffer(labels.value, np.int64)[np.repeat(~bad, sizes)]
        names: list[str] = []
        if (labels.decided or ("int", 0))[0] == "name":
            by_code = list(labels.codes)
            names = sorted(by_code[c] for c in np.unique(values).tolist())
            metadata["classes" if field == "label" else "label_classes"] = names
            remap = np.full(len(by_code), -1, np.int64)
            remap[[labels.codes[v] for v in names]] = np.arange(len(names))
            values = remap[values]
        if field == "label":
            items.label[~bad] = values
        else:
            counts = np.where(bad, 0, sizes)
            items.labels = (np.concatenate([[0], np.cumsum(counts)]), values)
            num_labels = len(names) if names else int(values.max(initial=-1)) + 1
    return metadata, num_labels

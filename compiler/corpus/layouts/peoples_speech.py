"""People's Speech, the original release: a JSON-lines manifest per subset, FLAC in tar shards.

Each manifest line is a source document (``audio_document_id``, ``identifier``,
``training_data: {duration_ms: [...], label: [...], name: [...]}`` as parallel
lists); each segment is one sample, its transcript the ``label``, with
``duration_ms`` and ``audio_document_id`` kept. A segment's ``name`` is a path
inside the subset's audio folder (``<manifest stem>/`` beside the manifest, or
the manifest's own folder): a member of one of the ``.tar`` shards below it,
else a file there. Tars are read member by member, in one pass each, never
extracted to disk; members are bytes only, never unpickled or executed.

Corpus order: segments in tars by shard name then member order (so each tar is
read once, front to back), then the other segments in manifest order.

A segment is one sample: a name given again (on another line, or twice in one
line's lists) is a bad input for the repeat alone, recorded with where the name
was first given; the first keeps its place and every other segment is compiled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...errors import CompileError
from ..listing import AUDIO_EXTS, I64, is_text, key_name, lines, name_bytes, name_key, utf8
from ..place import Place, source_place
from ..records import Corpus, Item, ListOptions, fingerprint

NAME = "peoples-speech"
MEDIA = ("audio",)
SIGNS = "People's Speech .json manifest (training_data lines)"
SUFFIXES = (".json", ".jsonl")
SIGN = b'"training_data"'
_HEAD_BYTES = 1 << 16  # the sign is looked for in a manifest's first 64 KiB
EXTRA_FIELDS = {"duration_ms": "i64", "audio_document_id": "str"}


def _has_sign(path: Place) -> bool:
    try:
        with path.open("rb") as f:
            return SIGN in f.read(_HEAD_BYTES)
    except OSError:
        return False


def _manifests(source: Place) -> list[Place]:
    if source.is_file():
        return [source]
    if not source.is_dir():
        return []
    found = (p for p in source.iterdir() if p.suffix in SUFFIXES and p.is_file())
    return sorted(p for p in found if _has_sign(p))


def detect(source: Place) -> bool:
    if source.is_file():
        return source.suffix in SUFFIXES and _has_sign(source)
    return bool(_manifests(source))


def _audio_dir(manifest: Place) -> Place:
    folder = manifest.parent / manifest.stem
    return folder if folder.is_dir() else manifest.parent


def _member_name(name: str) -> str:
    return name[2:] if name.startswith("./") else name


def _tar_index(tars: list[Place]) -> tuple[dict[str, tuple[int, int]], list[str]]:
    """member name -> (tar number, position in it) over the tars' headers (no data is read);
    and the tars that could not be listed, with why."""
    index: dict[str, tuple[int, int]] = {}
    damaged: list[str] = []
    for t, tar in enumerate(tars):
        try:
            with tar.open("rb") as f, tarfile.open(fileobj=f, mode="r:") as tf:
                for pos, m in enumerate(tf):
                    if m.isfile():
                        index.setdefault(_member_name(m.name), (t, pos))
        except (tarfile.TarError, OSError, EOFError) as e:
            damaged.append(f"{name_key(tar.name)}: not a readable tar ({e})")
    return index, damaged


@dataclasses.dataclass
class _Segment:
    item: Item
    name: str  # the segment's path in the audio folder ("" for a bad line)
    where: str = ""  # the manifest line and segment that named it


def _line_segments(obj: Any, where: str) -> list[tuple[str, Any, Any]]:
    """(name, label, duration_ms) of each segment of a manifest line; ValueError if malformed."""
    if not isinstance(obj, dict) or not isinstance(obj.get("training_data"), dict):
        raise ValueError("not an object with a training_data object")
    data = obj["training_data"]
    lists = [data.get(k) for k in ("name", "label", "duration_ms")]
    if not all(isinstance(v, list) for v in lists):
        raise ValueError("training_data needs lists name, label and duration_ms")
    names, labels, durations = lists
    if not len(names) == len(labels) == len(durations):
        raise ValueError(
            f"training_data lists differ in length (name {len(names)}, label {len(labels)}, "
            f"duration_ms {len(durations)}); they must be parallel"
        )
    return list(zip(names, labels, durations, strict=True))


def _segment_error(name: Any, label: Any, duration: Any) -> str | None:
    if not isinstance(name, str) or not name or not is_text(name):
        return f"name {name!r} is not a file name"
    if not isinstance(label, str) or not is_text(label):
        return f"label {label!r} is not a transcript string"
    if type(duration) is not int or duration < 0 or duration not in I64:
        return f"duration_ms {duration!r} is not a whole number of milliseconds >= 0"
    return None


def _read_manifest(manifest: Place, rel: str) -> tuple[bytes, list[_Segment]]:
    raw = manifest.read_bytes()
    segments: list[_Segment] = []
    for n, offset, data in lines(raw, manifest):
        where = f"{rel} line {n}"
        text, error = utf8(data, where, offset)
        if not text.strip():
            continue
        try:
            obj = json.loads(text) if error is None else {}
            found = [] if error is not None else _line_segments(obj, where)
        except (json.JSONDecodeError, ValueError) as e:
            error = f"{where} (byte {offset}): {type(e).__name__}: {e}"
        if error is not None:
            segments.append(_Segment(Item(key=where, error=error), ""))
            continue
        doc = obj.get("audio_document_id", obj.get("identifier", ""))
        for i, (name, label, duration) in enumerate(found):
            why = _segment_error(name, label, duration)
            key = name_key(name) if isinstance(name, str) and name else f"{where} segment {i}"
            item = Item(key=key, text=label if why is None else None)
            if why is not None:
                item.error = f"{where} segment {i}: {why}"
            else:
                item.extras = {"duration_ms": duration, "audio_document_id": str(doc)}
            name = _member_name(name) if why is None else ""
            segments.append(_Segment(item, name, f"{where} segment {i}"))
    return raw, segments


def list_corpus(source: Place, options: ListOptions) -> Corpus:
    manifests = _manifests(source)
    if not manifests:
        raise CompileError(
            f"{source}: no People's Speech manifest (a .json or .jsonl file whose lines hold "
            "training_data) found"
        )
    root = source if source.is_dir() else source.parent
    h = hashlib.sha256()
    in_tars: list[tuple[tuple[int, int, int], Item]] = []
    rest: list[Item] = []
    first: dict[tuple[str, str], str] = {}  # (audio folder, segment name) -> where first named
    for m, manifest in enumerate(manifests):
        raw, segments = _read_manifest(manifest, name_key(manifest.name))
        h.update(hashlib.sha256(raw).digest())
        audio = _audio_dir(manifest)
        _mark_repeats(segments, str(audio), first)
        tars = sorted(audio.walk((".tar",), corpus=root, allowed=options.allow_paths))
        index, damaged = _tar_index(tars)
        for tar in tars:
            h.update(name_bytes(str(tar.relative_to(root))) + f"\0{tar.size()}\n".encode())
        for seg in segments:
            item = seg.item
            if item.error is None and seg.name in index:
                t, pos = index[seg.name]
                ext = Path(seg.name).suffix.lower()
                item.member = (str(tars[t]), ext[1:] if ext in AUDIO_EXTS else "flac")
                in_tars.append(((m, t, pos), item))
                continue
            if item.error is None:
                try:
                    item.path = audio.confine(seg.name, options.allow_paths)
                except ValueError as e:
                    item.error = f"{seg.where}: {e}"
                    rest.append(item)
                    continue
                if tars and not (audio / seg.name).is_file():
                    item.error = (
                        f"{name_key(manifest.name)}: segment {item.key!r} is a member of none "
                        f"of the {len(tars)} tar shards below {name_key(audio.name)}/ and no "
                        "file there" + (f" ({'; '.join(damaged)})" if damaged else "")
                    )
            rest.append(item)
    items = [item for _, item in sorted(in_tars, key=lambda p: p[0])] + rest
    return Corpus(
        NAME,
        str(source),
        items,
        False,
        True,
        dict(EXTRA_FIELDS),
        {},
        fingerprint(items, h.digest(), source),
    )


def _mark_repeats(segments: list[_Segment], audio: str, first: dict[tuple[str, str], str]) -> None:
    """Makes each segment whose name was given before a bad input of its own; the first
    keeps its place (reading one tar member twice in a pass is not possible, and two samples
    under one key could not be told apart)."""
    for seg in segments:
        if seg.item.error is not None or not seg.name:
            continue
        was = first.setdefault((audio, seg.name), seg.where)
        if was != seg.where:
            seg.item.error = (
                f"{seg.where}: segment {seg.item.key!r} was already named at {was}; "
                "each segment is compiled once"
            )
            seg.item.text, seg.item.extras = None, {}
            seg.name = ""


def stream(corpus: Corpus, start: int, stop: int | None) -> Iterator[Item]:
    """The registry's hook: items [start, stop), tar members read in one pass per tar; each
    item yielded with bytes is a copy (the corpus's own items stay light)."""
    for tar, run in itertools.groupby(
        corpus.items[start:stop], key=lambda it: (it.member or ("", ""))[0]
    ):
        if tar:
            path = source_place(tar, corpus.storage_options)
            yield from _stream_tar(path, list(run))
        else:
            yield from run


def _stream_tar(tar: Place, items: list[Item]) -> Iterator[Item]:
    """The wanted members' bytes, in tar order; one the tar no longer holds is a bad input."""
    wanted = iter(items)
    item = next(wanted, None)
    problem = "the tar holds no such member (it changed since the listing)"
    try:
        with tar.open("rb") as f, tarfile.open(fileobj=f, mode="r:") as tf:
            for m in tf:
                if item is None:
                    return
                if not m.isfile() or _member_name(m.name) != _name_of(item):
                    continue
                member = tf.extractfile(m)
                data = member.read() if member is not None else b""
                ext = (item.member or ("", "flac"))[1]
                yield dataclasses.replace(item, data={ext: data})
                item = next(wanted, None)
    except (tarfile.TarError, OSError, EOFError) as e:
        problem = f"the tar could not be read to it ({e})"
    while item is not None:
        yield dataclasses.replace(item, error=f"{name_key(tar.name)}: {item.key!r}: {problem}")
        item = next(wanted, None)


def _name_of(item: Item) -> str:
    return key_name(item.key)

"""Lhotse manifests: a CutSet, or a RecordingSet with its SupervisionSet (``.jsonl``/``.jsonl.gz``).

Each supervision segment (or each cut of a CutSet) is one sample over its span
of the recording, with its text, speaker and language (``""`` where the
manifest gives none). The manifests are read as JSON lines here; Lhotse itself
is not needed, and nothing a manifest names is ever run: a ``command`` or
``url`` audio source is a bad input.

Downmix: a sample decodes the recording's source file that holds its
supervision's (or cut's) channel, the first one named when it names several;
that file's channels become one by ``--downmix`` (mean by default), as for
every layout. A recording with one file per channel therefore gives exactly
the supervision's channel; one file holding every channel gives their mix.

A relative audio path is looked for beside the manifest first, then (as Lhotse
reads it) from the working directory.

SOURCE is one manifest (a cuts, supervisions or recordings file: the other of
a supervisions/recordings pair is found by name, ``supervisions`` <->
``recordings``), or a folder holding exactly one cuts file or one such pair.
"""

from __future__ import annotations

import gzip
import io
import json
import math
from pathlib import Path
from typing import Any

from dlop.formats.urls import is_url

from ...errors import CompileError
from ..listing import MAX_LINE_BYTES, is_text, lines, name_key, utf8
from ..place import Place
from ..records import Corpus, Item, ListOptions, fingerprint

NAME = "lhotse"
MEDIA = ("audio",)
SIGNS = "Lhotse cuts or recordings + supervisions .jsonl(.gz)"
KINDS = ("cuts", "supervisions", "recordings")
EXTRA_FIELDS = {"speaker": "str", "language": "str"}
MAX_MANIFEST_BYTES = 1 << 34  # a gzipped manifest inflating past 16 GiB is refused
INFLATE_CHUNK = 1 << 20
# A span may end this far past its recording's end (rounding in the manifest's seconds).
END_TOLERANCE = 1e-3


def _kind(path: Place) -> str | None:
    name = path.name
    if not (name.endswith(".jsonl") or name.endswith(".jsonl.gz")):
        return None
    return next((k for k in KINDS if k in name), None)


def _candidates(folder: Place) -> list[Place]:
    return sorted(p for p in folder.iterdir() if _kind(p) is not None and p.is_file())


def detect(source: Place) -> bool:
    if source.is_file():
        return _kind(source) is not None
    return source.is_dir() and bool(_candidates(source))


def _partner(path: Place) -> Place:
    kind = _kind(path)
    other = "recordings" if kind == "supervisions" else "supervisions"
    return path.with_name(path.name.replace(str(kind), other))


def _manifests(source: Place) -> tuple[Place, Place | None]:
    """(cuts or supervisions file, recordings file or None for cuts)."""
    if source.is_dir():
        found = _candidates(source)
        cuts = [p for p in found if _kind(p) == "cuts"]
        sup_files = [p for p in found if _kind(p) == "supervisions"]
        if len(cuts) + len(sup_files) != 1:
            raise CompileError(
                f"{source}: holds {len(cuts)} cuts and {len(sup_files)} supervisions manifests "
                f"({', '.join(p.name for p in found)}); pass the one to compile as SOURCE"
            )
        source = (cuts or sup_files)[0]
    kind = _kind(source)
    if kind is None or not source.is_file():
        raise CompileError(
            f"{source}: not a Lhotse manifest (*cuts*, *supervisions* or "
            "*recordings* .jsonl or .jsonl.gz)"
        )
    if kind == "cuts":
        return source, None
    sups, recs = (
        (source, _partner(source)) if kind == "supervisions" else (_partner(source), source)
    )
    for p in (sups, recs):
        if not p.is_file():
            raise CompileError(f"{source}: its {_kind(p)} manifest {p.name} is not beside it")
    return sups, recs


def _read(path: Place) -> bytes:
    """The manifest's text bytes, inflated when gzipped: chunk by chunk, so a line longer
    than MAX_LINE_BYTES or a whole past MAX_MANIFEST_BYTES stops it before either is
    held (a small file of zeros inflates to gigabytes without a line end)."""
    with path.open("rb") as f:
        raw = f.read()
    if not path.name.endswith(".gz"):
        return raw  # lines() bounds its lines
    out, last = bytearray(), 0  # ``last``: the bytes of the line not ended yet
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(raw)) as g:
            while chunk := g.read(INFLATE_CHUNK):
                out += chunk
                end = chunk.rfind(b"\n")
                last = last + len(chunk) if end < 0 else len(chunk) - end - 1
                if last > MAX_LINE_BYTES:  # lines within one chunk are shorter than it
                    line = out.count(b"\n") + 1
                    raise CompileError(
                        f"{path}: line {line} inflates past {MAX_LINE_BYTES} bytes; a "
                        "manifest line describes one input: the file is damaged or not a "
                        "manifest"
                    )
                if len(out) > MAX_MANIFEST_BYTES:
                    raise CompileError(f"{path}: inflates past {MAX_MANIFEST_BYTES} bytes")
    except (OSError, EOFError) as e:
        raise CompileError(f"{path}: not a readable gzip file ({e})") from None
    return bytes(out)


def _objects(path: Place) -> tuple[bytes, list[tuple[str, dict[str, Any] | None, str | None]]]:
    """(the file's bytes, each line's (where, object or None, error))."""
    raw = _read(path)
    out: list[tuple[str, dict[str, Any] | None, str | None]] = []
    for n, offset, data in lines(raw, path):
        where = f"{name_key(path.name)} line {n}"
        text, error = utf8(data, where, offset)
        if not text.strip():
            continue
        obj = None
        if error is None:
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                error = f"{where} (byte {offset}): not JSON ({e})"
            else:
                if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
                    error, obj = f"{where} (byte {offset}): not an object with a string id", None
        out.append((where, obj, error))
    return raw, out


def _seconds(obj: dict[str, Any], name: str, default: float | None = None) -> float:
    value = obj.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} {value!r} is not a number of seconds")
    if value < 0:
        raise ValueError(f"{name} {value} is negative")
    return float(value)


def _recording_seconds(recording: dict[str, Any]) -> float | None:
    """The recording's length: num_samples / sampling_rate, else its duration; None if neither."""
    samples, rate = recording.get("num_samples"), recording.get("sampling_rate")
    if type(samples) is int and type(rate) is int and samples >= 0 and rate > 0:
        return samples / rate
    try:
        return _seconds(recording, "duration")
    except ValueError:
        return None


def _audio_file(
    recording: dict[str, Any], channel: Any, base: Place, allowed: tuple[str, ...]
) -> str:
    """The path of the source file holding ``channel`` (its first, when a list)."""
    if recording.get("transforms"):
        raise ValueError("has transforms (speed, volume, resampling), which dlop does not apply")
    sources = recording.get("sources")
    if not isinstance(sources, list) or not sources:
        raise ValueError("has no audio sources")
    held = [c for s in sources if isinstance(s, dict) for c in s.get("channels") or []]
    named = channel if isinstance(channel, list) else [channel]
    if channel is not None and held and any(c not in held for c in named):
        raise ValueError(f"names channel {channel!r}, but its recording holds channels {held}")
    wanted = named[0] if named else None
    chosen = next(
        (s for s in sources if isinstance(s, dict) and wanted in (s.get("channels") or [])),
        sources[0],
    )
    if not isinstance(chosen, dict) or not isinstance(chosen.get("source"), str):
        raise ValueError("has a malformed audio source")
    if chosen.get("type") != "file":
        raise ValueError(
            f"audio source type {chosen.get('type')!r} is not read (only files; dlop never "
            "runs a command or fetches a url that a manifest names)"
        )
    text = chosen["source"]
    inside = base.confine(text, allowed)
    if Path(text).is_absolute() or is_url(text) or (base / text).is_file():
        return inside
    # as Lhotse reads it: from the working directory, when that is an allowed folder
    return base.confine(str(Path(text).absolute()), allowed)


def _sample(
    key: str,
    recording: dict[str, Any],
    span: dict[str, Any],
    sups: list[Any],
    base: Place,
    allowed: tuple[str, ...],
) -> Item:
    """One sample: ``span`` (a supervision or a cut) over ``recording``, told by ``sups``."""
    item = Item(key=key)
    item.path = _audio_file(recording, span.get("channel"), base, allowed)
    item.offset = _seconds(span, "start", 0.0)
    item.duration = _seconds(span, "duration")
    length = _recording_seconds(recording)
    if length is not None and item.offset + item.duration > length + END_TOLERANCE:
        raise ValueError(
            f"spans {item.offset:g} s to {item.offset + item.duration:g} s, past the end of its "
            f"recording {recording.get('id')!r} ({length:g} s); fix its start or duration"
        )
    texts = [s.get("text") for s in sups if isinstance(s, dict)]
    if any(t is not None and (not isinstance(t, str) or not is_text(t)) for t in texts):
        raise ValueError("text is not a string of text")
    given = [t for t in texts if isinstance(t, str)]
    if given and len(given) == len(texts):
        item.text = " ".join(given)
    first = sups[0] if sups and isinstance(sups[0], dict) else {}
    for name in EXTRA_FIELDS:
        value = first.get(name)
        item.extras[name] = value if isinstance(value, str) and is_text(value) else ""
    return item


def list_corpus(source: Place, options: ListOptions) -> Corpus:
    main, recs_path = _manifests(source)
    base = main.parent
    raw, rows = _objects(main)
    extra = raw
    recordings: dict[str, dict[str, Any] | str] = {}  # id -> recording, or its line's error
    if recs_path is not None:
        rec_raw, rec_rows = _objects(recs_path)
        extra += rec_raw
        for _, obj, _error in rec_rows:
            if obj is not None:
                recordings.setdefault(obj["id"], obj)
    items: list[Item] = []
    for where, obj, error in rows:
        if obj is None:
            items.append(Item(key=where, error=error))
            continue
        key = obj["id"] if is_text(obj["id"]) and obj["id"] else where
        try:
            items.append(_listed(key, obj, recordings, recs_path, base, options.allow_paths))
        except (ValueError, TypeError) as e:
            items.append(Item(key=key, error=f"{where}: {key!r} {e}"))
    if items and all(it.error is not None and it.path is None for it in items):
        raise CompileError(
            f"{main}: no line is a Lhotse {_kind(main)} entry; the first: {items[0].error}"
        )
    has_text = any(it.text is not None for it in items)
    return Corpus(
        NAME,
        str(source),
        items,
        False,
        has_text,
        dict(EXTRA_FIELDS),
        {},
        fingerprint(items, extra, source),
    )


def _listed(
    key: str,
    obj: dict[str, Any],
    recordings: dict[str, Any],
    recs_path: Place | None,
    base: Place,
    allowed: tuple[str, ...],
) -> Item:
    if recs_path is None:  # a cut carries its recording and supervisions
        if obj.get("type", "MonoCut") != "MonoCut" or not isinstance(obj.get("recording"), dict):
            raise ValueError(f"is a {obj.get('type')} (only MonoCuts with a recording are read)")
        sups = obj.get("supervisions") or []
        if not isinstance(sups, list):
            raise ValueError("supervisions is not a list")
        return _sample(key, obj["recording"], obj, sups, base, allowed)
    recording = recordings.get(str(obj.get("recording_id")))
    if recording is None:
        raise ValueError(
            f"names recording {obj.get('recording_id')!r}, which {recs_path.name} does not hold"
        )
    return _sample(key, recording, obj, [obj], base, allowed)

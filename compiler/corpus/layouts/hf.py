"""Hugging Face ``datasets`` Parquet files: an ``Audio`` (or ``Image``) column and scalar columns.

The media column is the feature's struct of ``bytes`` and ``path``: bytes are
decoded in memory; without bytes, a relative path is resolved against the
dataset folder (SOURCE, or the folder of a SOURCE file). The features, with
their ``ClassLabel`` names and ``Audio`` sampling rate, come from the Parquet
schema metadata under ``huggingface``.

Listing reads each file's footer and its small columns only, never the media
bytes; ``stream`` reads the media column one row group at a time, so a split
of any size never sits in memory. pyarrow is imported only here, when used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dlop.formats.extras import needs_extra

from ...errors import CompileError
from ..listing import AUDIO_EXTS, IMAGE_EXTS, is_text, name_bytes, name_key
from ..place import Place, source_place
from ..records import MAX_LABEL, Corpus, Item, ListOptions, fingerprint

NAME = "hf"
MEDIA = ("audio", "image")
SIGNS = "*.parquet files"
SUFFIX = ".parquet"
TEXT_COLUMNS = ("text", "sentence", "transcription")
FEATURE_TYPES = {"audio": "Audio", "image": "Image"}
# Parquet files are looked for this deep below SOURCE (data/train-0000.parquet,
# config/split/0000.parquet), so detection never walks a whole corpus of media files.
_PATTERNS = ("*.parquet", "*/*.parquet", "*/*/*.parquet")


def _pq() -> Any:
    with needs_extra("hf", "reading Parquet (layout hf)"):
        import pyarrow.parquet as pq
    return pq


def detect(source: Place) -> bool:
    if source.is_file():
        return source.suffix == SUFFIX
    return source.is_dir() and bool(_files(source))


def _files(source: Place) -> list[Place]:
    if source.is_file():
        return [source]
    return sorted({p for pattern in _PATTERNS for p in source.glob(pattern) if p.is_file()})


def _read_errors() -> tuple[type[BaseException], ...]:
    """What pyarrow raises on a damaged Parquet file (a bad footer, page or thrift header)."""
    import pyarrow as pa

    return (pa.ArrowException, OSError)


@contextlib.contextmanager
def _opened(path: Place) -> Iterator[Any]:
    """A Parquet file's reader over the path's file object (a local file or an fsspec one);
    a file pyarrow cannot read, opening it or in the ``with`` body, is a CompileError naming it."""
    pq = _pq()
    try:
        with path.open("rb") as f:
            yield pq.ParquetFile(f)
    except _read_errors() as e:
        raise CompileError(
            f"{path}: not a readable Parquet file ({_why(e)}); it may be truncated or "
            "damaged: fetch or write it again"
        ) from None


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def _features(schema: Any) -> dict[str, Any]:
    """The ``datasets`` features from the schema metadata ({} when the file has none)."""
    raw = (schema.metadata or {}).get(b"huggingface")
    try:
        info = json.loads(raw) if raw else {}
        features = info.get("info", {}).get("features", {})
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return {}
    return features if isinstance(features, dict) else {}


def _type_of(features: dict[str, Any], column: str) -> str:
    spec = features.get(column)
    return str(spec.get("_type", "")) if isinstance(spec, dict) else ""


def source_media(source: Place) -> str:
    """image when the first file's features hold an Image and no Audio column, else audio."""
    files = _files(source)
    if not files:
        return "audio"
    with _opened(files[0]) as pf:
        features = _features(pf.schema_arrow)
    types = {_type_of(features, c) for c in features}
    return "image" if "Image" in types and "Audio" not in types else "audio"


@dataclasses.dataclass(frozen=True)
class _Columns:
    """Which column holds what, told once from the first file's schema."""

    media: str
    text: str | None
    label: str | None
    keep: dict[str, str]  # column -> "i64" | "f64" | "str"
    key: str | None  # a string ``id`` column names the samples


def _scalar_kind(arrow_type: Any) -> str | None:
    import pyarrow as pa

    if pa.types.is_integer(arrow_type) or pa.types.is_boolean(arrow_type):
        return "i64"
    if pa.types.is_floating(arrow_type):
        return "f64"
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "str"
    return None


def _media_struct(arrow_type: Any) -> bool:
    """An Audio or Image feature's storage: a struct of binary ``bytes`` and string ``path``."""
    import pyarrow as pa

    if not pa.types.is_struct(arrow_type):
        return False
    fields = {f.name: f.type for f in arrow_type}
    data, path = fields.get("bytes"), fields.get("path")
    return (
        data is not None
        and path is not None
        and (pa.types.is_binary(data) or pa.types.is_large_binary(data))
        and (pa.types.is_string(path) or pa.types.is_large_string(path))
    )


def _kind_of(schema: Any, column: str) -> str | None:
    return _scalar_kind(schema.field(column).type)


def _columns(path: Place, schema: Any, features: dict[str, Any], options: ListOptions) -> _Columns:
    names = list(schema.names)
    wanted = FEATURE_TYPES[options.media]
    media = next((c for c in names if _type_of(features, c) == wanted), None)
    if media is None and options.media in names:
        media = options.media
    if media is None or not _media_struct(schema.field(media).type):
        raise CompileError(
            f"{path}: no {wanted} column (a struct of binary bytes and string path, declared "
            f"in the huggingface schema metadata); columns: {names}"
            + (f"; {media!r} holds {schema.field(media).type}" if media is not None else "")
        )

    def pick(option: str, given: str | None, found: str | None) -> str | None:
        if given is not None and given not in names:
            raise CompileError(f"{path}: --{option} {given!r} is not a column; columns: {names}")
        column = given or found
        if column is not None and _scalar_kind(schema.field(column).type) is None:
            raise CompileError(
                f"{path}: --{option} {column!r} holds {schema.field(column).type}, "
                "not integers or strings"
            )
        return column

    text = pick(
        "text-column", options.text_column, next((c for c in TEXT_COLUMNS if c in names), None)
    )
    class_labels = [c for c in names if _type_of(features, c) == "ClassLabel"]
    found_label = "label" if "label" in names else next(iter(class_labels), None)
    label = pick("label-column", options.label_column, found_label)
    keep: dict[str, str] = {}
    for column in options.keep_columns:
        kind = _scalar_kind(schema.field(column).type) if column in names else None
        if kind is None or column in (media, text, label):
            why = "is not a column" if column not in names else f"holds {schema.field(column).type}"
            if column in (media, text, label):
                why = "is read already (media, text or label)"
            raise CompileError(
                f"{path}: --keep-columns {column!r} {why}; keep scalar columns (integers, "
                f"floats, strings) of {names}"
            )
        keep[column] = kind
    key = "id" if "id" in names and _scalar_kind(schema.field("id").type) == "str" else None
    return _Columns(media, text, label, keep, key)


def list_corpus(source: Place, options: ListOptions) -> Corpus:
    """Every row of every Parquet file, in file order then row order; media bytes not read."""
    files = _files(source)
    if not files:
        raise CompileError(
            f"{source}: no .parquet files found (looked {len(_PATTERNS)} levels deep)"
        )
    root = source if source.is_dir() else source.parent
    with _opened(files[0]) as first:
        schema = first.schema_arrow
    features = _features(schema)
    cols = _columns(files[0], schema, features, options)
    classes = _label_names(features, cols.label)
    if cols.label is not None and not classes and _kind_of(schema, cols.label) == "str":
        raise CompileError(
            f"{files[0]}: the label column {cols.label!r} holds strings but the huggingface "
            "schema metadata declares no ClassLabel names for it, so its values name no class "
            "index; cast it to a ClassLabel (datasets: class_encode_column), or pass "
            "--label-column with an integer column"
        )
    h = hashlib.sha256(json.dumps(features, sort_keys=True).encode())
    items: list[Item] = []
    for path in files:
        rel = name_key(str(path.relative_to(root)))
        h.update(name_bytes(rel) + f"\0{path.size()}\n".encode())
        with _opened(path) as pf:
            items += _list_file(pf, path, rel, cols, classes)
    metadata: dict[str, Any] = {"hf": _described(cols, features)}
    if classes:
        metadata["classes"] = classes
    return Corpus(
        NAME,
        str(source),
        items,
        cols.label is not None,
        cols.text is not None,
        dict(cols.keep),
        metadata,
        fingerprint(items, h.digest(), source),
        media=options.media,
    )


def _label_names(features: dict[str, Any], label: str | None) -> list[str]:
    spec = features.get(label or "")
    names = spec.get("names") if isinstance(spec, dict) else None
    return [str(n) for n in names] if isinstance(names, list) else []


def _described(cols: _Columns, features: dict[str, Any]) -> dict[str, Any]:
    """Where the archive's fields came from, and the media column's declared sampling rate."""
    spec = features.get(cols.media)
    rate = spec.get("sampling_rate") if isinstance(spec, dict) else None
    return {
        "media_column": cols.media,
        "text_column": cols.text,
        "label_column": cols.label,
        "keep_columns": list(cols.keep),
        "sampling_rate": rate if isinstance(rate, int) else None,
    }


def _list_file(pf: Any, path: Place, rel: str, cols: _Columns, classes: list[str]) -> list[Item]:
    names = list(pf.schema_arrow.names)
    small = [c for c in (cols.key, cols.text, cols.label, *cols.keep) if c is not None]
    missing = [c for c in small if c not in names]
    if missing or cols.media not in names:
        raise CompileError(
            f"{path}: lacks column(s) {missing or [cols.media]} that the first file has; "
            "every file of a split must share one schema"
        )
    items: list[Item] = []
    wanted = list(dict.fromkeys([*small, f"{cols.media}.path"]))
    row = 0
    for batch in pf.iter_batches(batch_size=1 << 16, columns=wanted):
        data = batch.to_pydict()
        paths = [(m or {}).get("path") for m in data[cols.media]]
        for n in range(batch.num_rows):
            items.append(_item(data, n, row, path, rel, cols, classes, paths[n]))
            row += 1
    _refuse_large_groups(pf, items, rel, cols.media)
    return items


def _refuse_large_groups(pf: Any, items: list[Item], rel: str, media: str) -> None:
    """Makes the rows of a row group whose media column takes more than MAX_GROUP_BYTES
    (uncompressed) bad inputs: the compile reads a row group's media column whole, so
    one such group would take twice its size in memory."""
    meta, start = pf.metadata, 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        size = sum(
            group.column(c).total_uncompressed_size
            for c in range(group.num_columns)
            if group.column(c).path_in_schema.split(".")[0] == media
        )
        if size > MAX_GROUP_BYTES:
            why = (
                f"its row group {g} holds {size} bytes of column {media!r} (uncompressed), "
                f"more than the {MAX_GROUP_BYTES} read at once; rewrite the file with smaller "
                "row groups (pyarrow's row_group_size, datasets' to_parquet batch_size)"
            )
            for n in range(start, min(start + group.num_rows, len(items))):
                items[n].error = f"{rel} row {n}: {why}"
        start += group.num_rows


def _item(
    data: dict[str, list[Any]],
    n: int,
    row: int,
    path: Place,
    rel: str,
    cols: _Columns,
    classes: list[str],
    media_path: str | None,
) -> Item:
    where = f"{rel} row {row}"
    key = data[cols.key][n] if cols.key is not None else None
    key = key if isinstance(key, str) and key and is_text(key) else where
    ext = Path(media_path or "").suffix.lower()
    known = ext in (AUDIO_EXTS if cols.media != "image" else IMAGE_EXTS)
    item = Item(key=key, member=(str(path), ext[1:] if known else "bin"), position=row)
    if cols.text is not None:
        text = data[cols.text][n]
        item.text = None if text is None else str(text)
    for column in cols.keep:
        if data[column][n] is not None:
            item.extras[column] = data[column][n]
    if cols.label is not None:
        value = data[cols.label][n]
        if isinstance(value, str) and classes:
            value = classes.index(value) if value in classes else None
        if type(value) is bool:
            value = int(value)
        top = len(classes) - 1 if classes else MAX_LABEL
        if type(value) is not int or not 0 <= value <= top:
            named = f" (the ClassLabel names {len(classes)} classes)" if classes else ""
            item.error = f"{where}: label {value!r} is not a class index from 0 to {top}{named}"
        else:
            item.label = value
    if item.text is not None and not is_text(item.text):
        item.error = f"{where}: text holds an unpaired surrogate escape, which is no text"
    return item


# Rows read from a Parquet file at a time: a row group of any size is never held whole.
STREAM_BATCH_ROWS = 16
MAX_GROUP_BYTES = 1 << 30  # a row group's media column read at once


class _Files:
    """A stream's files on one filesystem: URL files share one tree (one client, no listing)."""

    def __init__(self, corpus: Corpus) -> None:
        self.root_text = corpus.root
        source = corpus.root
        self.source = source_place(source, corpus.storage_options)

    def path(self, text: str) -> Place:
        return self.source.at(text)

    def root(self, file: str) -> Place:
        """What a relative media path is resolved against: SOURCE, or a SOURCE file's folder
        (the file listed is SOURCE itself), told without asking the storage."""
        return self.source.parent if file == self.root_text else self.source


def stream(corpus: Corpus, start: int, stop: int | None) -> Iterator[Item]:
    """The registry's hook: items [start, stop), each with its media bytes (or path), read a
    few rows at a time from the row groups that hold them. Each item names its row, so any
    slice of the items streams alike. The corpus's own items stay light: each one yielded
    is a copy. Items already known bad are passed on without reading their rows."""
    files = _Files(corpus)
    column = corpus.metadata["hf"]["media_column"]
    items = corpus.items[start:stop]
    runs = itertools.groupby(items, key=lambda it: ((it.member or ("", ""))[0], it.error is None))
    for (file, good), run in runs:
        todo = list(run)
        if not good:
            yield from todo
            continue
        with _opened(files.path(file)) as pf:
            yield from _stream_file(pf, file, todo, files.root(file), column, corpus.allow_paths)


def _row_groups(pf: Any, first: int, last: int) -> tuple[list[int], int]:
    """The row groups holding rows first..last, and the number of the first one's first row."""
    groups: list[int] = []
    group_start = begin = 0
    for g in range(pf.metadata.num_row_groups):
        rows = pf.metadata.row_group(g).num_rows
        if group_start <= last and first < group_start + rows:
            begin = group_start if not groups else begin
            groups.append(g)
        group_start += rows
    return groups, begin


def _stream_file(
    pf: Any, file: str, items: list[Item], root: Place, column: str, allowed: tuple[str, ...]
) -> Iterator[Item]:
    first, last, rows = items[0].position, items[-1].position, pf.metadata.num_rows
    if first < 0 or last >= rows or last - first + 1 != len(items):
        raise CompileError(
            f"{file}: holds {rows} rows, rows {first} to {last} were listed; the file changed "
            "during the compile"
        )
    groups, row = _row_groups(pf, first, last)
    where = name_key(Path(file).name)
    todo = iter(items)
    problem = f"the file ends before this row, though its footer counts {rows} rows"
    batches = pf.iter_batches(batch_size=STREAM_BATCH_ROWS, row_groups=groups, columns=[column])
    try:
        for batch in batches:
            cells = batch.column(0)
            for n in range(max(0, first - row), min(len(cells), last - row + 1)):
                cell = cells[n].as_py()
                yield _filled(next(todo), cell, root, f"{where} row {row + n}", allowed)
            row += len(cells)
            if row > last:
                break
    except _read_errors() as e:  # a damaged page: the rows not yet read are bad inputs
        problem = f"the file could not be read ({_why(e)})"
    for item in todo:
        yield dataclasses.replace(item, error=f"{where} row {item.position}: {problem}")


def _filled(
    item: Item, cell: dict[str, Any] | None, root: Place, where: str, allowed: tuple[str, ...]
) -> Item:
    """A copy of ``item`` with its media: the bytes in memory, else the resolved path."""
    data, path = (cell or {}).get("bytes"), (cell or {}).get("path")
    if item.error is not None:
        return item
    if not isinstance(data, bytes | None) or not isinstance(path, str | None):
        # a later file's media column of other types than the first file's
        return dataclasses.replace(
            item,
            error=f"{where}: the media cell holds {type(data).__name__} bytes and "
            f"{type(path).__name__} path, not binary bytes and a string path",
        )
    if data:
        ext = (item.member or ("", "bin"))[1]
        return dataclasses.replace(item, data={ext: data})
    if path:
        try:
            full = root.confine(path, allowed)
        except ValueError as e:
            return dataclasses.replace(item, error=f"{where}: {e}")
        return dataclasses.replace(item, path=full, member=None)
    why = "empty bytes and no path" if data is not None else "neither bytes nor a path"
    return dataclasses.replace(
        item, error=f"{where}: the media cell holds {why} (no media to decode)"
    )

"""Opening archives: ``open_archive`` (which Archive a path, list or URL names), the
Loader's archive (``open_for_loader``) and what a ``where`` keeps (``count_selected``,
for ``dlop-inspect info --where``)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dlop.formats import INDEX_NAME, Field, parse_index
from dlop.formats.transcode import needs_transcode
from dlop.formats.urls import is_url

from ..errors import UsageError, UsageTypeError
from ..storage.cached import open_cached
from ..storage.supply import local_index
from .concat import ArchivePaths, archive_paths
from .dataset import Archive
from .indices import field_names
from .selection import Where, select, text_codes, wanted_values


def open_archive(
    path: ArchivePaths,
    fields: Sequence[str] | str | None = None,
    pad_value: float = 0.0,
    *,
    where: Mapping[str, Any] | None = None,
    indices: Sequence[int] | np.ndarray | None = None,
    allow_recipe_mismatch: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_bytes: int | None = None,
    block_cache_bytes: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Archive:
    """Opens an archive, or several with one schema read as one, as a map-style Dataset
    of the samples ``where`` and ``indices`` choose (see Archive). A URL (``s3://``,
    ``https://``, any fsspec URL) is read through the node-local shard cache
    (runtime.storage.cached: ``cache_dir``, ``cache_bytes`` its byte budget), and so
    is a local archive with zstd fields given a ``cache_dir``. ``block_cache_bytes``
    sizes a local archive's decoded-block cache (Archive's). ``storage_options`` go to the fsspec filesystem of
    an archive at a URL (credentials, an endpoint, client settings), and are never kept
    in a loader state or shown in a message."""
    url = path if isinstance(path, str) and is_url(path) else None
    if storage_options is not None:
        if not isinstance(storage_options, Mapping):
            raise UsageTypeError(
                f"storage_options must be a dict of fsspec options, got "
                f"{type(storage_options).__name__}"
            )
        if url is None:
            raise UsageError(
                f"{path}: storage_options= are for an archive at a URL (s3://..., "
                "https://...); a local archive takes none"
            )
    if url is not None:
        if where is not None or indices is not None:
            raise UsageError(f"{path}: where= and indices= take local archives for now")
        refuse_block_cache(path, block_cache_bytes)
        names = field_names(url, fields)
        supply = open_cached(url, cache_dir, cache_bytes, storage_options, fields=names)
        return Archive.over(supply, fields, pad_value)
    if cache_dir is not None:
        paths = archive_paths(path)
        coded = [p for p in paths if needs_transcode(read_fields(p))]
        if coded:  # without block-coded fields the archive is mapped in place
            refuse_cached(coded[0], len(paths), where, indices)
            refuse_block_cache(coded[0], block_cache_bytes)
            names = field_names(paths[0], fields)
            supply = open_cached(paths[0], cache_dir, cache_bytes, local=True, fields=names)
            return Archive.over(supply, fields, pad_value)
    elif cache_bytes is not None:
        raise UsageError(
            f"{path}: cache_bytes= is the shard cache's budget, for an archive at a URL or "
            "given a cache_dir=; a local archive's decoded-block cache is block_cache_bytes="
        )
    archive_paths(path, distinct=True)  # a list naming one archive twice is refused
    return Archive(
        path,
        fields=fields,
        pad_value=pad_value,
        where=where,
        indices=indices,
        allow_recipe_mismatch=allow_recipe_mismatch,
        **({} if block_cache_bytes is None else {"block_cache_bytes": block_cache_bytes}),
    )


def read_fields(path: Path) -> list[Field]:
    """The fields an archive's reader reads: its own and those of its complete groups."""
    index = parse_index(path / INDEX_NAME, local_index(path))  # a sent archive's: as opened
    return [*index.fields, *(f for g in index.complete_groups() for f in g.fields)]


def refuse_cached(path: Path, count: int, where: Mapping[str, Any] | None, indices: object) -> None:
    """Refuses what a local archive read through the cache does not take yet."""
    if count > 1:
        raise UsageError(
            f"{path}: cache_dir decodes one zstd archive into the cache, got a list "
            f"of {count} archives; open them without cache_dir, or one at a time"
        )
    if where is not None or indices is not None:
        raise UsageError(
            f"{path}: where= and indices= do not take cache_dir yet; choose samples "
            "without cache_dir (zstd blocks decoded per batch), or drop the selection"
        )


def refuse_block_cache(path: object, block_cache_bytes: int | None) -> None:
    """Refuses a decoded-block budget for an archive read through the shard cache, which
    keeps its shards decoded."""
    if block_cache_bytes is not None:
        raise UsageError(
            f"{path}: block_cache_bytes= sizes a local archive's decoded-block cache, and "
            "this one is read through the shard cache, which keeps shards decoded "
            "(its budget is cache_bytes=)"
        )


def open_for_loader(
    archive: Archive | ArchivePaths,
    fields: Sequence[str] | str | None,
    pad_value: float | None,
    **options: Any,
) -> Archive:
    """The Loader's archive: ``archive`` opened with ``fields``, ``pad_value`` and
    ``options`` (open_archive's keywords); an Archive already open is taken as it is
    when they match it, refused when they do not."""
    if not isinstance(archive, Archive):
        pad = 0.0 if pad_value is None else pad_value
        return open_archive(archive, fields, pad, **options)
    given = [k for k, v in options.items() if v not in (None, False)]
    if given:
        raise UsageError(
            f"{archive.path}: Loader got an open Archive and {given[0]}=; give it to "
            f"open_archive(path, {given[0]}=...) instead, or pass the path"
        )
    if fields is not None:
        names = field_names(archive.path, fields)
        if names != list(archive.fields):
            raise UsageError(
                f"{archive.path}: Loader got an open Archive with fields {list(archive.fields)} "
                f"and fields={names}; open it with those fields (open_archive(path, "
                "fields=...)) or pass the path"
            )
    if pad_value is not None and pad_value != archive.pad_value:
        raise UsageError(
            f"{archive.path}: Loader got an open Archive padded with {archive.pad_value} and "
            f"pad_value={pad_value}; open it with that pad_value or pass the path"
        )
    return archive


def count_selected(archive: Any, where: Where) -> dict[str, Any]:
    """What ``where`` keeps of ``archive`` (an open Archive, a path or a list of paths):
    ``{"samples": all, "selected": kept, "values": {field: {value: kept count}}}``
    (for ``dlop-inspect info --where``)."""
    ds = archive if isinstance(archive, Archive) else Archive(archive, fields=[])
    chosen = select(ds.reader.fields, ds.shards, where, None, str(ds.path))
    base = np.arange(ds.num_samples) if ds.selection is None else ds.selection
    kept = base[np.isin(base, chosen)] if chosen is not None else base
    values: dict[str, dict[Any, int]] = {}
    for name, value in where.items():
        f = ds.reader.fields[name]
        if f.kind == "str":  # the kept samples hold one of the values asked for
            asked = sorted(set(wanted_values(f, value, str(ds.path))))
            codes = np.concatenate([text_codes(s, f, asked) for s in ds.shards])
            counts = np.bincount(codes[kept], minlength=len(asked))
            values[name] = {v: int(c) for v, c in zip(asked, counts.tolist(), strict=True) if c}
            continue
        col = np.concatenate([s.read_range(name, 0, s.num_samples) for s in ds.shards])
        found, counts = np.unique(col[kept], return_counts=True)
        values[name] = {v: int(c) for v, c in zip(found.tolist(), counts.tolist(), strict=True)}
    return {"samples": len(base), "selected": len(kept), "values": values}

"""A local archive with block-coded (zstd) fields read through the node-local shard
cache when a ``cache_dir`` is given: each shard is decoded once on the node into the
cache and its raw copy mapped, as for an archive at a URL (runtime.storage.remote_archive).

Batches then gather from zero-copy maps instead of decoding a block per sample.
The cache is the one remote archives use (same folder layout, budget, holds and
eviction), its folder named by a hash of the archive's index, so the same
archive read from disk and from object storage shares its cached shards.
Without a ``cache_dir`` a local archive never touches the cache, and an archive
with no block-coded field is mapped in place whatever the options.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dlop.formats import read_index
from dlop.formats.storage import Retry
from dlop.formats.transcode import needs_transcode

from ..archive.concat import ArchivePaths, archive_paths
from ..errors import UsageError
from .remote_archive import RemoteArchive

# A local read that fails or reads corrupt bytes fails the same way again.
LOCAL_RETRY = Retry(attempts=1)


class LocalFiles:
    """The one call of an fsspec filesystem the remote source makes, over local files."""

    def cat_file(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        with open(path, "rb") as f:
            f.seek(start or 0)
            return f.read() if end is None else f.read(max(0, end - (start or 0)))


class CachedArchive(RemoteArchive):
    """A local block-coded archive read through the node-local cache (see the module
    docstring); the same Dataset as a local Archive."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        fields: Sequence[str] | str | None = None,
        pad_value: float = 0.0,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_bytes: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        retry: Retry = LOCAL_RETRY,
    ) -> None:
        where = str(Path(path).resolve())
        super().__init__(where, fields, pad_value, cache_dir, cache_bytes, storage_options, retry)

    def client(self) -> tuple[Any, str]:
        return LocalFiles(), self.url


def open_cached(
    path: ArchivePaths,
    fields: Sequence[str] | str | None,
    pad_value: float,
    cache_dir: str | os.PathLike[str],
    cache_bytes: int | None,
    where: Mapping[str, Any] | None = None,
    indices: Sequence[int] | np.ndarray | None = None,
) -> CachedArchive | None:
    """The local archive at ``path`` read through the cache at ``cache_dir`` (within
    ``cache_bytes``, default ``DLOP_CACHE_BYTES``) when it has block-coded fields;
    None when it has none (it is mapped in place)."""
    paths = archive_paths(path)
    coded = [p for p in paths if needs_transcode(read_index(p).fields)]
    if not coded:
        return None
    if len(paths) > 1:
        raise UsageError(
            f"{coded[0]}: cache_dir decodes one zstd archive into the cache, got a list "
            f"of {len(paths)} archives; open them without cache_dir, or one at a time"
        )
    if where is not None or indices is not None:
        raise UsageError(
            f"{coded[0]}: where= and indices= do not take cache_dir yet; choose samples "
            "without cache_dir (zstd blocks decoded per batch), or drop the selection"
        )
    return CachedArchive(paths[0], fields, pad_value, cache_dir, cache_bytes)

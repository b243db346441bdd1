"""``open_remote``: an archive in object storage as an ``Archive``, its shards read
from the node-local cache (runtime.storage.cache) through a remote source
(runtime.storage.remote_source).

The index is fetched and validated first; it names the archive's cache folder
(a hash of its bytes). Block-coded (zstd) shards are decoded once as they
arrive and cached raw, so the gathers read them like raw shards: zero-copy
views of the mapped file. A batch is planned over the shards it touches only,
so shards the batch does not read need not be cached; the gathers made for a
set of shards are kept for the next batch over the same set while those
shards stay mapped (a window's batches touch the same few shards).
"""

from __future__ import annotations

import hashlib
import operator
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from dlop.formats import ArchiveReader, SchemaError, ShardReader
from dlop.formats.constants import MAX_INDEX_BYTES
from dlop.formats.redact import redact
from dlop.formats.storage import DEFAULT_RETRY, Retry
from dlop.formats.transcode import raw_fields

from ..archive.dataset import Archive, gather_for
from ..batch import Batch
from ..errors import SampleIndexError, UsageError, UsageTypeError
from ..gather.fields import Allocate, FieldGather
from ..gather.plan import CopyPlan
from .cache import CacheDir, is_shard
from .cache_folder import CacheError, byte_budget, default_cache_bytes, default_cache_dir
from .remote import fetch_index, filesystem
from .remote_source import RemoteSource

# Sets of shards whose gathers are kept (runtime.storage.remote_archive.Planners).
PLANNERS_KEPT = 64


class Planners:
    """The gathers for batches over a set of shards, kept while those shards stay
    mapped: made anew per batch they cost more than the copies of a small batch.
    ``forget(k)`` (shard k let go of) drops the gathers that read it, and with them
    their views of its mapping."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kept: dict[tuple[int, ...], tuple[list[ShardReader], dict[str, FieldGather]]] = {}

    def get(
        self, key: tuple[int, ...], readers: list[ShardReader]
    ) -> dict[str, FieldGather] | None:
        with self.lock:
            got = self.kept.get(key)
        if got is None or any(a is not b for a, b in zip(got[0], readers, strict=True)):
            return None  # a shard was mapped again since: new views
        return got[1]

    def put(
        self, key: tuple[int, ...], readers: list[ShardReader], gathers: dict[str, FieldGather]
    ) -> None:
        with self.lock:
            self.kept[key] = (readers, gathers)
            while len(self.kept) > PLANNERS_KEPT:
                del self.kept[next(iter(self.kept))]

    def forget(self, k: int) -> None:
        with self.lock:
            for key in [key for key in self.kept if k in key]:
                del self.kept[key]


class Sizing(FieldGather):
    """The Loader's buffer sizes for a field: fixed fields get a reusable buffer,
    others fresh tensors (their longest sample is not known before every shard
    was read)."""

    def buffer_numel(self, batch_size: int) -> int | None:
        if self.field.ragged or self.field.kind in ("str", "bytes"):
            return None
        return batch_size * int(np.prod(self.trail, dtype=np.int64))


class RemoteArchive(Archive):
    """An archive at a URL (see open_remote); the same Dataset as a local Archive."""

    def __init__(
        self,
        url: str,
        fields: Sequence[str] | str | None = None,
        pad_value: float = 0.0,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_bytes: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        retry: Retry = DEFAULT_RETRY,
    ) -> None:
        # The URL stands where a local archive has its folder: messages and pickling read it.
        self.path = cast(Path, url)
        self.url = url
        self._options = {
            "fields": names_of(url, fields),
            "pad_value": pad_value,
            "cache_dir": None if cache_dir is None else str(cache_dir),
            "cache_bytes": cache_bytes,
            "storage_options": dict(storage_options or {}),
            "retry": retry,
        }
        self.cache = CacheDir(
            default_cache_dir() if cache_dir is None else cache_dir,
            default_cache_bytes()
            if cache_bytes is None
            else byte_budget(cache_bytes, "cache_bytes"),
        )
        self.storage_options = dict(storage_options or {})
        fs, base = self.client()
        data = fetch_index(fs, base, url, MAX_INDEX_BYTES, retry)
        folder = self.cache.archive_dir(hashlib.sha256(data).hexdigest()[:24])
        publish(folder / "index.json", data)
        publish(folder / "source.txt", redact(url).encode() + b"\n")
        self.reader = ArchiveReader(folder)  # the validated index; shards come from the source
        check_shard_names(url, [s.file for s in self.reader.index.shards])
        names = names_of(url, fields)
        stored = list(self.reader.fields) if names is None else names
        missing = [n for n in stored if n not in self.reader.fields]
        if missing:
            raise SchemaError(
                f"{url}: no field(s) {missing}; fields are {list(self.reader.fields)}"
            )
        raw = {f.name: f for f in raw_fields(self.reader.index.fields)}
        self.fields = {n: raw[n] for n in stored}
        self.pad_value = pad_value
        self.planners = Planners()
        source = RemoteSource(url, self.reader.index, self.cache, folder, self.client, retry)
        source.on_drop = self.planners.forget
        source.sizes.check_budget(2)
        self.source = source  # type: ignore[assignment]
        self.shards = []  # mapped per batch by the source, never all at once
        self.paths = (self.path,)
        self.readers = [self.reader]
        self.selection = None
        self.shard_sizes = tuple(s.num_samples for s in self.reader.index.shards)
        self.shard_starts = np.cumsum((0, *self.shard_sizes), dtype=np.int64)
        self.num_samples = int(self.shard_starts[-1])
        self.starts = torch.from_numpy(self.shard_starts[:-1].copy())
        self.gathers = {n: Sizing(f, [], self.starts, pad_value) for n, f in self.fields.items()}
        self._engine = None

    def client(self) -> tuple[Any, str]:
        return filesystem(self.url, self.storage_options)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if isinstance(index, bool) or not hasattr(index, "__index__"):
            raise UsageTypeError(
                f"{self.url}: a sample number must be an integer, got {type(index).__name__}"
            )
        i, n = operator.index(index), len(self)
        if not -n <= i < n:
            raise SampleIndexError(f"{self.url}: sample {i} out of range 0..{n - 1} (or -{n}..-1)")
        batch = self.gather(torch.tensor([i + n if i < 0 else i]))
        out: dict[str, Any] = {}
        for name in self.fields:
            out[name] = batch[name][0]  # one sample: padded to its own shape, no padding
        return out

    def plan(
        self, indices: torch.Tensor, out: dict[str, torch.Tensor] | Allocate | None = None
    ) -> tuple[Batch, CopyPlan]:
        """As Archive.plan, over the shards ``indices`` touch, fetched first if need be."""
        per_index = self.shards_of(indices)
        touched = np.unique(per_index)
        self.source.ask(touched.tolist())  # held while planned, besides the Loader's own asks
        try:
            return self.plan_over(indices, per_index, touched, out)
        finally:
            self.source.release(touched.tolist())

    def plan_over(
        self,
        indices: torch.Tensor,
        per_index: np.ndarray,
        touched: np.ndarray,
        out: dict[str, torch.Tensor] | Allocate | None,
    ) -> tuple[Batch, CopyPlan]:
        key = tuple(touched.tolist())
        readers = [self.source.shard(k) for k in key]
        self.check_shards(touched)
        sizes = [r.num_samples for r in readers]
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        if len(indices):
            where = np.searchsorted(touched, per_index)
            local = indices.numpy() - self.shard_starts[per_index]
            indices = torch.from_numpy(starts[where] + local)
        gathers = self.planners.get(key, readers)
        if gathers is None:
            compact = torch.from_numpy(starts[:-1].copy())
            gathers = {
                n: gather_for(f, readers, compact, self.pad_value) for n, f in self.fields.items()
            }
            self.planners.put(key, readers, gathers)
        batch, steps = Batch(), []
        for name, g in gathers.items():
            where_out = out.get(name) if isinstance(out, dict) else out
            entries, field_steps = g.plan(indices, where_out)
            batch.update(entries)
            steps += field_steps
        return batch, CopyPlan(steps)

    def lengths(self, name: str) -> np.ndarray:
        """As Archive.lengths; reads each shard through the cache, one at a time."""
        f = self.fields.get(name)
        if f is None or not f.ragged:
            raise SchemaError(f"{self.url}: {name!r} is not a ragged field")
        axis = next(i for i, d in enumerate(f.shape) if d is None)
        parts = []
        for k in range(self.reader.num_shards):
            self.source.ask([k])
            try:
                parts.append(self.source.shard(k).shapes(name)[:, axis].copy())
            finally:
                self.source.release([k])
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def close(self) -> None:
        """Lets go of every cached shard this process holds."""
        source = self.source
        if isinstance(source, RemoteSource):
            source.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, **self._options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state.pop("url"), **state)  # type: ignore[misc]


def names_of(url: str, fields: Sequence[str] | str | None) -> list[str] | None:
    """``fields`` as a list of names (a str is one name), refused unless names."""
    if fields is None:
        return None
    names = [fields] if isinstance(fields, str) else list(fields)
    wrong = [n for n in names if not isinstance(n, str)]
    if wrong or len(set(names)) != len(names):
        raise UsageError(f"{url}: fields must be distinct field names (str), got {names!r}")
    return names


def publish(path: Path, data: bytes) -> None:
    """Writes ``data`` as ``path`` under a unique temporary name (several processes may)."""
    if path.exists() and path.read_bytes() == data:
        return
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def check_shard_names(url: str, names: list[str]) -> None:
    """Refuses shard names that are the cache's own files beside the shards."""
    for name in names:
        if not is_shard(name):
            raise CacheError(
                f"{url}: shard {name!r} has the name of a file the shard cache keeps beside "
                "the shards (index.json, source.txt, *.lock, *.tmp-*); such an archive "
                "cannot be read through the cache"
            )


def cache_options(
    cache_dir: str | os.PathLike[str] | None, cache_bytes: int | None
) -> dict[str, Any]:
    """The Loader's ``cache_dir``/``cache_bytes`` as options for open_archive: only
    those given, so archives that take no cache (local paths, mixtures) see none."""
    given = {"cache_dir": cache_dir, "cache_bytes": cache_bytes}
    return {k: v for k, v in given.items() if v is not None}


def open_remote(
    url: str,
    fields: Sequence[str] | str | None = None,
    pad_value: float = 0.0,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_bytes: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> RemoteArchive:
    """Opens the archive at ``url`` (any fsspec URL) as a map-style Dataset whose shards
    are cached under ``cache_dir`` (default ``DLOP_CACHE_DIR``, else a per-user cache
    folder) within ``cache_bytes`` (default ``DLOP_CACHE_BYTES``, else 16 GiB)."""
    if not isinstance(url, str) or "://" not in url:
        raise UsageError(f"open_remote takes a URL such as s3://bucket/archive, got {url!r}")
    return RemoteArchive(url, fields, pad_value, cache_dir, cache_bytes, storage_options)

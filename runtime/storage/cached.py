"""Opening a supply whose shards are read through the node-local cache: an archive at a
URL (any fsspec URL: ``s3://``, ``https://``, ``memory://``...), or a local archive with
block-coded (zstd) fields given a ``cache_dir``.

The index is fetched and validated first; it names the archive's cache folder (a
hash of its bytes), so the same archive read from disk and from object storage
shares its cached shards. Block-coded shards are decoded once on the node as they
arrive and cached raw, so the gathers read them like raw shards: zero-copy views
of the mapped file, where a local zstd archive read in place decodes each block a
batch touches. The supply itself (runtime.storage.remote_supply) fetches, holds and lets
go of the shards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlop.formats import ArchiveReader, Index, parse_index
from dlop.formats.archive import encode_index
from dlop.formats.constants import INDEX_NAME, MAX_INDEX_BYTES
from dlop.formats.redact import redact
from dlop.formats.storage import DEFAULT_RETRY, LocalStorage, Retry, Storage

from .cache import CacheDir, close_quietly, is_shard, locked
from .cache_folder import (
    BUDGET_LOCK,
    CacheError,
    byte_budget,
    default_cache_bytes,
    default_cache_dir,
)
from .grouped import GroupedSupply, group_index
from .remote import fetch_index, storage_at
from .remote_supply import RemoteSupply
from .supply import ShardSupply, pin_key, pinned_index

# A local read that fails or reads corrupt bytes fails the same way again.
LOCAL_RETRY = Retry(attempts=1)


@dataclass(frozen=True)
class Client:
    """This process's storage of the archive at ``where``: an fsspec client made once per
    process (runtime.storage.remote), or the local folder's files."""

    where: str
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    local: bool = False

    def __call__(self) -> Storage:
        if self.local:
            return LocalStorage(self.where)
        return storage_at(self.where, self.storage_options)


def open_cached(
    where: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None = None,
    cache_bytes: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    retry: Retry | None = None,
    local: bool = False,
    fields: Sequence[str] | None = None,
    index_data: bytes | None = None,
) -> ShardSupply:
    """The supply of the archive at ``where`` (a URL, or with ``local`` a folder) whose
    shards are cached under ``cache_dir`` (default ``DLOP_CACHE_DIR``, else a per-user
    cache folder) within ``cache_bytes`` (default ``DLOP_CACHE_BYTES``, else 16 GiB).
    A local archive's reads are not retried (``retry`` default: one attempt). The field
    groups holding any of ``fields`` (None: every field) are read beside the archive's
    shards (runtime.storage.grouped). ``index_data``: the index.json to read the archive
    by (as the process that sent the supply here read it), instead of the storage's now."""
    url = str(Path(where).resolve()) if local else str(where)
    retry = (LOCAL_RETRY if local else DEFAULT_RETRY) if retry is None else retry
    options = dict(storage_options or {})
    cache = CacheDir(
        default_cache_dir() if cache_dir is None else cache_dir,
        default_cache_bytes() if cache_bytes is None else byte_budget(cache_bytes, "cache_bytes"),
    )
    client = Client(url, options, local)
    if index_data is None:
        index_data = pinned_index(url)
    data = fetch_index(client(), url, MAX_INDEX_BYTES, retry) if index_data is None else index_data
    index = parse_index(f"{url}/{INDEX_NAME}", data)  # the format's bounds, first
    supply = _supply(url, data, index, cache, client, retry, "")
    supply.sizes.check_budget(2)
    # What reopens it in a DataLoader worker started by spawn: the same call, on the index
    # read here (an append or a field group compiled since does not change what it reads)
    reopen = (
        open_cached,
        (
            url,
            None if cache_dir is None else str(cache_dir),
            cache_bytes,
            options,
            retry,
            local,
            None if fields is None else list(fields),
            data,
        ),
    )
    supply.reopen = reopen
    supply.pin = {pin_key(url): data}
    names = [
        g.name
        for g in index.complete_groups()
        if fields is None or any(f.name in fields for f in g.fields)
    ]
    if not names:
        return supply
    groups: dict[str, RemoteSupply] = {}
    try:
        for name in names:
            data = group_index(index, name)
            group = parse_index(f"{url} field group {name}", data)
            groups[name] = _supply(url, data, group, cache, client, retry, name)
        grouped = GroupedSupply(supply, groups, reopen)
        grouped.check_budget(2)
    except BaseException:
        for s in [supply, *groups.values()]:
            s.close()
        raise
    return grouped


def _supply(
    url: str,
    data: bytes,
    index: Index,
    cache: CacheDir,
    client: Client,
    retry: Retry,
    group: str,
) -> RemoteSupply:
    """The supply of the shards ``index`` (``data`` parsed) lists, from ``url``'s folder:
    the archive's, or field group ``group``'s. An archive with field groups is cached
    under its index without them (adding, compiling again or dropping a group changes no
    shard of the archive's, so its cached shards stay where they are, whatever version of
    the index each reader opened), and read with the index as fetched."""
    if index.field_groups:
        data = encode_index(dataclasses.replace(index, field_groups=()))
    # the folder made, filled and marked in use at once: a --clear never sees it half made
    with locked(cache.root / BUDGET_LOCK):
        folder = cache.archive_dir(hashlib.sha256(data).hexdigest()[:24])
        publish(folder / "index.json", data)
        source = redact(url) + (f" field group {group}" if group else "")
        publish(folder / "source.txt", source.encode() + b"\n")
        in_use = cache.use(folder)
    try:
        # the validated index; shards come from the supply
        reader = ArchiveReader(folder, index=index)
        check_shard_names(url, [s.file for s in reader.index.shards])
        supply = RemoteSupply(url, reader, cache, folder, client, retry, in_use=in_use)
    except BaseException:
        close_quietly([in_use])
        raise
    return supply


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

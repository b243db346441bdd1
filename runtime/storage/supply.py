"""Where a shard's bytes come from: the supply stage.

An Archive (runtime.archive.dataset) reads every shard through its supply, and
the supplies differ only in where the bytes come from: ``LocalSupply`` maps one
local archive, or several read as one, when it opens (the page cache does the
rest); a remote supply (runtime.storage.remote_supply) fetches shards of an
archive in object storage, or of a local block-coded archive, into the
node-local cache and maps them there.

A supply hands out opened shards (``dlop.formats.ShardReader``) by number,
and hears ahead of time which shards a batch will read (``ask``) and when a
batch is done with them (``release``). The Loader asks for batch j's and
j+1's shards as it plans batch j (so a shard may be asked for more than once)
and releases batch j's once its copies are done. A local supply needs neither;
a remote one fetches on ``ask`` and may evict after ``release``. Before each
read, ``check`` refuses a shard that changed under its mapping. A supply
pickles as what reopens it (DataLoader workers started by spawn), never as
its mappings: where the archive lies and the index it opened, so that the
process it is sent to reads the same archive even after an append or a
field group compiled since.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dlop.formats import (
    INDEX_NAME,
    ArchiveReader,
    Field,
    FormatError,
    ShardReader,
    parse_index,
    read_index_data,
)
from dlop.formats.urls import is_url

from ..errors import LoaderError, shard_shrank


def distinct(shards: Sequence[int] | np.ndarray, count: int | None = None) -> np.ndarray:
    """``shards`` (numbers, in any order, repeats allowed) ascending, each once, as int64;
    with ``count``, IndexError names one outside 0..count-1 (numpy would wrap a negative
    one around)."""
    ks = np.sort(np.asarray(shards, dtype=np.int64).ravel())
    if len(ks) > 1:
        ks = ks[np.concatenate(([True], ks[1:] != ks[:-1]))]
    if count is not None and len(ks) and (ks[0] < 0 or ks[-1] >= count):
        bad = int(ks[0] if ks[0] < 0 else ks[-1])
        raise IndexError(f"shard {bad} out of range 0..{count - 1}")
    return ks


class ShardSupply(abc.ABC):
    """Everything the runtime asks of a shard supply; what a supply that maps every
    shard for good does not need is a no-op here, and a supply that fetches overrides it.

    ``name`` names the archive(s) in messages (a folder or a URL); ``paths`` are the
    archives read (local folders, or the URL standing for one); ``readers`` hold each
    archive's validated index; ``fields`` are the fields its shards serve (a remote
    supply serves block-coded fields decoded); ``shard_sizes`` counts the samples of
    every shard, numbered one archive after another. ``shards`` lists every shard when
    all are mapped for good, else None (shards are mapped per batch: ``shard(k)``
    between ``ask`` and ``release``). ``hears_asks``: whether ``ask`` and ``release``
    do anything (a supply that maps everything in place ignores them, and the Loader
    then spares each batch working out its shards).
    """

    hears_asks = True
    name: str
    paths: tuple[Path | str, ...]
    readers: list[ArchiveReader]
    fields: Mapping[str, Field]
    shard_sizes: tuple[int, ...]
    shards: list[ShardReader] | None

    @abc.abstractmethod
    def shard(self, k: int) -> ShardReader:
        """Shard ``k``, opened and validated."""

    def pins(self) -> dict[str, bytes]:
        """The index.json each archive read was opened by, by where it lies (``pinned``)."""
        return {}

    @abc.abstractmethod
    def check(self, shards: Sequence[int] | np.ndarray) -> None:
        """Raises when one of these shards can no longer be read safely."""

    def ask(self, shards: Sequence[int] | np.ndarray) -> None:
        """These shards will be read soon (a hint; reading does not depend on it)."""

    def release(self, shards: Sequence[int] | np.ndarray) -> None:
        """A batch that asked for these shards is done with them."""

    def hold_all(self) -> bool:
        """Holds every shard (one ``ask`` of them all) if every one is mapped here now,
        whole: a reading then holds them for its epoch, not batch by batch, and lets go
        with one ``release`` of them all. False, holding nothing, otherwise."""
        return False

    def ahead(self, shards: Sequence[int] | np.ndarray) -> None:
        """The shards later batches read first, in order (asked at each ``ask``): a
        supply that fetches may fetch them ahead."""

    def read_order(self, batches: Sequence[np.ndarray]) -> None:
        """This process's batches of the coming epoch (global sample numbers, in order):
        a shard arriving in parts may fetch first the parts earlier batches read."""

    def forget_failures(self) -> None:
        """A new epoch begins: shards that failed to arrive are tried again."""

    def ready(self, k: int, samples: np.ndarray, names: Sequence[str] | None = None) -> bool:
        """Returns once every byte of ``samples`` (shard-local numbers) of shard ``k`` in
        fields ``names`` can be read: True while the rest of the shard is still arriving
        (only those bytes may be read), False when the whole shard is there."""
        return False

    def partial_shard(self, k: int) -> ShardReader:
        """Shard ``k`` as ``shard``, or while it is still arriving (read only what
        ``ready`` allows)."""
        return self.shard(k)

    def mapped_stamps(self, shards: np.ndarray) -> np.ndarray | None:
        """The mapping stamp of each of ``shards`` (held: asked for), one array
        operation for them all: a number that differs each time a shard is mapped anew,
        -1 while it is not mapped whole here (still being fetched, or arriving). A
        planner keeps what it derived from a mapping while its stamp holds. None: the
        supply keeps no stamps (its batches are planned over the shards they touch)."""
        return None

    def mapping(self, k: int) -> tuple[ShardReader, int] | None:
        """Shard ``k``'s reader and mapping stamp while it is mapped here (the stamp -1
        while it is still arriving: read only what ``ready`` allows), else None."""
        return None

    def failure(self, k: int) -> BaseException:
        """Why shard ``k``, held by a batch, is no longer mapped here: its recorded fetch
        failure, else that it was let go of (the supply closed)."""
        return LoaderError(f"{self.name}: shard {k} was let go of while a batch read it")

    def on_drop(self, forget: Callable[[int], None]) -> None:
        """``forget(k)`` is called when shard ``k`` is unmapped, so views of it kept
        elsewhere go with it. A supply that maps its shards for good never calls it."""

    def check_budget(self, shards_in_flight: int, why: str = "") -> None:
        """Refuses, before any batch, a reading that holds ``shards_in_flight`` shards at
        once (``why``: the settings that make it so) where they could not all be held:
        a cache budget below them. A supply that maps shards in place takes any."""

    def close(self) -> None:
        """Lets go of what the supply holds (cached shards, their descriptors, fetch
        threads); a supply that maps its archive in place keeps its mappings until it
        is dropped."""


# index.json bytes to open archives by, by where they lie: set while an IterableArchive's
# DataLoader worker (started by spawn) opens the archives its parent opened, so that it
# reads them as its parent does even after an append or a field group compiled since
_PINNED: contextvars.ContextVar[Mapping[str, bytes]] = contextvars.ContextVar("pinned")


@contextlib.contextmanager
def pinned(indexes: Mapping[str, bytes]) -> Iterator[None]:
    """Archives opened in this block whose place ``indexes`` names (by ``pin_key``) are
    read by the index.json bytes it gives for them, not by what their folder or URL holds
    now."""
    token = _PINNED.set(dict(indexes))
    try:
        yield
    finally:
        _PINNED.reset(token)


def pin_key(place: str | os.PathLike[str]) -> str:
    """A local archive's place as ``pinned`` names it (the folder its path leads to, links
    resolved), or a URL."""
    text = os.fspath(place)
    return text if is_url(text) else os.path.realpath(text)


def pinned_index(place: str | os.PathLike[str]) -> bytes | None:
    """The index.json bytes ``pinned`` gives for the archive at ``place``, if any."""
    return _PINNED.get({}).get(pin_key(place))


def local_index(path: Path) -> bytes:
    """The index.json bytes to read the local archive at ``path`` by: ``pinned``'s, else
    the folder's own."""
    pinned = pinned_index(path)
    return read_index_data(path) if pinned is None else pinned


def open_reader(path: Path, block_cache_bytes: int, index: bytes) -> ArchiveReader:
    """The one place a local archive path becomes a reader (``block_cache_bytes``: its
    decoded-block cache) of the archive as ``index`` (its index.json's bytes) lists it."""
    checked = parse_index(path / INDEX_NAME, index)
    return ArchiveReader(path, block_cache_bytes=block_cache_bytes, index=checked)


class LocalSupply(ShardSupply):
    """Shards of local archives (one, or several read as one: their shards numbered one
    archive after another), memory-mapped once when the supply opens."""

    hears_asks = False

    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]],
        block_cache_bytes: int,
        indexes: Sequence[bytes] | None = None,
    ) -> None:
        self.paths: tuple[Path, ...] = tuple(Path(p) for p in paths)
        # the folders the paths lead to now: a process this supply is sent to reads those,
        # whatever a link swapped or a working directory changed since makes them name
        self.real = tuple(os.path.realpath(p) for p in self.paths)
        self.block_cache_bytes = block_cache_bytes
        # each archive's index.json as read here: a process this supply is sent to reads
        # the archives as they were then, not as an append or a field group since made them
        sent = indexes is not None or any(pinned_index(p) is not None for p in self.paths)
        self.indexes = (
            tuple(indexes) if indexes is not None else tuple(local_index(p) for p in self.paths)
        )
        try:
            self.readers = [
                open_reader(p, block_cache_bytes, i)
                for p, i in zip(self.paths, self.indexes, strict=True)
            ]
            self.shards: list[ShardReader] = [
                r.shard(k) for r in self.readers for k in range(r.num_shards)
            ]
            if sent:  # its field groups' files are opened later: missing ones named now
                groups = [(r.directory, g) for r in self.readers for g in r.groups.values()]
                gone = [d / s.info.file for d, g in groups for s in g.shards]
                gone = [f for f in gone if not f.is_file()]
                if gone:
                    raise FormatError(gone[0], "shard listed in index.json is missing")
        except FormatError as e:
            if not sent:
                raise
            raise FormatError(
                e.path,
                f"{e.problem}; this process reads the archive by the index.json the process "
                "that sent it opened, and the archive has changed since (a field group "
                "compiled again or dropped, or the archive compiled again): open it again, "
                "or keep DataLoader workers for the run (persistent_workers=True)",
            ) from None
        first = self.readers[0]
        self.name = (
            str(self.paths[0])
            if len(self.paths) == 1
            else f"{len(self.paths)} archives {self.paths[0]}, ..."
        )
        self.fields: Mapping[str, Field] = first.fields
        self.shard_sizes = tuple(i.num_samples for r in self.readers for i in r.index.shards)
        self.sizes = [info.bytes for r in self.readers for info in r.index.shards]  # as validated

    def __reduce__(self) -> tuple[Any, ...]:
        return (LocalSupply, (list(self.real), self.block_cache_bytes, self.indexes))

    def pins(self) -> dict[str, bytes]:
        return {pin_key(p): i for p, i in zip(self.real, self.indexes, strict=True)}

    def shard(self, k: int) -> ShardReader:
        return self.shards[k]

    def check(self, shards: Sequence[int] | np.ndarray) -> None:
        """Raises ShardChangedError when a shard among ``shards`` (numbers) has shrunk
        since it was mapped; reading its pages past the new end would kill the
        process with SIGBUS. A shard deleted or replaced by another file
        (``os.replace``) is not an error: the mapping keeps the file it opened.
        """
        for k in np.unique(np.asarray(shards, dtype=np.int64)).tolist():
            # fstat of the mapping's own descriptor: the mapped file, whatever its path names now
            size, now = self.sizes[k], self.shards[k].mapped_size()
            if now < size:
                raise shard_shrank(self.shards[k].path, size, now)
            for part in self.shards[k].parts()[1:]:  # a field group's shard read beside it
                size, now = part.mapped_span()[1], part.mapped_size()
                if now < size:
                    raise shard_shrank(part.path, size, now)

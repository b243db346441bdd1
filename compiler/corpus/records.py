"""What a layout's listing gives: a Corpus of Items, in corpus order.

Item is the one record for every media for now (the decode and featurize
stages read it); a field that a media does not use stays at its default.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np

from dlop.formats.generations import Listed, listing_identities

from . import listing
from .place import Place

MAX_LABEL = 2**31 - 1  # largest single class index a corpus may give
MAX_MULTI_LABELS = 1 << 16  # widest multi-hot ``labels`` vector (one byte per class per sample)


@dataclass(slots=True)  # no __dict__ per input: a listing of millions holds one Item each
class Item:
    """One input: where its audio is, and what the corpus says about it."""

    key: str
    path: str | None = None  # file on disk
    member: tuple[str, str] | None = None  # webdataset: (tar path, audio extension)
    label: int | None = None
    text: str | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    offset: float = 0.0
    duration: float | None = None
    error: str | None = None  # known bad before decoding (e.g. a malformed manifest line)
    data: dict[str, bytes] | None = None  # webdataset: the sample's members by extension
    labels: list[int] | None = None  # multi-label classes (Charades actions, manifest "labels")
    masks: dict[str, str | None] | None = None  # segmentation: mask field -> file (None: missing)
    # webdataset: listing stopped at damage in this sample's tar, so the tar stream may not
    # hold it (it is bad either way)
    unread: bool = False
    # a URL input's bytes (and its masks'), by URL, fetched by the worker (urls.fetch_inputs)
    fetched: dict[str, bytes] | None = None
    # hf: the row in its Parquet file; webdataset: the sample's number in its tar (so any
    # slice of the items streams from the right place)
    position: int = -1


def input_source(item: Item, path: str) -> str | bytes:
    """What decode reads for one of the item's files: its fetched bytes when it is a URL
    the worker fetched (urls.fetch_inputs), else the path."""
    if item.fetched is not None and path in item.fetched:
        return item.fetched[path]
    return path


@dataclass
class Corpus:
    layout: str
    root: str
    items: Sequence[Item]  # a list, or a layout's compact listing that makes Items on demand
    has_label: bool
    has_text: bool
    extra_fields: dict[str, str]  # name -> "i64" | "str"
    metadata: dict[str, Any]
    fingerprint: str
    media: str = "audio"
    num_labels: int = 0  # multi-hot width when items carry ``labels``
    mask_names: tuple[str, ...] = ()
    # fsspec options for a URL SOURCE (credentials, endpoint): for reading inputs, never stored
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False)
    # The fingerprint leaves out the inputs' sizes (it hashes a listing file that names
    # them, a manifest): each work unit records its inputs' sizes as it starts, and a
    # resume redoes a unit whose inputs' sizes have changed since.
    unit_sizes: bool = False
    # where the units of this process take their inputs' sizes from: SOURCE's place, made
    # once, so that a bucket's folder is listed once per compile, not once per unit (a
    # listing older than the unit can only make a resume redo it); a unit's task goes
    # without it (units.unit_corpus)
    sizes_place: Place | None = field(default=None, repr=False, compare=False)
    # folders and URL prefixes outside SOURCE its paths may name (Place.confine)
    allow_paths: tuple[str, ...] = ()
    # what names an input for --append (formats.generations): "key", the item's key (a
    # preset's input path or id, a Dataset's index); "input", a function's input as JSON
    identity: str = "key"
    # the inputs' identities, once known: for an append's inputs, their identities in the
    # whole listing (a repeat's number counts the inputs before it that the archive holds)
    ids: np.ndarray | None = field(default=None, repr=False, compare=False)
    repeats: list[int] = field(default_factory=list, repr=False, compare=False)
    # the listing file the inputs were listed from (formats.generations.Listed), where the
    # layout lists from one whose appended lines add inputs after the others; recorded in
    # the generation, so that the next append lists the lines after it only
    listed: Listed | None = None
    # an append's listing of the lines after the archive's listing file only (Known): that
    # file's record; its inputs (``prefix`` of them) are not in ``items``, which lists the
    # ones after them
    after: Listed | None = None

    @property
    def prefix(self) -> int:
        """How many inputs of the listing come before ``items`` (an append's tail listing)."""
        return 0 if self.after is None else self.after.inputs

    def identity_texts(self) -> Iterator[str]:
        """Each input's identity text, in corpus order: a compact listing's keys without
        making its Items (an append lists every input to find the new ones, and an Item
        costs a path check that only the inputs it compiles need)."""
        if self.identity == "key" and isinstance(self.items, OnDemand):
            yield from self.items.keys()
            return
        for item in self.items:
            yield input_text(item.extras["input"]) if self.identity == "input" else item.key

    def identities(self) -> np.ndarray:
        """Each input's identity (formats.generations.listing_identities), in corpus order."""
        if self.ids is None:
            self.repeats = []
            self.ids = listing_identities(list(self.identity_texts()), self.repeats)
        return self.ids


def input_text(value: Any) -> str:
    """A function input as the listing fingerprint and its identity see it: its JSON."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


class OnDemand(Sequence[Item]):
    """A layout's compact listing: what it read of each input, made into an Item (its
    media path confined, Place.confine) only when asked for. A slice is a list of Items
    (what a work unit carries)."""

    @abstractmethod
    def item(self, i: int) -> Item:
        """Input ``i``'s Item (0 <= i < len)."""

    @abstractmethod
    def keys(self) -> Iterator[str]:
        """Each input's key, in order, as its Item would give it, without making it."""

    @overload
    def __getitem__(self, i: int) -> Item: ...
    @overload
    def __getitem__(self, i: slice) -> list[Item]: ...
    def __getitem__(self, i: int | slice) -> Item | list[Item]:
        if isinstance(i, slice):
            return [self.item(k) for k in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"input {i} of a listing of {n} inputs")
        return self.item(i % n)

    def __iter__(self) -> Iterator[Item]:
        return (self.item(k) for k in range(len(self)))


class Picked(Sequence[Item]):
    """Some of a corpus's items, by their positions in it (ascending): what an append
    compiles. Streamed (layouts.stream_items) a run of consecutive positions at a time, so
    a layout reading tars or Parquet row groups reads each run as it would a slice."""

    def __init__(self, base: Sequence[Item], positions: np.ndarray) -> None:
        self.base, self.positions = base, np.asarray(positions, np.int64)

    def __len__(self) -> int:
        return len(self.positions)

    @overload
    def __getitem__(self, n: int) -> Item: ...
    @overload
    def __getitem__(self, n: slice) -> Picked: ...
    def __getitem__(self, n: int | slice) -> Item | Picked:
        if isinstance(n, slice):
            chosen = self.positions[n]
            if not len(chosen):
                return Picked([], chosen)
            low, high = int(chosen[0]), int(chosen[-1]) + 1
            # only the span these positions cover travels (a unit's corpus sent to Dask)
            return Picked(self.base[low:high], chosen - low)
        return self.base[int(self.positions[n])]

    def runs(self, start: int, stop: int | None) -> Iterator[tuple[int, int]]:
        """The positions of items [start, stop) as runs [a, b) of consecutive ones."""
        chosen = self.positions[start:stop]
        if not len(chosen):
            return
        breaks = np.flatnonzero(np.diff(chosen) != 1) + 1
        for part in np.split(chosen, breaks):
            yield int(part[0]), int(part[-1]) + 1


@dataclass(frozen=True)
class ListOptions:
    """What a compile asks of a layout's listing besides its SOURCE."""

    media: str = "audio"
    images: str | None = None  # segmentation: the images folder (default: detected)
    masks: tuple[str, ...] | None = None  # segmentation: mask folders (default: detected)
    text_column: str | None = None  # hf: the transcript column (default: text, sentence, ...)
    label_column: str | None = None  # hf: the class column (default: label, or a ClassLabel)
    keep_columns: tuple[str, ...] = ()  # hf: scalar columns carried as fields
    # folders and URL prefixes outside SOURCE the corpus's paths may name (Place.confine)
    allow_paths: tuple[str, ...] = ()
    # an append's: what the archive says of the listing its last compile read; a layout
    # that lists from one file may list the lines after it only (Corpus.after)
    known: Known | None = None


@dataclass(frozen=True)
class Known:
    """What the archive an append adds to says of the listing its last compile read: the
    listing file (formats.generations.Listed), the corpus facts (class names...) the
    archive records, whether any of its generations skipped an input, and its fields'
    names."""

    listed: Listed
    metadata: dict[str, Any]
    skipped: bool
    fields: tuple[str, ...]


def fingerprint(items: Iterable[Item], extra: bytes = b"", root: Place | None = None) -> str:
    """sha256 over every input's key and size plus the corpus's listing files (``extra``);
    ``root`` is SOURCE's place, whose listing gives the sizes of URL inputs."""
    return listing.fingerprint(
        ((it.key, it.path, it.offset, it.duration) for it in items), extra, root
    )

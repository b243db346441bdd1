"""Gathers that read sample by sample: text and bytes fields, as lists."""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from dlop.formats import Field, FormatError, ShardReader

from .engine import private_copy
from .fields import FieldGather, Groups, Output, Planned, batch_groups, shard_groups
from .spans import copied_tables, decoded

# Memory a lasting gather of a text field spends on keeping its samples as the objects
# it serves (TextGather): each sample counted as its bytes plus LISTED_OBJECT_BYTES.
LISTED_BYTES = 16 << 20
LISTED_OBJECT_BYTES = 64  # a str's or bytes' header, and its place in a list


class ShardText(NamedTuple):
    """A raw text field's values in one shard, copied out of its mapping (so no mapped
    byte is read in Python, and a batch needs no check of its shards first)."""

    # The slices a batch serves as they are: a str field's values decoded once where
    # they are ASCII (a byte is then a character, and the byte offsets hold), a bytes
    # field's values. Otherwise (a str field's other values) bytes, each sample decoded
    # as a batch reads it, so one that is not UTF-8 is an error naming it.
    values: str | bytes
    offsets: np.ndarray  # int64 [num_samples + 1]: byte offsets, as the shard gives them


def shard_text(shard: ShardReader, name: str, is_str: bool) -> ShardText:
    """A raw text field's values and offsets in ``shard``, copied out of its mapping."""
    data = private_copy(shard.values(name)).tobytes()
    offsets = private_copy(shard.offsets(name)).astype(np.int64)
    if is_str and data.isascii():
        return ShardText(data.decode("ascii"), offsets)
    return ShardText(data, offsets)


def not_utf8(path: Path, name: str, samples: Iterable[tuple[int, bytes]]) -> FormatError:
    """The error naming the first of ``samples`` (number in the shard at ``path``,
    bytes) that is not UTF-8, as ShardReader.get names it."""
    for i, b in samples:
        try:
            b.decode("utf-8")
        except UnicodeDecodeError as e:
            return FormatError(path, f"field {name!r} sample {i}: not UTF-8 ({e.reason})")
    raise AssertionError("a sample failed to decode once, not twice")


class TextGather(FieldGather):
    """A raw str/bytes field, as lists, planned by arrays. Each shard's values are copied
    once (``ShardText``); a batch's slices of them come from one table of every
    sample's bounds (``bounds``: shard ``k``'s offsets from its first sample plus
    ``k``), a few array operations a batch whatever the shards it touches: about
    0.08 us a sample, against 5 us through ShardReader.get. The table is zeros until a
    shard is first read (untouched pages cost no memory): 8 bytes a sample read.

    Shards read by a gather that lasts (not ``transient``) are kept besides as the
    objects a batch serves, while they take ``LISTED_BYTES`` in all (each sample its
    bytes and ``LISTED_OBJECT_BYTES``): a batch of them is a list lookup a sample,
    about 0.02 us. Past that, memory outweighs the time it saves. A lasting gather's
    copies are the shard's own (``ShardReader.derived``), shared with every other
    lasting gather of the shard in this process."""

    by_arrays = True

    def __init__(self, *args: Any, total: int | None = None, **kwargs: Any) -> None:
        """FieldGather's arguments; ``total``: the samples of every shard, where the
        shards are not given (SlottedText)."""
        super().__init__(*args, **kwargs)
        if not self.field.codec.mappable:
            raise ValueError(f"field {self.field.name!r}: TextGather is for raw fields")
        self.is_str = self.field.kind == "str"
        self.first = self.starts.numpy().astype(np.int64)
        count = len(self.first)
        if total is None:  # the samples of every shard: the last one's first, and its own
            total = int(self.first[-1]) + self.shards[-1].num_samples if self.shards else 0
        self.bounds = np.zeros(total + count, np.int64)
        self.texts: Any = [None] * count  # ShardText by shard number, once read
        self._read = np.zeros(count, bool)
        self.undecoded = np.zeros(count, bool)  # a str field's values kept as bytes
        self._lists: dict[int, list[Any]] = {}  # a shard's samples as served (LISTED_BYTES)
        self._listed = np.zeros(count, bool)
        self._listed_room = LISTED_BYTES if not self.transient else 0

    def place(self, k: int, text: ShardText) -> None:
        """Shard ``k``'s offsets into ``bounds`` (the same for every copy of the shard)."""
        at = int(self.first[k]) + k
        self.bounds[at : at + len(text.offsets)] = text.offsets

    def _entries(self, shards: np.ndarray) -> Sequence[ShardText] | Mapping[int, ShardText]:
        """The ShardText of each of ``shards``, copied in here where first read."""
        if not self._read[shards].all():
            for k in np.unique(shards[~self._read[shards]]).tolist():
                shard, name = self.shards[k], self.field.name
                if self.transient:  # a shard may still be arriving: copied for this gather
                    text = shard_text(shard, name, self.is_str)
                else:
                    made = functools.partial(shard_text, shard, name, self.is_str)
                    text = shard.derived(("text", name), made)
                self.place(k, text)
                self.texts[k] = text
                self.undecoded[k] = self.is_str and isinstance(text.values, bytes)
                self._list(k, text)
                self._read[k] = True  # last: another thread planning meanwhile copies it too
        return self.texts  # type: ignore[no-any-return]

    def _list(self, k: int, text: ShardText) -> None:
        """Shard ``k``'s samples as served, kept while ``LISTED_BYTES`` allows (a str
        sample that is not UTF-8 leaves the shard unlisted: a batch names it)."""
        # a str decoded from bytes that are not ASCII takes up to 4 bytes a character
        wide = 4 if self.is_str and isinstance(text.values, bytes) else 1
        cost = (len(text.offsets) - 1) * LISTED_OBJECT_BYTES + wide * len(text.values)
        if cost > self._listed_room:
            return
        values, ends = text.values, text.offsets.tolist()
        got: list[Any]
        if self.is_str and isinstance(values, bytes):
            try:
                got = [values[a:b].decode("utf-8") for a, b in itertools.pairwise(ends)]
            except UnicodeDecodeError:
                return
        else:
            got = [values[a:b] for a, b in itertools.pairwise(ends)]
        self._listed_room -= cost
        self._lists[k] = got
        self._listed[k] = True

    def _has_undecoded(self, shards: np.ndarray) -> bool:
        """Whether any of ``shards`` (read) holds a str field's values as bytes."""
        return bool(self.undecoded[shards].any())

    def path_of(self, k: int) -> Path:
        return self.shards[k].field_path(self.field.name)

    def plan(self, indices: torch.Tensor, out: Output) -> Planned:
        return self.plan_grouped(indices, batch_groups(indices, self.starts), out)

    def plan_grouped(self, indices: torch.Tensor, groups: Groups, out: Output) -> Planned:
        name = self.field.name
        if not len(indices):
            return {name: []}, []
        shards, rows = groups.shards, groups.rows
        texts = self._entries(shards)
        k = int(shards[0])
        single = len(self.first) == 1 or not (shards != k).any()
        if single and k in self._lists:
            listed = self._lists[k]
            return {name: [listed[r] for r in rows.tolist()]}, []
        if not single and self._listed[shards].all():
            lists = self._lists
            got: list[Any] = [
                lists[s][r] for s, r in zip(shards.tolist(), rows.tolist(), strict=True)
            ]
            return {name: got}, []
        at = np.ascontiguousarray(indices.numpy(), np.int64) + shards
        lo, hi = self.bounds[at].tolist(), self.bounds[at + 1].tolist()
        if single:
            values = texts[k].values
            got = [values[a:b] for a, b in zip(lo, hi, strict=True)]
        else:
            of = [texts[s].values for s in shards.tolist()]
            got = [v[a:b] for v, a, b in zip(of, lo, hi, strict=True)]
        if self.is_str and self._has_undecoded(shards):
            got = self._decoded(got, groups)
        return {name: got}, []

    def _decoded(self, got: list[Any], groups: Groups) -> list[str]:
        """``got`` with the bytes of a str field (shards not ASCII) decoded, sample by
        sample; the first that is not UTF-8 an error naming it."""
        try:
            return [s.decode("utf-8") if isinstance(s, bytes) else s for s in got]
        except UnicodeDecodeError:
            pass
        for k, row, s in zip(groups.shards.tolist(), groups.rows.tolist(), got, strict=True):
            if isinstance(s, bytes):
                try:
                    s.decode("utf-8")
                except UnicodeDecodeError:
                    raise not_utf8(self.path_of(k), self.field.name, [(row, s)]) from None
        raise AssertionError("a sample failed to decode once, not twice")


class BlockTextGather(FieldGather):
    """A compressed str/bytes field, as lists: each sample sliced from its decoded
    blocks (found in the block cache, or decoded once a batch), in shard runs."""

    def _block_bytes(self, k: int, local: list[int]) -> list[bytes]:
        """Samples ``local`` of shard ``k``, from their decoded blocks."""
        shard, name = self.shards[k], self.field.name
        offsets = copied_tables(shard, name, keep=True)[0]  # (slices of a block: bounded)
        firsts: np.ndarray = shard.derived(
            ("first samples", name),
            lambda: shard.block_table(name)["first_sample"].astype(np.int64),
        )
        at = np.asarray(local, np.int64)
        blocks = np.searchsorted(firsts, at, side="right") - 1
        base = offsets[firsts[blocks]]  # a block's values begin with its first sample's
        lo, hi = (offsets[at] - base).tolist(), (offsets[at + 1] - base).tolist()
        # each block the batch touches decoded (or found in the block cache) once
        values = {b: decoded(shard, name, b) for b in set(blocks.tolist())}
        return [values[b][a:z].tobytes() for b, a, z in zip(blocks.tolist(), lo, hi, strict=True)]

    def plan(self, indices: torch.Tensor, out: Output) -> Planned:
        name, is_str = self.field.name, self.field.kind == "str"
        values: list[Any] = []
        for k, a, b in shard_groups(indices, self.starts):
            start = int(self.starts[k])
            local = [int(i) - start for i in indices[a:b].tolist()]
            got = self._block_bytes(k, local)
            if not is_str:
                values += got
                continue
            try:
                values += [b.decode("utf-8") for b in got]
            except UnicodeDecodeError:
                raise not_utf8(
                    self.shards[k].field_path(name), name, zip(local, got, strict=True)
                ) from None
        return {name: values}, []


class SlottedText(TextGather):
    """A raw text field over every shard of an archive, each shard's values copied in
    while it is mapped (``put``) and dropped when it is let go of (``clear``). A batch
    plans over ``take`` of the shards it touches; the caller excludes ``put``,
    ``clear`` and ``take`` from one another (runtime.archive.planning.Slots).
    ``bounds`` is shared with what ``take`` gave: every put of a shard writes the same
    offsets there (its verified table), whole or still arriving."""

    def __init__(self, field: Field, starts: torch.Tensor, total: int, pad_value: float) -> None:
        super().__init__(field, [], starts, pad_value, total=total)
        self.texts = {}
        self._listed_room = 0  # entries come and go with their mappings: none listed
        self._bytes = False  # (taken) a str field's values held as bytes in some shard
        self.paths: dict[int, Path] = {}
        self.own_paths: dict[int, Path] = {}  # (taken) the batch's own entries' files

    def prepared(self, shard: ShardReader, whole: bool) -> tuple[ShardText, Path]:
        """A shard's text for ``put``, copied here (outside the caller's lock): kept by the
        shard (``whole``), or copied for one batch while it is still arriving (read only
        where ``ready`` allowed)."""
        name = self.field.name
        if whole:
            text: ShardText = shard.derived(
                ("text", name), lambda: shard_text(shard, name, self.is_str)
            )
        else:
            text = shard_text(shard, name, self.is_str)
        return text, shard.field_path(name)

    def put(self, k: int, prepared: tuple[ShardText, Path], shared: bool = True) -> None:
        """Shard ``k``'s offsets into ``bounds``; and its entry, for every batch to read
        (``shared``), or only for the batch that made it (``take``'s ``own``)."""
        text = prepared[0]
        self.place(k, text)
        if shared:
            self.texts[k], self.paths[k] = prepared
            self.undecoded[k] = self.is_str and isinstance(text.values, bytes)

    def clear(self, k: int) -> None:
        self.texts.pop(k, None)

    def has(self, ks: np.ndarray) -> int | None:
        """The first of shards ``ks`` without its text here, or None."""
        return next((k for k in ks.tolist() if k not in self.texts), None)

    def take(
        self, ks: np.ndarray, own: Mapping[int, tuple[ShardText, Path]] | None = None
    ) -> SlottedText:
        """This gather over shards ``ks`` only: later ``put`` and ``clear`` calls here do
        not change it. ``own``: entries a batch copied for itself (``prepared``, of shards
        still arriving), used instead of what is here, which another batch may have put
        from an older copy meanwhile."""
        out = copy.copy(self)
        out.texts = {k: self.texts[k] for k in ks.tolist() if k in self.texts}
        if own:
            out.own_paths = {k: path for k, (_, path) in own.items()}
            out.texts.update((k, text) for k, (text, _) in own.items())
        out._bytes = bool(self.undecoded[ks].any()) or any(
            self.is_str and isinstance(text.values, bytes) for text, _ in (own or {}).values()
        )
        return out

    def _has_undecoded(self, shards: np.ndarray) -> bool:
        return self._bytes  # of the shards taken

    def _entries(self, shards: np.ndarray) -> Mapping[int, ShardText]:
        return self.texts  # type: ignore[no-any-return]  # taken: every shard is here

    def path_of(self, k: int) -> Path:
        return self.own_paths[k] if k in self.own_paths else self.paths[k]

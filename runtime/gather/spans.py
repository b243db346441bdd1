"""Gathers of samples that lie as spans of values: raw ragged fields (any of their
dimensions varying) read from the mapped shards, and zstd fields read from their
decoded blocks.

Planned as arrays over the whole batch, whatever the number of shards it touches:
each sample's first value and shape come from per-sample tables held for all the
gather's shards, each contiguous piece of a sample becomes a copy run, and the
padding around the pieces becomes fill runs. No mapped byte is read in Python: the
tables and zstd frames are copied out of the mapping by the copy step
(``private_copy``), where a shard truncated under it is ShardChangedError naming it,
and the values themselves are copied by the compiled copier, so no check of the
shards precedes each batch (``Planner.checks_batches``).
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from dlop.formats import FormatError, ShardReader

from .engine import private_copy
from .fields import (
    FieldGather,
    Groups,
    Output,
    PackedPlan,
    Planned,
    aligned,
    batch_groups,
    check_padded,
    flat_bytes,
)
from .plan import Runs, Step, fill_runs


def copied_tables(shard: ShardReader, name: str, keep: bool) -> tuple[np.ndarray, np.ndarray]:
    """A ragged field's element offsets (``int64 [n + 1]``) and shapes (``int64 [n,
    ndim]``) in ``shard``, copied out of its mapping (ShardReader.copied_tables); with
    ``keep``, kept by the shard until it closes (a supply that maps shards per batch
    builds a batch's gathers anew, but not these)."""

    def copied() -> tuple[np.ndarray, np.ndarray]:
        offsets, shapes = shard.copied_tables(name, private_copy)
        return offsets.view(np.int64), shapes.view(np.int64)

    if not keep:
        return copied()
    tables: tuple[np.ndarray, np.ndarray] = shard.derived(("tables", name), copied)
    return tables


def decoded(shard: ShardReader, name: str, block: int) -> np.ndarray:
    """One zstd block of ``shard``'s field, decoded from a private copy of its frame
    (through the archive's block cache; read-only)."""
    return shard.decode_block(name, block, copy=private_copy)


def gaps(offsets: np.ndarray, sizes: np.ndarray, end: int) -> tuple[np.ndarray, np.ndarray]:
    """The bytes of [0, end) that ascending runs (offsets, sizes) leave uncovered."""
    starts = np.concatenate([[0], offsets + sizes]).astype(np.int64)
    ends = np.concatenate([offsets, [end]]).astype(np.int64)
    return starts, ends - starts


def piece_runs(
    shapes: np.ndarray, padded: tuple[int, ...], last: int, itemsize: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The contiguous pieces of C-ordered samples of ``shapes`` (``[B, ndim]``), each
    placed at the origin of its own ``padded`` region, the regions one after another:
    (owning sample, destination offset, offset within the sample's own bytes, size),
    in bytes, ascending. Axes after ``last`` are the same in every sample and in
    ``padded``, so a piece is one index over axes ``0..last-1``; -1 for ``last``: a
    sample is one piece."""
    count = len(shapes)
    region = math.prod(padded) * itemsize
    if last < 0:  # every sample its region's size
        owner = np.arange(count, dtype=np.int64)
        return owner, owner * region, np.zeros(count, np.int64), np.full(count, region, np.int64)
    strides = [math.prod(padded[i + 1 :]) * itemsize for i in range(len(padded))]
    size = shapes[:, last] * strides[last]  # bytes of one piece of each sample
    if last == 0:
        owner = np.arange(count, dtype=np.int64)
        return owner, owner * region, np.zeros(count, np.int64), size
    pieces = np.prod(shapes[:, :last], axis=1)
    owner = np.repeat(np.arange(count, dtype=np.int64), pieces)
    ends = np.cumsum(pieces)
    number = np.arange(int(ends[-1]) if count else 0, dtype=np.int64) - np.repeat(
        ends - pieces, pieces
    )
    at = owner * region
    rest = number.copy()
    for axis in range(last - 1, -1, -1):  # the piece number in mixed radix, last axis first
        radix = shapes[owner, axis]
        at += (rest % radix) * strides[axis]
        rest //= radix
    return owner, at, number * size[owner], size[owner]


def sample_sizes(lengths: np.ndarray | None, shapes: np.ndarray | None, row: int) -> np.ndarray:
    """Each sample's count of values from its ``lengths`` (only the first dimension
    varies) or the ``shapes`` of its varying dimensions, times ``row``: float64 (no
    overflow), -1 where a dimension is negative."""
    if lengths is not None:
        sizes: np.ndarray = lengths * float(row)
        return sizes
    assert shapes is not None
    sizes = np.full(len(shapes), float(row))
    negative = np.zeros(len(shapes), bool)
    for column in shapes.T:  # (a column at a time: faster than along rows)
        sizes *= column
        negative |= column < 0  # a product with another could pass as 0 or more
    sizes[negative] = -1.0
    return sizes


class SpanGather(FieldGather):
    """Raw ragged fields and zstd fields: one run per contiguous piece of each sample
    and fill runs for the padding around them, planned as arrays over the batch. Every
    sample's span is bounded by the values it lies in when the gather is made: its
    tables are private copies, CRC-checked, but never trusted with an address."""

    by_arrays = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        f = self.field
        self.itemsize = self.out_dtype.itemsize
        self.varying = [i for i, d in enumerate(f.shape) if d is None]
        self.last = self.varying[-1] if self.varying else -1  # the last axis that may pad
        self.row = math.prod(self.trail)  # values per step of the varying dimensions
        none = np.zeros(0, np.int64)
        # per sample, by number across the shards (ragged fields): its first value within
        # its shard's values, and its length (only the first dimension varies) or the
        # sizes of its varying dimensions
        self.first: np.ndarray | None = None
        self.lengths: np.ndarray | None = None
        self.shapes: np.ndarray | None = None
        if f.ragged:
            tables = [copied_tables(s, f.name, self.transient) for s in self.shards]
            self.first = np.concatenate([none] + [t[0][:-1] for t in tables])
            if self.varying == [0]:
                self.lengths = np.concatenate([none] + [t[1][:, 0] for t in tables])
            else:
                self.shapes = np.concatenate(
                    [np.zeros((0, len(self.varying)), np.int64)]
                    + [t[1][:, self.varying] for t in tables]
                )
        self.blocks = not f.codec.mappable
        if self.blocks:  # each block's first sample (by number across the shards) and place
            firsts = [s.block_table(f.name)["first_sample"].astype(np.int64) for s in self.shards]
            starts = self.starts.numpy()
            self.block_first = np.concatenate(
                [none] + [int(starts[k]) + b for k, b in enumerate(firsts)]
            )
            self.block_shard = np.concatenate(
                [none] + [np.full(len(b), k, np.int64) for k, b in enumerate(firsts)]
            )
            self.block_number = np.concatenate(
                [none] + [np.arange(len(b), dtype=np.int64) for b in firsts]
            )
        else:
            self.values = [s.values(f.name) for s in self.shards]  # kept: addresses point in
            self.bases = np.array([v.ctypes.data for v in self.values], np.int64)
        if f.ragged:
            self.bound()

    def bound(self) -> None:
        """Refuses a sample whose span leaves the values it lies in (its shard's, or a zstd
        block's): only tables changed since their shard was checked, in a way their CRC-32
        missed, hold one."""
        assert self.first is not None
        sizes = sample_sizes(self.lengths, self.shapes, self.row)
        if self.blocks:  # each sample's block: where its values begin and how many it has
            block = np.searchsorted(self.block_first, np.arange(len(self.first)), side="right") - 1
            raw = [s.block_table(self.field.name)["raw_length"] for s in self.shards]
            count = np.concatenate([np.zeros(0, np.int64)] + [r.astype(np.int64) for r in raw])
            first = self.first - self.first[self.block_first][block]
            ends = (count // max(self.itemsize, 1))[block]
        else:
            first = self.first
            ends = np.repeat([len(v) for v in self.values], [s.num_samples for s in self.shards])
        bad = (first < 0) | (sizes < 0) | (first + sizes > ends)
        if bad.any():
            j = int(np.argmax(bad))
            k = int(np.searchsorted(self.starts.numpy(), j, side="right")) - 1
            raise FormatError(
                self.shards[k].path,
                f"field {self.field.name!r} sample {j - int(self.starts[k])}: its offsets or "
                "shape point outside the field's values; the shard changed since it was "
                "opened",
            )

    def buffer_numel(self, batch_size: int, among: np.ndarray | None = None) -> int | None:
        if self.shapes is not None:  # padded to the longest in several dimensions
            return None
        lengths = self.lengths if self.lengths is None or among is None else self.lengths[among]
        longest = 1 if lengths is None else int(lengths.max(initial=0))
        return batch_size * longest * self.row

    def most_numel(self, batches: Sequence[np.ndarray]) -> int:
        if self.shapes is not None:
            return 0
        sizes = np.fromiter(map(len, batches), dtype=np.int64, count=len(batches))
        if self.lengths is None or not sizes.any():
            return int(sizes.max(initial=0)) * self.row
        longest = longest_each(self.lengths[np.concatenate(batches)], sizes)
        return int((sizes * longest).max()) * self.row

    def plan(self, indices: torch.Tensor, out: Output) -> Planned:
        return self.plan_grouped(indices, batch_groups(indices, self.starts), out)

    def first_values(self, idx: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Where samples ``idx`` (``rows`` within their shards) begin in their shard's
        values, in values."""
        if self.first is not None:
            first: np.ndarray = self.first[idx]
            return first
        return rows * self.row

    def sources(self, idx: np.ndarray, groups: Groups) -> tuple[np.ndarray, tuple[Any, ...]]:
        """Each sample's first byte's address, and what those addresses point into."""
        first = self.first_values(idx, groups.rows) * self.itemsize
        if not self.blocks:
            return self.bases[groups.shards] + first, (self.values,)
        block = np.searchsorted(self.block_first, idx, side="right") - 1
        used, which = np.unique(block, return_inverse=True)
        shard, number = self.block_shard[used], self.block_number[used]
        arrays = [
            decoded(self.shards[k], self.field.name, b)
            for k, b in zip(shard.tolist(), number.tolist(), strict=True)
        ]
        # a block's values begin with its first sample's
        head = self.block_first[used]
        bases = np.array([a.ctypes.data for a in arrays], np.int64)
        bases -= self.first_values(head, head - self.starts.numpy()[shard]) * self.itemsize
        return bases[which.reshape(-1)] + first, tuple(arrays)

    def plan_grouped(self, indices: torch.Tensor, groups: Groups, out: Output) -> Planned:
        f = self.field
        idx = np.ascontiguousarray(indices.numpy(), np.int64)  # checked by Archive.plan
        lengths: dict[str, torch.Tensor] = {}
        if self.lengths is not None:  # the common ragged field: its rows vary
            lens = self.lengths[idx]
            shapes = lens[:, None]  # only the first axis matters to the plan below
            padded = (int(lens.max()) if len(idx) else 0, *self.trail)
            lengths[f"{f.name}_lengths"] = torch.from_numpy(lens)
        elif self.shapes is not None:
            varying = self.shapes[idx]
            shapes = np.empty((len(idx), f.ndim), np.int64)
            shapes[:] = [0 if d is None else d for d in f.shape]
            shapes[:, self.varying] = varying
            check_padded(f, shapes, self.itemsize)
            padded = (
                tuple(int(m) for m in shapes.max(axis=0))
                if len(idx)
                else tuple(0 if d is None else d for d in f.shape)
            )
            counts = torch.from_numpy(varying)
            lengths[f"{f.name}_lengths"] = counts[:, 0] if len(self.varying) == 1 else counts
        else:  # zstd, fixed shape
            shapes = np.broadcast_to(np.array(f.shape, np.int64), (len(idx), f.ndim))
            padded = tuple(int(d) for d in f.shape if d is not None)
        out = self.output((len(idx), *padded), out)
        entries: dict[str, Any] = {f.name: out, **lengths}
        region = math.prod(padded) * self.itemsize
        if not len(idx) or not region:
            return entries, []
        src, keep = self.sources(idx, groups)
        flat = flat_bytes(out)
        if self.last <= 0:  # one piece a sample, at the front of its region
            dst = np.arange(len(idx), dtype=np.int64) * region
            if self.last < 0:
                return entries, [Runs(flat, dst, src, np.full(len(idx), region, np.int64), keep)]
            nbytes = shapes[:, 0] * (region // padded[0])
            steps: list[Step] = [Runs(flat, dst, src, nbytes, keep)]
            at, holes = dst + nbytes, region - nbytes
        else:
            owner, dst, within, nbytes = piece_runs(shapes, padded, self.last, self.itemsize)
            if not nbytes.all():  # pieces of a zero-length axis
                keep_runs = nbytes > 0
                owner, dst, within, nbytes = (a[keep_runs] for a in (owner, dst, within, nbytes))
            steps = [Runs(flat, dst, src[owner] + within, nbytes, keep)]
            at, holes = gaps(dst, nbytes, len(idx) * region)
        if holes.any():  # (fill_runs drops the empty ones)
            steps.append(fill_runs(flat, at, holes, self.pad_pattern(int(holes.max()))))
        return entries, steps

    def plan_packed(
        self, indices: torch.Tensor, groups: Groups, cuts: list[int], out: torch.Tensor | None
    ) -> PackedPlan:
        """As arrays over every batch at once where only the first dimension varies and
        the values are mapped: one run per sample and one fill per padded tail, each
        batch padded to its own longest sample, as ``plan_grouped`` pads it."""
        edges = np.asarray(cuts, np.int64)
        counts = edges[1:] - edges[:-1]
        region_row = self.row * self.itemsize  # bytes of one step of the first dimension
        if (
            out is None
            or self.lengths is None
            or self.blocks
            or not region_row
            or not len(counts)
            or not counts.all()
        ):
            return super().plan_packed(indices, groups, cuts, out)
        f = self.field
        out = out.view(-1).view(self.out_dtype)  # places below count the field's elements
        idx = np.ascontiguousarray(indices.numpy(), np.int64)  # checked by Archive.plan
        lens = self.lengths[idx]
        firsts = edges[:-1]
        longest = longest_each(lens, counts)
        numel = counts * longest * self.row
        starts = np.zeros(len(counts), np.int64)  # each batch's first element in ``out``
        np.cumsum(aligned(numel, self.itemsize)[:-1], out=starts[1:])
        entries: list[dict[str, Any]] = []
        for b, (a, z) in enumerate(itertools.pairwise(cuts)):
            shape = (z - a, int(longest[b]), *self.trail)
            entries.append(
                {
                    f.name: self.output(shape, out[int(starts[b]) :]),
                    f"{f.name}_lengths": torch.from_numpy(lens[a:z]),
                }
            )
        # per sample: where its batch begins, its place in the batch, its region's bytes
        batch = np.repeat(np.arange(len(counts)), counts)
        region = longest[batch] * region_row
        place = np.arange(len(idx), dtype=np.int64) - firsts[batch]
        dst = starts[batch] * self.itemsize + place * region
        nbytes = lens * region_row
        src, keep = self.sources(idx, groups)
        holes = region - nbytes
        if not holes.any():
            return entries, [Runs(flat_bytes(out), dst, src, nbytes, keep)]
        # one step: each sample's run, then its padding's (from the pad pattern), so a
        # share is one copy call on a helper, writing the buffer in order
        pattern = self.pad_pattern(int(holes.max()))
        both = np.empty((len(idx), 2, 3), np.int64)  # per sample: (dst, src, bytes), twice
        both[:, 0, 0], both[:, 0, 1], both[:, 0, 2] = dst, src, nbytes
        both[:, 1, 0], both[:, 1, 1], both[:, 1, 2] = dst + nbytes, pattern.data_ptr(), holes
        runs = both.reshape(-1, 3)
        runs = runs[runs[:, 2] > 0]  # no empty runs
        dst, src, nbytes = (np.ascontiguousarray(runs[:, k]) for k in range(3))
        return entries, [Runs(flat_bytes(out), dst, src, nbytes, (*keep, pattern))]


def longest_each(lengths: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The largest of each run of ``counts[i]`` consecutive ``lengths`` (the longest
    sample of each of several batches laid end to end), 0 for an empty run."""
    longest = np.zeros(len(counts), dtype=np.int64)
    kept = counts > 0  # reduceat over the non-empty runs' starts alone
    if kept.any():
        starts = np.cumsum(counts) - counts
        longest[kept] = np.maximum.reduceat(lengths, starts[kept])
    return longest


class Prepared(NamedTuple):
    """A shard's entries of a ``SlottedSpans``, copied and bounded: its samples'
    numbers across the archive (``lo``..``hi``), their first values, their lengths or
    varying sizes, and the shard's values."""

    lo: int
    hi: int
    first: np.ndarray
    sizes: np.ndarray
    values: np.ndarray


class SlottedSpans(SpanGather):
    """A raw ragged field's spans over every shard of an archive, each shard's entries
    filled in while it is mapped (``put``) and emptied when it is let go of (``clear``):
    per-sample tables by sample number across the archive (``starts``), and each
    shard's values. A batch plans over ``take`` of the shards it touches, which keeps
    their values; the caller excludes ``put``, ``clear`` and ``take`` from one
    another (runtime.archive.planning.Slots)."""

    def __init__(self, field: Any, starts: torch.Tensor, total: int, pad_value: float) -> None:
        super().__init__(field, [], starts, pad_value)
        if not field.ragged or self.blocks:
            raise ValueError(f"field {field.name!r}: slotted spans are for raw ragged fields")
        count = len(starts)
        self.first = np.zeros(total, np.int64)
        if self.lengths is not None:
            self.lengths = np.zeros(total, np.int64)
        else:
            self.shapes = np.zeros((total, len(self.varying)), np.int64)
        self.empty = np.zeros(0, np.dtype(field.np_dtype))
        self.values = [self.empty] * count
        self.bases = np.zeros(count, np.int64)

    def prepared(self, k: int, shard: ShardReader) -> Prepared:
        """Shard ``k``'s entries from ``shard`` (its tables copied, and every sample's span
        bounded by its values, as the constructor of SpanGather does), for ``put``: the
        copies are made here, outside the caller's lock."""
        offsets, shapes = copied_tables(shard, self.field.name, keep=True)
        values = shard.values(self.field.name)
        first = offsets[:-1]
        if self.lengths is not None:
            lengths, varying = shapes[:, 0], None
        else:
            lengths, varying = None, shapes[:, self.varying]
        sizes = sample_sizes(lengths, varying, self.row)
        bad = (first < 0) | (sizes < 0) | (first + sizes > len(values))
        if bad.any():
            raise FormatError(
                shard.path,
                f"field {self.field.name!r} sample {int(np.argmax(bad))}: its offsets or "
                "shape point outside the field's values; the shard changed since it was "
                "opened",
            )
        lo, table = int(self.starts[k]), lengths if varying is None else varying
        assert table is not None
        return Prepared(lo, lo + shard.num_samples, first, table, values)

    def put(self, k: int, p: Prepared) -> None:
        """Shard ``k``'s entries as ``prepared``."""
        assert self.first is not None
        self.first[p.lo : p.hi] = p.first
        if self.lengths is not None:
            self.lengths[p.lo : p.hi] = p.sizes
        else:
            assert self.shapes is not None
            self.shapes[p.lo : p.hi] = p.sizes
        self.values[k] = p.values
        self.bases[k] = p.values.ctypes.data

    def clear(self, k: int) -> None:
        self.bases[k] = 0
        self.values[k] = self.empty

    def take(self, ks: np.ndarray) -> SlottedSpans:
        """This gather over shards ``ks`` only (shard i of the batch is ``ks[i]``), keeping
        their values: later ``put`` and ``clear`` calls here do not change it."""
        out = copy.copy(self)
        out.values = [self.values[k] for k in ks.tolist()]
        out.bases = self.bases[ks]
        return out

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

import math
from typing import Any

import numpy as np
import torch

from dlop.formats import ShardReader

from .engine import private_copy
from .fields import FieldGather, Groups, Output, Planned, batch_groups, check_padded, flat_bytes
from .plan import Runs, Step, fill_runs


def copied_tables(shard: ShardReader, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A ragged field's element offsets (``int64 [n + 1]``) and shapes (``int64 [n,
    ndim]``) in ``shard``, copied out of its mapping and checked again."""
    offsets, shapes = shard.copied_tables(name, private_copy)
    return offsets.view(np.int64), shapes.view(np.int64)


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


class SpanGather(FieldGather):
    """Raw ragged fields and zstd fields: one run per contiguous piece of each sample
    and fill runs for the padding around them, planned as arrays over the batch."""

    by_arrays = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        f = self.field
        self.itemsize = self.out_dtype.itemsize
        self.varying = [i for i, d in enumerate(f.shape) if d is None]
        self.last = self.varying[-1] if self.varying else -1  # the last axis that may pad
        none = np.zeros(0, np.int64)
        # per sample, by number across the shards (ragged fields): its first value within
        # its shard's values, and its length (only the first dimension varies) or shape
        self.first: np.ndarray | None = None
        self.lengths: np.ndarray | None = None
        self.shapes: np.ndarray | None = None
        if f.ragged:
            # (not kept by the shards: the gather's arrays below hold them all once)
            tables = [copied_tables(s, f.name) for s in self.shards]
            self.first = np.concatenate([none] + [t[0][:-1] for t in tables])
            if self.varying == [0]:
                self.lengths = np.concatenate([none] + [t[1][:, 0] for t in tables])
            else:
                self.shapes = np.concatenate(
                    [np.zeros((0, f.ndim), np.int64)] + [t[1] for t in tables]
                ).reshape(-1, f.ndim)
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

    def buffer_numel(self, batch_size: int) -> int | None:
        if self.shapes is not None:  # padded to the longest in several dimensions
            return None
        longest = 1 if self.lengths is None else int(self.lengths.max(initial=0))
        return batch_size * longest * math.prod(self.trail)

    def plan(self, indices: torch.Tensor, out: Output) -> Planned:
        return self.plan_grouped(indices, batch_groups(indices, self.starts), out)

    def first_bytes(self, idx: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Where samples ``idx`` (``rows`` within their shards) begin in their shard's
        values, in bytes."""
        if self.first is not None:
            first: np.ndarray = self.first[idx] * self.itemsize
            return first
        return rows * (math.prod(self.trail) * self.itemsize)

    def sources(self, idx: np.ndarray, groups: Groups) -> tuple[np.ndarray, tuple[Any, ...]]:
        """Each sample's first byte's address, and what those addresses point into."""
        first = self.first_bytes(idx, groups.rows)
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
        bases -= self.first_bytes(head, head - self.starts.numpy()[shard])
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
            shapes = self.shapes[idx]
            check_padded(f, shapes, self.itemsize)
            padded = (
                tuple(int(m) for m in shapes.max(axis=0))
                if len(idx)
                else tuple(0 if d is None else d for d in f.shape)
            )
            varying = torch.from_numpy(np.ascontiguousarray(shapes[:, self.varying]))
            lengths[f"{f.name}_lengths"] = varying[:, 0] if len(self.varying) == 1 else varying
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
            sizes = shapes[:, 0] * (region // padded[0])
            steps: list[Step] = [Runs(flat, dst, src, sizes, keep)]
            at, holes = dst + sizes, region - sizes
        else:
            owner, dst, within, sizes = piece_runs(shapes, padded, self.last, self.itemsize)
            if not sizes.all():  # pieces of a zero-length axis
                keep_runs = sizes > 0
                owner, dst, within, sizes = (a[keep_runs] for a in (owner, dst, within, sizes))
            steps = [Runs(flat, dst, src[owner] + within, sizes, keep)]
            at, holes = gaps(dst, sizes, len(idx) * region)
        if holes.any():  # (fill_runs drops the empty ones)
            steps.append(fill_runs(flat, at, holes, self.pad_pattern(int(holes.max()))))
        return entries, steps

"""Gathers of raw fields straight from the mapped shards: fixed rows and ragged spans."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from dlop.formats import ShardReader

from .fields import (
    FieldGather,
    Groups,
    Output,
    Planned,
    as_bytes,
    batch_groups,
    flat_bytes,
)
from .plan import Rows, RowTable, Runs, Step, fill_runs


def rows_of(shard: ShardReader, name: str, row_bytes: int) -> torch.Tensor:
    """A mapped shard's fixed field as ``uint8`` rows, made once per shard (kept by the
    shard until it closes): a supply that maps shards per batch builds a batch's gathers
    anew, but not these views."""
    rows: torch.Tensor = shard.derived(
        ("rows", name, row_bytes),
        lambda: as_bytes(shard.array(name), shard.num_samples, row_bytes),
    )
    return rows


class FixedRawGather(FieldGather):
    """Fixed-shape raw fields: one ``Rows`` step per batch over a table of the shards'
    rows."""

    by_arrays = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.row_bytes = math.prod(self.trail) * self.out_dtype.itemsize
        sources = [rows_of(s, self.field.name, self.row_bytes) for s in self.shards]
        self.table = RowTable(sources, self.row_bytes) if sources and self.row_bytes else None

    def buffer_numel(self, batch_size: int) -> int | None:
        return batch_size * math.prod(self.trail)

    def plan(self, indices: torch.Tensor, out: Output) -> Planned:
        return self.plan_grouped(indices, batch_groups(indices, self.starts), out)

    def plan_grouped(self, indices: torch.Tensor, groups: Groups, out: Output) -> Planned:
        out = self.output((len(indices), *self.trail), out)
        steps: list[Step] = []
        if self.table is not None and len(indices):
            shards = groups.shards if len(self.table) > 1 else None
            steps.append(Rows(flat_bytes(out), self.table, shards, groups.rows))
        return {self.field.name: out}, steps


class RaggedRowsGather(FieldGather):
    """Raw ragged fields whose only varying dimension is the first: one run per sample
    of its rows, one run of padding after it, planned as arrays over the batch (each
    sample's first row and length held for all shards in one array each)."""

    by_arrays = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        f = self.field
        self.row = math.prod(self.trail)
        self.row_bytes = self.row * self.out_dtype.itemsize
        self.values = [s.values(f.name) for s in self.shards]  # kept: addresses point in
        self.bases = np.array([v.ctypes.data for v in self.values], np.int64)
        starts, lengths = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        for s in self.shards:
            starts.append(s.offsets(f.name)[:-1].astype(np.int64) // max(self.row, 1))
            lengths.append(s.shapes(f.name)[:, 0].astype(np.int64))
        # by sample number across the shards, as ``starts`` numbers them
        self.row_starts = np.concatenate(starts)
        self.lengths = np.concatenate(lengths)

    def buffer_numel(self, batch_size: int) -> int | None:
        longest = int(self.lengths.max()) if len(self.lengths) else 0
        return batch_size * longest * self.row

    def plan(self, indices: torch.Tensor, out: Output) -> Planned:
        return self.plan_grouped(indices, batch_groups(indices, self.starts), out)

    def plan_grouped(self, indices: torch.Tensor, groups: Groups, out: Output) -> Planned:
        f = self.field
        idx = indices.numpy()  # within the shards: Archive.plan checked them
        lens = self.lengths[idx]
        max_len = int(lens.max()) if len(lens) else 0
        out = self.output((len(indices), max_len, *self.trail), out)
        steps: list[Step] = []
        if len(lens) and max_len and self.row_bytes:
            flat, rb = flat_bytes(out), self.row_bytes
            dst = np.arange(len(lens), dtype=np.int64) * (max_len * rb)
            src = self.bases[groups.shards] + self.row_starts[idx] * rb
            sizes = lens * rb
            steps.append(Runs(flat, dst, src, sizes, (self.values,)))
            tails = max_len * rb - sizes
            if tails.any():
                steps.append(
                    fill_runs(flat, dst + sizes, tails, self.pad_pattern(int(tails.max())))
                )
        return {f.name: out, f"{f.name}_lengths": torch.from_numpy(lens)}, steps

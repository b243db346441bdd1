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
    shard_groups,
)
from .plan import Rows, Runs, Step, fill_runs


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
    """Fixed-shape raw fields: one ``Rows`` step per shard the batch touches."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.row_bytes = math.prod(self.trail) * self.out_dtype.itemsize
        self.sources = [rows_of(s, self.field.name, self.row_bytes) for s in self.shards]

    def buffer_numel(self, batch_size: int) -> int | None:
        return batch_size * math.prod(self.trail)

    def plan(self, indices: torch.Tensor, out: Output) -> Planned:
        return self.plan_grouped(indices, batch_groups(indices, self.starts), out)

    def plan_grouped(self, indices: torch.Tensor, groups: Groups, out: Output) -> Planned:
        out = self.output((len(indices), *self.trail), out)
        steps: list[Step] = []
        rb = self.row_bytes
        if rb:
            flat, rows = flat_bytes(out), groups.rows
            for k, a, b in groups.runs:
                steps.append(Rows(flat[a * rb : b * rb], self.sources[k], rows[a:b]))
        return {self.field.name: out}, steps


class RaggedRowsGather(FieldGather):
    """Raw ragged fields whose only varying dimension is the first: one run per sample
    of its rows, one run of padding after it."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        f = self.field
        self.row = math.prod(self.trail)
        self.row_bytes = self.row * self.out_dtype.itemsize
        self.values: list[np.ndarray] = []
        self.row_starts: list[np.ndarray] = []
        self.lengths: list[np.ndarray] = []
        for s in self.shards:
            self.values.append(s.values(f.name))
            offsets = s.offsets(f.name).astype(np.int64)
            self.row_starts.append(offsets[:-1] // max(self.row, 1))
            self.lengths.append(s.shapes(f.name)[:, 0].astype(np.int64))

    def buffer_numel(self, batch_size: int) -> int | None:
        longest = max((int(x.max()) for x in self.lengths if len(x)), default=0)
        return batch_size * longest * self.row

    def batch_lengths(self, indices: torch.Tensor) -> torch.Tensor:
        parts = [
            self.lengths[k][(indices[a:b] - self.starts[k]).numpy()]
            for k, a, b in shard_groups(indices, self.starts)
        ]
        return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64))

    def plan(self, indices: torch.Tensor, out: Output) -> Planned:
        return self.plan_grouped(indices, batch_groups(indices, self.starts), out)

    def plan_grouped(self, indices: torch.Tensor, groups: Groups, out: Output) -> Planned:
        f = self.field
        locals_ = [(k, groups.rows[a:b]) for k, a, b in groups.runs]
        lens = (
            np.concatenate([self.lengths[k][local] for k, local in locals_])
            if locals_
            else np.zeros(0, np.int64)
        )
        max_len = int(lens.max()) if len(lens) else 0
        out = self.output((len(indices), max_len, *self.trail), out)
        steps: list[Step] = []
        if len(lens) and max_len and self.row_bytes:
            flat, rb = flat_bytes(out), self.row_bytes
            dst = np.arange(len(lens), dtype=np.int64) * (max_len * rb)
            src = np.concatenate(
                [
                    self.values[k].ctypes.data + self.row_starts[k][local] * rb
                    for k, local in locals_
                ]
            )
            sizes = lens * rb
            keep = tuple(self.values[k] for k, _ in locals_)
            steps.append(Runs(flat, dst, src, sizes, keep))
            tails = max_len * rb - sizes
            if tails.any():
                steps.append(
                    fill_runs(flat, dst + sizes, tails, self.pad_pattern(int(tails.max())))
                )
        return {f.name: out, f"{f.name}_lengths": torch.from_numpy(lens)}, steps

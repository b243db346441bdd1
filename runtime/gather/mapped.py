"""Gathers of fixed raw fields straight from the mapped shards: rows."""

from __future__ import annotations

import math
from collections.abc import Sequence
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
from .plan import Rows, RowTable, Step


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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.row_bytes = math.prod(self.trail) * self.out_dtype.itemsize
        sources = [rows_of(s, self.field.name, self.row_bytes) for s in self.shards]
        self.table = RowTable(sources, self.row_bytes) if sources and self.row_bytes else None

    def buffer_numel(self, batch_size: int, among: np.ndarray | None = None) -> int | None:
        return batch_size * math.prod(self.trail)

    def most_numel(self, batches: Sequence[np.ndarray]) -> int:
        return max(map(len, batches), default=0) * math.prod(self.trail)

    def plan(self, indices: torch.Tensor, out: Output) -> Planned:
        return self.plan_grouped(indices, batch_groups(indices, self.starts), out)

    def plan_grouped(self, indices: torch.Tensor, groups: Groups, out: Output) -> Planned:
        return self.plan_rows(self.table, indices, groups, out)

    def plan_rows(
        self, table: RowTable | None, indices: torch.Tensor, groups: Groups, out: Output
    ) -> Planned:
        """``plan_grouped`` over ``table`` (``groups.shards`` number its sources)."""
        out = self.output((len(indices), *self.trail), out)
        steps: list[Step] = []
        if table is not None and len(indices):
            shards = groups.shards if len(table) > 1 else None
            steps.append(Rows(flat_bytes(out), table, shards, groups.rows))
        return {self.field.name: out}, steps

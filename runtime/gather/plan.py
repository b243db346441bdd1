"""Copy plans: where each byte of a batch comes from and goes to, as plain arrays.

A gather (runtime.gather.fields) turns a batch of indices into a ``CopyPlan`` without
copying anything; the copy engine (runtime.gather.engine) executes it. Two kinds of step,
each writing into one flat ``uint8`` destination tensor:

- ``Rows``: row ``rows[i]`` of source ``shards[i]`` of a ``RowTable`` (one
  ``[num_rows, row_bytes]`` source per shard) to consecutive rows of the
  destination (fixed-shape fields): one step per field and batch, whatever the
  number of shards the batch touches.
- ``Runs``: byte runs, ``nbytes[i]`` bytes from address ``src[i]`` to
  ``dst_offsets[i]`` (ragged spans, decoded samples). ``keep`` holds the
  arrays the addresses point into, so they outlive a queued copy. Padding
  is runs too, copied from a buffer of the pad value (``fill_runs``).

Steps are checked when made: every destination run lies inside its
destination, so an executed plan never writes outside the batch's buffers.
Source rows are checked by the engine against their table before copying;
source addresses come from offsets that ``dlop.formats`` validated.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def _check_inside(dst: torch.Tensor, offsets: np.ndarray, nbytes: np.ndarray, what: str) -> None:
    if dst.dtype != torch.uint8 or dst.ndim != 1 or not dst.is_contiguous():
        raise ValueError(f"{what}: the destination must be a flat contiguous uint8 tensor")
    if len(offsets) and (
        int(offsets.min()) < 0
        or int(nbytes.min()) < 0
        or int((offsets + nbytes).max()) > dst.numel()
    ):
        raise ValueError(f"{what}: a run falls outside its destination of {dst.numel()} bytes")


class RowTable:
    """A fixed-size field's rows over several sources (one per shard), each a
    ``uint8 [num_rows, row_bytes]`` tensor, addressed as one table: a batch's rows
    from any number of shards are one ``Rows`` step and one copy call."""

    def __init__(self, sources: list[torch.Tensor], row_bytes: int) -> None:
        for s in sources:
            if s.dtype != torch.uint8 or s.ndim != 2 or s.shape[1] != row_bytes:
                raise ValueError(f"RowTable: every source must be uint8 [rows, {row_bytes}]")
            if not s.is_contiguous():
                raise ValueError("RowTable: every source must be contiguous")
        self.sources = sources  # kept: the addresses below point into them
        self.row_bytes = row_bytes
        self.bases = np.array([s.data_ptr() for s in sources], np.int64)
        self.nums = np.array([s.shape[0] for s in sources], np.int64)

    def __len__(self) -> int:
        return len(self.sources)

    @classmethod
    def slots(cls, count: int, row_bytes: int) -> RowTable:
        """A table of ``count`` sources, each empty (no rows) until ``put``."""
        empty = torch.zeros((0, row_bytes), dtype=torch.uint8)
        return cls([empty] * count, row_bytes)

    def put(self, k: int, source: torch.Tensor) -> None:
        """Source ``k`` is ``source`` from now on (checked as in the constructor)."""
        one = RowTable([source], self.row_bytes)
        self.sources[k] = source
        self.bases[k], self.nums[k] = one.bases[0], one.nums[0]

    def clear(self, k: int) -> None:
        """Source ``k`` holds no rows (nor a view of any memory) from now on."""
        self.nums[k], self.bases[k] = 0, 0
        self.sources[k] = torch.zeros((0, self.row_bytes), dtype=torch.uint8)

    def take(self, ks: np.ndarray) -> RowTable:
        """A table of sources ``ks`` of this one (source i is this one's ``ks[i]``), which
        keeps them: later ``put`` and ``clear`` calls here do not change it."""
        out = RowTable([], self.row_bytes)
        out.sources = [self.sources[k] for k in ks.tolist()]
        out.bases, out.nums = self.bases[ks], self.nums[ks]
        return out


@dataclass(frozen=True)
class Rows:
    """Row ``rows[i]`` of source ``shards[i]`` of ``table`` to row i of ``dst``
    (``shards`` None: every row from source 0). Row and source numbers are checked
    against the table by the engine before anything is copied."""

    dst: torch.Tensor  # uint8 [len(rows) * row_bytes]
    table: RowTable
    shards: np.ndarray | None  # int64 [len(rows)], contiguous
    rows: np.ndarray  # int64, contiguous

    def __post_init__(self) -> None:
        if not len(self.table) or self.dst.numel() != len(self.rows) * self.table.row_bytes:
            raise ValueError("Rows: the destination must hold exactly len(rows) source rows")
        arrays = (self.rows,) if self.shards is None else (self.rows, self.shards)
        if self.shards is not None and len(self.shards) != len(self.rows):
            raise ValueError("Rows: one source number per row")
        if any(a.dtype != np.int64 or not a.flags.c_contiguous for a in arrays):
            raise ValueError("Rows: rows and shards must be contiguous int64 arrays")

    @property
    def nbytes(self) -> int:
        return int(self.dst.numel())

    def split(self, bounds: list[int]) -> list[Rows]:
        row, s = self.table.row_bytes, self.shards
        return [
            Rows(
                self.dst[a * row : b * row],
                self.table,
                None if s is None else s[a:b],
                self.rows[a:b],
            )
            for a, b in itertools.pairwise(bounds)
        ]

    def cuts(self, parts: int) -> list[int]:
        n = len(self.rows)
        return [n * i // parts for i in range(parts + 1)]


@dataclass(frozen=True)
class Runs:
    dst: torch.Tensor
    dst_offsets: np.ndarray  # int64
    src: np.ndarray  # int64 addresses
    sizes: np.ndarray  # int64 bytes
    keep: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        _check_inside(self.dst, self.dst_offsets, self.sizes, "Runs")

    @property
    def nbytes(self) -> int:
        return int(self.sizes.sum())

    def split(self, bounds: list[int]) -> list[Runs]:
        return [
            Runs(self.dst, self.dst_offsets[a:b], self.src[a:b], self.sizes[a:b], self.keep)
            for a, b in itertools.pairwise(bounds)
        ]

    def cuts(self, parts: int) -> list[int]:
        return byte_cuts(self.sizes, parts)


Step = Rows | Runs


def byte_cuts(sizes: np.ndarray, parts: int) -> list[int]:
    """Cuts of ``sizes`` into ``parts`` consecutive shares of about equal bytes."""
    total = int(sizes.sum())
    cuts = np.searchsorted(np.cumsum(sizes), total * np.arange(1, parts) / parts)
    return [0, *cuts.tolist(), len(sizes)]


@dataclass
class CopyPlan:
    """The steps of one batch's copies, in no particular order: no two write the same bytes.
    A plan of several batches made as one may say how to get each batch's steps
    (``apart``: an iterator of them, a batch's made as it is reached), to copy them again
    one batch at a time and find the one whose copy fails."""

    steps: list[Step]
    apart: Callable[[], Iterator[list[Step]]] | None = None

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.steps)

    def shares(self, parts: int, min_split_bytes: int) -> list[list[Step]]:
        """The steps cut into up to ``parts`` shares of about equal bytes: steps of at
        least ``min_split_bytes`` are split evenly, smaller ones go whole to the
        share with the fewest bytes so far. Empty shares are left out."""
        out: list[list[Step]] = [[] for _ in range(max(1, parts))]
        load = [0] * len(out)
        for step in self.steps:
            nbytes = step.nbytes  # a property: read once per step
            if not nbytes:
                continue
            if len(out) > 1 and nbytes >= min_split_bytes:
                pieces: list[Step] = list(step.split(step.cuts(len(out))))
                for i, piece in enumerate(pieces):
                    out[i].append(piece)
                    load[i] += piece.nbytes
            else:
                i = load.index(min(load))
                out[i].append(step)
                load[i] += nbytes
        return [share for share in out if share]


def fill_runs(
    dst: torch.Tensor, offsets: np.ndarray, sizes: np.ndarray, pattern: torch.Tensor
) -> Runs:
    """Runs that set ``sizes[i]`` bytes at ``offsets[i]`` to the bytes at the start of
    ``pattern`` (a flat buffer of the pad value, at least ``max(sizes)`` bytes long:
    runs start on element boundaries, so each begins with a whole value)."""
    keep = sizes > 0
    offsets, sizes = offsets[keep], sizes[keep]
    if len(sizes) and int(sizes.max()) > pattern.numel() * pattern.element_size():
        raise ValueError("fill_runs: the pattern is shorter than the longest fill")
    src = np.full(len(sizes), pattern.data_ptr(), np.int64)
    return Runs(dst, offsets, src, sizes, (pattern,))

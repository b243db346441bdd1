"""Batch gathers: a batch of indices to a copy plan and the batch's tensors, one gather per field.

A gather is pure and thread-free: ``plan(indices, out)`` returns the batch's
entries for its field (tensors that are views of ``out``, or fresh ones;
lengths; lists for text) and the copy steps (runtime.gather.plan) that fill those
tensors once the copy engine (runtime.gather.engine) has executed them. Nothing is
copied before that, so the same plan runs inline, on helper threads, or
queued behind the previous batch's.

Kinds (``gather_for``):

- fixed raw fields: one ``Rows`` step per batch, whatever the shards it
  touches (runtime.gather.mapped);
- raw ragged fields (any of their dimensions varying) and zstd fields (from
  their decoded blocks): one run per contiguous piece of a sample plus the
  padding around it, planned as arrays over the whole batch
  (runtime.gather.spans);
- text and bytes: lists, no copy steps (runtime.gather.samples).
"""

from __future__ import annotations

import itertools
import math
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch

from dlop.formats import Field, ShardReader
from dlop.formats.constants import DTYPES

from ..errors import UsageError, UsageTypeError
from .plan import Step

TORCH_DTYPES = {
    "u8": torch.uint8,
    "u16": torch.uint16,
    "u32": torch.uint32,
    "u64": torch.uint64,
    "i8": torch.int8,
    "i16": torch.int16,
    "i32": torch.int32,
    "i64": torch.int64,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "f32": torch.float32,
    "f64": torch.float64,
    "bool": torch.bool,
}

Planned = tuple[dict[str, Any], list[Step]]
# Several batches planned one after another into one buffer: each batch's entries, the steps.
PackedPlan = tuple[list[dict[str, Any]], list[Step]]
LINE = 64  # bytes: where each of several batches planned into one buffer begins
Count = TypeVar("Count", int, np.ndarray)
# Makes a fresh output tensor of a shape and dtype (fresh outputs: torch.empty).
Allocate = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
# Where a gather writes: the front of a reusable flat buffer, fresh tensors
# from an allocator, or (None) fresh tensors from torch.empty.
Output = torch.Tensor | Allocate | None


def as_tensor(arr: np.ndarray, dtype: str) -> torch.Tensor:
    """Zero-copy tensor over a (possibly read-only) mapped array, in the field's torch dtype."""
    with warnings.catch_warnings():
        # Mapped shards are read-only; torch warns that it cannot enforce that.
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr)
    return t.view(TORCH_DTYPES[dtype]) if t.dtype != TORCH_DTYPES[dtype] else t


def as_bytes(arr: np.ndarray, rows: int, row_bytes: int) -> torch.Tensor:
    """A mapped array as a read-only ``uint8 [rows, row_bytes]`` tensor, zero-copy."""
    flat = arr.reshape(-1).view(np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(flat).view(rows, row_bytes)


def memory_bytes() -> int | None:
    """This machine's physical memory, or None where the system does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_padded(field: Field, shapes: np.ndarray, itemsize: int) -> None:
    """Refuses a padded batch larger than this machine's memory before allocating it.

    Padding takes the longest sample in each varying dimension, so samples long
    in different dimensions ((1, 10**6) and (10**6, 1)) pad to an area no sample
    has. ``shapes`` is ``[B, ndim]``.
    """
    if not len(shapes):
        return
    maxes = [int(m) for m in shapes.max(axis=0)]
    padded = len(shapes) * math.prod(maxes) * itemsize  # Python ints: no overflow
    limit = memory_bytes()
    if limit is not None and padded > limit:
        data = int(np.prod(shapes, axis=1, dtype=np.float64).sum()) * itemsize
        ranges = " x ".join(
            f"{int(lo)}..{int(hi)}" for lo, hi in zip(shapes.min(axis=0), maxes, strict=True)
        )
        raise UsageError(
            f"field {field.name!r}: padding {len(shapes)} samples (sizes {ranges}) to the "
            f"longest in each dimension gives [{len(shapes)}, {', '.join(map(str, maxes))}], "
            f"{padded} bytes for {data} bytes of data, more than this machine's memory "
            f"({limit} bytes); batch samples of similar shape (bucket_by), crop them in the "
            "compiler, or read this field sample by sample (ds[i])"
        )


def shard_groups(indices: torch.Tensor, starts: torch.Tensor) -> list[tuple[int, int, int]]:
    """(shard, begin, end) runs of positions in ``indices``.

    Indices within one shard may come in any order; spanning shards, they must
    be ascending.
    """
    if not len(indices):
        return []
    if len(starts) == 1:
        return [(0, 0, len(indices))]
    # numpy: a few small searches, each a fraction of a torch call's overhead, per field
    # and batch
    idx, first = indices.numpy(), starts.numpy()
    ends = np.searchsorted(first, (idx.min(), idx.max()), side="right") - 1
    shard_of_first, shard_of_last = ends.tolist()
    if shard_of_first == shard_of_last:
        return [(shard_of_first, 0, len(indices))]
    cuts = np.searchsorted(idx, first[shard_of_first + 1 : shard_of_last + 1]).tolist()
    bounds = [0, *cuts, len(indices)]
    return [
        (shard_of_first + j, bounds[j], bounds[j + 1])
        for j in range(len(bounds) - 1)
        if bounds[j + 1] > bounds[j]
    ]


class Groups(NamedTuple):
    """A batch's indices by shard, worked out once for all its fields (``batch_groups``)
    as arrays: gathers plan a whole batch with array arithmetic, whatever the number
    of shards it touches."""

    shards: np.ndarray  # int64 [B], contiguous: the shard each index falls in
    rows: np.ndarray  # int64 [B], contiguous: each index's row within its shard


def batch_groups(indices: torch.Tensor, starts: torch.Tensor) -> Groups:
    """Each of ``indices`` (in any order) as its shard and its row within that shard."""
    idx = np.ascontiguousarray(indices.numpy(), np.int64)
    first = starts.numpy()
    if len(first) <= 1:
        return Groups(np.zeros(len(idx), np.int64), idx)
    shards = (np.searchsorted(first, idx, side="right") - 1).astype(np.int64, copy=False)
    return Groups(shards, idx - first[shards])


class Locator:
    """``batch_groups`` for many shards at a cost that does not grow with their number.

    A binary search costs log2(shards) steps a sample: on a thousand shards it
    outweighs a small batch's copies. Here a table gives the shard of every
    ``2**shift``-th sample, and a sample's shard is its block's entry plus at most
    ``steps`` corrections (the shard starts inside the block), a few array
    operations a batch. The block is chosen from the shards' sizes so that few
    starts fall inside one; where no block of at least ``MIN_BLOCK`` samples
    does that (many tiny shards), the binary search serves.
    """

    MIN_BLOCK = 64
    MAX_STEPS = 3

    def __init__(self, starts: torch.Tensor, total: int) -> None:
        self.starts = starts
        first = starts.numpy().astype(np.int64)
        # one past the last shard's first sample is the total; past that, never reached
        self.after = np.concatenate([first[1:], [total, np.iinfo(np.int64).max]])
        self.first = first
        self.table: np.ndarray | None = None
        self.shift, self.steps = 0, 0
        if len(first) <= 1 or total <= 0:
            return
        sizes = np.diff(np.append(first, total))
        block = 1 << max(0, int(np.median(sizes)).bit_length() - 1)
        while block >= self.MIN_BLOCK:
            marks = np.arange(0, total, block, dtype=np.int64)
            table = np.searchsorted(first, marks, side="right") - 1
            last_in_block = np.minimum(marks + block - 1, total - 1)
            steps = int((np.searchsorted(first, last_in_block, side="right") - 1 - table).max())
            if steps <= self.MAX_STEPS:
                self.table, self.shift, self.steps = (
                    table.astype(np.int64),
                    block.bit_length() - 1,
                    steps,
                )
                return
            block //= 2

    def groups(self, indices: torch.Tensor) -> Groups:
        """``batch_groups`` of ``indices`` (sample numbers of the archive: Archive.plan
        checks them)."""
        if self.table is None:
            return batch_groups(indices, self.starts)
        idx = np.ascontiguousarray(indices.numpy(), np.int64)
        shards = self.table[idx >> self.shift]  # a sample past the end: IndexError
        for _ in range(self.steps):
            shards += idx >= self.after[shards]
        return Groups(shards, idx - self.first[shards])


def check_pad_value(field: Field, pad_value: object, where: str) -> None:
    """Refuses a ``pad_value`` that the ragged array field ``field`` of the archive at
    ``where`` cannot hold exactly: a value outside an integer type's range or with a
    fraction, anything but 0 or 1 for ``bool``, a finite value beyond a float type's
    largest. NaN and infinities pad float fields as given."""
    if isinstance(pad_value, bool | np.bool_):
        value: float | int = int(pad_value)
    elif isinstance(pad_value, int | np.integer):
        value = int(pad_value)
    elif isinstance(pad_value, float | np.floating):
        value = float(pad_value)
    else:
        raise UsageTypeError(
            f"{where}: pad_value must be a number, got {type(pad_value).__name__} {pad_value!r:.40}"
        )
    dtype = TORCH_DTYPES[field.dtype]
    if dtype == torch.bool:
        holds, what = value in (0, 1), "0 or 1"
    elif dtype.is_floating_point:
        top = torch.finfo(dtype).max
        holds = (isinstance(value, float) and not math.isfinite(value)) or -top <= value <= top
        what = f"values from {-top:g} to {top:g}, infinities and NaN"
    else:
        info = np.iinfo(DTYPES[field.dtype])
        whole = isinstance(value, int) or (math.isfinite(value) and value.is_integer())
        holds = whole and int(info.min) <= value <= int(info.max)
        what = f"whole numbers from {info.min} to {info.max}"
    if not holds:
        raise UsageError(
            f"{where}: field {field.name!r} ({field.dtype}) is padded with "
            f"pad_value={pad_value!r}, which it cannot hold ({field.dtype} holds {what}); "
            "give a pad_value the field can hold, or leave out the field (fields=...)"
        )


def aligned(numel: Count, element_size: int) -> Count:
    """``numel`` elements of ``element_size`` bytes (a count, or an array of them) rounded
    up to whole ``LINE``-byte lines."""
    per_line = max(1, LINE // element_size)
    return -(-numel // per_line) * per_line


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 view."""
    return t.view(-1).view(torch.uint8)


class FieldGather:
    """Plans one field's part of a batch of global indices (any order within a shard,
    ascending across shards; see shard_groups), unless it plans ``by_arrays``."""

    # Plans a batch by array arithmetic over all its indices, in any order. No gather
    # reads a mapped byte in Python: what Python reads (per-sample tables, text, zstd
    # frames) the copy step copies out first, and the compiled copier copies values, so
    # a shard truncated under either is an error naming it (runtime.gather.engine), and
    # no check of the shards precedes each batch.
    by_arrays = False

    def __init__(
        self,
        field: Field,
        shards: list[ShardReader],
        starts: torch.Tensor,
        pad_value: float,
        *,
        transient: bool = False,
    ) -> None:
        # made for one batch's shards (a supply that maps shards per batch): what it
        # copies out of a shard the shard keeps (ShardReader.derived), for the next
        # batch's gathers; otherwise the gather holds it, once
        self.transient = transient
        self.field = field
        self.shards = shards
        self.starts = starts
        self.pad_value = pad_value
        self.out_dtype = TORCH_DTYPES[field.dtype]
        self.trail = tuple(d for d in field.shape if d is not None)
        self._pattern = torch.zeros(0, dtype=self.out_dtype)

    def output(self, shape: tuple[int, ...], out: Output) -> torch.Tensor:
        """A fresh tensor of ``shape``, or the front of a reusable flat buffer viewed as one."""
        if out is None:
            return torch.empty(shape, dtype=self.out_dtype)
        if not isinstance(out, torch.Tensor):
            return out(shape, self.out_dtype)
        return out.view(-1)[: math.prod(shape)].view(self.out_dtype).view(shape)

    def pad_pattern(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` bytes of the pad value. A longer one replaces
        it; plans hold the buffer they read, so a queued copy keeps its own."""
        if self._pattern.numel() * self._pattern.element_size() < nbytes:
            count = max(-(-nbytes // self._pattern.element_size()), 1024)
            # the archive checked the value against the field's type (check_pad_value)
            self._pattern = torch.full((count,), self.pad_value, dtype=self.out_dtype)
        return self._pattern

    def buffer_numel(self, batch_size: int, among: np.ndarray | None = None) -> int | None:
        """Elements a reusable output buffer needs at this batch size (None: fresh each
        batch), its samples drawn from ``among`` (sample numbers; None: any)."""
        return None

    def most_numel(self, batches: Sequence[np.ndarray]) -> int:
        """The most elements ``buffer_numel`` asks for any of ``batches`` (each its sample
        numbers); 0 for none, or where every batch's buffer is fresh."""
        return max((self.buffer_numel(len(b), b) or 0 for b in batches), default=0)

    def plan(self, indices: torch.Tensor, out: Output) -> Planned:
        """The field's batch entries and the copy steps that fill them."""
        raise NotImplementedError

    def plan_grouped(self, indices: torch.Tensor, groups: Groups, out: Output) -> Planned:
        """``plan``, given the batch's ``batch_groups`` (worked out once for all fields);
        gathers that read by shard runs take them, the others plan as ``plan``."""
        return self.plan(indices, out)

    def plan_packed(
        self, indices: torch.Tensor, groups: Groups, cuts: list[int], out: torch.Tensor | None
    ) -> PackedPlan:
        """The batches ``indices[cuts[i]:cuts[i + 1]]`` (``groups`` those of all of
        ``indices``) each planned into the flat buffer ``out`` after the one before, each
        beginning on a whole ``LINE`` (``aligned``); fresh outputs where ``out`` is None.
        Here batch by batch; gathers that can plan them all as arrays at once do."""
        entries, steps, at = [], [], 0
        for a, b in itertools.pairwise(cuts):
            part = Groups(groups.shards[a:b], groups.rows[a:b])
            got, more = self.plan_grouped(indices[a:b], part, None if out is None else out[at:])
            if out is not None:
                at += aligned(got[self.field.name].numel(), out.element_size())
            entries.append(got)
            steps += more
        return entries, steps

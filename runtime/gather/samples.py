"""Gathers that read sample by sample: zstd fields (blocks decoded here, through the
archive's block cache), fields with several varying dimensions, and text."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from dlop.formats import Field, FormatError

from .engine import private_copy
from .fields import FieldGather, Output, Planned, check_padded, flat_bytes, shard_groups
from .plan import Runs, Step, fill_runs


def sample_runs(
    shape: tuple[int, ...], padded: tuple[int, ...], itemsize: int
) -> tuple[np.ndarray, np.ndarray]:
    """(destination offsets, sizes) in bytes of the contiguous pieces of a C-ordered
    sample of ``shape`` placed at the origin of a ``padded`` region; the sample's
    own bytes are consecutive, in the same order."""
    if math.prod(shape) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    differs = [i for i, (s, p) in enumerate(zip(shape, padded, strict=True)) if s != p]
    if not differs:
        return np.zeros(1, np.int64), np.array([math.prod(shape) * itemsize], np.int64)
    k = differs[-1]  # axes after k match: each index over axes 0..k-1 is one piece
    strides = [math.prod(padded[i + 1 :]) * itemsize for i in range(len(padded))]
    size = shape[k] * strides[k]
    if k == 0:
        return np.zeros(1, np.int64), np.array([size], np.int64)
    lead = np.indices(shape[:k], dtype=np.int64).reshape(k, -1)
    offsets = np.asarray(strides[:k], np.int64) @ lead
    return offsets.astype(np.int64), np.full(len(offsets), size, np.int64)


def gaps(offsets: np.ndarray, sizes: np.ndarray, end: int) -> tuple[np.ndarray, np.ndarray]:
    """The bytes of [0, end) that ascending runs (offsets, sizes) leave uncovered."""
    starts = np.concatenate([[0], offsets + sizes]).astype(np.int64)
    ends = np.concatenate([offsets, [end]]).astype(np.int64)
    return starts, ends - starts


class PerSampleGather(FieldGather):
    """zstd fields and ragged fields with several varying dimensions: one run per
    contiguous piece of each sample, and runs of padding around them."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.ragged_axes = [i for i, d in enumerate(self.field.shape) if d is None]

    def buffer_numel(self, batch_size: int) -> int | None:
        return None if self.field.ragged else batch_size * math.prod(self.trail)

    def _values(self, indices: torch.Tensor) -> list[np.ndarray]:
        values = []
        for k, a, b in shard_groups(indices, self.starts):
            start = int(self.starts[k])
            for i in indices[a:b].tolist():
                value = self.shards[k].get(self.field.name, i - start)  # zstd: the block cache
                if not isinstance(value, np.ndarray):
                    raise TypeError(f"field {self.field.name!r} is not an array field")
                values.append(np.ascontiguousarray(value))
        return values

    def plan(self, indices: torch.Tensor, out: Output) -> Planned:
        f, values = self.field, self._values(indices)
        shapes = np.array([v.shape for v in values], dtype=np.int64).reshape(len(values), f.ndim)
        if f.ragged:
            check_padded(f, shapes, self.out_dtype.itemsize)
        padded = (
            tuple(int(m) for m in shapes.max(axis=0))
            if len(values)
            else tuple(0 if d is None else d for d in f.shape)
        )
        out = self.output((len(values), *padded), out)
        itemsize = self.out_dtype.itemsize
        sample_bytes = math.prod(padded) * itemsize
        dst, src, sizes, fill_at, fill_sizes = [], [], [], [], []
        for j, v in enumerate(values):
            offsets, lens = sample_runs(v.shape, padded, itemsize)
            base = j * sample_bytes
            dst.append(offsets + base)
            src.append(v.ctypes.data + np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64))
            sizes.append(lens)
            at, n = gaps(offsets, lens, sample_bytes)
            fill_at.append(at + base)
            fill_sizes.append(n)
        steps: list[Step] = []
        entries: dict[str, Any] = {f.name: out}
        if values and sample_bytes:
            flat = flat_bytes(out)
            sizes_all = np.concatenate(sizes)
            steps.append(
                Runs(flat, np.concatenate(dst), np.concatenate(src), sizes_all, tuple(values))
            )
            holes = np.concatenate(fill_sizes)
            if holes.any():
                pattern = self.pad_pattern(int(holes.max()))
                steps.append(fill_runs(flat, np.concatenate(fill_at), holes, pattern))
        if f.ragged:
            lengths = torch.from_numpy(shapes[:, self.ragged_axes].copy())
            entries[f"{f.name}_lengths"] = lengths[:, 0] if len(self.ragged_axes) == 1 else lengths
        return entries, steps


class TextGather(FieldGather):
    """str/bytes fields, as lists. Raw ones slice a per-shard copy of the (small) values
    region: about 0.3 us a sample against 5 us through ShardReader.get. The copy is made
    by the copy step (private_copy), so a raw text field reads no mapped byte in Python
    and its batches need no check first; a zstd one decodes from the mapping."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._text: dict[int, tuple[bytes, list[int]]] = {}

    @classmethod
    def reads_mapping(cls, field: Field) -> bool:
        return not field.codec.mappable

    def _shard_text(self, k: int) -> tuple[bytes, list[int]]:
        cached = self._text.get(k)
        if cached is None:
            shard = self.shards[k]
            cached = (
                private_copy(shard.values(self.field.name)).tobytes(),
                private_copy(shard.offsets(self.field.name)).tolist(),
            )
            self._text[k] = cached
        return cached

    def plan(self, indices: torch.Tensor, out: Output) -> Planned:
        name, is_str = self.field.name, self.field.kind == "str"
        values: list[Any] = []
        for k, a, b in shard_groups(indices, self.starts):
            start = int(self.starts[k])
            local = [int(i) - start for i in indices[a:b].tolist()]
            if not self.field.codec.mappable:
                values += [self.shards[k].get(name, i) for i in local]
                continue
            data, offsets = self._shard_text(k)
            if is_str:
                try:
                    values += [data[offsets[i] : offsets[i + 1]].decode("utf-8") for i in local]
                except UnicodeDecodeError:
                    raise self._not_utf8(k, data, offsets, local) from None
            else:
                values += [data[offsets[i] : offsets[i + 1]] for i in local]
        return {name: values}, []

    def _not_utf8(self, k: int, data: bytes, offsets: list[int], local: list[int]) -> FormatError:
        """The error naming the first of ``local`` that is not UTF-8 (as ShardReader.get
        names it), found in the copy."""
        for i in local:
            try:
                data[offsets[i] : offsets[i + 1]].decode("utf-8")
            except UnicodeDecodeError as e:
                return FormatError(
                    self.shards[k].path,
                    f"field {self.field.name!r} sample {i}: not UTF-8 ({e.reason})",
                )
        raise AssertionError("a sample failed to decode once, not twice")

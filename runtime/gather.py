"""Vectorized batch gathers, one per field kind, over every shard of an archive.

Fixed raw fields: one call per shard touched (one per batch for a
single-shard archive) copies the rows straight from the memory map into the
output: the compiled copier over a list of row addresses, or
``torch.index_select`` without it (runtime.copier). Ragged raw fields whose
first dimension varies: one copy per sample of its rows plus the padding.
Everything else (zstd blocks, several ragged dimensions, text) goes sample by
sample or block by block.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from dlop.formats import Field, ShardReader

from .copier import Copier, native
from .errors import UsageError

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


# torch's unsigned 16/32/64-bit types lack kernels such as index_select: gather
# through the signed type of the same width, a free view.
_GATHER_AS = {"u16": torch.int16, "u32": torch.int32, "u64": torch.int64, "bf16": torch.int16}


def as_tensor(arr: np.ndarray, dtype: str, *, for_gather: bool = False) -> torch.Tensor:
    """Zero-copy tensor over a (possibly read-only) mapped array, in the field's torch dtype."""
    with warnings.catch_warnings():
        # Mapped shards are read-only; torch warns that it cannot enforce that.
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr)
    if for_gather and dtype in _GATHER_AS:
        return t.view(_GATHER_AS[dtype])
    return t.view(TORCH_DTYPES[dtype]) if t.dtype != TORCH_DTYPES[dtype] else t


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
    if len(starts) == 1:
        return [(0, 0, len(indices))]
    shard_of_first = int(torch.searchsorted(starts, indices.min(), right=True)) - 1
    shard_of_last = int(torch.searchsorted(starts, indices.max(), right=True)) - 1
    if shard_of_first == shard_of_last:
        return [(shard_of_first, 0, len(indices))]
    cuts = torch.searchsorted(indices, starts[shard_of_first + 1 : shard_of_last + 1]).tolist()
    bounds = [0, *cuts, len(indices)]
    return [
        (shard_of_first + j, bounds[j], bounds[j + 1])
        for j in range(len(bounds) - 1)
        if bounds[j + 1] > bounds[j]
    ]


class FieldGather:
    """Gathers one field for a batch of global indices (any order within a shard,
    ascending across shards; see shard_groups)."""

    def __init__(
        self, field: Field, shards: list[ShardReader], starts: torch.Tensor, pad_value: float
    ) -> None:
        self.field = field
        self.shards = shards
        self.starts = starts
        self.pad_value = pad_value
        self.out_dtype = TORCH_DTYPES[field.dtype]
        self.dtype = _GATHER_AS.get(field.dtype, self.out_dtype)
        self.trail = tuple(d for d in field.shape if d is not None)

    def _output(self, shape: tuple[int, ...], out: torch.Tensor | None) -> torch.Tensor:
        """A fresh tensor of ``shape``, or the front of a reusable flat buffer viewed as one."""
        if out is None:
            return torch.empty(shape, dtype=self.dtype)
        return out.view(-1)[: math.prod(shape)].view(shape)

    def _groups(self, indices: torch.Tensor) -> list[tuple[int, int, int]]:
        return shard_groups(indices, self.starts) if len(indices) else []

    def gather(
        self, indices: torch.Tensor, out: torch.Tensor | None, copier: Copier | None = None
    ) -> dict[str, Any]:
        """Gathers sorted global ``indices``; ``copier`` is given off the main thread (see runtime.copier)."""
        raise NotImplementedError


class FixedRawGather(FieldGather):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.sources = [
            as_tensor(s.array(self.field.name), self.field.dtype, for_gather=True)
            for s in self.shards
        ]

    def gather(
        self, indices: torch.Tensor, out: torch.Tensor | None, copier: Copier | None = None
    ) -> dict[str, Any]:
        shape = (len(indices), *self.trail)
        out = self._output(shape, out)
        if len(indices):
            row_bytes = math.prod(self.trail) * out.element_size()
            for k, a, b in shard_groups(indices, self.starts):
                local = indices[a:b] - self.starts[k] if k else indices[a:b]
                if copier is None:
                    torch.index_select(self.sources[k], 0, local, out=out[a:b])
                elif row_bytes < 4096:  # tiny rows (labels): one numpy gather beats a call per row
                    np.take(self.sources[k].numpy(), local.numpy(), axis=0, out=out[a:b].numpy())
                elif native() is not None:  # shares of the rows, one compiled call per thread
                    src = self.sources[k]
                    copier.rows(
                        out[a:b].data_ptr(), src.data_ptr(), local.numpy(), row_bytes, len(src)
                    )
                else:  # shares of the rows, one serial index_select per copier thread
                    copier.parallel(_select_jobs(self.sources[k], local, out[a:b], copier.threads))
        return {self.field.name: out.view(self.out_dtype)}


def _select_jobs(
    src: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, parts: int
) -> list[Callable[[], object]]:
    """index_select of ``rows`` into ``out`` as up to ``parts`` jobs over consecutive shares."""
    bounds = np.linspace(0, len(rows), min(parts, len(rows)) + 1).round().astype(int).tolist()
    return [
        functools.partial(torch.index_select, src, 0, rows[lo:hi], out=out[lo:hi])
        for lo, hi in itertools.pairwise(bounds)
        if hi > lo
    ]


class PerSampleGather(FieldGather):
    """zstd fields and ragged fields with several varying dimensions: one copy per sample."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.ragged_axes = [i for i, d in enumerate(self.field.shape) if d is None]

    def _value(self, k: int, local: int) -> np.ndarray:
        value = self.shards[k].get(self.field.name, local)  # zstd blocks: the archive's block cache
        assert isinstance(value, np.ndarray)  # array fields only reach this gather
        return value

    def gather(
        self, indices: torch.Tensor, out: torch.Tensor | None, copier: Copier | None = None
    ) -> dict[str, Any]:
        # numpy copies: torch's parallel copy kernels crawl off the main thread (runtime.copier)
        f = self.field
        values = []
        for k, a, b in self._groups(indices):
            start = int(self.starts[k])
            values += [self._value(k, int(i) - start) for i in indices[a:b].tolist()]
        if not f.ragged:
            shape = (len(values), *self.trail)
            out = self._output(shape, out)
            target = out.numpy()
            for j, v in enumerate(values):
                np.copyto(target[j], v.view(target.dtype), casting="no")
            return {f.name: out.view(self.out_dtype)}
        shapes = np.array([v.shape for v in values], dtype=np.int64).reshape(len(values), f.ndim)
        check_padded(f, shapes, self.out_dtype.itemsize)
        maxes = shapes.max(axis=0) if len(values) else np.zeros(f.ndim, np.int64)
        shape = (len(values), *(int(m) for m in maxes))
        out = self._output(shape, out)
        target = out.numpy()
        for j, v in enumerate(values):
            valid: list[Any] = [slice(0, s) for s in v.shape]
            np.copyto(target[tuple([j, *valid])], v.view(target.dtype), casting="no")
            # The padding, written once: for each axis, what lies past this sample's
            # extent there, within its extent on the axes before it.
            for axis, size in enumerate(v.shape):
                if size < shape[axis + 1]:
                    target[tuple([j, *valid[:axis], slice(size, None)])] = self.pad_value
        lengths = torch.from_numpy(shapes[:, self.ragged_axes].copy())
        return {
            f.name: out.view(self.out_dtype),
            f"{f.name}_lengths": lengths[:, 0] if len(self.ragged_axes) == 1 else lengths,
        }


class RaggedRowsGather(FieldGather):
    """Raw ragged fields whose only varying dimension is the first: vectorized row gather."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        f = self.field
        self.row = math.prod(self.trail)
        self.rows = []
        self.row_starts = []
        self.lengths = []
        for s in self.shards:
            values = as_tensor(s.values(f.name), f.dtype, for_gather=True)
            self.rows.append(values.view(-1, *self.trail) if self.trail else values.view(-1))
            offsets = torch.from_numpy(s.offsets(f.name).astype(np.int64))
            self.row_starts.append(offsets[:-1] // max(self.row, 1))
            self.lengths.append(torch.from_numpy(s.shapes(f.name)[:, 0].copy()))

    def batch_lengths(self, indices: torch.Tensor) -> torch.Tensor:
        parts = []
        for k, a, b in self._groups(indices):
            parts.append(self.lengths[k][indices[a:b] - self.starts[k]])
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    # At or above this many bytes per sample, one contiguous copy per sample beats
    # the row gather: on the build machine 80-mel f16 rows (160 bytes) gathered
    # at 3.8 GB/s by index_select and at 7.0 GB/s as per-sample span copies.
    SPAN_COPY_BYTES = 32 << 10

    def gather(
        self, indices: torch.Tensor, out: torch.Tensor | None, copier: Copier | None = None
    ) -> dict[str, Any]:
        f = self.field
        lengths = self.batch_lengths(indices)
        max_len = int(lengths.max()) if len(lengths) else 0
        shape = (len(indices), max_len, *self.trail)
        out = self._output(shape, out)
        if len(indices) and max_len:
            row_bytes = self.row * self.rows[0].element_size()
            spans = float(lengths.double().mean()) * row_bytes >= self.SPAN_COPY_BYTES
            for k, a, b in shard_groups(indices, self.starts):
                local = indices[a:b] - self.starts[k]
                if copier is not None:
                    self._copier_spans(copier, k, local, out, a, max_len, row_bytes)
                elif spans:
                    self._copy_spans(k, local, out[a:b])
                else:
                    self._gather_rows(k, local, out[a:b], max_len)
        return {f.name: out.view(self.out_dtype), f"{f.name}_lengths": lengths}

    def _copier_spans(
        self,
        copier: Copier,
        k: int,
        local: torch.Tensor,
        out: torch.Tensor,
        first: int,
        max_len: int,
        row_bytes: int,
    ) -> None:
        lens = self.lengths[k][local].numpy()
        sample_bytes = max_len * row_bytes
        dst = out.data_ptr() + (first + np.arange(len(lens))) * sample_bytes
        src = self.rows[k].data_ptr() + self.row_starts[k][local].numpy() * row_bytes
        copier.copy(dst, src, lens * row_bytes)
        tails = (max_len - lens) * row_bytes
        if self.pad_value == 0:
            copier.zero(dst + lens * row_bytes, tails)
        else:
            target = out.numpy()
            for j, n in enumerate(lens.tolist()):
                target[first + j, n:] = self.pad_value

    def _copy_spans(self, k: int, local: torch.Tensor, out: torch.Tensor) -> None:
        rows, starts, lengths = (
            self.rows[k],
            self.row_starts[k][local].tolist(),
            self.lengths[k][local].tolist(),
        )
        for j, (start, n) in enumerate(zip(starts, lengths, strict=True)):
            out[j, :n].copy_(rows[start : start + n])
            if n < out.shape[1]:
                out[j, n:].fill_(self.pad_value)

    def _gather_rows(self, k: int, local: torch.Tensor, out: torch.Tensor, max_len: int) -> None:
        steps = torch.arange(max_len)
        lens = self.lengths[k][local]
        valid = steps[None, :] < lens[:, None]
        rows = torch.where(valid, self.row_starts[k][local][:, None] + steps[None, :], 0)
        target = out.view(-1, *self.trail) if self.trail else out.view(-1)
        torch.index_select(self.rows[k], 0, rows.view(-1), out=target)
        if not bool(valid.all()):
            pad = ~valid
            out.masked_fill_(pad.view(*pad.shape, *([1] * len(self.trail))), self.pad_value)


class TextGather(FieldGather):
    """str/bytes fields. Raw ones slice a per-shard copy of the (small) values
    region: about 0.3 us a sample against 5 us through ShardReader.get."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._text: dict[int, tuple[bytes, list[int]]] = {}

    def _shard_text(self, k: int) -> tuple[bytes, list[int]]:
        cached = self._text.get(k)
        if cached is None:
            shard = self.shards[k]
            cached = (
                shard.values(self.field.name).tobytes(),
                shard.offsets(self.field.name).tolist(),
            )
            self._text[k] = cached
        return cached

    def gather(
        self, indices: torch.Tensor, out: torch.Tensor | None, copier: Copier | None = None
    ) -> dict[str, Any]:
        name, is_str = self.field.name, self.field.kind == "str"
        values: list[Any] = []
        for k, a, b in self._groups(indices):
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
                    values += [self.shards[k].get(name, i) for i in local]  # names the bad sample
            else:
                values += [data[offsets[i] : offsets[i + 1]] for i in local]
        return {name: values}


def make_gather(
    field: Field,
    shards: list[ShardReader],
    starts: torch.Tensor,
    pad_value: float,
) -> FieldGather:
    if field.kind in ("str", "bytes"):
        return TextGather(field, shards, starts, pad_value)
    mapped = field.codec.mappable
    if not field.ragged and mapped:
        return FixedRawGather(field, shards, starts, pad_value)
    if mapped and field.shape[0] is None and all(d is not None for d in field.shape[1:]):
        return RaggedRowsGather(field, shards, starts, pad_value)
    return PerSampleGather(field, shards, starts, pad_value)

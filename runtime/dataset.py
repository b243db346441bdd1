"""``open_archive``: a map-style torch Dataset over a dlop archive."""

from __future__ import annotations

import operator
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dlop.formats import ArchiveReader, Field, SchemaError, ShardReader

from .batch import Batch
from .engine import CopyEngine
from .errors import SampleIndexError, UsageError, UsageTypeError
from .gather import Allocate, FieldGather, as_tensor
from .gather_mapped import FixedRawGather, RaggedRowsGather
from .gather_samples import PerSampleGather, TextGather
from .memory import keep_batch_memory
from .plan import CopyPlan
from .source import LocalSource


class Archive(Dataset[dict[str, Any]]):
    """A dlop archive as a ``torch.utils.data.Dataset``.

    ``ds[i]`` is a dict of tensors (zero-copy, read-only views of the mapped
    shards for raw fields), ``str`` for text and ``bytes`` for bytes fields.
    ``ds.__getitems__(indices)`` gathers a whole batch with one vectorized call
    per field: fixed fields become ``[B, ...]`` tensors; ragged fields are
    padded with ``pad_value`` to the batch's longest sample and come with
    ``<field>_lengths`` (``[B]``, or ``[B, k]`` for k varying dimensions);
    text fields are lists.

    ``fields`` selects fields by name: a list of names, or one name as a str.
    Every gather first checks that the shards it reads have not shrunk since
    they were opened (see ``check_shards``).

    Stages: the shards come from a source (runtime.source), each field's gather
    (runtime.gather) turns a batch of indices into a copy plan, and the copy
    engine (runtime.engine) executes it: ``plan`` and ``gather``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        fields: Sequence[str] | str | None = None,
        pad_value: float = 0.0,
        cache_bytes: int = 256 << 20,
    ) -> None:
        self.path = Path(path)
        fields = field_names(self.path, fields)
        self._options = {
            "fields": fields,
            "pad_value": pad_value,
            "cache_bytes": cache_bytes,
        }
        self.reader = ArchiveReader(self.path, block_cache_bytes=cache_bytes)
        names = list(self.reader.fields) if fields is None else list(fields)
        missing = [n for n in names if n not in self.reader.fields]
        if missing:
            raise SchemaError(
                f"{self.path}: no field(s) {missing}; fields are {list(self.reader.fields)}"
            )
        self.fields: dict[str, Field] = {n: self.reader.fields[n] for n in names}
        self.pad_value = pad_value
        self.source = LocalSource(self.reader)
        self.shards = self.source.shards
        self.starts = torch.from_numpy(self.reader.shard_starts.copy())
        self.gathers: dict[str, FieldGather] = {
            n: gather_for(f, self.shards, self.starts, pad_value) for n, f in self.fields.items()
        }
        self._engine: CopyEngine | None = None

    @property
    def index(self) -> Any:
        return self.reader.index

    def __len__(self) -> int:
        return int(self.reader.num_samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Sample ``index`` (negative counts from the end); fields are columns, so
        ``ds[i]["x"]``, not ``ds["x"]``."""
        if isinstance(index, str | bytes):
            raise UsageTypeError(
                f"{self.path}: an archive is indexed by sample number, got {index!r}; "
                f"for a field take ds[i][{index!r}], or open_archive(path, fields=[{index!r}])"
            )
        if isinstance(index, bool) or not hasattr(index, "__index__"):
            raise UsageTypeError(
                f"{self.path}: a sample number must be an integer, got {type(index).__name__}"
            )
        i = operator.index(index)
        n = len(self)
        if not -n <= i < n:
            raise SampleIndexError(f"{self.path}: sample {i} out of range 0..{n - 1} (or -{n}..-1)")
        k, local = self.reader.locate(i + n if i < 0 else i)
        self.check_shards([k])
        out: dict[str, Any] = {}
        for name, f in self.fields.items():
            value = self.shards[k].get(name, local)
            out[name] = value if isinstance(value, str | bytes) else as_tensor(value, f.dtype)
        return out

    def __getitems__(self, indices: Sequence[int] | torch.Tensor) -> Batch:
        """A collated batch, rows in the order of ``indices``."""
        keep_batch_memory()  # fresh batches reuse freed ones instead of faulting in new pages
        idx = self._batch_indices(indices)
        if len(idx) < 2 or bool((idx[1:] >= idx[:-1]).all()) or self._one_shard(idx):
            return self.gather(idx)  # gathers take any order within a shard
        order = torch.argsort(idx, stable=True)
        sorted_batch = self.gather(idx[order])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        out = Batch()
        for name, value in sorted_batch.items():
            out[name] = (
                [value[i] for i in inverse.tolist()]
                if isinstance(value, list)
                else value.index_select(0, inverse)
            )
        return out

    def _batch_indices(self, indices: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """``indices`` as a flat int64 tensor, each checked against 0..len-1."""
        if isinstance(indices, str | bytes):
            raise UsageTypeError(f"{self.path}: __getitems__ takes sample numbers, got {indices!r}")
        try:
            if isinstance(indices, torch.Tensor):
                if indices.dtype.is_floating_point or indices.dtype.is_complex:
                    raise TypeError(indices.dtype)
                arr = indices.detach().cpu().reshape(-1).numpy()
            else:
                arr = np.asarray(indices).reshape(-1)
            if arr.dtype.kind not in "iub" and arr.size:
                arr = np.array([operator.index(x) for x in arr.tolist()], dtype=object)
        except (TypeError, ValueError) as e:
            raise UsageTypeError(
                f"{self.path}: __getitems__ takes a sequence of integer sample numbers, "
                f"got {type(indices).__name__} ({e})"
            ) from None
        if arr.dtype.kind == "b":
            raise UsageTypeError(f"{self.path}: __getitems__ takes sample numbers, not booleans")
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= len(self):
                bad = lo if lo < 0 else hi
                raise SampleIndexError(f"{self.path}: sample {bad} out of range 0..{len(self) - 1}")
        return torch.from_numpy(arr.astype(np.int64))

    def check_shards(self, shards: Sequence[int] | np.ndarray) -> None:
        """Raises ShardChangedError when a shard among ``shards`` (numbers) has shrunk
        since it was mapped (see runtime.source.LocalSource.check)."""
        self.source.check(shards)

    def shards_of(self, indices: torch.Tensor) -> np.ndarray:
        """The shard numbers that global ``indices`` fall in."""
        if len(self.shards) == 1 or not len(indices):
            return np.zeros(min(1, len(indices)), np.int64)
        return (torch.searchsorted(self.starts, indices, right=True) - 1).numpy()

    def _one_shard(self, idx: torch.Tensor) -> bool:
        lo, hi = torch.searchsorted(
            self.starts, torch.stack([idx.min(), idx.max()]), right=True
        ).tolist()
        return bool(lo == hi)

    def plan(
        self, indices: torch.Tensor, out: dict[str, torch.Tensor] | Allocate | None = None
    ) -> tuple[Batch, CopyPlan]:
        """The batch for ascending global ``indices`` and the copies that fill it.

        Its tensors are views of ``out`` (flat buffers by field name, see
        ``buffer_numel``), made by ``out`` (an allocator), or fresh; they hold
        the batch once an engine has run the plan. Nothing is copied here;
        zstd blocks are decoded here.
        """
        self.check_shards(self.shards_of(indices))
        batch, steps = Batch(), []
        for name, g in self.gathers.items():
            where = out.get(name) if isinstance(out, dict) else out
            entries, field_steps = g.plan(indices, where)
            batch.update(entries)
            steps += field_steps
        return batch, CopyPlan(steps)

    def gather(
        self,
        indices: torch.Tensor,
        out: dict[str, torch.Tensor] | Allocate | None = None,
        engine: CopyEngine | None = None,
    ) -> Batch:
        """``plan`` executed by ``engine``, by default the archive's own (``own_engine``)."""
        batch, plan = self.plan(indices, out)
        (engine or self.own_engine()).run(plan)
        return batch

    def own_engine(self) -> CopyEngine:
        """This process's engine for gathers given none (``__getitems__``). A forked
        DataLoader worker makes its own, with the worker's thread count (1).

        It streams (runtime.engine): a fresh batch lands in memory the allocator
        last used a batch or more ago, no longer in cache (docs/runtime.md gives
        the measured effect).
        """
        if self._engine is None or self._engine.pid != os.getpid():
            self._engine = CopyEngine(streaming=True)
        return self._engine

    def buffer_numel(self, name: str, batch_size: int) -> int | None:
        """Elements a reusable output buffer for ``name`` needs at this batch size (None: no buffer)."""
        return self.gathers[name].buffer_numel(batch_size)

    def lengths(self, name: str) -> np.ndarray:
        """Per-sample length along the first varying dimension of a ragged field (no data read)."""
        f = self.fields.get(name) or self.reader.fields.get(name)
        if f is None or not f.ragged:
            raise SchemaError(f"{self.path}: {name!r} is not a ragged field")
        axis = next(i for i, d in enumerate(f.shape) if d is None)
        parts = [s.shapes(name)[:, axis] for s in self.shards]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    # DataLoader workers started with spawn/forkserver get the archive by pickle:
    # send the path and reopen, never the mappings.
    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self.path), **self._options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state.pop("path"), **state)  # type: ignore[misc]


def field_names(path: Path, fields: Sequence[str] | str | None) -> list[str] | None:
    """``fields`` as a list of names: a str is one name."""
    if fields is None:
        return None
    names = [fields] if isinstance(fields, str) else fields
    try:
        names = list(names)
    except TypeError:
        raise UsageTypeError(
            f"{path}: fields must be a field name or a list of them, got {type(fields).__name__}"
        ) from None
    wrong = [n for n in names if not isinstance(n, str)]
    if wrong:
        raise UsageTypeError(f"{path}: fields must be names (str), got {wrong!r}")
    if len(set(names)) != len(names):
        raise UsageError(f"{path}: fields {names} name a field more than once")
    return names


def gather_for(
    field: Field, shards: list[ShardReader], starts: torch.Tensor, pad_value: float
) -> FieldGather:
    """The gather for a field's kind and storage (runtime.gather lists them)."""
    if field.kind in ("str", "bytes"):
        return TextGather(field, shards, starts, pad_value)
    mapped = field.codec.mappable
    if not field.ragged and mapped:
        return FixedRawGather(field, shards, starts, pad_value)
    if mapped and field.shape[0] is None and all(d is not None for d in field.shape[1:]):
        return RaggedRowsGather(field, shards, starts, pad_value)
    return PerSampleGather(field, shards, starts, pad_value)


def open_archive(
    path: str | os.PathLike[str], fields: Sequence[str] | str | None = None, pad_value: float = 0.0
) -> Archive:
    """Opens an archive as a map-style Dataset (see Archive)."""
    return Archive(path, fields=fields, pad_value=pad_value)


def open_for_loader(
    archive: Archive | str | os.PathLike[str],
    fields: Sequence[str] | str | None,
    pad_value: float | None,
) -> Archive:
    """The Loader's archive: ``archive`` opened with ``fields`` and ``pad_value``; an
    Archive already open is taken as it is when they match it, refused when they do not."""
    if not isinstance(archive, Archive):
        return Archive(archive, fields=fields, pad_value=0.0 if pad_value is None else pad_value)
    if fields is not None:
        names = field_names(archive.path, fields)
        if names != list(archive.fields):
            raise UsageError(
                f"{archive.path}: Loader got an open Archive with fields {list(archive.fields)} "
                f"and fields={names}; open it with those fields (open_archive(path, "
                "fields=...)) or pass the path"
            )
    if pad_value is not None and pad_value != archive.pad_value:
        raise UsageError(
            f"{archive.path}: Loader got an open Archive padded with {archive.pad_value} and "
            f"pad_value={pad_value}; open it with that pad_value or pass the path"
        )
    return archive


def check_bucket_by(archive: Archive, bucket_by: object) -> None:
    """Refuses a ``bucket_by`` that is not one of the archive's ragged fields."""
    if bucket_by is None:
        return
    f = archive.fields.get(bucket_by) if isinstance(bucket_by, str) else None
    if f is None or not f.ragged:
        ragged = [n for n, g in archive.fields.items() if g.ragged]
        raise UsageError(
            f"{archive.path}: bucket_by must name a ragged field among {ragged}, got {bucket_by!r}"
        )

"""``open_archive``: a map-style torch Dataset over a dlop archive."""

from __future__ import annotations

import operator
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dlop.formats import Field, SchemaError, ShardReader
from dlop.formats.heap import keep_freed_memory

from ..batch import Batch
from ..errors import SampleIndexError, UsageTypeError
from ..gather.engine import CopyEngine
from ..gather.fields import Allocate, FieldGather, as_tensor, batch_groups
from ..gather.mapped import FixedRawGather, RaggedRowsGather
from ..gather.plan import CopyPlan
from ..gather.samples import PerSampleGather, TextGather
from ..storage.source import LocalSource
from .concat import ArchivePaths, ConcatSource, archive_paths, check_compatible, open_reader
from .indices import batch_indices, field_names
from .selection import select


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

    ``path`` may list several archives with the same schema (runtime.archive.concat):
    they read as one, samples numbered one archive after another. ``where``
    and ``indices`` choose samples (runtime.archive.selection): ``len``, ``ds[i]`` and
    ``__getitems__`` then count the selected samples only, while ``plan`` and
    ``gather`` take sample numbers of the whole (``selection[i]``).

    Stages: the shards come from a source (runtime.storage.source), each field's gather
    (runtime.gather.fields) turns a batch of indices into a copy plan, and the copy
    engine (runtime.gather.engine) executes it: ``plan`` and ``gather``.
    """

    def __init__(
        self,
        path: ArchivePaths,
        fields: Sequence[str] | str | None = None,
        pad_value: float = 0.0,
        cache_bytes: int = 256 << 20,
        where: Mapping[str, Any] | None = None,
        indices: Sequence[int] | np.ndarray | None = None,
        allow_recipe_mismatch: bool = False,
    ) -> None:
        self.paths = archive_paths(path)
        self.path = self.paths[0]
        fields = field_names(self.path, fields)
        self._options: dict[str, Any] = {
            "fields": fields,
            "pad_value": pad_value,
            "cache_bytes": cache_bytes,
            "where": where,
            "indices": indices,
            "allow_recipe_mismatch": allow_recipe_mismatch,
        }
        self.readers = [open_reader(p, cache_bytes) for p in self.paths]
        self.reader = self.readers[0]
        names = list(self.reader.fields) if fields is None else list(fields)
        # archives that differ first, naming both; then a field none of them holds
        check_compatible(self.readers, fields, allow_recipe_mismatch)
        for reader in self.readers:
            missing = [n for n in names if n not in reader.fields]
            if missing:
                raise SchemaError(
                    f"{reader.directory}: no field(s) {missing}; fields are {list(reader.fields)}"
                )
        self.fields: dict[str, Field] = {n: self.reader.fields[n] for n in names}
        self.pad_value = pad_value
        self.source = (
            LocalSource(self.reader) if len(self.readers) == 1 else ConcatSource(self.readers)
        )
        self.shards = self.source.shards
        # shard_sizes[k]: samples in shard k of the whole; starts: first sample of each, then the total
        self.shard_sizes = tuple(i.num_samples for r in self.readers for i in r.index.shards)
        self.shard_starts = np.cumsum((0, *self.shard_sizes), dtype=np.int64)
        self.num_samples = int(self.shard_starts[-1])
        self.starts = torch.from_numpy(self.shard_starts[:-1].copy())
        what = (
            str(self.path)
            if len(self.paths) == 1
            else f"{len(self.paths)} archives {self.path}, ..."
        )
        self.selection = select(self.reader.fields, self.shards, where, indices, what)
        self.gathers: dict[str, FieldGather] = {
            n: gather_for(f, self.shards, self.starts, pad_value) for n, f in self.fields.items()
        }
        self._engine: CopyEngine | None = None

    @property
    def index(self) -> Any:
        """The (first) archive's parsed index.json."""
        return self.reader.index

    def __len__(self) -> int:
        return self.num_samples if self.selection is None else len(self.selection)

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
        i = i + n if i < 0 else i
        g = i if self.selection is None else int(self.selection[i])
        k = int(np.searchsorted(self.shard_starts, g, side="right")) - 1
        local = g - int(self.shard_starts[k])
        self.check_shards([k])
        out: dict[str, Any] = {}
        for name, f in self.fields.items():
            value = self.shards[k].get(name, local)
            out[name] = value if isinstance(value, str | bytes) else as_tensor(value, f.dtype)
        return out

    def __getitems__(self, indices: Sequence[int] | torch.Tensor) -> Batch:
        """A collated batch, rows in the order of ``indices``."""
        keep_freed_memory()  # fresh batches reuse freed ones instead of faulting in new pages
        idx = batch_indices(self.path, indices, len(self))
        if self.selection is not None:
            idx = torch.from_numpy(self.selection[idx.numpy()])
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

    def check_shards(self, shards: Sequence[int] | np.ndarray) -> None:
        """Raises ShardChangedError when a shard among ``shards`` (numbers) has shrunk
        since it was mapped (see runtime.storage.source.LocalSource.check)."""
        self.source.check(shards)

    def shards_of(self, indices: torch.Tensor) -> np.ndarray:
        """The shard numbers that global ``indices`` fall in."""
        if len(self.shards) == 1 or not len(indices):
            return np.zeros(min(1, len(indices)), np.int64)
        # numpy, not torch: torch.searchsorted goes parallel over a batch of indices, and
        # waking its threads from the Loader's producer costs milliseconds a batch.
        found = np.searchsorted(self.shard_starts, indices.numpy(), side="right") - 1
        return found.astype(np.int64, copy=False)

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
        groups = batch_groups(indices, self.starts)  # once for all fields
        batch, steps = Batch(), []
        for name, g in self.gathers.items():
            where = out.get(name) if isinstance(out, dict) else out
            entries, field_steps = g.plan_grouped(indices, groups, where)
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

        It streams (runtime.gather.engine): a fresh batch lands in memory the allocator
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
    # send the paths and options and reopen, never the mappings.
    def __getstate__(self) -> dict[str, Any]:
        return {"path": [str(p) for p in self.paths], **self._options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state.pop("path"), **state)  # type: ignore[misc]


def gather_for(
    field: Field, shards: list[ShardReader], starts: torch.Tensor, pad_value: float
) -> FieldGather:
    """The gather for a field's kind and storage (runtime.gather.fields lists them)."""
    if field.kind in ("str", "bytes"):
        return TextGather(field, shards, starts, pad_value)
    mapped = field.codec.mappable
    if not field.ragged and mapped:
        return FixedRawGather(field, shards, starts, pad_value)
    if mapped and field.shape[0] is None and all(d is not None for d in field.shape[1:]):
        return RaggedRowsGather(field, shards, starts, pad_value)
    return PerSampleGather(field, shards, starts, pad_value)

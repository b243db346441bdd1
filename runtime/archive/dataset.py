"""``open_archive``: a map-style torch Dataset over a dlop archive."""

from __future__ import annotations

import operator
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dlop.formats import Field, Index, SchemaError
from dlop.formats.groups import field_owner
from dlop.formats.heap import keep_freed_memory

from ..batch import Batch, Collated
from ..errors import SampleIndexError, UsageTypeError
from ..gather.engine import CopyEngine
from ..gather.fields import Allocate, FieldGather, as_tensor, check_pad_value
from ..gather.plan import CopyPlan
from ..storage.supply import LocalSupply, ShardSupply
from .concat import ArchivePaths, archive_paths, check_compatible
from .indices import batch_indices, check_range, field_names
from .planning import held, planner, shards_of
from .selection import select
from .structure import Structure


def missing_fields(index: Index, missing: list[str], supply: ShardSupply) -> str:
    """Why fields ``missing`` cannot be read: none such, or a field group's that covers
    only the shards before an append."""
    for name in missing:
        group = field_owner(index.field_groups, name)
        if group is None:
            continue
        if group.covers < len(index.shards):
            return (
                f"field {name!r} is in field group {group.name!r}, which covers {group.covers} "
                f"of the archive's {len(index.shards)} shards (shards were appended since); "
                f"add_fields(archive, fn, {group.name!r}) computes it for the new ones"
            )
    return f"no field(s) {missing}; fields are {list(supply.fields)}"


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

    Stages: the shards come from a supply (runtime.storage.supply), each field's gather
    (runtime.gather.fields) turns a batch of indices into a copy plan, and the copy
    engine (runtime.gather.engine) executes it: ``plan`` and ``gather``.
    """

    def __init__(
        self,
        path: ArchivePaths,
        fields: Sequence[str] | str | None = None,
        pad_value: float = 0.0,
        block_cache_bytes: int = 256 << 20,
        where: Mapping[str, Any] | None = None,
        indices: Sequence[int] | np.ndarray | None = None,
        allow_recipe_mismatch: bool = False,
    ) -> None:
        supply = LocalSupply(archive_paths(path), block_cache_bytes)
        self.build(supply, fields, pad_value, where, indices, allow_recipe_mismatch)

    @classmethod
    def over(
        cls,
        supply: ShardSupply,
        fields: Sequence[str] | str | None = None,
        pad_value: float = 0.0,
        where: Mapping[str, Any] | None = None,
        indices: Sequence[int] | np.ndarray | None = None,
        allow_recipe_mismatch: bool = False,
    ) -> Archive:
        """The archive whose shards come from ``supply`` (runtime.storage.supply)."""
        archive = cls.__new__(cls)
        archive.build(supply, fields, pad_value, where, indices, allow_recipe_mismatch)
        return archive

    def build(
        self,
        supply: ShardSupply,
        fields: Sequence[str] | str | None,
        pad_value: float,
        where: Mapping[str, Any] | None,
        indices: Sequence[int] | np.ndarray | None,
        allow_recipe_mismatch: bool,
    ) -> None:
        """The archive's state over ``supply``: the one way every Archive is made."""
        self.supply = supply
        # A URL stands where a local archive has its folder: messages name it.
        self.paths = supply.paths
        self.path = self.paths[0]
        names = field_names(self.path, fields)
        self._options: dict[str, Any] = {
            "fields": names,
            "pad_value": pad_value,
            "where": where,
            "indices": indices,
            "allow_recipe_mismatch": allow_recipe_mismatch,
        }
        self.readers = supply.readers
        self.reader = self.readers[0]
        # archives that differ first, naming both; then a field none of them holds
        check_compatible(self.readers, names, allow_recipe_mismatch)
        stored = list(supply.fields) if names is None else names
        for reader in self.readers:
            what = supply.name if len(self.readers) == 1 else reader.directory
            missing = [n for n in stored if n not in reader.fields or n not in supply.fields]
            if missing:
                raise SchemaError(f"{what}: {missing_fields(reader.index, missing, supply)}")
        self.fields: dict[str, Field] = {n: supply.fields[n] for n in stored}
        for f in self.fields.values():
            if f.kind == "array" and f.ragged:
                check_pad_value(f, pad_value, str(self.path))
        self.pad_value = pad_value
        # shard_sizes[k]: samples in shard k of the whole; starts: first sample of each, then the total
        self.shard_sizes = supply.shard_sizes
        self.shard_starts = np.cumsum((0, *self.shard_sizes), dtype=np.int64)
        self.num_samples = int(self.shard_starts[-1])
        self.starts = torch.from_numpy(self.shard_starts[:-1].copy())
        self.shards = supply.shards or []  # empty when the supply maps shards per batch
        # a group's shards read here mapped now, as the rest are: a group changed meanwhile
        # never takes them away
        grouped = [n for n in self.fields if any(n in r.owners for r in self.readers)]
        for shard in self.shards if grouped else ():
            for name in grouped:
                shard.part(name)
        self.selection = select(supply.fields, self.shards, where, indices, supply.name)
        self.planner = planner(supply, self.fields, self.shard_starts, pad_value)
        # a user's own Dataset compiled (compiler.custom): samples come back in its shape
        # when its fields, and no others (a field group's), are read
        shaped = Structure.of(supply.name, self.reader.index.metadata, supply.fields)
        self.structure = shaped if shaped and set(shaped.names) == set(self.fields) else None
        self.gathers: dict[str, FieldGather] = self.planner.gathers
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
        if self.supply.shards is None:  # mapped per batch: copies, not views of a mapping
            batch = self.gather(torch.tensor([g]))
            one = {name: batch[name][0] for name in self.fields}  # one sample: no padding
            return one if self.structure is None else self.structure.sample(one)
        k = int(np.searchsorted(self.shard_starts, g, side="right")) - 1
        local = g - int(self.shard_starts[k])
        self.check_shards([k])
        out: dict[str, Any] = {}
        for name, f in self.fields.items():
            value = self.shards[k].get(name, local)
            out[name] = value if isinstance(value, str | bytes) else as_tensor(value, f.dtype)
        return out if self.structure is None else self.structure.sample(out)

    def __getitems__(self, indices: Sequence[int] | torch.Tensor) -> Batch | Collated:
        """A collated batch, rows in the order of ``indices``: a Batch of fields, or for an
        archive of a user's Dataset whose samples are tuples or nested, the batch in their
        shape (Structure.batch), which DataLoader's default collate passes on as it is."""
        batch = self._batch(indices)
        shaped = batch if self.structure is None else self.structure.batch(batch)
        return batch if shaped is batch else Collated(shaped)

    def _batch(self, indices: Sequence[int] | torch.Tensor) -> Batch:
        keep_freed_memory()  # fresh batches reuse freed ones instead of faulting in new pages
        idx = batch_indices(self.path, indices, len(self))
        if self.selection is not None:
            idx = torch.from_numpy(self.selection[idx.numpy()])
        ascending = len(idx) < 2 or bool((idx[1:] >= idx[:-1]).all())
        if self.planner.by_arrays or ascending or self._one_shard(idx):
            return self.gather(idx)  # gathers take any order within a shard (by arrays: any)
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

    def check_shards(self, shards: Sequence[int] | np.ndarray | None = None) -> None:
        """Raises ShardChangedError when a shard among ``shards`` (numbers; None: every
        shard) has shrunk since it was mapped (see runtime.storage.supply.LocalSupply.check).
        The Loader and IterableArchive check every shard as each epoch starts."""
        if shards is None:
            self.planner.check_all()
        else:
            self.supply.check(shards)

    def shards_of(self, indices: torch.Tensor) -> np.ndarray:
        """The shard numbers that global ``indices`` fall in."""
        return shards_of(self.shard_starts, indices)

    def _one_shard(self, idx: torch.Tensor) -> bool:
        lo, hi = torch.searchsorted(
            self.starts, torch.stack([idx.min(), idx.max()]), right=True
        ).tolist()
        return bool(lo == hi)

    def plan(
        self, indices: torch.Tensor, out: dict[str, torch.Tensor] | Allocate | None = None
    ) -> tuple[Batch, CopyPlan]:
        """The batch for global ``indices`` and the copies that fill it: ascending,
        unless every field plans by arrays (``planner.by_arrays``), which takes any order.

        Its tensors are views of ``out`` (flat buffers by field name, see
        ``buffer_numel``), made by ``out`` (an allocator), or fresh; they hold
        the batch once an engine has run the plan. Nothing is copied here;
        zstd blocks are decoded here. A supply that maps shards per batch holds the
        shards the batch touches while it is planned (runtime.archive.planning).
        A number outside the archive raises SampleIndexError: the gathers of ragged
        fields take each sample's span from arrays a negative number would wrap around.
        """
        check_range(self.path, indices.numpy(), self.num_samples)
        return self.planner.plan(indices, out)

    def plan_packed(
        self, indices: torch.Tensor, cuts: list[int], out: dict[str, torch.Tensor]
    ) -> tuple[list[Batch], CopyPlan] | None:
        """The batches ``indices[cuts[i]:cuts[i + 1]]`` (each as ``plan`` takes it)
        planned one after another into the flat buffers ``out`` by field name, each
        beginning on a whole 64-byte line, as one plan; None where the planner plans
        batch by batch (a supply that maps shards per batch). ``cuts`` begin at 0, end
        at ``len(indices)`` and never go down."""
        bounds = np.asarray(cuts)
        if (
            bounds.ndim != 1
            or bounds.dtype.kind not in "iu"
            or len(bounds) < 2
            or bounds[0] != 0
            or bounds[-1] != len(indices)
            or (bounds[1:] < bounds[:-1]).any()
        ):
            raise ValueError(
                f"cuts must be whole numbers that begin at 0, end at len(indices) = "
                f"{len(indices)} and never go down, got {str(list(cuts))[:80]}"
            )
        check_range(self.path, indices.numpy(), self.num_samples)
        return self.planner.plan_packed(indices, bounds.tolist(), out)

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
        """Per-sample length along the first varying dimension of a ragged field (no
        sample data read; shards mapped per batch are held one at a time)."""
        f = self.fields.get(name) or self.reader.fields.get(name)
        if f is None or not f.ragged:
            raise SchemaError(f"{self.path}: {name!r} is not a ragged field")
        axis = next(i for i, d in enumerate(f.shape) if d is None)
        parts = []
        for k in range(len(self.shard_sizes)):
            with held(self.supply, [k]):
                parts.append(self.supply.shard(k).shapes(name)[:, axis].copy())
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def close(self) -> None:
        """Lets go of what the supply holds (cached shards; a local supply keeps its
        shards mapped until the archive is dropped)."""
        self.supply.close()

    # DataLoader workers started with spawn/forkserver get the archive by pickle: the
    # supply pickles as what reopens it (paths or a URL and options), never as mappings.
    def __getstate__(self) -> dict[str, Any]:
        return {"supply": self.supply, **self._options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.build(**state)

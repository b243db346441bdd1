"""``open_archive``: a map-style torch Dataset over a dlop archive."""

from __future__ import annotations

import contextlib
import operator
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from dlop.formats import ArchiveReader, Field, SchemaError
from torch.utils.data import Dataset

from .batch import Batch
from .copier import Copier, native
from .errors import SampleIndexError, ShardChangedError, UsageError, UsageTypeError
from .gather import FieldGather, RaggedRowsGather, as_tensor, make_gather
from .memory import keep_batch_memory


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
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        fields: Sequence[str] | str | None = None,
        pad_value: float = 0.0,
        cache_bytes: int = 256 << 20,
    ) -> None:
        self.path = Path(path)
        fields = _field_names(self.path, fields)
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
        self.shards = [self.reader.shard(k) for k in range(self.reader.num_shards)]
        # What each shard's file was when mapped: (size, device, inode).
        self._files = [
            _file_identity(s.path, info.bytes)
            for s, info in zip(self.shards, self.reader.index.shards, strict=True)
        ]
        self.starts = torch.from_numpy(self.reader.shard_starts.copy())
        self.gathers: dict[str, FieldGather] = {
            n: make_gather(f, self.shards, self.starts, pad_value) for n, f in self.fields.items()
        }
        self._copier: Copier | None = None

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
        since it was mapped; reading its pages past the new end would kill the
        process with SIGBUS. A shard deleted or replaced by another file
        (``os.replace``) is not an error: the mapping keeps the file it opened.
        """
        for k in np.unique(np.asarray(shards, dtype=np.int64)).tolist():
            size, dev, ino = self._files[k]
            path = self.shards[k].path
            try:
                st = os.stat(path)
            except OSError:
                continue  # deleted: the mapped file lives on until unmapped
            if st.st_ino == ino and st.st_dev == dev and st.st_size < size:
                raise ShardChangedError(
                    f"{path}: shard shrank from {size} to {st.st_size} bytes after the "
                    "archive opened it; rewrite shards under a new name and os.replace "
                    "them, never in place, while a job reads them"
                )

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

    def gather(
        self,
        indices: torch.Tensor,
        out: dict[str, torch.Tensor] | None = None,
        copier: Copier | None = None,
    ) -> Batch:
        """Batch for ascending global ``indices``, optionally into preallocated flat buffers.

        ``copier`` (runtime.copier) does the copies; without one the archive's
        own serves, or torch's kernels where the compiled copier is missing.
        Off the main thread pass one: torch's parallel kernels are slow there.
        """
        self.check_shards(self.shards_of(indices))
        if copier is None:
            copier = self.own_copier()
        batch = Batch()
        with copier.batched() if copier is not None else contextlib.nullcontext():
            for name, g in self.gathers.items():
                batch.update(g.gather(indices, None if out is None else out.get(name), copier))
        return batch

    def own_copier(self) -> Copier | None:
        """This process's copier for gathers called without one (``__getitems__``); None
        without the compiled copier. A forked DataLoader worker makes its own, with
        the worker's thread count (1).

        It streams (runtime.copier): a fresh batch lands in memory the allocator
        last used a batch or more ago, no longer in cache. On the build machine
        ``DataLoader(ds, batch_size=256)`` runs at 0.94x of the Loader this way
        and 0.75x with ordinary stores.
        """
        if native() is None:
            return None
        if self._copier is None or self._copier.pid != os.getpid():
            self._copier = Copier(streaming=True)
        return self._copier

    def buffer_numel(self, name: str, batch_size: int) -> int | None:
        """Elements a reusable output buffer for ``name`` needs at this batch size (None: no buffer)."""
        f = self.fields[name]
        g = self.gathers[name]
        if f.kind != "array":
            return None
        if not f.ragged:
            return batch_size * int(np.prod(g.trail, dtype=np.int64))
        if isinstance(g, RaggedRowsGather):
            longest = max((int(x.max()) for x in g.lengths if len(x)), default=0)
            return batch_size * longest * int(np.prod(g.trail, dtype=np.int64))
        return None

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


def _field_names(path: Path, fields: Sequence[str] | str | None) -> list[str] | None:
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


def _file_identity(path: Path, size: int) -> tuple[int, int, int]:
    """(size the reader validated, device, inode) of a mapped shard file."""
    st = os.stat(path)
    return size, st.st_dev, st.st_ino


def open_archive(
    path: str | os.PathLike[str], fields: Sequence[str] | str | None = None, pad_value: float = 0.0
) -> Archive:
    """Opens an archive as a map-style Dataset (see Archive)."""
    return Archive(path, fields=fields, pad_value=pad_value)

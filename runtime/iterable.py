"""An IterableDataset for DataLoader worker processes: each worker of each rank takes a disjoint share."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import IterableDataset, get_worker_info

from .batch import Batch
from .dataset import Archive
from .distributed import rank_and_world
from .order import OrderSpec, rank_batches


class IterableArchive(IterableDataset[Batch]):
    """Yields whole batches; use ``DataLoader(ds, batch_size=None, num_workers=k)``.

    Workers and ranks are treated as ``world_size * num_workers`` consumers
    with the Loader's distribution rules (runtime.order), so every consumer
    gets the same number of batches and the union covers the epoch.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        fields: Sequence[str] | None = None,
        pad_value: float = 0.0,
        order: str = "global",
        window_shards: int = 8,
    ) -> None:
        self.path = str(path)
        self.batch_size, self.shuffle, self.seed, self.drop_last = (
            batch_size,
            shuffle,
            seed,
            drop_last,
        )
        self.rank, self.world_size = rank_and_world(rank, world_size)
        self.fields, self.pad_value, self.order, self.window_shards = (
            fields,
            pad_value,
            order,
            window_shards,
        )
        self.epoch = 0
        self._archive: Archive | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[Batch]:
        if self._archive is None:
            self._archive = Archive(self.path, fields=self.fields, pad_value=self.pad_value)
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        spec = OrderSpec(
            len(self._archive),
            self.batch_size,
            self.shuffle,
            self.seed,
            self.drop_last,
            rank=self.rank * workers + worker,
            world_size=self.world_size * workers,
            mode=self.order,
            shard_sizes=tuple(s.num_samples for s in self._archive.index.shards),
            window_shards=self.window_shards,
        )
        for indices in rank_batches(spec, self.epoch):
            yield self._archive.gather(torch.from_numpy(indices))

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state["_archive"] = None  # each worker maps the shards itself
        return state

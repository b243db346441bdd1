"""An IterableDataset for DataLoader worker processes: each worker of each rank takes a disjoint share.

Composed of the Loader's order and gather stages: the order (bucketing and
window order included) is that of ``world_size * num_workers`` consumers,
and each worker gathers its batches with its archive's own copy engine.

Epoch and resume reach persistent workers through a small shared-memory
tensor made in the parent (``torch.Tensor.share_memory_``) and read by each
worker when its iteration starts: ``[epoch, batches done, claimed by worker
0, 1, ...]``. ``DataLoader`` takes batches from its workers round-robin,
starting at worker 0, and every consumer has the same number of batches, so
"n batches consumed" means consumer c has handed out ``ceil((n - c) / workers)``
(see ``IterableArchive._claim`` for which worker continues as which consumer).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from .batch import Batch
from .dataset import Archive, check_bucket_by
from .distributed import rank_and_world
from .errors import UsageError, UsageTypeError, check_int
from .memory import shared_empty
from .order import BatchOrder, OrderSpec

STATE_FORMAT = "dlop-iterable-state"
MAX_WORKERS = 256  # workers that can resume from a state (one claim slot each)
_EPOCH, _DONE, _CLAIMS = 0, 1, 2


class IterableArchive(IterableDataset[Batch]):
    """Yields whole batches; use ``DataLoader(ds, batch_size=None, num_workers=k)``.

    Workers and ranks are treated as ``world_size * num_workers`` consumers
    with the Loader's distribution rules (runtime.order), so every consumer
    gets the same number of batches and the union covers the epoch.
    ``set_epoch`` and ``load_state_dict`` reach persistent workers.
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
        fields: Sequence[str] | str | None = None,
        pad_value: float = 0.0,
        order: str = "global",
        window_shards: int = 8,
        bucket_by: str | None = None,
        bucket_window: int = 64,
    ) -> None:
        self.path = str(path)
        self.batch_size = check_int("IterableArchive batch_size", batch_size, low=1)
        self.seed = check_int("IterableArchive seed", seed)
        self.shuffle, self.drop_last = shuffle, drop_last
        rank, world_size = rank_and_world(rank, world_size)
        self.world_size = check_int("IterableArchive world_size", world_size, low=1)
        self.rank = check_int("IterableArchive rank", rank, low=0, high=self.world_size - 1)
        if order not in ("global", "window"):
            raise UsageError(f"IterableArchive order must be 'global' or 'window', got {order!r}")
        self.fields, self.pad_value, self.order = fields, pad_value, order
        self.window_shards = check_int("IterableArchive window_shards", window_shards, low=1)
        self.bucket_window = check_int("IterableArchive bucket_window", bucket_window, low=1)
        self.bucket_by = bucket_by
        self._archive: Archive | None = None
        shared = torch.zeros(_CLAIMS + MAX_WORKERS, dtype=torch.int64)
        self._shared = shared.share_memory_()  # type: ignore[no-untyped-call]  # unannotated in torch
        self._handed_out = 0  # batches this process yielded in the current epoch
        check_bucket_by(self.archive(), bucket_by)

    def archive(self) -> Archive:
        """This process's archive (each worker maps the shards itself)."""
        if self._archive is None:
            self._archive = Archive(self.path, fields=self.fields, pad_value=self.pad_value)
        return self._archive

    @property
    def epoch(self) -> int:
        return int(self._shared[_EPOCH])

    def set_epoch(self, epoch: int) -> None:
        self._publish(check_int("IterableArchive.set_epoch epoch", epoch, low=0), 0)

    def _publish(self, epoch: int, done: int) -> None:
        self._shared[_CLAIMS:] = 0
        self._shared[_DONE] = done
        self._shared[_EPOCH] = epoch
        self._handed_out = done

    def order_for(self, worker: int, workers: int) -> BatchOrder:
        """The order stage of one consumer: worker ``worker`` of ``workers`` on this rank."""
        archive = self.archive()
        spec = OrderSpec(
            len(archive),
            self.batch_size,
            self.shuffle,
            self.seed,
            self.drop_last,
            rank=self.rank * workers + worker,
            world_size=self.world_size * workers,
            mode=self.order,
            shard_sizes=tuple(s.num_samples for s in archive.index.shards),
            window_shards=self.window_shards,
            bucket_window=self.bucket_window,
        )
        lengths = archive.lengths(self.bucket_by) if self.bucket_by else None
        return BatchOrder(spec, lengths, owner="IterableArchive")

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        consumer, skip = self._claim(worker, workers)
        order = self.order_for(consumer, workers)
        order.set_epoch(self.epoch)
        archive = self.archive()
        engine = archive.own_engine()
        # In a worker, batches are made in shared memory, where DataLoader sends them.
        out = shared_empty if info is not None else None
        for j, indices in enumerate(order.batches()):
            if j < skip:
                continue
            batch = archive.gather(torch.from_numpy(indices), out, engine)
            self._handed_out += 1
            yield batch

    def _claim(self, worker: int, workers: int) -> tuple[int, int]:
        """(consumer, batches to skip) for this worker's iteration.

        After a loaded state of n batches, DataLoader asks worker 0 first, but
        the next batch is consumer n % workers's: worker w plays consumer
        (w + n) % workers, and skips what that consumer had handed out. Once
        per state: later iterations start the epoch over.
        """
        done = int(self._shared[_DONE])
        if not done or int(self._shared[_CLAIMS + worker]):
            return worker, 0
        if worker >= MAX_WORKERS:
            raise UsageError(f"IterableArchive resumes with at most {MAX_WORKERS} workers")
        self._shared[_CLAIMS + worker] = 1
        consumer = (worker + done) % workers
        return consumer, (done - consumer + workers - 1) // workers

    def state_dict(self, batches_done: int | None = None) -> dict[str, Any]:
        """The position after ``batches_done`` batches of the current epoch (the batches
        the training loop took from the DataLoader); by default, the batches this
        process yielded itself (exact with ``num_workers=0``)."""
        done = self._handed_out if batches_done is None else batches_done
        return {
            "format": STATE_FORMAT,
            "version": 1,
            "epoch": self.epoch,
            "batches_done": check_int("IterableArchive.state_dict batches_done", done, low=0),
            "seed": self.seed,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "rank": self.rank,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next iteration continues after the state's batches; later ones start
        their epoch at the beginning."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise UsageTypeError(
                f"IterableArchive.load_state_dict takes the dict its state_dict() returned, got {state!r:.80}"
            )
        for key in ("seed", "batch_size", "world_size", "rank"):
            if state.get(key) != getattr(self, key):
                raise UsageError(
                    f"iterable state was saved with {key}={state.get(key)!r}, "
                    f"this dataset has {getattr(self, key)!r}"
                )
        epoch = check_int("iterable state epoch", state.get("epoch"), low=0)
        done = check_int("iterable state batches_done", state.get("batches_done"), low=0)
        self._publish(epoch, done)

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state["_archive"] = None  # each worker maps the shards itself
        return state

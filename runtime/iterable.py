"""An IterableDataset for DataLoader worker processes: the Loader's batches, shared out to workers.

Each rank computes exactly the Loader's batches (same order stage, bucketing
and window order included, ``world_size`` ranks), and worker ``w`` of ``W``
gathers batches ``w, w + W, w + 2W, ...`` with its archive's own copy engine.
``DataLoader`` takes batches from its workers round-robin, starting at worker
0, so it yields them in the Loader's order; the worker count changes nothing
but who gathers what.

Epoch and resume reach persistent workers through a small shared-memory
tensor made in the parent (``torch.Tensor.share_memory_``) and read by each
worker when its iteration starts: ``[epoch, resume point, served by workers,
claimed by worker 0, 1, ...]``. After a state of n batches, the next iteration's worker w
serves batches ``n + w, n + w + W, ...``: the DataLoader asks worker 0 first,
so batch n comes first. Each worker resumes once per state (its claim slot);
later iterations start the epoch over.

Each batch carries its number in the epoch (``batch.position``, counted from
the epoch's start, the same after a resume), so the training loop saves
``state_dict(after=batch)`` from the batch it holds. Batches gathered by
workers are not counted in this process: there ``state_dict()`` with neither
``after`` nor ``batches_done`` raises rather than record a wrong position.

It takes what the Loader takes (runtime.order.choose): a path, a list of paths read
as one, a URL (each worker reads through the node-local shard cache), a
mixture (a dict of sources; batches name each sample's source), ``where`` and
``indices``. Each worker opens the archive and computes the order itself; a
state records the choice of samples and is refused by another.

In a worker, batches are gathered into a few shared-memory slots reused from
batch to batch (runtime.pipeline.shared_ring), each refilled only once the main
process no longer holds the batch that used it.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Unpack

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from dlop.formats import DlopError

from .archive.concat import ArchivePaths
from .archive.dataset import Archive
from .batch import Batch
from .errors import UsageError, UsageTypeError, check_int
from .order.choose import Choice, choose, earlier_generation, earlier_spec
from .order.distributed import agree_across_ranks
from .order.epochs import MAX_SHAPES, BatchOrder, OrderSpec, Shape, check_epoch
from .order.mixture import Source
from .order.reading import Reading, ReadingOptions
from .pipeline.loader_state import check_settings, order_settings, same
from .pipeline.shared_ring import MAX_SLOTS, ReleaseTable, WorkerRing, slot_bytes
from .storage.supply import pin_key, pinned

STATE_FORMAT = "dlop-iterable-state"
# version 1 split batches among world_size * workers consumers; a version 2 state
# without "selection" and "mixture" chose the whole archive
STATE_VERSION = 2
MAX_WORKERS = 256  # workers that can resume from a state (one claim slot each)
_EPOCH, _DONE, _SERVED, _CLAIMS = 0, 1, 2, 3
# Per worker: iterations begun since set_epoch or load_state_dict (the epoch moves on with each);
# then 1 + the worker count those iterations ran with (0: none yet).
_PASSES = _CLAIMS + MAX_WORKERS
_WORKER_COUNT = _PASSES + MAX_WORKERS
# The earlier worlds the published epoch was partly read in (BatchOrder.shapes): their
# count, then four numbers each.
_SHAPES = _WORKER_COUNT + 1
# a loaded state saved before an append: its epoch reads the archive's first shards only
_APPENDED = _SHAPES + 1 + 4 * MAX_SHAPES
_SHARED = _APPENDED + 1


def _real_paths(archive: Any) -> Any:
    """``archive`` (IterableArchive's argument) with each local path replaced by the
    folder it leads to now; URLs and open Archives as they are."""
    if isinstance(archive, str | os.PathLike):
        return pin_key(archive)
    if isinstance(archive, Source):
        return dataclasses.replace(archive, path=_real_paths(archive.path))
    if isinstance(archive, Mapping):
        return {k: _real_paths(v) for k, v in archive.items()}
    if isinstance(archive, Sequence) and not isinstance(archive, bytes):
        return [_real_paths(p) for p in archive]
    return archive


class IterableArchive(IterableDataset[Batch]):
    """Yields whole batches; use ``DataLoader(ds, batch_size=None, num_workers=k,
    collate_fn=batch_as_is)`` (``dlop.runtime.batch_as_is``: the batches come collated).

    Through the DataLoader, each rank gets exactly the Loader's batches in the
    Loader's order (same archive argument, seed and settings), whatever ``k``
    is: worker ``w`` gathers every ``k``-th batch starting at ``w``.
    ``set_epoch`` and ``load_state_dict`` reach persistent workers. Each worker
    reuses ``worker_buffers`` shared-memory batch buffers (0: fresh memory for
    every batch); the default covers DataLoader's default ``prefetch_factor=2``
    with the training loop holding a batch or two. The other keywords are the
    Loader's, declared once for both (runtime.order.reading; docs/choosing.md).
    """

    def __init__(
        self,
        archive: Archive | ArchivePaths | Mapping[str, Archive | ArchivePaths | Source],
        batch_size: int | None,
        *,
        worker_buffers: int = 4,
        **options: Unpack[ReadingOptions],
    ) -> None:
        self.path = archive
        # what the workers open: the folders the paths lead to now (a link swapped or the
        # working directory changed later sends them no other archive)
        self._opened = _real_paths(archive)
        reading = Reading.given("IterableArchive", options, ("worker_buffers",))
        self.worker_buffers = check_int(
            "IterableArchive worker_buffers", worker_buffers, low=0, high=MAX_SLOTS
        )
        # rank and world size are the parent's: workers have no process group
        self.reading = reading.in_this_process()
        # placed by torch.distributed (not by rank= and world_size=): its ranks load together
        self._grouped = reading.rank is None and reading.world_size is None
        self._open_options = self.reading.open_options()
        self._order_options = self.reading.order_options("IterableArchive", batch_size)
        self.bucket_by = self.reading.bucket_by
        self._choice: Choice | None = None
        self._pins: dict[str, bytes] = {}  # the parent's indexes, in a worker (__getstate__)
        self._share_with_workers()
        # opens the archive and checks the settings here, not in a worker
        chosen = self.choice()
        chosen.order.refuse_empty(str(chosen.archive.path))

    def _share_with_workers(self) -> None:
        """What the workers share with this process: epoch and resume point, slot releases."""
        shared = torch.zeros(_SHARED, dtype=torch.int64)
        self._shared = shared.share_memory_()  # type: ignore[no-untyped-call]  # unannotated in torch
        self._handed_out = 0  # batch number reached by this process's latest iteration
        self._released = ReleaseTable(secrets.randbits(62), MAX_WORKERS, self.worker_buffers)
        self._ring: WorkerRing | None = None  # made in each worker process

    def choice(self) -> Choice:
        """This process's archive and order stage (each worker opens the archive itself)."""
        if self._choice is None:
            options = dict(self._order_options)
            with pinned(self._pins):  # a worker reads the archives as this process opened them
                self._choice = choose(
                    self.path, dict(self._open_options), owner="IterableArchive", **options
                )
        return self._choice

    def archive(self) -> Archive:
        """This process's archive (for a mixture, its sources read as one)."""
        return self.choice().archive

    @property
    def sources(self) -> tuple[str, ...]:
        """A mixture's source names, which ``batch["source"]`` indexes (empty otherwise)."""
        mix = self.choice().mixture
        return mix.names if mix is not None else ()

    @property
    def epoch(self) -> int:
        """The epoch set (``set_epoch``, ``load_state_dict``), plus one for each iteration
        begun since, after the first: the epoch of the latest iteration."""
        passes = int(self._shared[_PASSES:_WORKER_COUNT].max())
        return int(self._shared[_EPOCH]) + max(passes - 1, 0)

    def set_epoch(self, epoch: int) -> None:
        """Starts ``epoch`` at its beginning; a state just loaded for this same epoch
        is kept (the usual loop calls ``load_state_dict`` and then ``set_epoch``)."""
        epoch = check_epoch("IterableArchive.set_epoch epoch", epoch)
        if epoch == self.epoch and self._resume_pending():
            return
        self._publish(epoch, 0)

    def _resume_pending(self) -> bool:
        """A loaded state that no worker has started from yet."""
        loaded = int(self._shared[_DONE]) > 0 or int(self._shared[_SHAPES]) > 0
        return loaded and not bool(self._shared[_CLAIMS:_PASSES].any())

    def _publish(
        self, epoch: int, done: int, shapes: tuple[Shape, ...] = (), appended: int = 0
    ) -> None:
        self._shared[_CLAIMS:] = 0  # the claims, the iteration counts, the worker count, shapes
        self._shared[_SERVED] = 0
        self._shared[_APPENDED] = appended
        self._shared[_DONE] = done
        self._shared[_EPOCH] = epoch
        self._shared[_SHAPES] = len(shapes)
        for i, shape in enumerate(shapes):
            at = _SHAPES + 1 + 4 * i
            self._shared[at : at + 4] = torch.tensor(shape.as_list(), dtype=torch.int64)
        self._handed_out = done

    def batch_order(self) -> BatchOrder:
        """This rank's order stage: the Loader's, for ``world_size`` ranks, reading the rest
        of an epoch begun in another world where a loaded state says so."""
        order = self.choice().order
        count = int(self._shared[_SHAPES])
        values = self._shared[_SHAPES + 1 : _SHAPES + 1 + 4 * count].tolist()
        shapes = tuple(Shape(*values[i : i + 4]) for i in range(0, len(values), 4))
        epoch, appended = int(self._shared[_EPOCH]), int(self._shared[_APPENDED])
        order.follow(epoch, shapes)
        order.read_earlier(
            epoch, earlier_spec(order.spec, appended, order.lengths) if appended else None
        )
        return order

    def batches(self, epoch: int | None = None) -> list[np.ndarray]:
        """This rank's sample indices, batch by batch, for an epoch (default: the current
        one): a copy, which the caller may change without changing what is read."""
        return [
            b.copy() for b in self.batch_order().batches(self.epoch if epoch is None else epoch)
        ]

    def __len__(self) -> int:
        """Batches per epoch on this rank (all workers together): a whole epoch's in this
        world (an epoch continued from another world reads only its rest, ``batches()``)."""
        return self.batch_order().whole_count(self.epoch)

    def __iter__(self) -> Iterator[Batch]:
        # once a pass, not per batch (Planner.checks_batches); before the pass is counted
        self.choice().archive.check_shards()
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        # Every worker of a DataLoader begins each pass once: counting its own passes,
        # each one reaches the same epoch without asking the others. That holds while
        # the worker count stays; a pass with another count needs set_epoch first.
        seen = int(self._shared[_WORKER_COUNT])
        if seen and seen != workers + 1:
            raise UsageError(
                f"IterableArchive: this pass runs {workers} worker(s), the passes since the "
                f"last set_epoch ran {seen - 1}; each worker counts the passes it served to "
                "find the epoch, so call set_epoch(epoch) before a pass with another worker "
                "count (or before every epoch)"
            )
        self._shared[_WORKER_COUNT] = workers + 1
        slot = _PASSES + worker % MAX_WORKERS
        passes = int(self._shared[slot])
        self._shared[slot] = passes + 1
        start = self._claim(worker) if passes == 0 else 0
        batches = self.batch_order().batches(int(self._shared[_EPOCH]) + passes)
        choice = self.choice()
        # each worker gathers one batch at a time, a rank's workers consecutive ones
        bucketing = self.reading.bucket_by is not None
        choice.check_budget(workers + 1, bucketing, f"{workers} DataLoader worker(s)")
        engine = choice.archive.own_engine()
        ring = self._worker_ring(worker) if info is not None else None
        self._handed_out = start
        planner = choice.archive.planner
        whole = planner.hold_whole()  # a warm node cache: every shard held for the pass
        try:
            for j in range(start + worker, len(batches), workers):
                indices = torch.from_numpy(batches[j])
                if ring is not None:
                    batch = ring.gather(choice, indices, engine)
                else:
                    batch = choice.gather(indices, None, engine)
                batch.position = j
                self._handed_out = j + 1  # with workers=1 (in process): batches yielded so far
                yield batch
        finally:
            if whole:
                planner.let_go_whole()

    def _worker_ring(self, worker: int) -> WorkerRing:
        """This worker's shared-memory slots, kept across iterations (persistent workers)."""
        if self._ring is None:
            count = self.worker_buffers if worker < MAX_WORKERS else 0
            nbytes = slot_bytes(self.choice()) if count else 0
            self._ring = WorkerRing(self._released, worker % MAX_WORKERS, nbytes, count)
        return self._ring

    def buffer_counts(self) -> tuple[int, int]:
        """Batches the DataLoader workers made so far: (in their shared-memory buffers,
        in fresh shared memory because every buffer was still held in this process)."""
        return self._released.counts()

    def _claim(self, worker: int) -> int:
        """The batch number this worker's iteration starts from: the loaded state's
        position, once per worker and state; 0 after that."""
        if get_worker_info() is not None:
            self._shared[_SERVED] = 1  # this process cannot count the batches the loop took
        done = int(self._shared[_DONE])
        if not done and not int(self._shared[_SHAPES]):
            return 0
        if worker >= MAX_WORKERS:
            raise UsageError(
                f"IterableArchive resumes with at most {MAX_WORKERS} workers, this is worker "
                f"{worker}; resume with fewer DataLoader workers"
            )
        if int(self._shared[_CLAIMS + worker]):
            return 0
        self._shared[_CLAIMS + worker] = 1
        return done

    def state_dict(
        self, batches_done: int | None = None, *, after: Batch | None = None
    ) -> dict[str, Any]:
        """The position after batch ``after`` (the latest batch the training loop took;
        its ``position``), or after ``batches_done`` batches of the current epoch counted
        from the epoch's start (a resumed epoch's earlier batches included). With
        neither: the batches this process yielded itself, which it knows only with
        ``num_workers=0``; after DataLoader workers served this epoch that raises."""
        done = self._handed_out if batches_done is None else batches_done
        if after is not None:
            if batches_done is not None or not isinstance(after.position, int):
                raise UsageError(
                    "IterableArchive.state_dict(after=batch) takes a batch this dataset "
                    f"yielded (its position, got {getattr(after, 'position', None)!r}) and "
                    "no batches_done"
                )
            done = after.position + 1
        elif batches_done is None and int(self._shared[_SERVED]):
            raise UsageError(
                "IterableArchive.state_dict(): DataLoader workers served this epoch, so this "
                "process does not know how many batches the training loop took; pass the "
                "latest batch taken, state_dict(after=batch), or batches_done=N counted "
                "from the epoch's start"
            )
        count = len(self.batch_order().batches(self.epoch))
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "epoch": self.epoch,
            **self.batch_order().earlier(self.epoch),
            "batches_done": check_int(
                f"IterableArchive.state_dict batches_done (epoch {self.epoch} has {count} batches)",
                done,
                low=0,
                high=count,
            ),
            **self._settings(self.batch_order().spec_for(self.epoch)),
        }

    def _settings(self, spec: OrderSpec | None = None) -> dict[str, Any]:
        """The settings that shape the order (the Loader's STATE_SETTINGS), the rank and
        the choice of samples (CHOICE_SETTINGS: selection fingerprint, mixture), under
        ``spec`` (default: the whole archive's; an epoch of the archive as it was before
        an append names its first shards)."""
        choice = self.choice()
        return order_settings(spec or choice.spec, self.bucket_by, choice.settings(spec))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next iteration continues after the state's batches, whatever the worker
        count was or is; later ones start their epoch at the beginning. A state saved
        under other order settings (``STATE_SETTINGS``), with another choice of samples
        (``CHOICE_SETTINGS``) or for another rank is refused."""
        if not isinstance(state, dict) or not same(state.get("format"), STATE_FORMAT):
            raise UsageTypeError(
                f"IterableArchive.load_state_dict takes the dict its state_dict() returned, got {state!r:.80}"
            )
        if not same(state.get("version"), STATE_VERSION):
            raise UsageError(
                f"iterable state version {state.get('version')!r} is not {STATE_VERSION}: "
                "states saved before the worker order was made the Loader's cannot resume; "
                "start the epoch over"
            )
        order = self.batch_order()
        held = order.hold()
        earlier = earlier_generation(self.choice().archive, state.get("archives"))
        spec = None if earlier is None else earlier_spec(order.spec, earlier[0], order.lengths)
        try:
            check_settings(state, self._settings(spec), "iterable")
            if spec is not None:
                order.read_earlier(check_epoch("iterable state epoch", state.get("epoch")), spec)
            order.reset(state, where="iterable state")
        except DlopError:
            agree_across_ranks(None, order.spec, self._grouped, "IterableArchive")
            raise
        try:
            agree_across_ranks(state, order.spec, self._grouped, "IterableArchive")
        except DlopError:
            order.restore(held)
            raise
        appended = 0 if earlier is None else earlier[0]
        self._publish(order.epoch, order.batches_done, order.shapes, appended)

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        # each worker opens the archive and computes the order itself, on the indexes this
        # process opened (an append or a field group compiled since changes nothing read)
        state["_pins"] = self.choice().archive.supply.pins()
        state["path"] = self._opened
        state["_choice"] = None
        state["_ring"] = None  # and makes its own slots
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._released.register()  # batches unpickled here release slots in the shared table

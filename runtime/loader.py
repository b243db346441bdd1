"""The Loader: shuffled batches gathered into reusable buffers by a background thread.

Data flow per batch: order (runtime.order) -> vectorized gather into a ring
buffer slot (pinned when CUDA is available) -> optional non-blocking copy to
the device on a side CUDA stream, recorded by an event -> transforms.

One gather thread per Loader, kept across epochs, prepares each batch and
queues its copies on the copier's helper threads (runtime.copier) behind the
batch they are copying, so the copies run back to back (see _Epoch._produce).

Buffer contract: on the CPU, a batch's tensors are views of a ring slot and
stay valid until the next batch is requested (copy what you keep). On a CUDA
device every batch is freshly allocated, and a slot is refilled only after the
event of its copy has completed.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import os
import queue
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from dlop.formats import DlopError

from .batch import Batch
from .copier import Copier, JobThread, Pending, native
from .dataset import Archive
from .distributed import rank_and_world
from .errors import ShardChangedError, UsageError, UsageTypeError, check_int
from .order import OrderSpec, rank_batches

Transform = Callable[[Batch, torch.Generator], Batch]
STATE_FORMAT = "dlop-loader-state"


class LoaderError(DlopError):
    """A failure in the background gather thread, re-raised in the training loop."""


@dataclass
class _Slot:
    buffers: dict[str, torch.Tensor]
    event: Any = None  # torch.cuda.Event of the last copy out of this slot


@dataclass
class _Ready:
    number: int
    batch: Batch | None = None
    slot: _Slot | None = None
    event: Any = None
    error: BaseException | None = None
    trace: str = ""


_DONE = object()
_live: weakref.WeakSet[Loader] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Loaders still open at exit stop their threads before the interpreter shuts
    down (runs before runtime.copier's own exit hook, registered earlier)."""
    for loader in list(_live):
        loader.close()


class Loader:
    """Iterates dict batches of an archive; see the module docstring for the buffer contract.

    ``rank``/``world_size`` default to torch.distributed's when it is
    initialized; ``order`` is ``global`` (full permutation) or ``window``
    (out-of-core, see runtime.order); ``bucket_by`` names a ragged field whose
    lengths group batches; ``transforms`` are callables ``(batch, generator)
    -> batch`` run on the batch's device with a generator seeded from (seed,
    epoch, batch number), so resumed epochs repeat their augmentations too.
    """

    def __init__(
        self,
        archive: Archive | str | os.PathLike[str],
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        device: str | torch.device | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        transforms: Sequence[Transform] = (),
        bucket_by: str | None = None,
        prefetch: int = 2,
        order: str = "global",
        window_shards: int = 8,
        bucket_window: int = 64,
        fields: Sequence[str] | str | None = None,
        pad_value: float = 0.0,
    ) -> None:
        batch_size = check_int("Loader batch_size", batch_size, low=1)
        prefetch = check_int("Loader prefetch", prefetch, low=0)
        seed = check_int("Loader seed", seed)
        window_shards = check_int("Loader window_shards", window_shards, low=1)
        bucket_window = check_int("Loader bucket_window", bucket_window, low=1)
        if order not in ("global", "window"):
            raise UsageError(f"Loader order must be 'global' or 'window', got {order!r}")
        self.archive = (
            archive
            if isinstance(archive, Archive)
            else Archive(archive, fields=fields, pad_value=pad_value)
        )
        rank, world_size = rank_and_world(rank, world_size)
        world_size = check_int("Loader world_size", world_size, low=1)
        rank = check_int("Loader rank", rank, low=0, high=world_size - 1)
        if bucket_by is not None:
            f = self.archive.fields.get(bucket_by) if isinstance(bucket_by, str) else None
            if f is None or not f.ragged:
                ragged = [n for n, g in self.archive.fields.items() if g.ragged]
                raise UsageError(
                    f"{self.archive.path}: Loader bucket_by must name a ragged field among "
                    f"{ragged}, got {bucket_by!r}"
                )
        self.spec = OrderSpec(
            num_samples=len(self.archive),
            batch_size=batch_size,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            rank=rank,
            world_size=world_size,
            mode=order,
            shard_sizes=tuple(s.num_samples for s in self.archive.index.shards),
            window_shards=window_shards,
            bucket_window=bucket_window,
        )
        self.bucket_by = bucket_by
        self._lengths = self.archive.lengths(bucket_by) if bucket_by else None
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise LoaderError(f"device {self.device} requested, but CUDA is not available")
        self.transforms = tuple(transforms)
        self.prefetch = prefetch
        self.epoch = 0
        self._resume_from: int | None = None
        self._batches_done = 0
        self._slots: list[_Slot] | None = None
        self._active: weakref.ref[_Iter] | None = None
        # The gather thread, kept across epochs: starting an epoch costs a queue
        # put rather than a thread start.
        self._thread: JobThread | None = None
        _live.add(self)
        # Slots that take turns have left the cache when refilled: stream into them.
        self.copier = Copier(streaming=self._slot_count() > 1)

    # -- order and state ----------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        self.epoch = check_int("Loader.set_epoch epoch", epoch, low=0)
        self._batches_done = 0

    def batches(self, epoch: int | None = None) -> list[np.ndarray]:
        """This rank's sample indices, batch by batch, for an epoch."""
        return rank_batches(self.spec, self.epoch if epoch is None else epoch, self._lengths)

    def __len__(self) -> int:
        return len(self.batches())

    def state_dict(self) -> dict[str, Any]:
        s = self.spec
        return {
            "format": STATE_FORMAT,
            "version": 1,
            "epoch": self.epoch,
            "batches_done": self._batches_done,
            "seed": s.seed,
            "num_samples": s.num_samples,
            "batch_size": s.batch_size,
            "shuffle": s.shuffle,
            "drop_last": s.drop_last,
            "rank": s.rank,
            "world_size": s.world_size,
            "order": s.mode,
            "window_shards": s.window_shards,
            "bucket_by": self.bucket_by,
            "bucket_window": s.bucket_window,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from a saved position: the next iteration yields the remaining batches of its epoch."""
        if not isinstance(state, dict):
            raise UsageTypeError(
                f"Loader.load_state_dict takes the dict state_dict() returned, got {type(state).__name__}"
            )
        if state.get("format") != STATE_FORMAT or state.get("version") != 1:
            raise UsageError(
                f"not a dlop Loader state: format {state.get('format')!r} version "
                f"{state.get('version')!r}, expected {STATE_FORMAT!r} version 1"
            )
        mine = self.state_dict()
        for key in (
            "seed",
            "num_samples",
            "batch_size",
            "shuffle",
            "drop_last",
            "world_size",
            "order",
            "window_shards",
            "bucket_by",
            "bucket_window",
        ):
            if state.get(key) != mine[key]:
                raise UsageError(
                    f"loader state was saved with {key}={state.get(key)!r}, this loader has {mine[key]!r}"
                )
        if state.get("rank") != self.spec.rank:
            raise UsageError(
                f"loader state is rank {state.get('rank')}'s, this loader is rank {self.spec.rank}"
            )
        epoch = check_int("loader state epoch", state.get("epoch"), low=0)
        count = len(self.batches(epoch))
        done = check_int(
            f"loader state batches_done (epoch {epoch} has {count} batches)",
            state.get("batches_done"),
            low=0,
            high=count,
        )
        self.epoch = epoch
        self._batches_done = self._resume_from = done

    # -- iteration ------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        self._close_active()
        start = self._resume_from or 0
        self._resume_from = None
        self._batches_done = start
        if self.prefetch == 0:
            return self._synchronous(self.batches(), start)
        it = _Iter(self, self.batches(), start)
        # Weak: an iterator the training loop drops is collected and stops its epoch.
        self._active = weakref.ref(it)
        return it

    def _close_active(self) -> None:
        ref = getattr(self, "_active", None)
        active = ref() if ref is not None else None
        if active is not None:
            active.close()
        self._active = None

    def _ring(self) -> list[_Slot]:
        if self._slots is None:
            pin = torch.cuda.is_available()
            # No batch holds more samples than the archive: a larger batch_size
            # does not make larger buffers.
            b = min(self.spec.batch_size, max(1, self.spec.num_samples))
            sizes = {}
            for name, g in self.archive.gathers.items():
                numel = self.archive.buffer_numel(name, b)
                if numel is not None:
                    sizes[name] = (numel, g.dtype)
            count = self._slot_count()
            total = count * sum(n * d.itemsize for n, d in sizes.values())
            slots = []
            try:
                for _ in range(count):
                    buffers = {}
                    for name, (numel, dtype) in sizes.items():
                        t = torch.empty(numel, dtype=dtype, pin_memory=pin)
                        t.zero_()  # first touch here, not in the first timed batches
                        buffers[name] = t
                    slots.append(_Slot(buffers))
            except RuntimeError as e:  # the allocator's "can't allocate"
                raise LoaderError(
                    f"{self.archive.path}: cannot allocate {count} batch buffers of "
                    f"batch_size={b} ({total} bytes in all): {e}; lower batch_size or prefetch"
                ) from None
            self._slots = slots
        return self._slots

    def _slot_count(self) -> int:
        """prefetch batches waiting plus the one in use; synchronous CPU loading needs only one.

        On the CPU a batch is valid until the next is requested (the buffer
        contract), so without prefetching one slot serves, and it stays warm in
        cache: rotating several batch-sized buffers costs about a quarter of the
        gather's speed on the build machine. A CUDA copy needs a second slot to
        gather into while the first is still being copied.
        """
        if self.prefetch == 0:
            return 2 if self.device.type == "cuda" else 1
        return self.prefetch + 1

    def _synchronous(self, batches: list[np.ndarray], start: int) -> Iterator[Batch]:
        """prefetch=0: each batch is gathered on the calling thread when asked for, into
        a buffer still warm in cache, at the cost of the gather's time in the
        training loop. The Loader's copier serves when it is the compiled one;
        otherwise torch's parallel kernels, which run well on the calling thread.
        """
        slots = self._ring()
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None  # type: ignore[no-untyped-call]  # torch.cuda ships no annotations
        for j in range(start, len(batches)):
            slot = slots[j % len(slots)]
            if slot.event is not None:
                slot.event.synchronize()
            try:
                batch = self.archive.gather(
                    torch.from_numpy(batches[j]),
                    out=slot.buffers,
                    copier=self.copier if native() is not None else None,
                )
            except ShardChangedError as e:
                raise LoaderError(
                    f"{self.archive.path}: gathering batch {j} of epoch {self.epoch} failed: {e}"
                ) from e
            if stream is not None:
                batch, slot.event = _copy_to_device(batch, self.device, stream)
                _use_on_current_stream(batch, slot.event, self.device)
            batch = _apply_transforms(self, batch, self.epoch, j)
            self._batches_done = j + 1
            yield batch

    def _worker(self) -> JobThread:
        if self._thread is None or self._thread.pid != os.getpid() or not self._thread.is_alive():
            self._thread = JobThread("dlop-loader")
        return self._thread

    def close(self) -> None:
        self._close_active()
        if getattr(self, "_thread", None) is not None:
            self._thread.stop(timeout=10)  # type: ignore[union-attr]
            self._thread = None
        if getattr(self, "copier", None) is not None:
            self.copier.close()

    def __del__(self) -> None:
        self.close()


def _copy_to_device(batch: Batch, device: torch.device, stream: Any) -> tuple[Batch, Any]:
    """Non-blocking copies of the batch's tensors on ``stream``; returns the batch and an event after them."""
    with torch.cuda.stream(stream):
        moved = Batch(
            {
                k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                for k, v in batch.items()
            }
        )
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
        event.record(stream)
    return moved, event


def _use_on_current_stream(batch: Batch, event: Any, device: torch.device) -> None:
    """Makes the current stream wait for the copy, and tells the allocator these tensors are used there."""
    current = torch.cuda.current_stream(device)
    current.wait_event(event)
    for v in batch.values():
        if isinstance(v, torch.Tensor):
            v.record_stream(current)


def _apply_transforms(loader: Loader, batch: Batch, epoch: int, number: int) -> Batch:
    """Runs the transforms with generators seeded from (seed, epoch, batch number)."""
    if not loader.transforms:
        return batch
    gen = torch.Generator(device=loader.device)
    seed = np.random.SeedSequence([loader.spec.seed, epoch, number, 0x5EED]).generate_state(1)
    for i, transform in enumerate(loader.transforms):
        gen.manual_seed(int(seed[0]) + i)
        batch = transform(batch, gen)
    return batch


class _Epoch:
    """One epoch's production, shared by the gather thread and the consumer's _Iter.
    It holds no reference to the _Iter, so an iterator the training loop drops
    is collected and stops its epoch (see _Iter.__del__)."""

    def __init__(self, loader: Loader, batches: list[np.ndarray]) -> None:
        self.loader = loader
        self.batches = batches
        self.epoch = loader.epoch
        self.cuda = loader.device.type == "cuda"
        slots = loader._ring()
        # On the CPU the most recently released slot is refilled first (LIFO): it is
        # the one most likely still in cache, which matters where copies go through
        # the cache (no compiled copier). A CUDA slot has just been handed to an
        # asynchronous copy, so there the oldest goes first (FIFO).
        self.free: collections.deque[_Slot] = collections.deque(slots)
        # Guards ``free`` and ``consumer_waiting``; the producer waits on it for a slot.
        self.cond = threading.Condition()
        self.consumer_waiting = False
        self.ready: queue.Queue[Any] = queue.Queue()
        self.held: _Slot | None = None
        self.stop = threading.Event()
        self.finished = threading.Event()
        self.stream = torch.cuda.Stream(loader.device) if self.cuda else None  # type: ignore[no-untyped-call]

    def _produce(self, start: int) -> None:
        """Gathers the epoch's batches in order, pipelined: this thread prepares a
        batch (address lists, small fields) and queues its copies on the copier's
        helpers behind the batch they are copying, then publishes that one when
        its copies are done. So the helpers copy back to back while the Python
        work of the next batch and the hand-over to the consumer overlap them."""
        archive, copier = self.loader.archive, self.loader.copier
        in_flight: collections.deque[tuple[int, Batch, _Slot, Pending]] = collections.deque()

        def publish() -> bool:
            """Finishes the oldest batch in flight and hands it over; False after an error."""
            j, batch, slot, pending = in_flight.popleft()
            try:
                pending.wait()
                event = None
                if self.stream is not None:
                    batch, event = _copy_to_device(batch, self.loader.device, self.stream)
                    slot.event = event
                    self._release(slot)  # refilled only after event completes
                self.ready.put(_Ready(j, batch, None if self.stream else slot, event))
                return True
            except BaseException as e:
                self.ready.put(_Ready(j, error=e, trace=traceback.format_exc()))
                return False

        def take_slot() -> _Slot | None:
            """A free slot, or None once stopped or failed. While none is free, the
            oldest batch in flight is finished and handed over only if the consumer
            is waiting for it; otherwise the copies queued on the helpers keep them
            busy while this thread waits for the consumer to release a slot."""
            while True:
                with self.cond:
                    while not self.stop.is_set():
                        if self.free:
                            return self.free.pop() if not self.cuda else self.free.popleft()
                        if in_flight and self.consumer_waiting:
                            break
                        self.cond.wait(0.1)
                    else:
                        return None
                if not publish():
                    return None

        try:
            for j in range(start, len(self.batches)):
                slot = take_slot()
                if slot is None:
                    return
                try:
                    if slot.event is not None:
                        slot.event.synchronize()  # the slot's previous copy to the device is done
                    with copier.collecting() as parts:
                        batch = archive.gather(
                            torch.from_numpy(self.batches[j]), out=slot.buffers, copier=copier
                        )
                    in_flight.append((j, batch, slot, copier.start(parts)))
                except BaseException as e:
                    while in_flight:
                        if not publish():
                            return
                    self.ready.put(_Ready(j, error=e, trace=traceback.format_exc()))
                    return
                if len(in_flight) > 1 and not publish():
                    return
            while in_flight:
                if not publish():
                    return
            self.ready.put(_DONE)
        finally:
            for *_, pending in in_flight:  # stopped early: let the copies finish
                with contextlib.suppress(BaseException):
                    pending.wait()
            self.finished.set()

    def _release(self, slot: _Slot) -> None:
        with self.cond:
            self.free.append(slot)
            self.cond.notify()


class _Iter:
    """The training loop's side of an epoch: hands out batches, releases slots."""

    def __init__(self, loader: Loader, batches: list[np.ndarray], start: int) -> None:
        self.loader = loader
        self.e = _Epoch(loader, batches)
        loader._worker().submit(functools.partial(self.e._produce, start))

    def __iter__(self) -> _Iter:
        return self

    def __next__(self) -> Batch:
        e = self.e
        with e.cond:
            if e.held is not None:
                e.free.append(e.held)
                e.held = None
            # Racy but safe: if the producer publishes meanwhile, it has at worst
            # finished a batch in flight a little early.
            e.consumer_waiting = e.ready.empty()
            e.cond.notify()
        try:
            item = e.ready.get()
        finally:
            e.consumer_waiting = False
        if item is _DONE:
            e.finished.wait()
            raise StopIteration
        if item.error is not None:
            self.close()
            raise LoaderError(
                f"{self.loader.archive.path}: gathering batch {item.number} of epoch {e.epoch} failed: "
                f"{type(item.error).__name__}: {item.error}\n--- in the loader thread:\n{item.trace}"
            ) from item.error
        batch: Batch = item.batch
        if e.cuda:
            _use_on_current_stream(batch, item.event, self.loader.device)
        e.held = item.slot
        batch = _apply_transforms(self.loader, batch, e.epoch, item.number)
        self.loader._batches_done = item.number + 1
        return batch

    def close(self) -> None:
        """Stops production and waits until the gather thread has left this epoch."""
        e = self.e
        e.stop.set()
        with e.cond:
            e.cond.notify_all()
        worker = self.loader._thread
        if worker is None or threading.current_thread() is worker:
            return
        while not e.finished.wait(0.1) and worker.is_alive():
            pass

    def __del__(self) -> None:
        """An iterator dropped mid-epoch stops its production (without waiting for it)."""
        e = getattr(self, "e", None)
        if e is not None:
            e.stop.set()
            with e.cond:
                e.cond.notify_all()

"""The Loader: the runtime's stages composed, in the order the bytes move.

    order (runtime.order.epochs)      which samples make batch j of this epoch
      -> supply (runtime.storage.supply)  the mapped shards they live in
      -> gather (runtime.gather.fields*)  indices -> a copy plan into a ring slot
      -> engine (runtime.gather.engine)   executes the plan on the copy threads
      -> ring/prefetch (runtime.pipeline.ring, runtime.pipeline.prefetch)  slots, back-pressure
      -> device (runtime.pipeline.device)   side-stream copy to CUDA, with an event
      -> transforms (runtime.transforms.base)  seeded per (seed, epoch, batch)

``prefetch > 0`` runs gather and device on one producer thread kept for the
Loader's lifetime, while the training loop takes ready batches;
``prefetch=0`` runs the same stages inline when a batch is asked for.
The buffer contract is in runtime.pipeline.ring.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Unpack, cast

import numpy as np
import torch

from dlop.formats import DlopError

from .archive.concat import ArchivePaths
from .archive.dataset import Archive
from .batch import Batch, split_batch
from .errors import LoaderError, SampleIndexError, UsageError, UsageTypeError, check_int
from .gather.engine import CopyEngine
from .gather.plan import CopyPlan
from .gather.threads import JobThread, at_exit, exiting
from .order.choose import choose, earlier_generation, earlier_spec
from .order.distributed import agree_across_ranks
from .order.epochs import OrderSpec, check_epoch
from .order.mixture import Source
from .order.reading import Reading, ReadingOptions
from .pipeline import packing
from .pipeline.device import DeviceStage
from .pipeline.loader_state import STATE_FORMAT, STATE_SETTINGS, check_state, loader_state
from .pipeline.packing import Packer, copied_apart, packed_room
from .pipeline.prefetch import (
    STOPPED_MESSAGE,
    Asks,
    InlineRun,
    PlanGroup,
    Prefetcher,
    PrefetchIter,
    Production,
)
from .pipeline.ring import Slot, allocate, slot_count
from .storage.cache import holds_node_lock
from .transforms.base import Transform, TransformStage, check_transforms

__all__ = ["STATE_FORMAT", "STATE_SETTINGS", "Loader", "LoaderError", "Transform"]

# Raised as they are from the training loop: they name the misuse already.
USAGE_ERRORS = (UsageError, UsageTypeError, SampleIndexError)

_live: weakref.WeakSet[Loader] = weakref.WeakSet()


def _close_all() -> None:
    """Loaders still open at exit stop their threads before the interpreter shuts down."""
    for loader in list(_live):
        loader.close()


at_exit(_close_all)


# Closes of Loaders collected on the runtime's own threads (Loader.__del__), waited for
# at exit.
_closing: set[threading.Thread] = set()
_closing_lock = threading.Lock()


def _close_then_forget(close: Callable[[], None]) -> None:
    try:
        close()
    finally:  # the Loader goes with its thread
        with _closing_lock:
            _closing.discard(threading.current_thread())


def _finish_closes() -> None:
    with _closing_lock:
        closing = list(_closing)
        _closing.clear()
    for t in closing:
        t.join(timeout=10)


at_exit(_finish_closes)


class LoaderThreads(NamedTuple):
    """A Loader's threads: the producer (None before the first prefetching epoch) and
    the copy engine's helpers."""

    producer: JobThread | None
    helpers: list[JobThread]


class Loader:
    """Iterates dict batches of an archive; see the module docstring for the stages.

    ``rank``/``world_size`` default to torch.distributed's when it is
    initialized; ``nodes`` (default: from the launcher's environment then, else 1)
    deals the archive's shards to nodes, each node's share kept across epochs
    (``node_share="keep"``) or dealt anew (``"redeal"``), ``node_rank`` checked
    against the rank (runtime.order.epochs); ``order`` is ``global`` (full permutation) or ``window``
    (out-of-core, see runtime.order.epochs); ``bucket_by`` names a ragged field whose
    lengths group batches, and with ``max_frames`` or ``max_padded_frames`` budget them
    (runtime.order.budget; ``batch_size`` then caps the count, None: no cap); ``transforms`` are callables ``(batch, generator)
    -> batch`` run on the batch's device with a generator seeded from (seed,
    epoch, batch number), so resumed epochs repeat their augmentations too.
    ``fields`` and ``pad_value`` open ``archive`` when it is a path; given an
    ``Archive``, they must match what it was opened with.

    What to train on (docs/choosing.md): ``archive`` may be a list of paths
    read as one (``allow_recipe_mismatch`` lets recipes differ); ``where`` and
    ``indices`` choose samples (runtime.archive.selection); a dict of source name ->
    path(s), Archive or ``Source`` (its weight and selection) is a mixture
    (runtime.order.mixture), each epoch ``samples_per_epoch`` samples drawn by the
    sources' weights (default: their sizes), each batch from one source with ``batch_per_source``; its batches
    name each sample's source in ``batch["source"]`` (an index into
    ``loader.sources``). An archive URL (``s3://``, any fsspec URL) is read through
    the node-local shard cache ``cache_dir`` within ``cache_bytes`` (runtime.storage.cached).
    ``even_shares=False`` reads each sample once across ranks, shares uneven (runtime.order.epochs).
    Besides ``device``, ``transforms`` and ``prefetch``, the keywords are the ones the
    Loader shares with IterableArchive, declared once (runtime.order.reading).
    """

    def __init__(
        self,
        archive: Archive | ArchivePaths | Mapping[str, Archive | ArchivePaths | Source],
        batch_size: int | None,
        *,
        device: str | torch.device | None = None,
        transforms: Sequence[Transform] = (),
        prefetch: int = 2,
        **reading: Unpack[ReadingOptions],
    ) -> None:
        self.reading = Reading.given("Loader", reading, ("device", "transforms", "prefetch"))
        # placed by torch.distributed (not by rank= and world_size=): its ranks load together
        self._grouped = self.reading.rank is None and self.reading.world_size is None
        self.prefetch = check_int("Loader prefetch", prefetch, low=0)
        self.choice = choose(
            archive,
            self.reading.open_options(),
            owner="Loader",
            **self.reading.order_options("Loader", batch_size),
        )
        self.archive, self.spec = self.choice.archive, self.choice.spec
        # an archive the Loader opened (from a path, a URL, a dict) is its own to close
        self._owns_archive = not isinstance(archive, Archive)
        self.order, self.bucket_by = self.choice.order, self.reading.bucket_by
        check_transforms(transforms, self.archive, self.choice.mixture is not None)
        self.order.refuse_empty(str(self.archive.path))
        # a shard cache too small for this order in some epoch is refused now
        self.choice.check_budget(
            self.prefetch + 2, self.bucket_by is not None, f"prefetch={self.prefetch}"
        )
        self._later_stages(device, transforms, self.reading.seed)
        _live.add(self)

    def _later_stages(
        self, device: str | torch.device | None, transforms: Sequence[Transform], seed: int
    ) -> None:
        """The stages after the order: device, transforms, ring, prefetch and copy engine."""
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise LoaderError(f"device {self.device} requested, but CUDA is not available")
        self.to_device = DeviceStage(self.device)
        self.transforms = tuple(transforms)
        self.transform = TransformStage(self.transforms, seed, self.device)
        self._slots: list[Slot] | None = None
        self._group: int | None = None  # batches made as one (group_size)
        self._texts: dict[str, np.ndarray] = {}  # text fields' bytes per sample
        self._active: weakref.ref[PrefetchIter | InlineRun] | None = None
        self.prefetcher = Prefetcher("dlop-loader")
        # Slots that take turns have left the cache when refilled: stream into them.
        self.engine = CopyEngine(streaming=slot_count(self.prefetch, self.to_device.cuda) > 1)

    @property
    def sources(self) -> tuple[str, ...]:
        """A mixture's source names, which ``batch["source"]`` indexes (empty otherwise)."""
        mix = self.choice.mixture
        return mix.names if mix is not None else ()

    # -- order and state ----------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self.order.epoch

    def set_epoch(self, epoch: int) -> None:
        self.order.set_epoch(epoch)

    def batches(self, epoch: int | None = None) -> list[np.ndarray]:
        """This rank's sample indices, batch by batch, for an epoch: a copy, which the
        caller may change without changing what the loader reads."""
        return [b.copy() for b in self.order.batches(epoch)]

    def __len__(self) -> int:
        """Batches per epoch on this rank: a whole epoch's in this world (an epoch
        continued from another world reads only its rest, ``batches()``)."""
        return self.order.whole_count()

    def state_dict(self) -> dict[str, Any]:
        """The position (epoch, batches done) and the settings that shape the order,
        the choice of samples included (runtime.pipeline.loader_state); a few numbers and a
        fingerprint, never index lists."""
        return self._state(self.order.spec_for(self.order.epoch))

    def _state(self, spec: OrderSpec) -> dict[str, Any]:
        """state_dict for an epoch read under ``spec``: the whole archive's, or for an epoch
        of the archive as it was before an append, that archive's (its first shards)."""
        settings = self.choice.settings(spec)
        return loader_state(spec, self.order.state_dict(), self.bucket_by, settings)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from a saved position: the next iteration yields the remaining batches
        of its epoch. A state saved before an append to the archive continues its epoch on
        the samples the archive held then; the next epoch reads them all."""
        held = self.order.hold()
        try:
            spec = self.spec
            saved = state.get("archives") if isinstance(state, dict) else None
            earlier = earlier_generation(self.archive, saved)
            if earlier is not None:
                spec = earlier_spec(self.spec, earlier[0], self.order.lengths)
                self.order.read_earlier(check_epoch("loader state epoch", state.get("epoch")), spec)
            self.order.reset(check_state(state, self._state(spec)))
        except DlopError:
            self.order.restore(held)
            agree_across_ranks(None, self.spec, self._grouped, "Loader")  # then its own error
            raise
        try:
            agree_across_ranks(state, self.spec, self._grouped, "Loader")
        except DlopError:
            self.order.restore(held)
            raise

    # -- iteration ------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        self._close_active()
        held = self.order.hold()
        start = self.order.begin()
        epoch, batches = self.order.epoch, self.order.batches()
        try:  # once an epoch, not per batch (Planner.checks_batches)
            self.archive.check_shards()
            self._fit_ring(batches)
        except Exception as e:
            self.order.restore(held)  # a retry starts where this one would have
            raise self._wrapped(e, start, epoch) from e
        if self.prefetch == 0:
            run = InlineRun()
            self._active = weakref.ref(run)
            return self._deliver(self._inline(batches, start, epoch, run), epoch)
        slots = self._ring()  # first: a failure here leaves no shard held (Asks)
        asks = Asks(self.archive, batches)
        packer = self._packer()  # after Asks: a warm node cache is held for the epoch
        production = Production(
            self._planner(batches, asks, packer),
            self.engine,
            self.to_device,
            slots,
            self._groups(start, len(batches), batches, packer),
            asks.release,
            asks.release_all,
        )
        it = self.prefetcher.start(
            production,
            lambda ready: self._wrapped(
                cast(BaseException, ready.error), ready.number, epoch, ready.trace
            ),
        )
        # Weak: an iterator the training loop drops is collected and stops its epoch.
        self._active = weakref.ref(it)
        return self._deliver(it, epoch)

    def _deliver(self, made: Iterator[tuple[int, Batch]], epoch: int) -> Iterator[Batch]:
        """The transform stage, and the count of batches handed out (the order's state)."""
        shaped = getattr(self.archive, "structure", None)  # a user's Dataset's sample shape
        for number, batch in made:
            batch = self.transform(batch, epoch, number)
            self.order.handed_out(number + 1)
            yield batch if shaped is None else shaped.batch(batch)

    def _planner(self, batches: list[np.ndarray], asks: Asks, packer: Packer | None) -> PlanGroup:
        """The gather stage for the producer: a group of batches planned into a ring slot,
        as one plan when there are several: fixed-size fields' batches as one batch then
        cut apart (``group_size``), others each after the one before (runtime.pipeline.packing)."""

        def plan_group(numbers: range, slot: Slot) -> tuple[list[Batch], CopyPlan]:
            for j in numbers:
                asks.ask_through(j)
            if len(numbers) == 1:
                batch, plan = self.plan(batches[numbers[0]], slot.buffers)
                return [batch], plan
            if packer is None:
                parts = [batches[j] for j in numbers]
                whole, plan = self.plan(np.concatenate(parts), slot.buffers)
                return split_batch(whole, [len(p) for p in parts]), plan
            return packer.plan_group(numbers, slot, batches)

        return plan_group

    def _groups(
        self, start: int, end: int, batches: list[np.ndarray], packer: Packer | None
    ) -> Iterable[range]:
        """Batches ``start`` to ``end`` in the groups the producer makes them in: small
        batches of fixed-size fields ``group_size`` at a time, others as many as a ring
        slot holds where the epoch packs them (``packer``); else one by one (a CUDA
        device, an epoch whose shards are held batch by batch: a cold node cache)."""
        if self.archive.planner.groups_batches:
            size = self.group_size
            return [range(j, min(j + size, end)) for j in range(start, end, size)]
        if packer is None:
            return [range(j, j + 1) for j in range(start, end)]
        return packer.groups(start, end, batches)

    def _packer(self) -> Packer | None:
        """This epoch's packing (runtime.pipeline.packing), where the read packs and every
        shard is kept (mapped for good, or a warm node cache held for the epoch). Made per
        epoch and held by its production only: the Loader keeps no reference to it, so a
        Loader dropped mid-epoch is let go of as soon as its producer is."""
        if not self._packs() or not self.archive.planner.keeps_shards:
            return None
        buffers = self._ring()[0].buffers
        return Packer(
            {name: buf.numel() for name, buf in buffers.items()},
            {name: buf.element_size() for name, buf in buffers.items()},
            {name: self.archive.gathers[name] for name in buffers},
            [self._text_bytes(name) for name in self._text_fields()],
            self.plan,
            self.choice.plan_packed,
        )

    def _packs(self) -> bool:
        """Whether this read packs its batches (runtime.pipeline.packing): on the CPU, some
        field not fixed-size, and every field filling slot buffers or handing out text."""
        if self.to_device.cuda or self.archive.planner.fixed_only:
            return False
        text = set(self._text_fields())
        return all(
            name in text or (self.choice.buffer_numel(name) is not None and f.codec.mappable)
            for name, f in self.archive.fields.items()
        )

    def _text_fields(self) -> list[str]:
        return [n for n, f in self.archive.fields.items() if f.kind in ("str", "bytes")]

    def _text_bytes(self, name: str) -> np.ndarray:
        """A text field's bytes per sample, by sample number (kept for the Loader)."""
        if name not in self._texts:
            self._texts[name] = self.archive.lengths(name)
        return self._texts[name]

    @property
    def group_size(self) -> int:
        """Batches made as one: a group of small batches of fixed-size fields costs one
        plan, one copy call per field and one hand-over (docs/runtime.md); others, and
        batches for a CUDA device, are made one by one."""
        if self._group is None:
            self._group = 1
            if not self.to_device.cuda and self.archive.planner.fixed_only:
                nbytes = sum(
                    (self.choice.buffer_numel(name) or 0) * g.out_dtype.itemsize
                    for name, g in self.archive.gathers.items()
                )
                most = packing.GROUP_BATCHES
                self._group = max(1, min(most, packing.GROUP_BYTES // max(1, nbytes)))
        return self._group

    def _inline(
        self, batches: list[np.ndarray], start: int, epoch: int, run: InlineRun
    ) -> Iterator[tuple[int, Batch]]:
        """prefetch=0: each batch made on the calling thread when asked for, into a
        buffer still warm in cache, at the cost of the gather's time in the loop."""
        slots = self._ring()
        asks = Asks(self.archive, batches)
        run.release = asks.release_all  # a closed run lets go at once, not when collected
        packer = self._packer()
        plan_group = self._planner(batches, asks, packer)
        try:
            for g, numbers in enumerate(self._groups(start, len(batches), batches, packer)):
                if run.closed:
                    raise LoaderError(STOPPED_MESSAGE)
                slot = slots[g % len(slots)]
                failed: Exception | None = None
                try:
                    slot.wait_copied()
                    try:
                        made, plan = plan_group(numbers, slot)
                        numbers = numbers[: len(made)]  # cut short before a failing batch
                        try:
                            self.engine.run(plan)
                        except Exception as e:
                            made, failed = copied_apart(self.engine, plan, e, made)
                    finally:
                        for j in numbers:
                            asks.release(j)
                    moved = []
                    for batch in made:
                        batch, slot.event = self.to_device.copy(batch)
                        self.to_device.use(batch, slot.event)
                        moved.append(batch)
                except Exception as e:
                    error = self._wrapped(e, numbers[0], epoch)
                    if error is e:
                        raise
                    raise error from e
                for j, batch in zip(numbers, moved, strict=False):
                    if run.closed:
                        raise LoaderError(STOPPED_MESSAGE)
                    yield j, batch
                if failed is not None:  # the batch after those handed out
                    error = self._wrapped(failed, numbers[len(moved)], epoch)
                    if error is failed:
                        raise failed
                    raise error from failed
        finally:
            asks.release_all()  # stopped early: the batch asked ahead, too

    def plan(self, indices: np.ndarray, buffers: dict[str, torch.Tensor]) -> tuple[Batch, CopyPlan]:
        """The gather stage's plan of a batch into ``buffers`` (runtime.order.choose.Choice.plan:
        a mixture's batches also say each sample's source, ``batch["source"]``)."""
        return self.choice.plan(indices, buffers)

    def _wrapped(self, e: BaseException, number: int, epoch: int, trace: str = "") -> BaseException:
        """What the training loop raises for batch ``number``'s error ``e``: a usage
        error (or a BaseException that is no Exception) as it is, any other a
        ``LoaderError`` naming the archive, batch and epoch (``e`` its cause)."""
        where = f"\n--- in the loader thread:\n{trace}" if trace else ""
        if isinstance(e, USAGE_ERRORS) or not isinstance(e, Exception):
            if where:  # raised as it is: where it was raised, as a note
                e.add_note(where.lstrip("\n"))
            return e
        return LoaderError(
            f"{self.archive.path}: gathering batch {number} of epoch {epoch} failed: "
            f"{type(e).__name__}: {e}{where}"
        )

    def _close_active(self) -> None:
        ref = getattr(self, "_active", None)
        active = ref() if ref is not None else None
        if active is not None:
            active.close()
        self._active = None

    # -- introspection and teardown -------------------------------------------------

    def buffers(self) -> list[dict[str, torch.Tensor]]:
        """The ring's batch buffers (flat, by field), allocated on first use, pinned
        when CUDA is available; batches are views of them on the CPU."""
        return [slot.buffers for slot in self._ring()]

    def _ring(self) -> list[Slot]:
        if self._slots is None:
            # No batch holds more samples than the archive: a larger batch_size
            # does not make larger buffers. A group's batches share a slot: where
            # batches are packed, each buffer holds the largest batch, or up to
            # GROUP_BATCHES of it within PACK_BYTES (runtime.pipeline.packing).
            sizes = {}
            for name, g in self.archive.gathers.items():
                numel = self.choice.buffer_numel(name)
                if numel is not None:
                    sizes[name] = (self._room(numel, g.out_dtype.itemsize), g.out_dtype)
            count = slot_count(self.prefetch, self.to_device.cuda)
            b = self.choice.most_samples() * self.group_size
            where = f"{self.archive.path} (batches of up to {b} samples)"
            self._slots = allocate(sizes, count, torch.cuda.is_available(), where)
        return self._slots

    def _fit_ring(self, batches: list[np.ndarray]) -> None:
        """An epoch continued from a state (the rest of another world's epoch, the archive
        as it was before an append) may make batches larger than this world's largest, which
        the ring is sized for: the ring grows to hold its largest."""
        appended = self.order.appended
        if not self.order.earlier() and (appended is None or appended[0] != self.order.epoch):
            return
        slots = self._ring()
        grown = {}
        for name, buf in slots[0].buffers.items():
            gather = self.archive.gathers[name]
            most = self._room(gather.most_numel(batches), buf.element_size())
            if most > buf.numel():
                grown[name] = most
        if grown:
            self._close_active()  # no batch of the old ring is made after this
            sizes = {
                name: (max(buf.numel(), grown.get(name, 0)), buf.dtype)
                for name, buf in slots[0].buffers.items()
            }
            where = f"{self.archive.path} (a continued epoch's batches)"
            self._slots = allocate(sizes, len(slots), torch.cuda.is_available(), where)

    def _room(self, numel: int, element_size: int) -> int:
        """Elements of a ring slot's buffer for a field whose largest batch needs ``numel``:
        ``group_size`` batches of fixed-size fields, or room to pack several others
        (runtime.pipeline.packing)."""
        if self._packs():
            return packed_room(numel, element_size)
        return numel * self.group_size

    def threads(self) -> LoaderThreads:
        """The threads this Loader runs (for inspection and tests)."""
        return LoaderThreads(self.prefetcher.thread, self.engine.helpers())

    def close(self) -> None:
        """Stops the epoch in progress and every thread of this Loader, waiting for them;
        an archive the Loader opened itself lets go of what it holds (cached shards, their
        descriptors and fetch threads: runtime.storage.remote_supply), an open Archive
        given to it is left to its owner (``Archive.close``)."""
        owned = getattr(self, "_owns_archive", False)
        ref = getattr(self, "_active", None)
        active = ref() if ref is not None else None
        if owned:
            if active is not None:
                active.halt()  # no more asks; then a batch waiting for a stalled fetch
            self.archive.close()  # is answered at once, not after the fetch's timeouts
        self._close_active()
        if getattr(self, "prefetcher", None) is not None:
            self.prefetcher.close()
        if getattr(self, "engine", None) is not None:
            self.engine.close()
        if owned:
            self.archive.close()

    def __del__(self) -> None:
        # A collection runs this on whatever thread allocates. On one of the runtime's
        # own (a fetch thread), or on any thread inside a cache's budget lock (the main
        # thread too, reserving room for a shard), this close could wait behind a fetch
        # thread that holds its supply's lock while it waits for the budget's: it runs
        # on a thread of its own, which the exit hooks wait for. Once the interpreter has
        # begun to shut down (the hooks run, or it is finalizing), nothing is started:
        # the hooks close what is open, and the modules close uses may be gone.
        if sys.is_finalizing() or exiting():
            return
        try:
            if threading.current_thread() is threading.main_thread() and not holds_node_lock():
                self.close()
            else:
                closing = threading.Thread(
                    target=_close_then_forget, args=(self.close,), name="dlop-close", daemon=True
                )
                with _closing_lock:  # started under the lock: the exit hook joins it
                    closing.start()
                    _closing.add(closing)
        except Exception:
            pass

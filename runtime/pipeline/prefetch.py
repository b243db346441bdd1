"""The prefetch stage: batches made ahead on one producer thread, handed over through the ring.

The producer works in groups of consecutive batches: one batch each, or, for
small batches of fixed-size fields, several planned as one, copied in one call
per field and handed over at once; or batches with ragged or text fields
packed one after another into a slot (runtime.pipeline.packing). runtime.loader
chooses; a group's batches are views of one ring slot, and a group cut short
before a batch that failed ends where its batches do. It plans group g+1 (row lists, decoded blocks,
text) while the copy engine's helpers copy group g, and starts g+1's copies
behind g's, so the helpers copy back to back; then it waits for g's copies,
queues g's copy to the device and hands g over. At most two groups are in
flight.

Back-pressure: the producer takes a free ring slot for each batch. While none
is free it finishes and hands over the oldest batch in flight only if the
training loop is waiting for it; otherwise the copies queued on the helpers
keep them busy while the producer waits for a slot to come back. On a CUDA
device a slot comes back as soon as its copy to the device is done, so there
the producer also waits while ``len(slots) - 1`` device batches are ready and
not yet taken: the batches on the device ahead of the training loop stay that
many, whatever the loop's speed.

One producer thread serves a Loader for its lifetime (``Prefetcher``);
starting an epoch costs a queue put, not a thread start.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import queue
import threading
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..batch import Batch
from ..errors import LoaderError, kept
from ..gather.engine import CopyEngine, Ticket
from ..gather.plan import CopyPlan
from ..gather.threads import JobThread
from .device import DeviceStage
from .packing import copied_apart
from .ring import FreeSlots, Slot

if TYPE_CHECKING:
    from ..archive.dataset import Archive

# The batches numbered ``numbers``, planned into a ring slot, and the copies that fill them.
PlanGroup = Callable[[range, Slot], tuple[list[Batch], CopyPlan]]
Copied = Callable[[int], None]  # batch j's copies are done (its supply may let go)
Ended = Callable[[], None]  # the production has ended, its copies done (let go of the rest)


@dataclass
class Ready:
    number: int  # of the first batch
    batches: list[Batch] | None = None
    slot: Slot | None = None
    event: Any = None
    error: BaseException | None = None
    trace: str = ""


_DONE = object()  # the epoch's last batch has been handed over
_STOPPED = object()  # halted before the end: the iterator was closed or superseded

STOPPED_MESSAGE = (
    "this Loader iterator was stopped: Loader.close() or a new iter(loader) ended its "
    "epoch; take a new iterator with iter(loader)"
)


class Asks:
    """The supply stage's side of one epoch: batch j's shards asked for once, while
    batch j-1 is made (a remote supply fetches them meanwhile), and let go of once:
    when j has been copied, or by ``release_all`` when the epoch ends early. A supply
    that maps shards per batch (a remote one) also hears, at each ask, the shards later
    batches read first, in order, to fetch them ahead."""

    def __init__(self, archive: Archive, batches: list[np.ndarray]) -> None:
        self.archive = archive
        self.batches = batches
        self.out: dict[int, np.ndarray] = {}  # asked for, not yet let go of
        self.firsts: tuple[np.ndarray, np.ndarray] | None = None
        # A warm node cache holding the whole archive holds it for the epoch, not per batch.
        self.whole = archive.planner.hold_whole()
        self.hears = archive.supply.hears_asks and not self.whole  # else no asks, releases
        self.fetches = archive.supply.shards is None  # per batch: a supply that fetches
        archive.supply.forget_failures()  # a new epoch's batches try failed shards again
        archive.supply.read_order(batches)  # a shard arriving in parts: those read first

    def ask_through(self, j: int) -> None:
        """Batch j (if not asked for yet) and the one after it."""
        if not self.hears:
            return
        for k in (j, j + 1):
            if k < len(self.batches) and k not in self.out:
                shards = self.archive.shards_of(torch.from_numpy(self.batches[k]))
                self.archive.supply.ask(shards)
                self.out[k] = shards
        if self.fetches:  # ahead too
            self.archive.supply.ahead(self.first_read_after(j + 1))

    def first_read_after(self, j: int) -> np.ndarray:
        """The shards that batches after j read and none up to j does, in first-read order."""
        if self.firsts is None:
            flat = np.concatenate(self.batches) if self.batches else np.zeros(0, np.int64)
            batch_of = np.repeat(np.arange(len(self.batches)), [len(b) for b in self.batches])
            of = self.archive.shards_of(torch.from_numpy(flat))
            shards, first = np.unique(of, return_index=True)
            by_use = np.argsort(first, kind="stable")
            self.firsts = (shards[by_use], batch_of[first[by_use]])
        shards, batch = self.firsts
        return shards[np.searchsorted(batch, j, side="right") :]

    def release(self, j: int) -> None:
        shards = self.out.pop(j, None)
        if shards is not None:
            self.archive.supply.release(shards)

    def release_all(self) -> None:
        for j in list(self.out):
            self.release(j)
        if self.whole:
            self.whole = False
            self.archive.planner.let_go_whole()


class InlineRun:
    """prefetch=0's handle on an epoch for ``Loader.close`` and a new ``iter``:
    closed, its iterator raises ``LoaderError`` instead of making more batches."""

    def __init__(self) -> None:
        self.closed = False
        self.release: Callable[[], None] | None = None  # what the epoch holds, let go of

    def halt(self) -> None:
        self.closed = True

    def close(self) -> None:
        self.closed = True
        if self.release is not None:
            self.release()


class Production:
    """One epoch's batches, in ``groups`` of consecutive numbers, made on the producer
    thread (``run``) and taken by the training loop (``PrefetchIter``). It holds no
    reference to the iterator, so an iterator the training loop drops is collected and
    stops its epoch."""

    def __init__(
        self,
        plan_group: PlanGroup,
        engine: CopyEngine,
        device: DeviceStage,
        slots: list[Slot],
        groups: Iterable[range],
        copied: Copied,
        ended: Ended = lambda: None,
    ) -> None:
        self.plan_group = plan_group
        self.copied = copied
        self.ended = ended
        self.engine = engine
        self.device = device
        self.groups = groups
        self.free = FreeSlots(slots, lifo=not device.cuda)
        self.consumer_waiting = False  # guarded by free.cond
        # Device batches handed over and not yet taken, and how many may be (CUDA only).
        self.untaken = 0  # guarded by free.cond
        self.ahead = max(1, len(slots) - 1) if device.cuda else None
        self.ready: queue.Queue[Any] = queue.Queue()
        self.held: Slot | None = None
        self.stop = threading.Event()
        self.finished = threading.Event()
        self.in_flight: collections.deque[tuple[range, list[Batch], Slot, Ticket, CopyPlan]] = (
            collections.deque()
        )

    def run(self) -> None:
        end: object = _STOPPED  # halted or failed unless it reaches the end
        try:
            for numbers in self.groups:
                slot = self._take_slot()
                if slot is None or not self._start(numbers, slot):
                    return
                if len(self.in_flight) > 1 and not self._publish():
                    return
            while self.in_flight:
                if not self._publish():
                    return
            end = _DONE
        finally:
            for *_, ticket, _ in self.in_flight:  # stopped early: let the copies finish
                with contextlib.suppress(BaseException):
                    ticket.wait()
            # Every batch asked for and not yet let go of (in flight, asked ahead).
            with contextlib.suppress(BaseException):
                self.ended()
            self.finished.set()
            # Last, so a training loop waiting in ``next`` always wakes up.
            self.ready.put(end)

    def _start(self, numbers: range, slot: Slot) -> bool:
        """Plans the batches ``numbers`` into ``slot`` and starts their copies; False
        after an error."""
        try:
            slot.wait_copied()
            batches, plan = self.plan_group(numbers, slot)
            numbers = numbers[: len(batches)]  # cut short before a batch that failed to plan
            self.in_flight.append((numbers, batches, slot, self.engine.start(plan), plan))
            return True
        except BaseException as e:
            trace = traceback.format_exc()
            while self.in_flight:
                if not self._publish():
                    return False
            self.ready.put(Ready(numbers[0], error=kept(e, note=False), trace=trace))
            return False

    def _publish(self) -> bool:
        """Finishes the oldest group in flight and hands it over; False after an error."""
        numbers, batches, slot, ticket, plan = self.in_flight.popleft()
        failed: Exception | None = None
        try:
            try:
                ticket.wait()
            except Exception as e:  # the batch whose copy fails, after those before it
                batches, failed = copied_apart(self.engine, plan, e, batches)
            finally:
                for j in numbers:
                    self.copied(j)
            moved, event = [], None
            for batch in batches:
                batch, event = self.device.copy(batch)
                moved.append(batch)
            if self.device.cuda:
                slot.event = event
                with self.free.cond:
                    self.untaken += 1
                    self.free.put(slot)  # refilled only after its event completes
            self.ready.put(Ready(numbers[0], moved, None if self.device.cuda else slot, event))
            if failed is not None:
                trace = "".join(traceback.format_exception(failed))
                self.ready.put(
                    Ready(numbers[len(moved)], error=kept(failed, note=False), trace=trace)
                )
                return False
            return True
        except BaseException as e:
            trace = traceback.format_exc()
            self.ready.put(Ready(numbers[0], error=kept(e, note=False), trace=trace))
            return False

    def _take_slot(self) -> Slot | None:
        """A free slot, or None once stopped or failed (see the module docstring)."""
        while True:
            with self.free.cond:
                while not self.stop.is_set():
                    slot = self._free_slot()
                    if slot is not None:
                        return slot
                    if self.in_flight and self.consumer_waiting:
                        break
                    self.free.cond.wait(0.1)
                else:
                    return None
            if not self._publish():
                return None

    def _free_slot(self) -> Slot | None:
        """A free slot, unless the device batches not yet taken are at their bound;
        call with ``free.cond`` held."""
        if self.ahead is not None and self.untaken >= self.ahead:
            return None
        return self.free.pop()

    def taken(self) -> None:
        """The training loop took a device group: the producer may make another."""
        if self.ahead is not None:
            with self.free.cond:
                self.untaken -= 1
                self.free.cond.notify()

    def halt(self) -> None:
        """Asks the producer to stop (it finishes the copies it started)."""
        self.stop.set()
        with self.free.cond:
            self.free.cond.notify_all()


class PrefetchIter:
    """The training loop's side of a production: yields ``(number, batch)``; a failed
    batch raises ``fail(ready)``; a production halted before its end (``close``, the
    Loader's ``close`` or a new ``iter``) raises ``LoaderError``."""

    def __init__(
        self,
        production: Production,
        producer: JobThread,
        fail: Callable[[Ready], BaseException],
    ) -> None:
        self.p = production
        self.producer = producer
        self.fail = fail
        self.pending: collections.deque[tuple[int, Batch]] = collections.deque()  # of a group
        producer.submit(production.run)

    def __iter__(self) -> PrefetchIter:
        return self

    def __next__(self) -> tuple[int, Batch]:
        p = self.p
        if self.pending:  # the rest of a group taken: no hand-over, its slot still held
            if p.stop.is_set():
                self.close()
                raise LoaderError(STOPPED_MESSAGE)
            return self.pending.popleft()
        with p.free.cond:
            if p.held is not None:
                p.free.put(p.held)
                p.held = None
            # Racy but safe: if the producer publishes meanwhile, it has at worst
            # finished a batch in flight a little early.
            p.consumer_waiting = p.ready.empty()
            p.free.cond.notify()
        if p.stop.is_set():
            # Batches still queued may share ring slots with a newer epoch: none is handed out.
            self.close()
            raise LoaderError(STOPPED_MESSAGE)
        try:
            item = p.ready.get()
        finally:
            p.consumer_waiting = False
        if item is _DONE or item is _STOPPED:
            p.ready.put(item)  # a later ``next`` ends the same way
            p.finished.wait()
            if item is _DONE:
                raise StopIteration
            raise LoaderError(STOPPED_MESSAGE)
        if item.batches is not None:
            p.taken()
        if item.error is not None:
            self.close()
            error = self.fail(item)
            if error is item.error:  # a usage error, raised as it is
                raise error
            raise error from item.error
        first, *rest = item.batches
        for batch in item.batches:
            p.device.use(batch, item.event)
        p.held = item.slot  # given back when the group's last batch is done with
        self.pending.extend(zip(itertools.count(item.number + 1), rest))
        return item.number, first

    def halt(self) -> None:
        """Asks the producer to stop, without waiting for it (``close`` waits)."""
        self.p.halt()

    def close(self) -> None:
        """Stops production and waits until the producer has left this epoch."""
        self.p.halt()
        if threading.current_thread() is self.producer:
            return
        while not self.p.finished.wait(0.1) and self.producer.is_alive():
            pass

    def __del__(self) -> None:
        """An iterator dropped mid-epoch stops its production (without waiting for it)."""
        p = getattr(self, "p", None)
        if p is not None:
            p.halt()


class Prefetcher:
    """Owns the producer thread, kept across epochs, and starts each epoch's production."""

    def __init__(self, name: str = "dlop-loader") -> None:
        self.name = name
        self.thread: JobThread | None = None

    def start(self, production: Production, fail: Callable[[Ready], BaseException]) -> PrefetchIter:
        if self.thread is None or not self.thread.usable():
            self.thread = JobThread(self.name)
        return PrefetchIter(production, self.thread, fail)

    def close(self) -> None:
        if self.thread is not None:
            self.thread.stop(timeout=10)
            self.thread = None

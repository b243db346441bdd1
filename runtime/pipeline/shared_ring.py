"""The worker ring: a DataLoader worker's batch buffers in shared memory, reused across batches.

A worker's batch reaches the main process through torch.multiprocessing,
which sends a tensor already in shared memory as a handle to its segment (a
file descriptor, or a name under the ``file_system`` strategy) that the main
process maps; a tensor in private memory is first copied into a new segment.
Fresh shared memory costs a page fault per page as it is first written, so a
worker gathers each batch into one of a few slots (one shared segment each)
made once and reused: the hand-over then sends a handle to pages that exist.

A slot is reused only once the main process no longer holds any of the
memory it sent. Unpickling a batch in the main process (``claim``) ties a
finalizer to the slot's storage there; when the last tensor, view or numpy
array over it dies, the finalizer writes the hand-out's number into the
slot's cell of a small table in shared memory (``ReleaseTable``), made by the
dataset in the main process before the workers start. The worker refills a
slot only when its cell holds the number it handed the slot out with; hand-out
numbers start at the worker's start time in nanoseconds, so a finalizer of an
earlier worker (or DataLoader) writing the same cell never matches. With no
slot free (batches kept by the training loop), the worker gathers into fresh
shared memory instead of waiting: slower, never stuck, never overwriting.

How a slot's segment reaches the main process: torch sends a segment's file
descriptor through the worker's resource-sharer socket, a connection and an
authentication handshake per batch, which took about 1.3 ms of the main
process's time for each batch on a 2-core machine, more than gathering a
batch of short utterances. A slot's segment stays open in the worker until the
main process has let go of the batch, so where this process can open another
process's descriptors under ``/proc/<pid>/fd`` (Linux; checked once, when the
table is made) a slot batch carries the worker's pid, the descriptor's number
and the segment's inode instead, and the main process opens and maps it
itself (``claim_by_proc``, tens of microseconds), refusing a file that is not
the one named. It keeps the mapping for the slot's later batches while the
worker holds the segment (``SegmentMaps``): no map, unmap or page fault per
batch. Fresh batches and tensors outside the slot go torch's way.
"""

from __future__ import annotations

import math
import mmap
import multiprocessing.util
import os
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from ..archive.dataset import Archive
from ..batch import Batch
from ..errors import LoaderError
from ..gather.engine import CopyEngine
from ..gather.fields import Allocate
from ..gather.memory import shared_buffer, shared_empty

ALIGN = 64  # bytes: each tensor in a slot starts on a cache line
MAX_SLOTS = 64  # slots per worker the table has room for
_REUSED, _FRESH = 0, 1  # the table's counter columns, after the slots' cells
MAX_MAPPED = 256  # worker segments the main process keeps mapped (SegmentMaps)
SWEEP_SECONDS = 0.25  # how often it checks that their workers still hold them

# Release tables of this process by token: ``claim`` finds a batch's table here.
_tables: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


class Sized(Protocol):
    """What sizes a worker's slots: the archive read, and the most a batch of the
    order holds (runtime.order.choose.Choice)."""

    archive: Archive

    def most_samples(self) -> int: ...

    def buffer_numel(self, name: str) -> int | None: ...


class Gathers(Protocol):
    """What a worker ring gathers from: an Archive, or the samples chosen from one."""

    def gather(self, indices: torch.Tensor, out: Allocate, engine: CopyEngine) -> Batch: ...


class Ticket(NamedTuple):
    """Which hand-out a batch is: the table's token, the worker, its slot, the hand-out number."""

    token: int
    worker: int
    slot: int
    number: int


class ReleaseTable:
    """``[workers, slots + 2]`` int64 in shared memory: each slot's last released hand-out
    number, then per worker the batches made in reused slots and in fresh memory."""

    def __init__(self, token: int, workers: int, slots: int) -> None:
        self.token, self.slots = token, slots
        table = torch.zeros(workers, slots + 2, dtype=torch.int64)
        self.tensor = table.share_memory_()  # type: ignore[no-untyped-call]  # unannotated in torch
        self.by_proc = proc_fds_open()  # how slot batches travel (module docstring)
        self.register()

    def register(self) -> None:
        """Makes this process's ``claim`` release slots into this table (also after unpickling)."""
        _tables[self.token] = self.tensor

    def counts(self) -> tuple[int, int]:
        """Batches made by all workers so far: (in reused slots, in fresh shared memory)."""
        totals = self.tensor[:, self.slots :].sum(dim=0).tolist()
        return int(totals[_REUSED]), int(totals[_FRESH])


def proc_fds_open() -> bool:
    """Whether this process can open a file through ``/proc/<pid>/fd/<n>``, as claim_by_proc
    opens a worker's slot segment (Linux with /proc mounted)."""
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is None:
        return False
    try:
        fd = memfd_create("dlop-probe")
    except OSError:
        return False
    try:
        os.close(os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_RDWR))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


# A slot batch's value as claim_by_proc rebuilds it: a piece of the segment (its storage
# offset in elements, shape, strides, dtype), or any other value as pickled.
Piece = tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]


def open_segment(handle: tuple[int, int, int, int]) -> mmap.mmap:
    """The worker's segment ``handle`` = (pid, fd, bytes, inode) opened through /proc and
    mapped; a file that is not the one named is refused."""
    pid, fd, nbytes, inode = handle
    where = f"/proc/{pid}/fd/{fd}"
    try:
        opened = os.open(where, os.O_RDWR)
    except OSError as e:
        raise LoaderError(
            f"cannot open DataLoader worker {pid}'s batch memory at {where} ({e}); "
            "IterableArchive(worker_buffers=0) sends every batch through torch instead"
        ) from None
    try:
        st = os.fstat(opened)
        if st.st_ino != inode or st.st_size < nbytes:
            raise LoaderError(
                f"{where} is not the {nbytes}-byte batch memory (inode {inode}) that "
                f"DataLoader worker {pid} sent (inode {st.st_ino}, {st.st_size} bytes)"
            )
        return mmap.mmap(opened, nbytes)
    finally:
        os.close(opened)


class SegmentMaps:
    """The main process's mappings of worker slot segments, kept from batch to batch.

    Mapping a slot anew for every batch costs a map and an unmap, and a page fault per
    page the training loop reads. A mapping is kept while its worker still holds the
    segment under the same descriptor (a daemon thread checks every ``SWEEP_SECONDS``
    while any is kept), so an ended worker's memory is let go of within that time; at
    most ``MAX_MAPPED`` are kept. Each batch gets a storage of its own over the
    mapping, whose finalizer releases the slot (``claim``).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.maps: OrderedDict[tuple[int, int], tuple[int, int, mmap.mmap]] = OrderedDict()
        self.sweeping = False

    def storage(self, handle: tuple[int, int, int, int]) -> tuple[torch.UntypedStorage, mmap.mmap]:
        """A new storage over the segment ``handle`` names (mapped now, or kept), and the
        mapping: the batch's finalizer holds it (``claim``), since the storage alone lets go
        of it once its data moves (``share_memory_``, sending it to another process) while
        arrays taken from it before may still point there."""
        pid, fd, nbytes, inode = handle
        with self.lock:
            kept = self.maps.get((pid, fd))
            if kept is not None and kept[:2] == (inode, nbytes):
                self.maps.move_to_end((pid, fd))
                mapped = kept[2]
            else:
                mapped = None
        if mapped is None:
            mapped = open_segment(handle)
            with self.lock:
                self.maps[(pid, fd)] = (inode, nbytes, mapped)
                while len(self.maps) > MAX_MAPPED:
                    self.maps.popitem(last=False)
                if not self.sweeping:
                    try:
                        threading.Thread(target=self.sweep_until_empty, daemon=True).start()
                        self.sweeping = True
                    except RuntimeError:  # no thread now (shutdown): keep nothing unwatched
                        del self.maps[(pid, fd)]
        return torch.frombuffer(mapped, dtype=torch.uint8).untyped_storage(), mapped

    def sweep(self) -> bool:
        """Forgets the mappings whose worker no longer holds the segment (ended, or the
        slot replaced); whether any is left."""
        with self.lock:
            entries = list(self.maps.items())
        gone = []
        for (pid, fd), kept in entries:
            try:
                held = os.stat(f"/proc/{pid}/fd/{fd}").st_ino == kept[0]
            except OSError:
                held = False
            if not held:
                gone.append(((pid, fd), kept))
        with self.lock:
            for key, kept in gone:
                if self.maps.get(key) is kept:
                    del self.maps[key]  # batches still over it keep the mapping alive
            self.sweeping = bool(self.maps)
            return self.sweeping

    def sweep_until_empty(self) -> None:
        while True:
            time.sleep(SWEEP_SECONDS)
            if not self.sweep():
                return


maps = SegmentMaps()  # this process's


def _forget_maps() -> None:
    """A forked child (a DataLoader worker) keeps none of the parent's mappings."""
    global maps
    maps = SegmentMaps()


if hasattr(os, "register_at_fork"):  # not on Windows, where nothing forks
    os.register_at_fork(after_in_child=_forget_maps)


def claim_by_proc(
    handle: tuple[int, int, int, int], values: list[tuple[str, bool, Any]], ticket: Ticket
) -> Batch:
    """A slot batch sent by descriptor number (SlotBatch.__reduce__): the worker's segment
    ``handle`` = (pid, fd, bytes, inode), mapped through /proc (``SegmentMaps``), its pieces
    as tensors over it, then ``claim``."""
    storage, mapped = maps.storage(handle)
    items: dict[str, Any] = {}
    for name, piece, value in values:
        if piece:
            offset, shape, stride, dtype = value
            items[name] = torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
        else:
            items[name] = value
    return claim(items, torch.empty(0, dtype=torch.uint8).set_(storage), ticket, mapped)


def mark_released(
    table: np.ndarray, worker: int, slot: int, number: int, keep: object = None
) -> None:
    """The finalizer of a batch's storage (``keep``: what it held alive until now)."""
    table[worker, slot] = number


def _let_go(keep: object) -> None:
    """The finalizer of a batch's storage with no table to mark: it only held ``keep``."""


def claim(
    items: dict[str, Any], slot_memory: torch.Tensor, ticket: Ticket, keep: object = None
) -> Batch:
    """A worker's batch as unpickled in the main process: a plain ``Batch``, with a finalizer
    on the slot's storage that marks the slot free once nothing here uses it any more,
    holding ``keep`` (the slot's mapping, for claim_by_proc) until then."""
    table = _tables.get(ticket.token)
    storage = slot_memory.untyped_storage()
    if table is not None:  # without its table the slot is never marked free: safe, not reused
        t = table.numpy()
        release = weakref.finalize(
            storage, mark_released, t, ticket.worker, ticket.slot, ticket.number, keep
        )
        release.atexit = False
    elif keep is not None:
        weakref.finalize(storage, _let_go, keep).atexit = False
    return Batch(items)


class SlotBatch(Batch):
    """A batch in a worker's slot; pickled, it carries the slot's memory (by descriptor
    number where its segment's ``handle`` is given, see the module docstring) and its ticket."""

    def __init__(
        self,
        items: dict[str, Any],
        slot_memory: torch.Tensor,
        ticket: Ticket,
        handle: tuple[int, int, int, int] | None,
    ) -> None:
        super().__init__(items)
        self.slot_memory, self.ticket, self.handle = slot_memory, ticket, handle

    def __copy__(self) -> SlotBatch:  # DataLoader's default_convert copies the batch
        copied = SlotBatch(dict(self), self.slot_memory, self.ticket, self.handle)
        copied.position = self.position
        return copied

    def __reduce__(self) -> tuple[Any, ...]:
        state = {"position": self.position}
        if self.handle is None:
            return (claim, (dict(self), self.slot_memory, self.ticket), state)
        storage = self.slot_memory.untyped_storage().data_ptr()
        values: list[tuple[str, bool, Any]] = []
        for name, value in self.items():
            if (
                type(value) is torch.Tensor
                and not value.requires_grad
                and value.untyped_storage().data_ptr() == storage
            ):
                piece: Piece = (
                    int(value.storage_offset()),
                    tuple(value.shape),
                    value.stride(),
                    value.dtype,
                )
                values.append((name, True, piece))
            else:
                values.append((name, False, value))
        return (claim_by_proc, (self.handle, values, self.ticket), state)


def segment_handle(memory: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(pid, fd, bytes, inode) of the shared segment under ``memory``, or None where it has
    no descriptor (the ``file_system`` strategy)."""
    strategy = torch.multiprocessing.get_sharing_strategy()  # type: ignore[no-untyped-call]  # unannotated in torch
    if strategy != "file_descriptor":
        return None
    try:
        fd, nbytes = memory.untyped_storage()._share_fd_cpu_()
    except RuntimeError:
        return None
    return os.getpid(), int(fd), int(nbytes), os.fstat(fd).st_ino


def align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def slot_bytes(choice: Sized) -> int:
    """A slot's starting size: the fields the Loader's ring sizes (runtime.pipeline.ring) and the
    ragged fields' lengths. Other fields (several varying dimensions) grow it."""
    archive, b = choice.archive, choice.most_samples()
    total = 0
    for name, gather in archive.gathers.items():
        numel = choice.buffer_numel(name)
        if numel is not None:
            total += align(numel * gather.out_dtype.itemsize)
        field = archive.fields[name]
        if field.ragged:
            total += align(b * 8 * sum(d is None for d in field.shape))
    return total


class Slot:
    """One slot's shared memory, handed out front to back within a batch."""

    def __init__(self, memory: torch.Tensor) -> None:
        self.memory = memory
        self.storage = memory.untyped_storage()
        self.base = memory.storage_offset()  # bytes: the memory is uint8
        if self.base % ALIGN:
            raise ValueError(f"a slot's memory must start {ALIGN}-byte aligned in its storage")
        self.handle: tuple[int, int, int, int] | None = None  # segment_handle, once asked
        self.used = 0
        self.wanted = 0  # bytes the latest batch asked for, overflow included
        self.overflow: set[int] = set()  # storages made outside it, already in ``wanted``

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The next piece of the slot as a tensor, or None when it does not fit."""
        nbytes = math.prod(shape) * dtype.itemsize
        start, self.wanted = self.used, self.wanted + align(nbytes)
        if start + nbytes > self.memory.numel():
            return None
        self.used = start + align(nbytes)
        # starts are ALIGN-aligned, so a whole number of elements of any dtype
        offset, numel = (self.base + start) // dtype.itemsize, nbytes // dtype.itemsize
        flat = torch.empty(0, dtype=dtype).set_(self.storage, offset, (numel,), (1,))
        return flat.view(shape)

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The gathers' allocator (runtime.gather.fields.Allocate): the next piece of the slot,
        or fresh shared memory once the slot is full."""
        t = self.take(shape, dtype)
        if t is None:
            t = shared_empty(shape, dtype)
            self.overflow.add(t.untyped_storage().data_ptr())
        return t

    def adopt(self, batch: Batch) -> None:
        """Moves the batch's tensors made outside the slot (lengths) into it where they fit,
        so that the batch travels as one segment; those that overflowed it stay where
        they are (``wanted`` counts them once)."""
        skip = {self.memory.untyped_storage().data_ptr(), *self.overflow}
        for name, value in batch.items():
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in skip:
                moved = self.take(tuple(value.shape), value.dtype)
                if moved is not None:
                    batch[name] = moved.copy_(value)


def new_slot(nbytes: int) -> Slot | None:
    """A slot of ``nbytes``, or None where shared memory cannot hold it (a full /dev/shm)."""
    memory = shared_buffer(max(nbytes, ALIGN))
    return None if memory is None else Slot(memory)


class WorkerRing:
    """One worker's slots and its row of the release table (see the module docstring)."""

    def __init__(self, table: ReleaseTable, worker: int, nbytes: int, count: int) -> None:
        self.table, self.worker = table, worker
        self.row = table.tensor.numpy()[worker]  # this worker's cells, shared with the main process
        self.slots: list[Slot] = []
        while len(self.slots) < count and (slot := new_slot(nbytes)) is not None:
            self.slots.append(slot)  # fewer where shared memory runs out: fresh batches then
        self.handed = [0] * len(self.slots)  # each slot's latest hand-out number (0: never)
        self.number = time.monotonic_ns()  # hand-out numbers: see the module docstring
        # A worker process runs these finalizers on its way out (os._exit skips atexit).
        multiprocessing.util.Finalize(self, self.close, exitpriority=0)

    def close(self) -> None:
        """Lets go of the slots (a worker calls it as it exits: under the ``file_system``
        strategy a segment's file is removed only once no process holds it)."""
        self.slots, self.handed = [], []

    def free_slot(self) -> int | None:
        for s, handed in enumerate(self.handed):
            if handed == 0 or int(self.row[s]) == handed:
                return s
        return None

    def gather(self, archive: Gathers, indices: torch.Tensor, engine: CopyEngine) -> Batch:
        """Batch ``indices`` in a free slot, or in fresh shared memory while none is free."""
        s = self.free_slot()
        if s is None:
            self.row[self.table.slots + _FRESH] += 1
            return archive.gather(indices, shared_empty, engine)
        slot = self.slots[s]
        if slot.wanted > slot.memory.numel():  # the last batch overflowed it: grow
            grown = new_slot(max(slot.wanted, slot.memory.numel() * 5 // 4))
            slot = self.slots[s] = grown or slot
        slot.used = slot.wanted = 0
        slot.overflow.clear()
        batch = archive.gather(indices, slot.allocate, engine)
        slot.adopt(batch)
        self.number += 1
        self.handed[s] = self.number
        self.row[self.table.slots + _REUSED] += 1
        ticket = Ticket(self.table.token, self.worker, s, self.number)
        if self.table.by_proc and slot.handle is None:  # stays None where it is not
            slot.handle = segment_handle(slot.memory)
        return SlotBatch(batch, slot.memory[:1], ticket, slot.handle)

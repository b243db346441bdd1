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
the one named. Fresh batches and tensors outside the slot go torch's way.
"""

from __future__ import annotations

import multiprocessing.util
import os
import time
import weakref
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

# Release tables of this process by token: ``claim`` finds a batch's table here.
_tables: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


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


def claim_by_proc(
    handle: tuple[int, int, int, int], values: list[tuple[str, bool, Any]], ticket: Ticket
) -> Batch:
    """A slot batch sent by descriptor number (SlotBatch.__reduce__): the worker's segment
    ``handle`` = (pid, fd, bytes, inode) opened through /proc and mapped, its pieces as
    tensors over it, then ``claim``."""
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
        storage = torch.UntypedStorage._new_shared_fd_cpu(opened, nbytes)  # type: ignore[attr-defined]  # unannotated in torch
    finally:
        os.close(opened)
    items: dict[str, Any] = {}
    for name, piece, value in values:
        if piece:
            offset, shape, stride, dtype = value
            items[name] = torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
        else:
            items[name] = value
    return claim(items, torch.empty(0, dtype=torch.uint8).set_(storage), ticket)


def mark_released(table: np.ndarray, worker: int, slot: int, number: int) -> None:
    table[worker, slot] = number


def claim(items: dict[str, Any], slot_memory: torch.Tensor, ticket: Ticket) -> Batch:
    """A worker's batch as unpickled in the main process: a plain ``Batch``, with a finalizer
    on the slot's storage that marks the slot free once nothing here uses it any more."""
    table = _tables.get(ticket.token)
    if table is not None:  # without its table the slot is never marked free: safe, not reused
        release = weakref.finalize(
            slot_memory.untyped_storage(),
            mark_released,
            table.numpy(),
            ticket.worker,
            ticket.slot,
            ticket.number,
        )
        release.atexit = False
    return Batch(items)


class SlotBatch(Batch):
    """A batch in a worker's slot; pickled, it carries the slot's memory (by descriptor
    number where ``by_proc``, see the module docstring) and its ticket."""

    def __init__(
        self, items: dict[str, Any], slot_memory: torch.Tensor, ticket: Ticket, by_proc: bool
    ) -> None:
        super().__init__(items)
        self.slot_memory, self.ticket, self.by_proc = slot_memory, ticket, by_proc

    def __copy__(self) -> SlotBatch:  # DataLoader's default_convert copies the batch
        copied = SlotBatch(dict(self), self.slot_memory, self.ticket, self.by_proc)
        copied.position = self.position
        return copied

    def __reduce__(self) -> tuple[Any, ...]:
        state = {"position": self.position}
        handle = self._handle() if self.by_proc else None
        if handle is None:
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
        return (claim_by_proc, (handle, values, self.ticket), state)

    def _handle(self) -> tuple[int, int, int, int] | None:
        """(pid, fd, bytes, inode) of the slot's segment, or None where it has no descriptor
        (the ``file_system`` strategy)."""
        strategy = torch.multiprocessing.get_sharing_strategy()  # type: ignore[no-untyped-call]  # unannotated in torch
        if strategy != "file_descriptor":
            return None
        storage = self.slot_memory.untyped_storage()
        try:
            fd, nbytes = storage._share_fd_cpu_()
        except RuntimeError:
            return None
        return os.getpid(), int(fd), int(nbytes), os.fstat(fd).st_ino


def align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def slot_bytes(archive: Archive, batch_size: int) -> int:
    """A slot's starting size: the fields the Loader's ring sizes (runtime.pipeline.ring) and the
    ragged fields' lengths. Other fields (zstd, several varying dimensions) grow it."""
    b = min(batch_size, max(1, len(archive)))
    total = 0
    for name, gather in archive.gathers.items():
        numel = gather.buffer_numel(b)
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
        self.used = 0
        self.wanted = 0  # bytes the latest batch asked for, overflow included
        self.overflow: set[int] = set()  # storages made outside it, already in ``wanted``

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The next piece of the slot as a tensor, or None when it does not fit."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        start, self.wanted = self.used, self.wanted + align(nbytes)
        if start + nbytes > self.memory.numel():
            return None
        self.used = start + align(nbytes)
        return self.memory[start : start + nbytes].view(dtype).view(shape)

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
        return SlotBatch(batch, slot.memory[:1], ticket, self.table.by_proc)

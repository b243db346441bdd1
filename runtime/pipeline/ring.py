"""The ring stage: batch buffers that take turns between the producer and the training loop.

Buffer contract (docs/runtime.md): on the CPU a batch's tensors are views of
a slot and stay valid until the next batch is requested; on a CUDA device a
slot is refilled only after the event of its copy to the device completed.

Reuse rules: on the CPU the most recently released slot is refilled first
(LIFO), the one most likely still in cache; a CUDA slot has just been handed
to an asynchronous copy, so there the oldest goes first (FIFO).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import LoaderError


@dataclass
class Slot:
    buffers: dict[str, torch.Tensor]  # flat buffers by field name
    event: Any = None  # torch.cuda.Event of the last copy out of this slot

    def wait_copied(self) -> None:
        """Returns once the slot's previous copy to the device is done."""
        if self.event is not None:
            self.event.synchronize()


def slot_count(prefetch: int, cuda: bool) -> int:
    """prefetch batches waiting plus the one in use; synchronous CPU loading needs only one.

    On the CPU a batch is valid until the next is requested (the buffer
    contract), so without prefetching one slot serves, and it stays warm in
    cache: rotating several batch-sized buffers costs about a quarter of the
    gather's speed on the build machine. A CUDA copy needs a second slot to
    gather into while the first is still being copied.
    """
    if prefetch == 0:
        return 2 if cuda else 1
    return prefetch + 1


def allocate(
    sizes: dict[str, tuple[int, torch.dtype]], count: int, pin: bool, where: str
) -> list[Slot]:
    """``count`` slots of flat buffers (elements, dtype) by field name, touched once here
    so that page faults are not paid in the first batches."""
    slots = []
    try:
        for _ in range(count):
            buffers = {}
            for name, (numel, dtype) in sizes.items():
                t = torch.empty(numel, dtype=dtype, pin_memory=pin)
                t.zero_()
                buffers[name] = t
            slots.append(Slot(buffers))
    except RuntimeError as e:  # the allocator's "can't allocate"
        total = count * sum(n * d.itemsize for n, d in sizes.values())
        raise LoaderError(
            f"{where}: cannot allocate {count} batch buffers ({total} bytes in all): {e}; "
            "lower batch_size or prefetch"
        ) from None
    return slots


class FreeSlots:
    """The slots not in use, handed out LIFO on the CPU and FIFO on CUDA; ``cond``
    guards them (and whatever the producer waits on beside them)."""

    def __init__(self, slots: list[Slot], lifo: bool) -> None:
        self.slots: collections.deque[Slot] = collections.deque(slots)
        self.lifo = lifo
        self.cond = threading.Condition()

    def pop(self) -> Slot | None:
        """A free slot or None; call with ``cond`` held."""
        if not self.slots:
            return None
        return self.slots.pop() if self.lifo else self.slots.popleft()

    def put(self, slot: Slot) -> None:
        """Returns a slot; call with ``cond`` held."""
        self.slots.append(slot)
        self.cond.notify()

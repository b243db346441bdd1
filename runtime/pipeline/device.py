"""The device stage: batches to a CUDA device on a side stream, each copy recorded by an event."""

from __future__ import annotations

from typing import Any

import torch

from ..batch import Batch


class DeviceStage:
    """Non-blocking copies of pinned CPU batches to ``device`` on a stream of their own.

    ``copy`` queues a batch's copies and returns the device batch with an event
    recorded behind them; ``use`` makes the training loop's current stream
    wait for that event and tells the caching allocator that the tensors are
    used there. On the CPU both pass the batch through.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._stream: Any = None

    def stream(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]  # torch.cuda ships no annotations
        return self._stream

    @staticmethod
    def staged(batch: Batch) -> Batch:
        """The batch with every tensor in pinned memory, where an asynchronous copy
        can read it. Fields gathered into the ring are pinned already; the rest
        (``<field>_lengths``, fields ragged in several axes, which are gathered
        into tensors of their own) are copied into pinned memory from torch's
        caching host allocator, which keeps each block until its copy is done."""
        return Batch(
            {
                k: v.pin_memory() if isinstance(v, torch.Tensor) and not v.is_pinned() else v
                for k, v in batch.items()
            }
        )

    def copy(self, batch: Batch) -> tuple[Batch, Any]:
        """The batch on the device and the event after its copies (None on the CPU)."""
        if not self.cuda:
            return batch, None
        stream = self.stream()
        staged = self.staged(batch)
        with torch.cuda.stream(stream):
            moved = Batch(
                {
                    k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                    for k, v in staged.items()
                }
            )
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
            event.record(stream)
        return moved, event

    def use(self, batch: Batch, event: Any) -> None:
        """Makes the current stream wait for the copy, and records the tensors' use there."""
        if not self.cuda:
            return
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for v in batch.values():
            if isinstance(v, torch.Tensor):
                v.record_stream(current)

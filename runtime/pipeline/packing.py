"""Packing: batches with ragged or text fields made several to a ring slot, one after another.

A ring slot holds the largest batch the order can make
(runtime.order.choose.Choice.buffer_numel), which is room for several usual ones.
Consecutive batches are planned each into the slot after the one before (64-byte
aligned), as many as the slot's buffers hold, up to ``GROUP_BATCHES``, the text they
hand out within ``GROUP_BYTES`` past the first batch; their copies run as one plan and
the group is handed over at once (runtime.pipeline.prefetch), so a group pays one copy
call and one hand-over between threads. Only reads whose every field fills slot
buffers or hands out text are packed: a field gathered into fresh tensors (ragged in
several axes) or decoded from zstd blocks would make the memory held outside the ring
grow with the group.

Errors keep their batch: a batch that fails to plan ends its group before it (the
batches before it are handed out) and is planned again as the first of the next group,
where its error names it; a group whose copies fail is copied again one batch at a
time (copies may be repeated) to find the batch that fails, the batches before it
handed out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..batch import Batch
from ..gather.engine import CopyEngine
from ..gather.fields import FieldGather
from ..gather.plan import CopyPlan
from .ring import Slot

# Small batches are made in groups of up to GROUP_BATCHES batches and GROUP_BYTES bytes
# (of fixed-size fields: runtime.loader.Loader.group_size; of text, packed): a batch's
# fixed costs (planning, a copy call per field, the hand-over between threads) are paid
# once a group.
GROUP_BYTES = 1 << 20
GROUP_BATCHES = 64
LINE = 64  # bytes: where a packed batch begins in a slot's buffer


def aligned(numel: int, element_size: int) -> int:
    """``numel`` elements of ``element_size`` bytes rounded up to whole 64-byte lines."""
    per_line = max(1, LINE // element_size)
    return -(-numel // per_line) * per_line


def packed_room(numel: int, element_size: int) -> int:
    """Elements of a slot buffer for a field of ``numel`` elements in the largest batch,
    where batches are packed: that batch, or up to GROUP_BATCHES of it within GROUP_BYTES."""
    one = aligned(numel, element_size)
    return max(one, min(one * GROUP_BATCHES, GROUP_BYTES // element_size))


@dataclass
class Packer:
    """One epoch's packing over a Loader's slots: ``rooms`` (elements of each slot buffer)
    and their element ``sizes``, the ``gathers`` that fill them, each text field's bytes
    per sample (``text``, by sample number) and ``plan`` (a batch's plan into buffers)."""

    rooms: dict[str, int]
    sizes: dict[str, int]
    gathers: dict[str, FieldGather]
    text: list[np.ndarray]
    plan: Callable[[np.ndarray, dict[str, torch.Tensor]], tuple[Batch, CopyPlan]]
    resume: int | None = None  # where the next group begins after a group cut short

    def groups(self, start: int, end: int, batches: list[np.ndarray]) -> Iterator[range]:
        """Batches ``start`` to ``end`` in groups, each as many as fit a slot; a group
        ``plan_group`` cut short is followed by one from where it ended."""
        j = start
        while j < end:
            k = self._fit(j, end, batches)
            self.resume = None
            yield range(j, k)
            j = k if self.resume is None else self.resume

    def _fit(self, j: int, end: int, batches: list[np.ndarray]) -> int:
        """Where a group starting at ``j`` ends: at least one batch."""
        used = dict.fromkeys(self.rooms, 0)
        text = 0
        k = j
        while k < end and k - j < GROUP_BATCHES:
            batch = batches[k]
            need = {n: g.buffer_numel(len(batch), batch) or 0 for n, g in self.gathers.items()}
            words = sum(int(t[batch].sum()) for t in self.text)
            if k > j and (
                text + words > GROUP_BYTES or any(used[n] + need[n] > self.rooms[n] for n in need)
            ):
                break
            for n, numel in need.items():
                used[n] += aligned(numel, self.sizes[n])
            text += words if k > j else 0
            k += 1
        return k

    def plan_group(
        self, numbers: range, slot: Slot, batches: list[np.ndarray]
    ) -> tuple[list[Batch], CopyPlan]:
        """Batches ``numbers`` planned each after the one before in ``slot``; cut short
        before a batch that fails to plan (unless it is the first: its error is raised),
        which begins the next group."""
        made: list[Batch] = []
        parts = []
        at = dict.fromkeys(slot.buffers, 0)
        for j in numbers:
            rest = {n: buf[at[n] :] for n, buf in slot.buffers.items()}
            try:
                batch, plan = self.plan(batches[j], rest)
            except Exception:
                if not made:
                    raise
                self.resume = j
                break
            for n in at:
                at[n] += aligned(batch[n].numel(), self.sizes[n])
            made.append(batch)
            parts.append(plan.steps)
        return made, CopyPlan([s for part in parts for s in part], parts)


def copied_apart(
    engine: CopyEngine, plan: CopyPlan, error: Exception, made: list[Batch]
) -> tuple[list[Batch], Exception]:
    """After the copies of ``plan`` (of the batches ``made``) failed with ``error``: its
    batches (``parts``) copied again one at a time; the batches copied before one failed,
    and that one's error. Raises the error where none was copied: the first batch's, or
    ``error`` where every one copies this time (none is trusted then)."""
    for i, part in enumerate(plan.parts):
        try:
            engine.run(CopyPlan(part))
        except Exception as e:
            if not i:
                raise e from None
            return made[:i], e
    raise error

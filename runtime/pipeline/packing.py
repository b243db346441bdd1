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
from ..gather.fields import FieldGather, aligned
from ..gather.plan import CopyPlan, Step
from .ring import Slot

# Small batches are made in groups of up to GROUP_BATCHES batches and GROUP_BYTES bytes
# (of fixed-size fields: runtime.loader.Loader.group_size; of text, packed): a batch's
# fixed costs (planning, a copy call per field, the hand-over between threads) are paid
# once a group.
GROUP_BYTES = 1 << 20
GROUP_BATCHES = 64
# A slot buffer of packed batches holds up to PACK_BYTES (or one largest batch, if more):
# room for several usual batches, so a group's fixed costs (its plan's arrays, the copy
# call, the hand-over) are paid once for many (docs/runtime.md, Performance notes, gives
# what 8 MiB gains over 1 MiB).
PACK_BYTES = 8 << 20


def packed_room(numel: int, element_size: int) -> int:
    """Elements of a slot buffer for a field of ``numel`` elements in the largest batch,
    where batches are packed: that batch, or up to GROUP_BATCHES of it within PACK_BYTES."""
    one = aligned(numel, element_size)
    return max(one, min(one * GROUP_BATCHES, PACK_BYTES // element_size))


@dataclass
class Packer:
    """One epoch's packing over a Loader's slots: ``rooms`` (elements of each slot buffer)
    and their element ``sizes``, the ``gathers`` that fill them, each text field's bytes
    per sample (``text``, by sample number), ``plan`` (a batch's plan into buffers) and
    ``packed`` (several batches' plan into buffers as one, or None where the read plans
    them one by one)."""

    rooms: dict[str, int]
    sizes: dict[str, int]
    gathers: dict[str, FieldGather]
    text: list[np.ndarray]
    plan: Callable[[np.ndarray, dict[str, torch.Tensor]], tuple[Batch, CopyPlan]]
    packed: Callable[
        [list[np.ndarray], dict[str, torch.Tensor]], tuple[list[Batch], CopyPlan] | None
    ]
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
        """Batches ``numbers`` planned each after the one before in ``slot``: as one plan
        where the read can (``packed``), else one by one, cut short before a batch that
        fails to plan (unless it is the first: its error is raised), which begins the
        next group."""
        chosen = [batches[j] for j in numbers]
        if len(chosen) > 1:
            try:
                got = self.packed(chosen, slot.buffers)
            except Exception:  # planned one by one below, where the error names its batch
                got = None  # (tests check that packed groups are planned as one)
            if got is not None:
                together, plan = got
                plan.apart = lambda: (p.steps for _, p in self._each(chosen, slot))
                return together, plan
        made: list[Batch] = []
        parts: list[list[Step]] = []
        each = self._each(chosen, slot)
        for j in numbers:
            try:
                batch, plan = next(each)
            except Exception:
                if not made:
                    raise
                self.resume = j
                break
            made.append(batch)
            parts.append(plan.steps)
        return made, CopyPlan([s for part in parts for s in part], lambda: iter(parts))

    def _each(self, chosen: list[np.ndarray], slot: Slot) -> Iterator[tuple[Batch, CopyPlan]]:
        """Each of the batches ``chosen`` planned on its own into ``slot`` after the one
        before, each beginning on a whole 64-byte line: the places a plan of them all as
        one gives them too, so a batch planned here again has the same steps."""
        at = dict.fromkeys(slot.buffers, 0)
        for indices in chosen:
            batch, plan = self.plan(indices, {n: buf[at[n] :] for n, buf in slot.buffers.items()})
            yield batch, plan
            for n in at:
                at[n] += aligned(batch[n].numel(), self.sizes[n])


def copied_apart(
    engine: CopyEngine, plan: CopyPlan, error: Exception, made: list[Batch]
) -> tuple[list[Batch], Exception]:
    """After the copies of ``plan`` (of the batches ``made``) failed with ``error``: where
    the plan says how (``apart``), its batches copied again one at a time, each planned
    again as it is reached; the batches copied before one failed, and that one's error
    (in planning it again or in copying it). Raises ``error`` for a plan of one batch or
    one that does not say, or where every batch copies this time (none is trusted then);
    the first batch's own error where that one fails."""
    if plan.apart is None or len(made) < 2:
        raise error
    parts = plan.apart()
    for i in range(len(made)):
        try:
            engine.run(CopyPlan(next(parts)))
        except Exception as e:
            if not i:
                raise e from None
            return made[:i], e
    raise error

"""How an Archive plans a batch over its supply's shards.

Each field's gather (runtime.gather.fields) addresses a list of shards by their
first sample numbers. When the supply maps every shard for good (local
archives), one gather per field over all of them is made when the archive
opens: ``Mapped``. When shards are mapped per batch (the node-local cache), a
batch is planned over the shards it touches only, held for the while
(``ask``/``release``), so shards the batch does not read need not be cached:
``Fetched``, which keeps the gathers made for a set of shards for the next
batch over the same set while those shards stay mapped (a window's batches
touch the same few shards). Where every field is raw (the node cache serves zstd
shards decoded) and the supply stamps its mappings, ``Fetched`` instead keeps what
each field needs of every shard mapped here, by shard number (``Slots``: fixed
rows in one table, ragged fields' per-sample tables by sample number, text's
copied values), refreshed only for shards mapped anew: a batch is planned by
array arithmetic whatever the number of shards it touches.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from dlop.formats import Field, ShardReader

from ..batch import Batch
from ..gather.engine import compiled
from ..gather.fields import Allocate, FieldGather, Groups, Locator, batch_groups
from ..gather.mapped import FixedRawGather, rows_of
from ..gather.plan import CopyPlan, RowTable
from ..gather.samples import BlockTextGather, ShardText, SlottedText, TextGather
from ..gather.spans import SlottedSpans, SpanGather
from ..storage.supply import ShardSupply, distinct

Out = dict[str, torch.Tensor] | Allocate | None

# Sets of shards whose gathers are kept (Planners).
PLANNERS_KEPT = 64


def gather_kind(field: Field) -> type[FieldGather]:
    """The gather for a field's kind and storage (runtime.gather.fields lists them)."""
    if field.kind in ("str", "bytes"):
        return TextGather if field.codec.mappable else BlockTextGather
    if not field.ragged and field.codec.mappable:
        return FixedRawGather
    return SpanGather


def gather_for(
    field: Field,
    shards: list[ShardReader],
    starts: torch.Tensor,
    pad_value: float,
    transient: bool = False,
) -> FieldGather:
    """The gather of ``gather_kind`` for ``field`` over ``shards`` (``transient``: for
    one batch's shards; FieldGather)."""
    return gather_kind(field)(field, shards, starts, pad_value, transient=transient)


def shards_of(shard_starts: np.ndarray, indices: torch.Tensor) -> np.ndarray:
    """The shard numbers that global ``indices`` fall in (``shard_starts``: the first
    sample of each shard, then the total)."""
    if len(shard_starts) <= 2 or not len(indices):
        return np.zeros(min(1, len(indices)), np.int64)
    # numpy, not torch: torch.searchsorted goes parallel over a batch of indices, and
    # waking its threads from the Loader's producer costs milliseconds a batch.
    found = np.searchsorted(shard_starts, indices.numpy(), side="right") - 1
    return found.astype(np.int64, copy=False)


class Planner:
    """Plans batches of an archive over ``supply``: ``gathers`` (one per field, what
    the Loader sizes its buffers by) and ``plan``."""

    def __init__(
        self,
        supply: ShardSupply,
        fields: Mapping[str, Field],
        shard_starts: np.ndarray,
        pad_value: float,
    ) -> None:
        self.supply = supply
        self.fields = dict(fields)
        self.shard_starts = shard_starts  # the first sample of each shard, then the total
        self.starts = torch.from_numpy(shard_starts[:-1].copy())
        self.pad_value = pad_value
        # every field planned by arrays: a batch's indices in any order
        # (FieldGather.by_arrays)
        self.by_arrays = all(gather_kind(f).by_arrays for f in self.fields.values())
        # every field fixed-size: a batch's tensors do not depend on which batch it is
        self.fixed_only = all(gather_kind(f) is FixedRawGather for f in self.fields.values())
        # every field raw (fixed-size, ragged or text): planned by Slots where the supply
        # stamps its mappings (Fetched)
        self.slotted = all(slottable(f) for f in self.fields.values())
        self.gathers: dict[str, FieldGather] = self.made_gathers()

    def made_gathers(self) -> dict[str, FieldGather]:
        raise NotImplementedError

    @property
    def keeps_shards(self) -> bool:
        """Whether every shard is mapped for good or held for the epoch (``hold_whole``):
        several batches may then be made as one, none holding shards of its own."""
        return False

    @property
    def groups_batches(self) -> bool:
        """Whether several batches may be planned as one now, then cut apart: every
        field fixed-size (``fixed_only``) and every shard kept (``keeps_shards``)."""
        return self.fixed_only and self.keeps_shards

    def hold_whole(self) -> bool:
        """For an epoch's reading: holds every shard if the supply can (a warm node
        cache that holds the archive), and plans batches as over mapped shards until
        ``let_go_whole``. False where batches hold their own shards."""
        return False

    def let_go_whole(self) -> None:
        """Ends what ``hold_whole`` began (once for each True it gave)."""

    def checks_batches(self) -> bool:
        """Whether each batch's shards are checked before it is planned (the supply's
        ``check``): where copies run without the compiled copier, which turns a read
        past a truncated shard's end into an error. Otherwise ``check_all`` at each
        epoch's start is the check, and a copy's fault names the shard (no gather reads
        a mapped byte in Python; see the comment on FieldGather.by_arrays)."""
        return compiled() is None

    def check_all(self) -> None:
        """Checks every shard the supply holds mapped (at an epoch's start)."""
        self.supply.check(np.arange(len(self.shard_starts) - 1))

    def plan(self, indices: torch.Tensor, out: Out) -> tuple[Batch, CopyPlan]:
        """The batch for ascending global ``indices`` and the copies that fill it."""
        raise NotImplementedError

    def plan_mapped(
        self, gathers: Mapping[str, FieldGather], locator: Locator, indices: torch.Tensor, out: Out
    ) -> tuple[Batch, CopyPlan]:
        """``plan`` over every shard, each mapped while the batch is read: its shards
        checked first where ``checks_batches``."""
        groups = locator.groups(indices)
        if self.checks_batches():
            self.supply.check(groups.shards)  # each supply checks a shard once
        return plan_fields(gathers, indices, groups, out)

    def plan_packed(
        self, indices: torch.Tensor, cuts: list[int], out: dict[str, torch.Tensor]
    ) -> tuple[list[Batch], CopyPlan] | None:
        """The batches ``indices[cuts[i]:cuts[i + 1]]`` planned one after another into the
        flat buffers ``out`` (FieldGather.plan_packed), as one plan: where every shard is
        kept (``keeps_shards``); None where this planner plans batch by batch."""
        return None

    def plan_mapped_packed(
        self,
        gathers: Mapping[str, FieldGather],
        locator: Locator,
        indices: torch.Tensor,
        cuts: list[int],
        out: dict[str, torch.Tensor],
    ) -> tuple[list[Batch], CopyPlan]:
        """``plan_packed`` over every shard mapped, as ``plan_mapped`` plans one batch."""
        groups = locator.groups(indices)
        if self.checks_batches():
            self.supply.check(groups.shards)
        batches = [Batch() for _ in range(len(cuts) - 1)]
        steps = []
        for name, g in gathers.items():
            entries, field_steps = g.plan_packed(indices, groups, cuts, out.get(name))
            for batch, got in zip(batches, entries, strict=True):
                batch.update(got)
            steps += field_steps
        return batches, CopyPlan(steps)


class Mapped(Planner):
    """Plans over every shard of a supply that maps them all for good."""

    @property
    def keeps_shards(self) -> bool:
        return True

    def made_gathers(self) -> dict[str, FieldGather]:
        shards = self.supply.shards
        assert shards is not None
        self.locator = Locator(self.starts, int(self.shard_starts[-1]))
        return {
            n: gather_for(f, shards, self.starts, self.pad_value) for n, f in self.fields.items()
        }

    def plan(self, indices: torch.Tensor, out: Out) -> tuple[Batch, CopyPlan]:
        return self.plan_mapped(self.gathers, self.locator, indices, out)

    def plan_packed(
        self, indices: torch.Tensor, cuts: list[int], out: dict[str, torch.Tensor]
    ) -> tuple[list[Batch], CopyPlan] | None:
        return self.plan_mapped_packed(self.gathers, self.locator, indices, cuts, out)


class Sizing(FieldGather):
    """The Loader's buffer sizes for a field of a supply that maps shards per batch:
    fixed fields get a reusable buffer, others fresh tensors (their longest sample is
    not known before every shard was read)."""

    def buffer_numel(self, batch_size: int, among: np.ndarray | None = None) -> int | None:
        if self.field.ragged or self.field.kind in ("str", "bytes"):
            return None
        return batch_size * int(np.prod(self.trail, dtype=np.int64))


class Planners:
    """The gathers for batches over a set of shards, kept while those shards stay
    mapped: made anew per batch they cost more than the copies of a small batch; and
    the ``Slots``, where they serve (made by the first batch in each process).
    ``forget(k)`` (shard k let go of) drops the gathers that read it and its slots'
    rows, and with them their views of its mapping. (The supply holds this, not the
    planner: nothing refers back to the supply, so no cycle outlives a close.) A forked
    child starts from none of the parent's, with a lock of its own (``mine``)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.kept: dict[tuple[int, ...], tuple[list[ShardReader], dict[str, FieldGather]]] = {}
        self.slots: Slots | None = None

    def mine(self) -> None:
        """A forked child's first look: the parent's gathers and slots are not this
        process's, nor is its lock, which a parent thread may have held at the fork."""
        if self.pid != os.getpid():  # the pid last: another thread of the child waits
            self.lock, self.kept, self.slots = threading.Lock(), {}, None
            self.pid = os.getpid()

    def get(
        self, key: tuple[int, ...], readers: list[ShardReader]
    ) -> dict[str, FieldGather] | None:
        self.mine()
        with self.lock:
            got = self.kept.get(key)
        if got is None or any(a is not b for a, b in zip(got[0], readers, strict=True)):
            return None  # a shard was mapped again since: new views
        return got[1]

    def put(
        self, key: tuple[int, ...], readers: list[ShardReader], gathers: dict[str, FieldGather]
    ) -> None:
        self.mine()
        with self.lock:
            self.kept[key] = (readers, gathers)
            while len(self.kept) > PLANNERS_KEPT:
                del self.kept[next(iter(self.kept))]

    def forget(self, k: int) -> None:
        self.mine()
        with self.lock:
            for key in [key for key in self.kept if k in key]:
                del self.kept[key]
        if self.slots is not None:  # (a forked child's: none, mine() dropped the parent's)
            self.slots.clear(k)


def slottable(field: Field) -> bool:
    """Whether ``Slots`` plan ``field``: any raw field (fixed-size, ragged or text)."""
    return gather_kind(field) is FixedRawGather or field.codec.mappable


class Gone(Exception):
    """Shard ``k``'s entries were let go of while a batch was planned over it."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.k = k


class Slots:
    """What each field read needs of every shard mapped here, by shard number: a fixed
    field's rows in one table (``RowTable.slots``), a ragged field's per-sample tables
    and values (``SlottedSpans``), a text field's copied values (``SlottedText``); the
    mapping stamp each shard's entries came from (ShardSupply.mapped_stamps; -2: none,
    or entries put for one batch while the shard arrives); and the reader they came
    from. A batch takes the entries of the shards it touches (``take``): its plan
    keeps them, and the views keep the mappings, whatever is let go of before its
    copies run."""

    def __init__(
        self, fields: Mapping[str, Field], starts: torch.Tensor, total: int, pad_value: float
    ) -> None:
        count = len(starts)
        self.gathers: dict[str, FixedRawGather | SlottedSpans | SlottedText] = {}
        self.tables: dict[str, RowTable] = {}
        self.spans: dict[str, SlottedSpans] = {}
        self.texts: dict[str, SlottedText] = {}
        for n, f in fields.items():
            kind = gather_kind(f)
            if kind is FixedRawGather:
                g = self.gathers[n] = FixedRawGather(f, [], starts, pad_value)
                if g.row_bytes:
                    self.tables[n] = RowTable.slots(count, g.row_bytes)
            elif kind is TextGather:
                self.gathers[n] = self.texts[n] = SlottedText(f, starts, total, pad_value)
            else:
                self.gathers[n] = self.spans[n] = SlottedSpans(f, starts, total, pad_value)
        self.stamps = np.full(count, -2, np.int64)
        self.readers: dict[int, ShardReader] = {}
        # put, clear and take exclude one another: an entry and the view it points into
        # change together. clear runs on whichever thread lets go of a shard, holding
        # the supply's lock: the copies a put needs are made before this lock is taken.
        self.lock = threading.Lock()

    def put(self, k: int, reader: ShardReader, stamp: int) -> dict[str, tuple[ShardText, Path]]:
        """Shard ``k``'s entries from ``reader`` (its mapping ``stamp``; -2: still
        arriving, put for one batch). Returns the text entries it copied: a batch over a
        shard still arriving plans with its own (``plan``'s ``own``), which are never
        put here, where a batch over the shard once whole would read them (a copy made
        before the rest of the shard arrived)."""
        rows = {n: rows_of(reader, n, t.row_bytes) for n, t in self.tables.items()}
        spans = {n: g.prepared(k, reader) for n, g in self.spans.items()}
        texts = {n: g.prepared(reader, whole=stamp >= 0) for n, g in self.texts.items()}
        with self.lock:
            for name, table in self.tables.items():
                table.put(k, rows[name])
            for name, g in self.spans.items():
                g.put(k, spans[name])
            for name, text in self.texts.items():
                text.put(k, texts[name], shared=stamp >= 0)
            self.stamps[k] = stamp
            self.readers[k] = reader
        return texts

    def clear(self, k: int, only: ShardReader | None = None) -> None:
        """Shard ``k``'s entries gone (``only``: if they are still those put from it)."""
        with self.lock:
            if only is not None and self.readers.get(k) is not only:
                return
            self.readers.pop(k, None)
            self.stamps[k] = -2
            for table in self.tables.values():
                table.clear(k)
            for spans in self.spans.values():
                spans.clear(k)
            for text in self.texts.values():
                text.clear(k)

    def plan(
        self,
        indices: torch.Tensor,
        groups: Groups,
        touched: np.ndarray,
        out: Out,
        own: Mapping[int, dict[str, tuple[ShardText, Path]]] | None = None,
    ) -> tuple[Batch, CopyPlan]:
        """The batch of ``indices`` (in ``groups``, by global shard number), every shard
        in ``touched`` (ascending) filled in; ``own``: the text entries the batch put for
        shards still arriving (``put``'s), by shard."""
        local = Groups(np.searchsorted(touched, groups.shards), groups.rows)
        own = own or {}
        with self.lock:
            tables = {n: t.take(touched) for n, t in self.tables.items()}
            spans = {n: g.take(touched) for n, g in self.spans.items()}
            texts = {
                n: g.take(touched, {k: entries[n] for k, entries in own.items()})
                for n, g in self.texts.items()
            }
        # no shard a batch reads is empty: an empty entry was let go of meanwhile
        gone = [int(np.argmin(t.nums)) for t in tables.values() if not t.nums.all()]
        gone += [int(np.argmin(g.bases)) for g in spans.values() if not g.bases.all()]
        missing = [k for g in texts.values() if (k := g.has(touched)) is not None]
        gone += [int(np.searchsorted(touched, missing[0]))] if missing else []
        if gone:
            raise Gone(int(touched[gone[0]]))
        batch, steps = Batch(), []
        for name, g in self.gathers.items():
            where = out.get(name) if isinstance(out, dict) else out
            if isinstance(g, SlottedText):
                entries, field_steps = texts[name].plan_grouped(indices, groups, where)
            elif isinstance(g, SlottedSpans):
                entries, field_steps = spans[name].plan_grouped(indices, local, where)
            else:
                entries, field_steps = g.plan_rows(tables.get(name), indices, local, where)
            batch.update(entries)
            steps += field_steps
        return batch, CopyPlan(steps)


class Fetched(Planner):
    """Plans over the shards a batch touches, held from the supply while planned (the
    Loader holds them besides until the copies are done)."""

    def made_gathers(self) -> dict[str, FieldGather]:
        self.planners = Planners()
        self.supply.on_drop(self.planners.forget)
        self.locator = Locator(self.starts, int(self.shard_starts[-1]))
        self.names = list(self.fields)  # what ready() waits for, the same every batch
        # While every shard is held for an epoch: gathers over all of them and where each
        # sample lies, as for mapped shards (``hold_whole``); and how many readings hold.
        self.whole: tuple[dict[str, FieldGather], Locator] | None = None
        self.whole_pid = os.getpid()  # the process holding: a forked child holds nothing
        self.holders = 0
        self.whole_lock = threading.Lock()
        return {n: Sizing(f, [], self.starts, self.pad_value) for n, f in self.fields.items()}

    @property
    def keeps_shards(self) -> bool:
        return self.held() is not None

    def held(self) -> tuple[dict[str, FieldGather], Locator] | None:
        """The gathers over every shard while this process holds them all, else None."""
        return self.whole if self.whole_pid == os.getpid() else None

    def mine(self) -> None:
        """A forked child's first look: the parent's holds, and its lock (which a parent
        thread may have held at the fork), are not this process's."""
        if self.whole_pid != os.getpid():
            self.whole, self.holders, self.whole_pid = None, 0, os.getpid()
            self.whole_lock = threading.Lock()

    def hold_whole(self) -> bool:
        self.mine()
        if not self.supply.hold_all():
            return False
        everything = list(range(len(self.starts)))
        try:
            with self.whole_lock:
                if self.whole is None:
                    # the gathers read each shard's offsets: checked first
                    self.supply.check(everything)
                    readers = [self.supply.partial_shard(k) for k in everything]
                    gathers = {
                        n: gather_for(f, readers, self.starts, self.pad_value)
                        for n, f in self.fields.items()
                    }
                    self.whole = (gathers, Locator(self.starts, int(self.shard_starts[-1])))
                self.holders += 1
        except BaseException:
            self.supply.release(everything)
            raise
        return True

    def let_go_whole(self) -> None:
        self.mine()
        with self.whole_lock:
            if not self.holders:  # held in the parent before a fork: not this process's
                return
            self.holders -= 1
            if not self.holders:
                self.whole = None
        self.supply.release(list(range(len(self.starts))))

    def plan_packed(
        self, indices: torch.Tensor, cuts: list[int], out: dict[str, torch.Tensor]
    ) -> tuple[list[Batch], CopyPlan] | None:
        whole = self.held()
        return None if whole is None else self.plan_mapped_packed(*whole, indices, cuts, out)

    def plan(self, indices: torch.Tensor, out: Out) -> tuple[Batch, CopyPlan]:
        whole = self.held()
        if whole is not None:  # every shard held and mapped: as Mapped plans
            return self.plan_mapped(*whole, indices, out)
        groups = self.locator.groups(indices)
        touched = distinct(groups.shards)
        self.supply.ask(touched)
        try:
            planned = self.plan_slotted(indices, groups, touched, out)
            if planned is not None:
                return planned
            return self.plan_over(indices, groups.shards, touched, out)
        finally:
            self.supply.release(touched)

    def plan_slotted(
        self, indices: torch.Tensor, groups: Groups, touched: np.ndarray, out: Out
    ) -> tuple[Batch, CopyPlan] | None:
        """``plan`` by the ``Slots`` of every shard mapped here, filled in for the shards
        ``touched`` mapped anew since; a shard still arriving is read once the bytes of
        its samples are in (``ready``), its entries put for this batch only. A shard
        let go of meanwhile (its fetch failed, or the archive closed) raises the
        supply's ``failure``. None where it does not apply (a block-coded field, a
        supply without stamps)."""
        if not self.slotted:
            return None
        stamps = self.supply.mapped_stamps(touched)
        if stamps is None:
            return None
        self.planners.mine()  # a forked child keeps none of these
        slots = self.planners.slots
        if slots is None:
            total = int(self.shard_starts[-1])
            slots = Slots(self.fields, self.starts, total, self.pad_value)
            self.planners.slots = slots
        stale = touched[stamps != slots.stamps[touched]].tolist()
        for k in stale:
            self.supply.partial_shard(k)  # fetched now, or its fetch waited for
        if self.checks_batches():  # before a put reads the mapping
            self.supply.check(touched)
        own: dict[int, dict[str, tuple[ShardText, Path]]] = {}  # arriving: this batch's copies
        for k in stale:
            got = self.supply.mapping(k)
            if got is None:
                raise self.supply.failure(k)
            reader, stamp = got
            arriving = stamp < 0
            if arriving:  # read once the batch's bytes of it are in
                self.supply.ready(k, groups.rows[groups.shards == k], self.names)
            try:
                texts = slots.put(k, reader, -2 if arriving else stamp)
                if arriving:  # its text copied for this batch only
                    own[k] = texts
            except Exception:
                now = self.supply.mapping(k)
                if now is None or now[0] is not reader:  # closed under the put
                    raise self.supply.failure(k) from None
                raise
            now = self.supply.mapping(k)
            if now is None or now[0] is not reader:  # let go of meanwhile: not kept
                slots.clear(k, only=reader)
        try:
            return slots.plan(indices, groups, touched, out, own)
        except Gone as e:  # a fetch that failed, or a close, let go of it meanwhile
            raise self.supply.failure(e.k) from None

    def plan_over(
        self, indices: torch.Tensor, per_index: np.ndarray, touched: np.ndarray, out: Out
    ) -> tuple[Batch, CopyPlan]:
        key = tuple(touched.tolist())
        # A shard still arriving (runtime.storage.streamed) is read once the bytes of the
        # batch's samples in it are verified.
        readers = [self.supply.partial_shard(k) for k in key]
        arriving = False  # a shard still arriving: its gathers are not kept
        if self.checks_batches():
            self.supply.check(touched)
        sizes = [r.num_samples for r in readers]
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        if len(indices):  # global sample numbers to numbers within the touched shards
            where = np.searchsorted(touched, per_index)
            local = indices.numpy() - self.shard_starts[per_index]
            by_shard = np.argsort(where, kind="stable")  # each shard's samples, in one pass
            cuts = np.searchsorted(where[by_shard], np.arange(len(key) + 1)).tolist()
            for j, k in enumerate(key):
                arriving |= self.supply.ready(k, local[by_shard[cuts[j] : cuts[j + 1]]], self.names)
            indices = torch.from_numpy(starts[where] + local)
        compact = torch.from_numpy(starts[:-1].copy())
        gathers = None if arriving else self.planners.get(key, readers)
        if gathers is None:
            gathers = {
                n: gather_for(f, readers, compact, self.pad_value, transient=True)
                for n, f in self.fields.items()
            }
            if not arriving:  # a gather may copy a whole shard's text once: only when whole
                self.planners.put(key, readers, gathers)
        return plan_fields(gathers, indices, batch_groups(indices, compact), out)


def plan_fields(
    gathers: Mapping[str, FieldGather], indices: torch.Tensor, groups: Groups, out: Out
) -> tuple[Batch, CopyPlan]:
    """Every field's entries and copy steps for ascending ``indices``, the batch's
    shard groups (``batch_groups``) worked out once for all fields."""
    batch, steps = Batch(), []
    for name, g in gathers.items():
        where = out.get(name) if isinstance(out, dict) else out
        entries, field_steps = g.plan_grouped(indices, groups, where)
        batch.update(entries)
        steps += field_steps
    return batch, CopyPlan(steps)


def planner(
    supply: ShardSupply, fields: Mapping[str, Field], shard_starts: np.ndarray, pad_value: float
) -> Planner:
    """The planner for how ``supply`` maps its shards."""
    kind = Mapped if supply.shards is not None else Fetched
    return kind(supply, fields, shard_starts, pad_value)


@contextmanager
def held(supply: ShardSupply, shards: Sequence[int]) -> Iterator[None]:
    """``with held(supply, [k]):`` holds shards ``k`` while the block reads them."""
    supply.ask(shards)
    try:
        yield
    finally:
        supply.release(shards)

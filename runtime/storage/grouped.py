"""An archive's shards joined with its field groups' shards, each from a supply of its own:
what reads a field group's fields from object storage (or the node cache).

A field group's shards are aligned with the archive's (SPEC.md §6.3), so a group read
through the node cache is, for the cache, an archive of its own: its shards, listed in an
index the cache derives from the archive's (``group_index``), fetched from beside the
archive's. ``GroupedSupply`` asks, holds and lets go of shard k in every supply at
once, and serves shard k as one reader (``JoinedShard``) whose fields come each from the
file that holds it. Only the groups whose fields are read are joined: reading the
archive's own fields fetches no group file.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from dlop.formats import Field, Index, ShardReader
from dlop.formats.archive import encode_index
from dlop.formats.joined import JoinedShard

from ..errors import UsageError
from .cache import STAMP_BYTES
from .remote_supply import RemoteSupply
from .supply import ShardSupply


def group_index(index: Index, name: str) -> bytes:
    """The index.json of field group ``name`` read as an archive of its own: its fields
    and its shards (each entry as the archive's index lists it)."""
    group = next(g for g in index.field_groups if g.name == name)
    shards = tuple(s.info for s in group.shards)
    recipe = {"field_group": name, "of": index.provenance.get("created", "")}
    return encode_index(Index(group.fields, shards, sum(s.num_samples for s in shards), recipe))


class GroupedSupply(ShardSupply):
    """Shard k of ``base`` joined with shard k of each of ``groups`` (name -> the supply of
    that field group's shards), all of one node cache; ``reopen`` is what reopens it in
    another process."""

    def __init__(
        self,
        base: RemoteSupply,
        groups: Mapping[str, RemoteSupply],
        reopen: tuple[Callable[..., Any], tuple[Any, ...]],
    ) -> None:
        self.base = base
        self.groups = dict(groups)
        self.reopen = reopen
        self.name, self.paths, self.readers = base.name, base.paths, base.readers
        self.owners = {f: g for g, s in self.groups.items() for f in s.fields}
        self.group_fields: dict[str, Field] = {
            f: field for s in self.groups.values() for f, field in s.fields.items()
        }
        self.fields = {**base.fields, **self.group_fields}
        self.shard_sizes = base.shard_sizes
        self.shards = None  # mapped per batch, as the supplies it joins
        self.pid = -1
        self.mine()
        base.cache.squeeze = self.squeeze  # one cache: room is made in any of them
        for s in self.every():  # idle shards kept: half the budget among them all
            s.loose_bytes = base.cache.max_bytes // (2 * len(self.every()))

    def mine(self) -> None:
        """This process's state (a forked child's first look: nothing of the parent's)."""
        if self.pid != os.getpid():
            self.pid = os.getpid()
            self.lock = threading.Lock()
            # shard k's joined reader while the readers it joins stay the same (a batch's
            # gathers are kept by the identity of the readers they read)
            self.joined: dict[int, tuple[tuple[ShardReader, ...], JoinedShard]] = {}

    def squeeze(self) -> bool:
        """Lets go of an idle shard of any of the supplies (room is wanted)."""
        return any(s.squeeze() for s in self.every())

    def __reduce__(self) -> tuple[Any, ...]:
        return self.reopen

    def pins(self) -> dict[str, bytes]:
        return self.base.pins()

    def every(self) -> list[RemoteSupply]:
        return [self.base, *self.groups.values()]

    def join(self, k: int, partial: bool) -> ShardReader:
        self.mine()
        parts = tuple(s.partial_shard(k) if partial else s.shard(k) for s in self.every())
        with self.lock:
            got = self.joined.get(k)
            if got is not None and all(a is b for a, b in zip(got[0], parts, strict=True)):
                return got[1]
            by_group = dict(zip(self.groups, parts[1:], strict=True))
            reader = JoinedShard(parts[0], self.group_fields, self.owners, by_group.__getitem__)
            self.joined[k] = (parts, reader)
            return reader

    def shard(self, k: int) -> ShardReader:
        return self.join(k, partial=False)

    def partial_shard(self, k: int) -> ShardReader:
        return self.join(k, partial=True)

    def check(self, shards: Sequence[int] | np.ndarray) -> None:
        for s in self.every():
            s.check(shards)

    def ask(self, shards: Sequence[int] | np.ndarray) -> None:
        done: list[RemoteSupply] = []
        try:
            for s in self.every():
                s.ask(shards)
                done.append(s)
        except BaseException:
            for s in done:
                s.release(shards)
            raise

    def release(self, shards: Sequence[int] | np.ndarray) -> None:
        each(self.every(), lambda s: s.release(shards))

    def hold_all(self) -> bool:
        held: list[RemoteSupply] = []
        try:
            for s in self.every():
                if not s.hold_all():
                    break
                held.append(s)
        finally:
            if len(held) < len(self.every()):
                everything = list(range(len(self.shard_sizes)))
                each(held, lambda h: h.release(everything))
        return len(held) == len(self.every())

    def ahead(self, shards: Sequence[int] | np.ndarray) -> None:
        for s in self.every():
            s.ahead(shards)

    def read_order(self, batches: Sequence[np.ndarray]) -> None:
        for s in self.every():
            s.read_order(batches)

    def forget_failures(self) -> None:
        for s in self.every():
            s.forget_failures()

    def ready(self, k: int, samples: np.ndarray, names: Sequence[str] | None = None) -> bool:
        arriving = False
        for group, s in [("", self.base), *self.groups.items()]:
            mine = [n for n in (names or self.fields) if self.owners.get(n, "") == group]
            if mine:
                arriving |= s.ready(k, samples, mine)
        return arriving

    def mapped_stamps(self, shards: np.ndarray) -> np.ndarray | None:
        """Shard k's stamp as joined: the sum of its parts' stamps, -1 while any part is not
        mapped whole. Each part's stamps only grow (a new mapping, a new number), so
        the sum changes whenever a part is mapped anew."""
        parts = [s.mapped_stamps(shards) for s in self.every()]
        if any(p is None for p in parts):
            return None
        stacked = np.stack([p for p in parts if p is not None])
        joined: np.ndarray = stacked.sum(axis=0)
        joined[(stacked < 0).any(axis=0)] = -1
        return joined

    def failure(self, k: int) -> BaseException:
        failed = [s for s in self.every() if k in s.ahead_errors]
        return (failed[0] if failed else self.base).failure(k)

    def mapping(self, k: int) -> tuple[ShardReader, int] | None:
        got = [s.mapping(k) for s in self.every()]
        if any(g is None for g in got):
            return None
        stamps = [g[1] for g in got if g is not None]
        return self.join(k, partial=True), -1 if min(stamps) < 0 else sum(stamps)

    def on_drop(self, forget: Callable[[int], None]) -> None:
        def dropped(k: int) -> None:
            self.mine()
            with self.lock:
                self.joined.pop(k, None)
            forget(k)

        for s in self.every():
            s.on_drop(dropped)

    def check_budget(self, shards_in_flight: int, why: str = "") -> None:
        """Each supply's own check, then theirs together: shard k of the archive and of
        each group are held at once, in one cache."""
        for s in self.every():
            s.check_budget(shards_in_flight, why)
        largest = sum(s.sizes.largest + STAMP_BYTES for s in self.every())
        n = min(shards_in_flight, len(self.shard_sizes))
        budget = self.base.cache.max_bytes
        if n * largest > budget:
            because = f" ({why})" if why else ""
            raise UsageError(
                f"{self.name}: cache_bytes {budget} is below what reading the archive and "
                f"its field groups {sorted(self.groups)} needs in flight: {n} shards, each "
                f"with its groups' shards beside it, x {largest} bytes (the largest of each, "
                f"with their stamps) = {n * largest}{because}; raise cache_bytes "
                f"(DLOP_CACHE_BYTES) to at least {n * largest}, or hold fewer shards at once"
            )

    def close(self) -> None:
        self.mine()
        with self.lock:
            self.joined.clear()
        each(self.every(), lambda s: s.close())


def each(supplies: Sequence[ShardSupply], act: Callable[[ShardSupply], None]) -> None:
    """``act`` on every supply, each even when one before it raised (the first error is
    raised once all were done)."""
    first: BaseException | None = None
    for s in supplies:
        try:
            act(s)
        except BaseException as e:
            first = first or e
    if first is not None:
        raise first

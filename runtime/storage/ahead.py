"""Fetching ahead: the shards later batches read first, fetched into the node-local
cache before a batch asks for them (a remote supply's, runtime.storage.remote_supply).

The supply hears, at each ask, which shards later batches read first, in order
(runtime.pipeline.prefetch.Asks). One background thread fetches the first ``count``
of them into the cache, not held, one at a time, while the shards the process holds
plus those ahead fit the cache's budget: loose shards that are not upcoming are let
go of to make that room. A shard another process is fetching, or one with no room
now, is skipped until the next ask; one whose fetch failed, until the next epoch.
A warm epoch (every upcoming shard mapped already) starts nothing.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Protocol

import numpy as np

from dlop.formats import ShardReader

from .holder import Holder
from .pool import DaemonPool


class AheadHost(Holder, Protocol):
    """What fetching ahead reads of the supply besides ``Holder``: the holds and the
    fetches under way, and how to fetch one shard."""

    asked: int
    refs: np.ndarray  # holds on each shard
    pending: dict[int, Future[ShardReader]]
    stopping: threading.Event  # set by close(): the fetches begun before it are stale

    def arriving(self, k: int) -> bool: ...

    def drop(self, k: int) -> None: ...

    def streams_shard(self, k: int) -> bool: ...

    def stream(self, k: int, keep: bool, stopping: threading.Event) -> ShardReader | None: ...

    def fetch(self, k: int, what: str, stopping: threading.Event) -> bytes: ...

    def to_raw(self, path: Path) -> Callable[[bytes], bytes] | None: ...


class FetchAhead:
    """The fetch-ahead of one supply (``host``): up to ``count`` upcoming shards."""

    def __init__(self, host: AheadHost, count: int) -> None:
        self.host = host
        self.count = count
        self.upcoming: list[int] = []  # shards later batches read first, in order
        self.job: Future[None] | None = None
        self.pool: DaemonPool | None = None
        self.skipped: set[int] = set()  # no room, or fetched elsewhere: try at the next ask

    def hear(self, shards: Sequence[int] | np.ndarray) -> None:
        """Shards later batches read first, in the order they do (none asked for yet):
        the first ``count`` are fetched into the cache in the background."""
        host = self.host
        upcoming = [int(k) for k in shards[: self.count]]
        with host.lock:
            self.upcoming = upcoming
            self.skipped.clear()
            mapped = all(k in host.open for k in upcoming)  # a warm epoch: nothing to fetch
            if not mapped and (self.job is None or self.job.done()):
                if self.pool is None:
                    self.pool = DaemonPool(1, "dlop-ahead")
                self.job = self.pool.submit(self.run)

    def stop(self) -> DaemonPool | None:
        """Nothing more is fetched ahead; the thread's pool, to shut down (under the
        host's lock)."""
        self.upcoming = []
        pool, self.pool = self.pool, None
        return pool

    def next(self) -> int | None:
        """The first upcoming shard not cached yet whose fetch keeps what batches hold
        plus the shards before it within the budget; loose shards not upcoming are let
        go of, oldest first, to make that room (called under the host's lock)."""
        host = self.host
        held = host.asked + sum(1 for k in host.pending if host.refs[k] == 0)
        fit = host.cache.max_bytes // max(1, host.sizes.largest)
        for i, k in enumerate(self.upcoming):
            if held + i + 1 > fit:
                return None
            if k in host.open or k in host.pending or k in self.skipped or host.arriving(k):
                continue
            if k in host.ahead_errors:
                continue
            if not (host.folder / host.index.shards[k].file).exists():
                soon = set(self.upcoming[: i + 1])
                spare = [j for j in host.loose if j not in soon]
                while spare and held + i + 1 + len(host.loose) > fit:
                    host.drop(spare.pop(0))
                return k
        return None

    def run(self) -> None:
        """Fetches upcoming shards into the cache, one at a time, until none is left that
        fits (runs on the ahead thread)."""
        host = self.host
        while True:
            with host.lock:
                k = self.next()
                stopping = host.stopping  # this fetch's generation: it ends with close()
            if k is None:
                return
            info = host.index.shards[k]
            path = host.folder / info.file
            what = f"{host.url}: shard {k} ({info.file})"
            try:
                if host.streams_shard(k):
                    done = host.stream(k, False, stopping) is not None
                else:
                    fetch = functools.partial(host.fetch, k, what, stopping)
                    done = host.cache.prefetch(path, host.sizes.size(k), fetch, host.to_raw(path))
            except Exception as e:
                host.note_failure(k, e, stopping)
                continue
            if not done:
                with host.lock:
                    self.skipped.add(k)

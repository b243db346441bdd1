"""A remote archive's supply stage: shards fetched into the node-local cache on ``ask``
(in the background), held while batches read them, let go of on ``release``.

A shard is held (a shared lock on its cached file, runtime.storage.cache) for as long
as it is mapped; no process on the node evicts a held shard. A shard no batch
asks for any more stays mapped in case it is read again (a later window, the
next epoch: then it costs nothing to ask for), as a loose shard: the loose
shards used last stay while they take at most ``loose_bytes`` (by default half
the budget; at least ``loose_shards`` of them stay). They are let go of, oldest
first, when this process needs their room (a fetch, a fetch ahead) and all at
once when another process on the node waits for room (it stamps the cache's
``.wanted``, looked at in each ``ask``) or the supply closes.

This module holds the shards (holding and eviction) and serves them; two concerns
live beside it. Ahead of the asks, ``ahead`` hears which shards later batches read
first, in order (runtime.pipeline.prefetch.Asks), and ``FetchAhead``
(runtime.storage.ahead) fetches the first ``ahead_shards`` of them into the cache,
not held, while the shards this process holds plus those ahead fit the budget, so a
new window's shards are in place (a warm cache: only mapped) before its first batch
asks for them. A raw shard streams (``Arrivals``, runtime.storage.arrival): it is
mapped from its temporary file as soon as its front is verified, its values
arriving part by part on the part threads, and ``ready`` holds a batch until the
bytes of its samples are verified. A zstd shard, one written before CRC pieces, and one whose header the
index does not record (an index written before ``header_crc32``), is served whole.

Budget checks count a shard at its size in the cache: for a block-coded (zstd)
shard, the raw copy, bounded from its header (one small ranged read) before
the shard itself is fetched. A shard whose fetch failed (retries spent) fails
every batch that reads it until the next epoch. After a fork (DataLoader
workers) the child starts afresh: it holds nothing its parent held, and makes
its own threads and storage client.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import itertools
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, InvalidStateError
from pathlib import Path
from typing import Any

import numpy as np

from dlop.formats import ArchiveReader, Field, FormatError, ShardReader
from dlop.formats.limits import room_for_files
from dlop.formats.storage import (
    DEFAULT_RETRY,
    Retry,
    Storage,
    checker,
)
from dlop.formats.transcode import needs_transcode, raw_fields, transcode_bytes

from ..errors import LoaderError, ShardChangedError, UsageError, kept
from .ahead import FetchAhead
from .arrival import Arrivals, closed
from .cache import CacheDir, Held, close_quietly, locked
from .cache_folder import BUDGET_LOCK
from .pool import DaemonPool
from .remote import in_parallel
from .remote_sizes import ShardSizes
from .streamed import Incoming, Lead
from .supply import ShardSupply, distinct

Client = Callable[[], Storage]  # this process's storage of the archive

_SUPPLIES: weakref.WeakSet[RemoteSupply] = weakref.WeakSet()

# Mapping stamps (RemoteSupply.stamps): never the same number twice in a process, nor
# in a forked child (its numbers continue past what the parent had handed out).
_stamps = itertools.count()


def _forget_parents() -> None:
    """Run in a forked child before anything else (os.register_at_fork)."""
    for supply in list(_SUPPLIES):
        supply.forget_parent()


os.register_at_fork(after_in_child=_forget_parents)

# How long closing waits for a shard whose parts are all in to be synced and published,
# and for fetch threads to end (one stuck in a network read is left to end with it).
LANDING_WAIT_S = 30.0
CLOSE_WAIT_S = 1.0


def nap(stopping: threading.Event, url: str, seconds: float) -> None:
    """A retry's sleep between attempts, cut short by its supply's close()."""
    if stopping.wait(seconds):
        raise closed(url)


@atexit.register
def _close_supplies() -> None:
    """At exit, every supply this process still has open lets go of its shards and lands
    those whose bytes are all in (their part threads are daemons: ended with the
    interpreter, a shard mid-landing would stay a temporary file)."""
    for supply in list(_SUPPLIES):
        if supply.pid == os.getpid():
            with contextlib.suppress(Exception):
                supply.close()


class RemoteSupply(ShardSupply):
    """Shards of the archive at ``url``, cached under ``folder`` of ``cache``; ``reader``
    holds its validated index (runtime.storage.cached opens one)."""

    def __init__(
        self,
        url: str,
        reader: ArchiveReader,
        cache: CacheDir,
        folder: Path,
        client: Client,
        retry: Retry = DEFAULT_RETRY,
        loose_shards: int = 2,
        fetch_threads: int = 2,
        ahead_shards: int = 16,
        loose_bytes: int | None = None,
        in_use: int = -1,
    ) -> None:
        self.url = self.name = url
        self.paths = (url,)  # a URL stands where a local archive has its folder
        # the descriptor whose shared lock marks the cache folder in use (CacheDir.use)
        self.in_use = in_use
        self.readers = [reader]
        index = self.index = reader.index
        # Block-coded fields are served decoded: the cache keeps shards raw.
        self.fields: Mapping[str, Field] = {f.name: f for f in raw_fields(index.fields)}
        self.shard_sizes = tuple(s.num_samples for s in index.shards)
        self.starts = np.concatenate([[0], np.cumsum(self.shard_sizes)]).astype(np.int64)
        self.shards: list[ShardReader] | None = None  # mapped per batch, never all at once
        self.reopen: tuple[Callable[..., ShardSupply], tuple[Any, ...]] | None = None
        self.pin: dict[str, bytes] = {}  # the index.json it was opened by (open_cached's)
        self.cache = cache
        self.folder = folder
        self.client = client
        self.base_retry = retry  # self.retry: the same, its sleeps cut short by close()
        self.loose_shards = loose_shards
        self.loose_bytes = cache.max_bytes // 2 if loose_bytes is None else loose_bytes
        self.fetch_threads = fetch_threads
        self.ahead_shards = ahead_shards
        self.transcode = needs_transcode(index.fields)
        self.sizes = ShardSizes(url, index, cache.max_bytes, client, retry)
        # a shard held open keeps two descriptors: its lock's and its mapping's
        room_for_files(2 * len(index.shards))
        cache.squeeze = self.squeeze
        self.dropped: Callable[[int], None] | None = None  # told when shard k is let go of
        self.pid = -1
        self.fresh()
        _SUPPLIES.add(self)

    def fresh(self) -> None:
        """This process's state: nothing held, no fetches under way."""
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.refs = np.zeros(len(self.index.shards), np.int64)  # holds on each shard
        self.asked = 0  # shards with a hold (refs > 0)
        # mapped here (open, or arriving) and held in the cache; only set_open and
        # set_closed change it
        self.open: dict[int, tuple[ShardReader, Held]] = {}
        # each shard's mapping stamp while it is open and whole, else -1 (mapped_stamps)
        self.stamps = np.full(len(self.index.shards), -1, np.int64)
        self.pending: dict[int, Future[ShardReader]] = {}
        self.loose: OrderedDict[int, None] = OrderedDict()  # oldest use first
        self.wanted = self.cache.wanted_stamp()
        self.next_generation()
        self.pool: DaemonPool | None = None
        self.fetch_ahead = FetchAhead(self, self.ahead_shards)
        self.ahead_errors: dict[int, Exception] = {}  # failed fetches, attempts spent
        self.arrive = Arrivals(self)  # raw shards arriving part by part (runtime.storage.arrival)
        self.closer: int | None = None  # the thread running close(), while it runs

    def forget_parent(self) -> None:
        """In a forked child, at once: closes its copies of the descriptors of the shards
        the parent is writing, whose locks would otherwise outlive the parent's (a
        ``flock`` belongs to every copy of a descriptor)."""
        for a in self.arrive.arrivals:
            close_quietly([a.fd, a.lock_fd])
        self.arrive = Arrivals(self)

    def next_generation(self) -> None:
        """Fetches from here on belong to a new generation: ``stopping``, set by close(),
        cuts their retries' sleeps short and marks what they bring in as stale."""
        self.stopping = threading.Event()
        self.retry = dataclasses.replace(
            self.base_retry, sleep=functools.partial(nap, self.stopping, self.url)
        )

    def __del__(self) -> None:
        close_quietly([getattr(self, "in_use", -1)])  # the folder no longer in use here

    def pins(self) -> dict[str, bytes]:
        return dict(self.pin)

    def __reduce__(self) -> tuple[Any, ...]:
        if self.reopen is None:
            raise TypeError(f"{self.url}: this supply was not opened to be sent to a process")
        return self.reopen

    def mine(self) -> None:
        if self.pid != os.getpid():
            self.fresh()  # a forked child: what the parent held is the parent's

    def ask(self, shards: Sequence[int] | np.ndarray) -> None:
        """Counts a hold on each shard and starts fetching those not cached here yet
        (array arithmetic over the shards: a Python step only for those not open)."""
        self.mine()
        if self.in_use < 0:  # read again after close
            self.use_folder()
        ks = distinct(shards, len(self.refs))
        wanted = self.cache.wanted_stamp()
        with self.lock:
            if wanted != self.wanted:  # another process waits for room
                self.wanted = wanted
                self.drop_loose()
            self.refs[ks] += 1
            first = ks[self.refs[ks] == 1]
            self.asked += len(first)
            if self.loose:
                for k in first.tolist():
                    self.loose.pop(k, None)
            try:
                self.check_in_flight()
            except UsageError:
                self.refs[ks] -= 1
                self.asked -= len(first)
                for k in first.tolist():  # loose again, as they were
                    if k in self.open:
                        self.loose[k] = None
                raise
            for k in ks[self.stamps[ks] < 0].tolist():
                if k not in self.open and k not in self.pending:
                    if self.pool is None:
                        self.pool = DaemonPool(self.fetch_threads, "dlop-fetch")
                    self.pending[k] = self.pool.submit(self.load, k)

    def hold_all(self) -> bool:
        """Every shard held at once when the cache holds the whole archive, each mapped
        and whole (a warm cache): see ShardSupply.hold_all."""
        self.mine()
        everything = np.arange(len(self.refs))
        if self.cache.wanted_stamp() != self.wanted:  # another process waits for room
            return False
        with self.lock:
            if len(self.open) < len(everything) or self.pending or self.arrive.streams:
                return False
        try:
            self.ask(everything)
        except UsageError:  # more holds than the budget's count allows: batch by batch
            return False
        with self.lock:  # dropped for another process meanwhile: batch by batch
            whole = len(self.open) == len(everything) and not self.arrive.streams
        if not whole:
            self.release(everything)
        return whole

    def release(self, shards: Sequence[int] | np.ndarray) -> None:
        """Drops one hold on each shard. A shard no batch holds becomes loose: it stays
        mapped while the loose shards fit ``loose_bytes`` (see the module docstring)."""
        self.mine()
        ks = distinct(shards, len(self.refs))
        with self.lock:
            ks = ks[self.refs[ks] > 0]
            self.refs[ks] -= 1
            freed = ks[self.refs[ks] == 0]
            self.asked -= len(freed)
            for k in freed.tolist():
                self.loose[k] = None
                self.loose.move_to_end(k)
            self.trim_loose()

    def trim_loose(self) -> None:
        """Lets go of the oldest loose shards past ``loose_bytes`` (under the lock)."""
        size = self.sizes.largest
        while len(self.loose) > self.loose_shards and len(self.loose) * size > self.loose_bytes:
            self.drop(next(iter(self.loose)))

    def drop_loose(self, keep: int = 0) -> bool:
        """Lets go of loose shards, oldest first, until ``keep`` are left (locked); True if any went."""
        gone = False
        while len(self.loose) > keep:
            self.drop(next(iter(self.loose)))
            gone = True
        return gone

    def ahead(self, shards: Sequence[int] | np.ndarray) -> None:
        """Shards later batches read first (runtime.storage.ahead fetches them)."""
        self.mine()
        self.fetch_ahead.hear(shards)

    def arriving(self, k: int) -> bool:
        """Whether shard ``k`` is arriving part by part here (under the lock)."""
        return k in self.arrive.streams

    def forget_failures(self) -> None:  # a new epoch: shards that failed are tried again
        self.mine()
        with self.lock:
            self.forget_errors()

    def forget_errors(self) -> None:
        """Forgets the recorded failures (under the lock). Raised again since they were
        recorded, each may hold frames of the reads that raised it (and through them
        mapped shards): let go of here, not when Python's collector runs."""
        for e in self.ahead_errors.values():
            kept(e)
        self.ahead_errors.clear()

    def squeeze(self) -> bool:
        """Lets go of the oldest loose shard (this process needs room); True if one went."""
        with self.lock:
            return self.drop_loose(keep=max(0, len(self.loose) - 1))

    def on_drop(self, forget: Callable[[int], None]) -> None:
        self.dropped = forget

    def check_budget(self, shards_in_flight: int, why: str = "") -> None:
        self.sizes.check_budget(shards_in_flight, why)

    def check_in_flight(self) -> None:
        """Refuses holds that could never all be cached (called under the lock)."""
        self.sizes.check_in_flight(self.asked)

    def shard(self, k: int) -> ShardReader:
        """Shard ``k`` mapped from the cache: fetched now, or waited for if under way,
        whole and verified. Callers hold it (``ask``) for as long as they read it."""
        reader = self.partial_shard(k)
        while True:
            with self.lock:
                inc = self.arrive.streams.get(k)
                if inc is None:
                    got = self.open.get(k)
                    if got is not None and got[0] is reader:
                        return reader
                    raise self.failure(k)
            inc.wait_whole()

    def partial_shard(self, k: int) -> ShardReader:
        """Shard ``k`` as ``shard``, but possibly still arriving: read a sample only after
        ``ready`` says its bytes are verified."""
        self.mine()
        with self.lock:
            got = self.open.get(k)
            future = self.pending.get(k)
            mine = got is None and future is None
            if mine:
                future = self.pending[k] = Future()
        if got is not None:
            return got[0]
        if future is None:  # not reached: one of the two is set above
            raise LoaderError(f"{self.url}: shard {k} neither open nor being fetched")
        if mine:
            try:
                loaded = self.load(k)
            except BaseException as e:
                with contextlib.suppress(InvalidStateError):  # answered by close()
                    future.set_exception(e)
            else:
                with contextlib.suppress(InvalidStateError):
                    future.set_result(loaded)
        return future.result()

    def load(self, k: int) -> ShardReader:
        """Fetches (once per node) and maps shard ``k``; called on a fetch thread or inline.
        A raw shard is mapped once its front is in (runtime.storage.streamed), the rest
        arriving meanwhile."""
        info = self.index.shards[k]
        path = self.folder / info.file
        what = f"{self.url}: shard {k} ({info.file})"
        stopping = self.stopping
        try:
            if self.streams_shard(k):
                got = self.arrive.stream(k, keep=True, stopping=stopping)
                assert got is not None  # keep waits for the fetch lock and for room
            else:
                fetched = functools.partial(self.fetch, k, what, stopping)
                held = self.cache.get(path, fetched, self.to_raw(path))
                got = self.opened(k, held, what, stopping)
            if stopping.is_set():  # closed meanwhile: close() let go of what it got
                raise closed(self.url)
            return got
        finally:
            with self.lock:
                if not stopping.is_set():  # else close() took it: a read since asks anew
                    self.pending.pop(k, None)

    def opened(self, k: int, held: Held, what: str, stopping: threading.Event) -> ShardReader:
        """Maps the cached shard ``k`` this process holds, and keeps it open; let go of
        when ``stopping``, the generation of the fetch that brought it in, has ended:
        what a close() left behind is never taken up by a read after it."""
        try:
            reader = self.map(k, held)
        except FormatError as e:
            self.cache.let_go(held)
            raise LoaderError(
                f"{what}: the cached copy does not read ({e}); remove it, or run "
                "dlop-inspect cache --clear, and read again: it is fetched anew"
            ) from None
        self.sizes.learn(k, held.bytes)
        with self.lock:
            stale = stopping.is_set()
            if not stale:
                self.keep_open(k, reader, held, whole=True)
        if stale:
            reader.close()
            self.cache.let_go(held)
            raise closed(self.url)
        return reader

    def keep_open(self, k: int, reader: ShardReader, held: Held, whole: bool = False) -> None:
        """Shard ``k`` mapped and held here (``whole``: every byte verified, else still
        arriving); loose at once when no batch holds it any more (fetched for a hold
        already let go of). Called under the lock."""
        self.set_open(k, reader, held, whole)
        if self.refs[k] == 0 and k not in self.loose:
            self.loose[k] = None

    def set_open(self, k: int, reader: ShardReader, held: Held, whole: bool) -> None:
        """Records shard ``k`` as mapped (``open``) with a new stamp when ``whole`` (under
        the lock)."""
        self.open[k] = (reader, held)
        self.stamps[k] = next(_stamps) if whole else -1

    def set_closed(self, k: int) -> tuple[ShardReader, Held] | None:
        """Shard ``k`` no longer mapped here: its mapping and hold, if it had them (under
        the lock)."""
        self.stamps[k] = -1
        return self.open.pop(k, None)

    def mapped_stamps(self, shards: np.ndarray) -> np.ndarray | None:
        self.mine()
        stamps: np.ndarray = self.stamps[shards]
        return stamps

    def mapping(self, k: int) -> tuple[ShardReader, int] | None:
        self.mine()
        with self.lock:
            got, stamp = self.open.get(k), int(self.stamps[k])
        return None if got is None else (got[0], stamp)

    def failure(self, k: int) -> BaseException:
        """Why shard ``k``, held by a batch, is no longer open here: its fetch failed."""
        return self.ahead_errors.get(k) or LoaderError(
            f"{self.url}: shard {k} was let go of while a batch read it"
        )

    # -- streamed fetches (runtime.storage.streamed) ------------------------------------

    def streams_shard(self, k: int) -> bool:
        """Whether shard ``k`` streams: a raw shard whose header the index records
        (SPEC.md §6 ``header_crc32``), so its pieces' CRCs chain to the index. Others are
        served once whole and matching the index's CRC."""
        return not self.transcode and self.index.shards[k].header_crc32 is not None

    def stream(self, k: int, keep: bool, stopping: threading.Event) -> ShardReader | None:
        return self.arrive.stream(k, keep, stopping)

    def ready(self, k: int, samples: np.ndarray, names: Sequence[str] | None = None) -> bool:
        return self.arrive.ready(k, samples, names)

    def read_order(self, batches: Sequence[np.ndarray]) -> None:
        self.mine()  # a forked child's first epoch: its own state takes the order
        self.arrive.read_order(batches)

    def note_failure(self, k: int, e: BaseException, stopping: threading.Event) -> BaseException:
        """Records that shard ``k`` failed (its batches raise it until the next epoch), by
        a fetch of generation ``stopping``; recorded only for the current generation
        (what close() records, it forgets when done): a fetch begun before close() that
        fails after it, with the close or otherwise, leaves the shard to be fetched
        afresh."""
        kept(e)
        with self.lock:  # the first failure is the one to report (a later one may be its echo)
            if stopping is not self.stopping:
                return self.ahead_errors.get(k, e)
            return self.ahead_errors.setdefault(k, e)  # type: ignore[arg-type]

    def fetch(self, k: int, what: str, stopping: threading.Event) -> bytes:
        """Shard k's verified bytes; a failure is noted under its fetch lock and raised
        again, not retried, by every read of it until forget_failures (unless the fetch,
        of generation ``stopping``, began before a close: ``note_failure``)."""
        with self.lock:
            if (failed := self.ahead_errors.get(k)) is not None:
                raise failed
        try:
            return self.fetch_checked(k, what)
        except Exception as e:
            self.note_failure(k, e, stopping)
            raise

    def fetch_checked(self, k: int, what: str) -> bytes:
        if self.transcode:  # its raw copy must fit beside what is held: known before the body
            self.sizes.check_fits(k, what)
            with self.lock:
                self.check_in_flight()
        info = self.index.shards[k]
        check = checker(info.bytes, info.crc32)
        return self.client().fetch(
            info.file,
            check,
            size=info.bytes,
            retry=self.retry,
            what=what,
            map_parts=in_parallel(self.retry),
        )

    def to_raw(self, path: Path) -> Callable[[bytes], bytes] | None:
        """Decodes a block-coded shard once, as it arrives: the cache keeps it raw."""
        if not self.transcode:
            return None
        # Outside the budget for a moment: the scratch copies live in TMPDIR, not the cache.
        return functools.partial(transcode_bytes, name=path.name)

    def map(self, k: int, held: Held) -> ShardReader:
        info = self.index.shards[k]
        reader = ShardReader(held.path, expected_bytes=held.bytes)
        if reader.num_samples != info.num_samples:
            reader.close()
            raise FormatError(
                held.path, f"holds {reader.num_samples} samples, index.json says {info.num_samples}"
            )
        return reader

    def drop(self, k: int) -> None:
        """Unmaps shard ``k`` and lets go of its hold (called under the lock). A shard
        still arriving goes on arriving, into the cache only."""
        self.loose.pop(k, None)
        got = self.set_closed(k)
        if got is not None:
            if self.dropped is not None:
                self.dropped(k)
            reader, held = got
            inc = self.arrive.streams.get(k)
            if inc is not None and inc.reader is reader:
                inc.keep = False  # landed() publishes it unheld and unmaps it
                return
            reader.close()  # views still in use keep the mapping; the file may go meanwhile
            self.cache.let_go(held)

    def check(self, shards: Sequence[int] | np.ndarray) -> None:
        """Refuses a cached shard that shrank under its mapping (see LocalSupply.check)."""
        for k in set(np.asarray(shards, dtype=np.int64).tolist()):
            got = self.open.get(k)
            if got is not None and got[0].mapped_size() < got[1].bytes:
                raise ShardChangedError(
                    f"{got[1].path}: cached shard shrank from {got[1].bytes} to "
                    f"{got[0].mapped_size()} bytes while mapped; nothing but dlop should "
                    "write in the cache folder"
                )

    def held_bytes(self) -> int:
        return sum(h.bytes for _, h in self.open.values())

    def use_folder(self) -> None:
        """Marks the cache folder in use again (a supply read after ``close``); a folder
        cleared meanwhile is refused."""
        with locked(self.cache.root / BUDGET_LOCK):
            if not (self.folder / "index.json").exists():
                raise LoaderError(
                    f"{self.url}: its cache folder {self.folder} was cleared after the "
                    "archive was closed; open the archive again"
                )
            self.in_use = self.cache.use(self.folder)

    def close(self) -> None:
        """Lets go of every shard, stops the fetch threads and marks the cache folder no
        longer in use; a shard still arriving is removed. Read again, it takes them up
        anew."""
        me = threading.get_ident()
        if self.closer == me:  # called again inside this close (a Loader that the
            return  # collector freed meanwhile closing its archive): this close does it all
        self.closer = me
        try:
            self._close()
        finally:
            self.closer = None

    def _close(self) -> None:
        with self.lock:
            for k in list(self.open):
                self.drop(k)
            pools = [p for p in (self.pool, self.fetch_ahead.stop()) if p is not None]
            self.pool = None
            self.stopping.set()  # a fetch sleeping between attempts gives up now
            # a batch waiting for a fetch stuck in a network read is answered now; the
            # fetch's own result, when it comes, is discarded (load, DaemonPool)
            for future in self.pending.values():
                with contextlib.suppress(InvalidStateError):
                    if not future.done():
                        future.set_exception(closed(self.url))
            self.pending.clear()
            parts, self.arrive.parts = self.arrive.parts, None
            leads = list(self.arrive.leads)
        if self.pid == os.getpid():
            deadline = time.monotonic() + CLOSE_WAIT_S
            for pool in pools:  # a fetch stuck in a read is not waited for past this
                pool.shutdown(max(0.0, deadline - time.monotonic()), cancel_futures=True)
            if parts is not None:
                # who waits for a dropped job stops waiting
                for job in parts.close(max(0.0, deadline - time.monotonic())):
                    owner = job.args[0] if isinstance(job, functools.partial) else None
                    if isinstance(owner, Incoming):  # a front, for its part
                        owner.settle_tail(None, closed(self.url))
                    elif isinstance(owner, Lead):  # a reader, for a lead range
                        owner.stop()
            for lead in leads:  # a range still in a read: its front reads it itself
                lead.stop()
            for inc in list(self.arrive.streams.values()):
                # a shard whose every part is in lands (synced, published) rather than
                # being thrown away: a peer, or the next run, finds it whole
                if not inc.whole_soon(LANDING_WAIT_S):
                    self.arrive.failed(inc, closed(self.url))
            with self.lock:
                self.forget_errors()
                self.next_generation()  # read again, it fetches and retries anew
        with self.lock:  # taken under the lock: two closes at once close it once
            in_use, self.in_use = self.in_use, -1
        close_quietly([in_use])

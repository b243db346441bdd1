"""A remote archive's source stage: shards fetched into the node-local cache on ``ask``
(in the background), held while batches read them, let go of on ``release``.

A shard is held (a shared lock on its cached file, runtime.storage.cache) for as long
as it is mapped; no process on the node evicts a held shard. A shard no batch
asks for any more stays mapped in case it is read again (a later window, the
next epoch: then it costs nothing to ask for), as a loose shard: the loose
shards used last stay while they take at most ``loose_bytes`` (by default half
the budget; at least ``loose_shards`` of them stay). They are let go of, oldest
first, when this process needs their room (a fetch, a fetch ahead) and all at
once when another process on the node waits for room (it stamps the cache's
``.wanted``, looked at in each ``ask``) or the source closes.

Ahead of the asks, ``ahead`` hears which shards later batches read first, in
order (runtime.pipeline.prefetch.Asks): one background thread fetches the first
``ahead_shards`` of them into the cache, not held, while the shards this
process holds plus those ahead fit the budget, so a new window's shards are
in place (a warm cache: only mapped) before its first batch asks for them.

A raw shard streams (runtime.storage.streamed): it is mapped from its temporary
file as soon as its front is verified, its values arriving part by part on the
part threads, and ``ready`` holds a batch until the bytes of its samples are
verified. A zstd shard, one written before CRC pieces, and one whose header the
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
from dlop.formats.storage import (
    DEFAULT_RETRY,
    FetchError,
    Rejected,
    Retry,
    Storage,
    checker,
    fetch,
    retrying,
)
from dlop.formats.transcode import header_span, needs_transcode, raw_fields, transcode_bytes

from ..errors import FetchFailed, LoaderError, ShardChangedError, UsageError, kept
from .ahead import FetchAhead
from .cache import Arriving, CacheDir, Held, close_quietly, locked, write_at
from .cache_folder import BUDGET_LOCK
from .pool import DaemonPool
from .remote import fetch_bytes, fetch_head
from .remote_sizes import ShardSizes
from .source import ShardSource
from .streamed import (
    DONE,
    FLYING,
    LATER,
    QUEUED,
    FrontFailed,
    Incoming,
    PartQueue,
    fetch_front,
    first_reads,
    fronts_of,
)

Client = Callable[[], Storage]  # this process's storage of the archive

_SOURCES: weakref.WeakSet[RemoteSource] = weakref.WeakSet()


def _forget_parents() -> None:
    """Run in a forked child before anything else (os.register_at_fork)."""
    for source in list(_SOURCES):
        source.forget_parent()


os.register_at_fork(after_in_child=_forget_parents)

# How long closing waits for a shard whose parts are all in to be synced and published,
# and for fetch threads to end (one stuck in a network read is left to end with it).
LANDING_WAIT_S = 30.0
CLOSE_WAIT_S = 1.0


def closed(url: str) -> LoaderError:
    """What a batch, a fetch or a retry of a closed source gets."""
    return LoaderError(f"{url}: the source was closed")


def nap(stopping: threading.Event, url: str, seconds: float) -> None:
    """A retry's sleep between attempts, cut short by its source's close()."""
    if stopping.wait(seconds):
        raise closed(url)


@atexit.register
def _close_sources() -> None:
    """At exit, every source this process still has open lets go of its shards and lands
    those whose bytes are all in (their part threads are daemons: ended with the
    interpreter, a shard mid-landing would stay a temporary file)."""
    for source in list(_SOURCES):
        if source.pid == os.getpid():
            with contextlib.suppress(Exception):
                source.close()


class RemoteSource(ShardSource):
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
        self.reopen: tuple[Callable[..., RemoteSource], tuple[Any, ...]] | None = None
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
        cache.squeeze = self.squeeze
        self.dropped: Callable[[int], None] | None = None  # told when shard k is let go of
        self.pid = -1
        self.fresh()
        _SOURCES.add(self)

    def fresh(self) -> None:
        """This process's state: nothing held, no fetches under way."""
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.refs = [0] * len(self.index.shards)
        self.asked = 0  # shards with a hold (refs > 0)
        self.open: dict[int, tuple[ShardReader, Held]] = {}
        self.pending: dict[int, Future[ShardReader]] = {}
        self.loose: OrderedDict[int, None] = OrderedDict()  # oldest use first
        self.wanted = self.cache.wanted_stamp()
        self.next_generation()
        self.pool: DaemonPool | None = None
        self.fetch_ahead = FetchAhead(self, self.ahead_shards)
        self.ahead_errors: dict[int, Exception] = {}  # failed fetches, attempts spent
        self.streams: dict[int, Incoming] = {}  # raw shards arriving part by part
        self.fronting: dict[int, threading.Event] = {}  # set once the front is in or failed
        self.arrivals: set[Arriving] = set()  # temporary files this process writes
        self.closing = False
        self.closer: int | None = None  # the thread running close(), while it runs
        self.parts: PartQueue | None = None
        self.order: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # read_order's

    def forget_parent(self) -> None:
        """In a forked child, at once: closes its copies of the descriptors of the shards
        the parent is writing, whose locks would otherwise outlive the parent's (a
        ``flock`` belongs to every copy of a descriptor)."""
        for a in self.arrivals:
            close_quietly([a.fd, a.lock_fd])
        self.arrivals = set()
        self.streams = {}

    def next_generation(self) -> None:
        """Fetches from here on belong to a new generation: ``stopping``, set by close(),
        cuts their retries' sleeps short and marks what they bring in as stale."""
        self.stopping = threading.Event()
        self.retry = dataclasses.replace(
            self.base_retry, sleep=functools.partial(nap, self.stopping, self.url)
        )

    def __del__(self) -> None:
        close_quietly([getattr(self, "in_use", -1)])  # the folder no longer in use here

    def __reduce__(self) -> tuple[Any, ...]:
        if self.reopen is None:
            raise TypeError(f"{self.url}: this source was not opened to be sent to a process")
        return self.reopen

    def mine(self) -> None:
        if self.pid != os.getpid():
            self.fresh()  # a forked child: what the parent held is the parent's

    def ask(self, shards: Sequence[int]) -> None:
        """Counts a hold on each shard and starts fetching those not cached here yet."""
        self.mine()
        if self.in_use < 0:  # read again after close
            self.use_folder()
        wanted = self.cache.wanted_stamp()
        with self.lock:
            if wanted != self.wanted:  # another process waits for room
                self.wanted = wanted
                self.drop_loose()
            for k in sorted(set(shards)):
                self.refs[k] += 1
                self.asked += self.refs[k] == 1
                self.loose.pop(k, None)
            try:
                self.check_in_flight()
            except UsageError:
                for k in set(shards):
                    self.refs[k] -= 1
                    self.asked -= self.refs[k] == 0
                raise
            for k in sorted(set(shards)):
                if k not in self.open and k not in self.pending:
                    if self.pool is None:
                        self.pool = DaemonPool(self.fetch_threads, "dlop-fetch")
                    self.pending[k] = self.pool.submit(self.load, k)

    def release(self, shards: Sequence[int]) -> None:
        """Drops one hold on each shard. A shard no batch holds becomes loose: it stays
        mapped while the loose shards fit ``loose_bytes`` (see the module docstring)."""
        self.mine()
        with self.lock:
            for k in sorted(set(shards)):
                if self.refs[k] == 0:
                    continue
                self.refs[k] -= 1
                if self.refs[k] == 0:
                    self.asked -= 1
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
        return k in self.streams

    def forget_failures(self) -> None:  # a new epoch: shards that failed are tried again
        with self.lock:
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
                inc = self.streams.get(k)
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
                got = self.stream(k, keep=True)
                assert got is not None  # keep waits for the fetch lock and for room
            else:
                held = self.cache.get(path, lambda: self.fetch(k, what), self.to_raw(path))
                got = self.opened(k, held, what)
            if stopping.is_set():  # the source closed meanwhile: not kept
                self.discard(k, got)
                raise closed(self.url)
            return got
        finally:
            with self.lock:
                self.pending.pop(k, None)

    def discard(self, k: int, reader: ShardReader) -> None:
        """Lets go of shard ``k`` (mapped as ``reader``) that a fetch begun before close()
        brought in after close() had let go of everything."""
        with self.lock:
            got = self.open.get(k)
            if got is not None and got[0] is reader:
                self.drop(k)
            inc = self.streams.get(k)
        if inc is not None and inc.reader is reader:
            self.failed(inc, closed(self.url))

    def opened(self, k: int, held: Held, what: str) -> ShardReader:
        """Maps the cached shard ``k`` this process holds, and keeps it open."""
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
            self.keep_open(k, reader, held)
        return reader

    def keep_open(self, k: int, reader: ShardReader, held: Held) -> None:
        """Shard ``k`` mapped and held here; loose at once when no batch holds it any
        more (fetched for a hold already let go of). Called under the lock."""
        self.open[k] = (reader, held)
        if self.refs[k] == 0 and k not in self.loose:
            self.loose[k] = None

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

    def stream(self, k: int, keep: bool) -> ShardReader | None:
        """Raw shard ``k``: mapped from the cache, or its fetch started part by part and
        its front verified. ``keep``: held for batches (waits for the fetch lock and
        room), else fetched ahead only: None when another process fetches it or the
        budget has no room now."""
        while True:
            with self.lock:
                inc = self.streams.get(k)
                if inc is not None and inc.reader is not None:  # its front is in
                    if keep and not inc.keep:  # a fetch ahead's: batches hold it now
                        inc.keep = True
                        self.keep_open(k, inc.reader, inc.held())
                    return inc.reader
                if (failed := self.ahead_errors.get(k)) is not None:
                    raise failed
                other = self.fronting.get(k)
                if other is None:
                    mine = self.fronting[k] = threading.Event()
                    break
            if not keep:
                return None  # being fetched here already
            other.wait()  # its front is in, or it failed: look again
        try:
            return self.start_stream(k, keep)
        finally:
            with self.lock:
                del self.fronting[k]
            mine.set()

    def start_stream(self, k: int, keep: bool) -> ShardReader | None:
        """``stream``'s fetch of shard ``k`` (none under way in this process)."""
        info = self.index.shards[k]
        path = self.folder / info.file
        what = f"{self.url}: shard {k} ({info.file})"
        got = self.cache.arrive(path, info.bytes, wait=keep)
        if got is None:
            return None
        if isinstance(got, Held):
            if not keep:
                self.cache.let_go(got)
                return None
            return self.opened(k, got, what)
        with self.lock:
            self.arrivals.add(got)
        inc: Incoming | None = None
        try:
            store = self.client()
            head, layout = fetch_head(
                store, info.file, info.bytes, what, self.retry, info.header_crc32
            )
            if layout.num_samples != info.num_samples:
                raise LoaderError(
                    f"{what}: holds {layout.num_samples} samples, index.json says {info.num_samples}"
                )
            head_len = header_span(head, store.name_url(info.file), info.bytes)
            inc = Incoming(k, got, layout, head_len, self.retry, keep)
            inc.ride(fronts_of(layout, info.bytes), self.retry, len(head))
            with self.lock:
                first = self.first_reads(k)
            ranks = inc.ranks(first)
            # The part the front waits for goes before the shard's others (whose samples'
            # places are known: a ragged field's wait for the front).
            ride = min((r for r in ranks if r < LATER), default=0) - 1
            ranks = [ride if p.end != p.hi else r for p, r in zip(inc.parts, ranks, strict=True)]
            self.queue(inc, ranks)  # fixed fields' values come in beside the front
            reader, fronts = fetch_front(
                store, info.file, inc, what, self.retry, info.crc32, (head, layout)
            )
            with self.lock, inc.cond:
                if inc.error is not None:  # a part failed meanwhile: failed() cleaned up
                    reader.close()
                    raise inc.error
                self.streams[k] = inc
                if keep:
                    self.keep_open(k, reader, inc.held())
            inc.fronted(reader, fronts)
            ragged = [p.rank == LATER for p in inc.parts]
            if any(ragged):  # their samples' places are known now
                self.queue(inc, inc.ranks(first), only=ragged)
        except Exception as e:
            if inc is None:
                failure = self.note_failure(k, e)
                self.let_go_of(got, failure)
                raise failure from None
            raise self.failed(inc, e) from None
        if not inc.parts:
            self.landed(inc)
        return reader

    def let_go_of(self, a: Arriving, failure: BaseException | None = None) -> None:
        """Removes a shard that will not arrive whole (once), recording a fetch
        ``failure`` for the node's other processes (CacheDir.abandon)."""
        with self.lock:
            if a not in self.arrivals:
                return
            self.arrivals.discard(a)
        self.cache.abandon(a, failure)

    def note_failure(self, k: int, e: BaseException) -> BaseException:
        """Records that shard ``k`` failed (its batches raise it until the next epoch)."""
        if isinstance(e, FetchError):
            e = FetchFailed(str(e))
        kept(e)
        with self.lock:  # the first failure is the one to report (a later one may be its echo)
            return self.ahead_errors.setdefault(k, e)  # type: ignore[arg-type]

    def queue(self, inc: Incoming, ranks: list[int], only: list[bool] | None = None) -> None:
        """Puts the parts of ``inc`` (those ``only`` marks) in the fetch queue at ``ranks``."""
        jobs = []
        with inc.cond:
            for i, (part, rank) in enumerate(zip(inc.parts, ranks, strict=True)):
                if (only is None or only[i]) and part.state == QUEUED:
                    part.rank = rank
                    jobs.append((rank, functools.partial(self.fetch_part, inc, i, rank)))
        if jobs:
            with self.lock:
                if self.closing:  # close() fails what is still arriving
                    inc.settle_tail(None, closed(self.url))
                    return
                if self.parts is None:
                    self.parts = PartQueue(self.retry.parallel_parts)
                parts = self.parts
            if not parts.put(jobs):
                inc.settle_tail(None, closed(self.url))

    def fetch_part(self, inc: Incoming, i: int, rank: int) -> None:
        """Fetches, verifies and writes part ``i`` of a shard arriving (a part thread)."""
        part = inc.parts[i]
        with inc.cond:
            if inc.error is not None or part.state != QUEUED or rank != part.rank:
                return  # done, under way, or queued again at another rank
            part.state = FLYING
        name = self.index.shards[inc.k].file
        what = f"{self.url}: shard {inc.k} ({name}) bytes {part.lo}..{part.hi}"
        try:
            store = self.client()

            def read() -> bytes:
                try:
                    data = store.read_once(name, part.lo, part.end)
                except Exception as e:
                    inc.hand_tail(part, None, e)  # the front reads its span itself, now
                    raise
                if len(data) != part.end - part.lo:
                    inc.hand_tail(part, None)
                return data

            data = fetch(
                read,
                inc.check(part),
                what,
                store.name_url(name),
                self.retry,
                give_up=(FrontFailed,),
            )
            with inc.writer():
                write_at(inc.arriving.fd, memoryview(data)[: part.hi - part.lo], part.lo)
        except Exception as e:
            inc.hand_tail(part, None, e)
            self.failed(inc, e)
            return
        with inc.cond:
            part.state = DONE
            inc.pieced[part.region].verified[part.p0 : part.p1] = True
            inc.left -= 1
            last = inc.left == 0
            inc.cond.notify_all()
        if last:
            self.landed(inc)

    def landed(self, inc: Incoming) -> None:
        """Every part of ``inc`` is in: checked whole against the index (its padding
        fetched again while that fails), then published."""
        info = self.index.shards[inc.k]
        reader = inc.reader
        try:
            assert reader is not None  # parts are checked only once the front is in
            if inc.file_crc() != info.crc32:
                self.fetch_gaps(inc)
            with inc.writer():  # outside the lock: a sync takes long
                os.fsync(inc.arriving.fd)
            with self.lock, inc.cond:
                if inc.error is not None:
                    return
                held = self.cache.publish(inc.arriving, info.crc32, keep=inc.keep, synced=True)
                self.arrivals.discard(inc.arriving)
                self.streams.pop(inc.k, None)
                if inc.keep:
                    self.open[inc.k] = (reader, held)
                    self.sizes.learn(inc.k, held.bytes)
                inc.done = True
                inc.cond.notify_all()
        except Exception as e:
            self.failed(inc, e)
            return
        if not inc.keep:
            reader.close()

    def fetch_gaps(self, inc: Incoming) -> None:
        """Fetches the front spans of ``inc`` again, writing only the bytes no checksum but
        the file's covers (padding), until the whole file's CRC-32 is the index's; FetchError when it never is (the
        object is not the one the index describes)."""
        info = self.index.shards[inc.k]
        store = self.client()

        def once() -> None:
            for lo, hi, _ in inc.fronts:
                gaps = [(max(a, lo), min(b, hi)) for a, b in inc.gaps if a < hi and b > lo]
                if not gaps:
                    continue
                data = store.read_once(info.file, lo, hi)
                if len(data) != hi - lo:
                    raise Rejected(
                        f"got {len(data)} bytes of the {hi - lo} from {lo} (truncated transfer?)"
                    )
                with inc.writer():  # only the padding: verified bytes are never written again
                    for a, b in gaps:
                        write_at(inc.arriving.fd, memoryview(data)[a - lo : b - lo], a)
            assert inc.reader is not None
            crc = inc.reader.file_crc32()
            if crc != info.crc32:
                raise Rejected(
                    f"CRC-32 {crc:#010x} of the whole file, index.json says {info.crc32:#010x}: "
                    "the object changed since the index was written, or its padding is corrupt"
                )

        what = f"{self.url}: shard {inc.k} ({info.file})"
        retrying(once, what, store.name_url(info.file), self.retry, give_up=(FrontFailed,))

    def failed(self, inc: Incoming, e: BaseException) -> BaseException:
        """``inc`` will not arrive: batches that read it fail until the next epoch with
        its first failure (``note_failure``), returned. Its mapping stays valid for views
        still using it (the file is removed)."""
        e = self.note_failure(inc.k, e)
        with inc.cond:
            if inc.error is not None or inc.done:
                return e
            inc.error = e
            while inc.writing:
                inc.cond.wait()
            inc.cond.notify_all()
        inc.settle_tail(None, e)  # a front waiting for its last span stops waiting
        with self.lock:
            self.streams.pop(inc.k, None)
            got = self.open.get(inc.k)
            held = got is not None and got[0] is inc.reader
            if held:
                del self.open[inc.k]
                self.loose.pop(inc.k, None)
                if self.dropped is not None:
                    self.dropped(inc.k)
        if not held and inc.reader is not None:
            inc.reader.close()  # a fetch ahead's: nothing reads it
        self.let_go_of(inc.arriving, e)
        return e

    def ready(self, k: int, samples: np.ndarray, names: Sequence[str] | None = None) -> bool:
        """Returns once every byte of ``samples`` (shard-local numbers) in fields ``names``
        is verified (the parts they wait for jump the fetch queue): True while the rest of
        the shard is still arriving, when only those bytes may be read."""
        if not self.streams and k in self.open:  # nothing arriving (a warm epoch): no lock
            return False
        with self.lock:
            inc = self.streams.get(k)
            if inc is None and k not in self.open:  # held by the batch, so it failed
                raise self.failure(k)
        if inc is None:
            return False
        samples = np.asarray(samples, dtype=np.int64)
        with inc.cond:
            while True:
                if inc.error is not None:
                    raise inc.error
                if inc.done:
                    return False
                wanted = inc.missing(samples, names)
                if not wanted:
                    return True
                parts = inc.parts
                waiting = {i for i in wanted if parts[i].state == QUEUED and parts[i].rank != -1}
                if waiting:  # to the front of the queue
                    inc.cond.release()
                    try:
                        jump = [i in waiting for i in range(len(inc.parts))]
                        self.queue(inc, [-1] * len(inc.parts), only=jump)
                    finally:
                        inc.cond.acquire()
                inc.cond.wait(0.5)

    def read_order(self, batches: Sequence[np.ndarray]) -> None:
        """This process's batches of the coming epoch (global sample numbers, in order):
        a shard arriving fetches the parts that earlier batches read first."""
        flat = np.concatenate(batches).astype(np.int64) if batches else np.zeros(0, np.int64)
        of = np.searchsorted(self.starts, flat, side="right") - 1
        by_shard = np.argsort(of, kind="stable")
        bounds = np.searchsorted(of[by_shard], np.arange(len(self.shard_sizes) + 1))
        with self.lock:
            self.order = (flat, by_shard, bounds)

    def first_reads(self, k: int) -> np.ndarray | None:
        """Per sample of shard ``k``, where this epoch first reads it (read_order); None
        when no order was given (called under the lock)."""
        if self.order is None:
            return None
        flat, by_shard, bounds = self.order
        lo, hi = int(self.starts[k]), int(self.starts[k + 1])
        return first_reads(flat, lo, hi, by_shard[bounds[k] : bounds[k + 1]])

    def fetch(self, k: int, what: str) -> bytes:
        """Shard k's verified bytes; a failure is noted under its fetch lock and raised
        again, not retried, by every read of it until forget_failures."""
        with self.lock:
            if (failed := self.ahead_errors.get(k)) is not None:
                raise failed
        try:
            return self.fetch_checked(k, what)
        except Exception as e:
            self.note_failure(k, e)
            raise

    def fetch_checked(self, k: int, what: str) -> bytes:
        if self.transcode:  # its raw copy must fit beside what is held: known before the body
            self.sizes.check_fits(k, what)
            with self.lock:
                self.check_in_flight()
        info = self.index.shards[k]
        check = checker(info.bytes, info.crc32)
        return fetch_bytes(self.client(), info.file, info.bytes, check, what, self.retry)

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
        got = self.open.pop(k, None)
        if got is not None:
            if self.dropped is not None:
                self.dropped(k)
            reader, held = got
            inc = self.streams.get(k)
            if inc is not None and inc.reader is reader:
                inc.keep = False  # landed() publishes it unheld and unmaps it
                return
            reader.close()  # views still in use keep the mapping; the file may go meanwhile
            self.cache.let_go(held)

    def check(self, shards: Sequence[int] | np.ndarray) -> None:
        """Refuses a cached shard that shrank under its mapping (see LocalSource.check)."""
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
        """Marks the cache folder in use again (a source read after ``close``); a folder
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
            self.closing = True
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
            parts, self.parts = self.parts, None
        if self.pid == os.getpid():
            deadline = time.monotonic() + CLOSE_WAIT_S
            for pool in pools:  # a fetch stuck in a read is not waited for past this
                pool.shutdown(max(0.0, deadline - time.monotonic()), cancel_futures=True)
            if parts is not None:
                for job in parts.close():  # a front waiting for a dropped part stops waiting
                    if isinstance(job, functools.partial) and isinstance(job.args[0], Incoming):
                        job.args[0].settle_tail(None, closed(self.url))
            for inc in list(self.streams.values()):
                # a shard whose every part is in lands (synced, published) rather than
                # being thrown away: a peer, or the next run, finds it whole
                if not inc.whole_soon(LANDING_WAIT_S):
                    self.failed(inc, closed(self.url))
            with self.lock:
                self.ahead_errors.clear()
                self.closing = False
                self.next_generation()  # read again, it fetches and retries anew
        in_use, self.in_use = self.in_use, -1
        close_quietly([in_use])

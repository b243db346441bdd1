"""Streamed arrival: a raw shard mapped as soon as its front is verified, its values
arriving part by part (a remote supply's, runtime.storage.remote_supply; the file and
its parts: runtime.storage.streamed).

``stream`` maps shard ``k`` from the cache or starts its fetch: the header checked
against the CRC index.json records for it, then its metadata, each region checked,
while its values come in ranged parts on the part threads, in the order this
process's epoch first reads their samples (``read_order``). ``ready`` holds a batch
until the bytes of its samples are verified (the parts it waits for jump the queue).
When the last part is in, the whole file is checked against the index and published
in the cache (``landed``); a part that fails its retries fails the shard
(``failed``), and its batches raise that failure until the next epoch.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol, cast

import numpy as np

from dlop.formats import ShardReader
from dlop.formats.storage import Rejected, Retry, Storage, fetch, retrying
from dlop.formats.transcode import header_span

from ..errors import LoaderError
from .cache import Arriving, Held, write_at
from .holder import Holder
from .remote import fetch_head
from .streamed import (
    DONE,
    FLYING,
    LATER,
    LEAD,
    QUEUED,
    FrontFailed,
    Incoming,
    Lead,
    PartQueue,
    fetch_front,
    first_reads,
    fronts_of,
    lead_spans,
)


def closed(url: str) -> LoaderError:
    """What a batch, a fetch or a retry of a closed supply gets."""
    return LoaderError(f"{url}: the supply was closed")


class ArrivalHost(Holder, Protocol):
    """What streamed arrival uses of the supply besides ``Holder``: its storage and
    retries, its generation, who hears of a dropped shard, and how a shard
    is kept open (and recorded open or closed: ``open`` changes only through these)."""

    retry: Retry
    client: Callable[[], Storage]
    stopping: threading.Event  # set by close(): the fetches begun before it are stale
    dropped: Callable[[int], None] | None
    starts: np.ndarray
    shard_sizes: tuple[int, ...]

    def keep_open(self, k: int, reader: ShardReader, held: Held, whole: bool = False) -> None: ...

    def set_open(self, k: int, reader: ShardReader, held: Held, whole: bool) -> None: ...

    def set_closed(self, k: int) -> tuple[ShardReader, Held] | None: ...

    def opened(self, k: int, held: Held, what: str, stopping: threading.Event) -> ShardReader: ...

    def failure(self, k: int) -> BaseException: ...


class Arrivals:
    """The shards of one supply (``host``) arriving part by part in this process."""

    def __init__(self, host: ArrivalHost) -> None:
        self.host = host
        self.streams: dict[int, Incoming] = {}  # raw shards arriving part by part
        self.fronting: dict[int, threading.Event] = {}  # set once the front is in or failed
        self.arrivals: set[Arriving] = set()  # temporary files this process writes
        self.parts: PartQueue | None = None
        # byte ranges asked for before headers: close() stops them, so that a front
        # waiting for one reads its bytes itself (a read after close does not wait for
        # a range stalled before it)
        self.leads: weakref.WeakSet[Lead] = weakref.WeakSet()
        self.order: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # read_order's

    def stream(self, k: int, keep: bool, stopping: threading.Event) -> ShardReader | None:
        """Raw shard ``k``: mapped from the cache, or its fetch started part by part and
        its front verified. ``keep``: held for batches (waits for the fetch lock and
        room), else fetched ahead only: None when another process fetches it or the
        budget has no room now. ``stopping``: the generation of the read that asks
        (refused once the supply closed since: what a read begun before close() brings
        in is never a later read's)."""
        while True:
            with self.host.lock:
                if stopping.is_set():
                    raise closed(self.host.url)
                retry = self.host.retry  # its sleeps cut short by this generation's close
                inc = self.streams.get(k)
                if inc is not None and inc.reader is not None:  # its front is in
                    if keep and not inc.keep:  # a fetch ahead's: batches hold it now
                        inc.keep = True
                        self.host.keep_open(k, inc.reader, inc.held())
                    return inc.reader
                if (failed := self.host.ahead_errors.get(k)) is not None:
                    raise failed
                other = self.fronting.get(k)
                if other is None:
                    mine = self.fronting[k] = threading.Event()
                    break
            if not keep:
                return None  # being fetched here already
            other.wait()  # its front is in, or it failed: look again
        try:
            return self.start_stream(k, keep, stopping, retry)
        finally:
            with self.host.lock:
                del self.fronting[k]
            mine.set()

    def start_stream(
        self, k: int, keep: bool, stopping: threading.Event, retry: Retry
    ) -> ShardReader | None:
        """``stream``'s fetch of shard ``k`` (none under way in this process)."""
        info = self.host.index.shards[k]
        path = self.host.folder / info.file
        what = f"{self.host.url}: shard {k} ({info.file})"
        got = self.host.cache.arrive(path, info.bytes, wait=keep)
        if got is None:
            return None
        if isinstance(got, Held):
            if not keep:
                self.host.cache.let_go(got)
                return None
            return self.host.opened(k, got, what, stopping)
        with self.host.lock:
            self.arrivals.add(got)
        inc: Incoming | None = None
        lead: Lead | None = None
        try:
            store = self.host.client()
            spans = lead_spans(info.bytes, retry)
            if spans:  # asked for at once: the header comes with the first range
                lead = Lead(got, spans)
                with self.host.lock:
                    self.leads.add(lead)
                jobs = [
                    functools.partial(Lead.fetch, lead, i, store, info.file)
                    for i in range(len(spans))
                ]
                if not self.put([(LEAD, job) for job in jobs], stopping):
                    raise closed(self.host.url)  # stops the lead (below)
            head, layout = fetch_head(
                store,
                info.file,
                info.bytes,
                what,
                retry,
                info.header_crc32,
                None if lead is None else lead.take,
            )
            if stopping.is_set():  # closed meanwhile: the front is not fetched
                raise closed(self.host.url)
            if layout.num_samples != info.num_samples:
                raise LoaderError(
                    f"{what}: holds {layout.num_samples} samples, index.json says {info.num_samples}"
                )
            head_len = header_span(head, store.name_url(info.file), info.bytes)
            inc = Incoming(k, got, layout, head_len, retry, keep, lead, stopping)
            inc.ride(fronts_of(layout, info.bytes), retry, len(head))
            with self.host.lock:
                first = self.first_reads(k)
            ranks = inc.ranks(first)
            # The part the front waits for goes before the shard's others (whose samples'
            # places are known: a ragged field's wait for the front).
            ride = min((r for r in ranks if r < LATER), default=0) - 1
            ranks = [ride if p.end != p.hi else r for p, r in zip(inc.parts, ranks, strict=True)]
            self.queue(inc, ranks)  # fixed fields' values come in beside the front
            reader, fronts = fetch_front(
                store, info.file, inc, what, retry, info.crc32, (head, layout)
            )
            with self.host.lock, inc.cond:
                if inc.error is not None:  # a part failed meanwhile: failed() cleaned up
                    reader.close()
                    raise inc.error
                if stopping.is_set():  # begun before a close(): nothing after it takes it up
                    reader.close()
                    raise closed(self.host.url)
                self.streams[k] = inc
                if keep:
                    self.host.keep_open(k, reader, inc.held())
            inc.fronted(reader, fronts)
            ragged = [p.rank == LATER for p in inc.parts]
            if any(ragged):  # their samples' places are known now
                self.queue(inc, inc.ranks(first), only=ragged)
        except Exception as e:
            if inc is None:
                failure = self.host.note_failure(k, e, stopping)
                if lead is not None:
                    lead.stop()  # nothing more is written into the file let go of
                self.let_go_of(got, failure)
                raise failure from None
            raise self.failed(inc, e) from None
        if not inc.parts:
            self.landed(inc)
        return reader

    def let_go_of(self, a: Arriving, failure: BaseException | None = None) -> None:
        """Removes a shard that will not arrive whole (once), recording a fetch
        ``failure`` for the node's other processes (CacheDir.abandon)."""
        with self.host.lock:
            if a not in self.arrivals:
                return
            self.arrivals.discard(a)
        self.host.cache.abandon(a, failure)

    def queue(self, inc: Incoming, ranks: list[int], only: list[bool] | None = None) -> None:
        """Puts the parts of ``inc`` (those ``only`` marks) in the fetch queue at ``ranks``."""
        jobs = []
        with inc.cond:
            for i, (part, rank) in enumerate(zip(inc.parts, ranks, strict=True)):
                if (only is None or only[i]) and part.state == QUEUED:
                    part.rank = rank
                    jobs.append((rank, functools.partial(self.fetch_part, inc, i, rank)))
        if jobs and not self.put(jobs, inc.stopping):
            inc.settle_tail(None, closed(self.host.url))

    def put(
        self, jobs: Sequence[tuple[int, Callable[[], None]]], stopping: threading.Event
    ) -> bool:
        """Puts ``jobs`` (rank, job) of a fetch of generation ``stopping`` in the fetch
        queue; False when the supply closes or closed since."""
        with self.host.lock:
            if stopping.is_set():  # closing or closed: close() fails what is arriving
                return False
            if self.parts is None:
                self.parts = PartQueue(self.host.retry.parallel_parts)
            parts = self.parts
        return parts.put(jobs)

    def fetch_part(self, inc: Incoming, i: int, rank: int) -> None:
        """Fetches, verifies and writes part ``i`` of a shard arriving (a part thread)."""
        part = inc.parts[i]
        with inc.cond:
            if inc.error is not None or part.state != QUEUED or rank != part.rank:
                return  # done, under way, or queued again at another rank
            part.state = FLYING
        name = self.host.index.shards[inc.k].file
        what = f"{self.host.url}: shard {inc.k} ({name}) bytes {part.lo}..{part.hi}"
        lead = inc.lead  # the first try's bytes, when its lead has them
        led = False  # the bytes checked came from the lead: in the file already
        try:
            store = self.host.client()

            def read() -> bytes:
                nonlocal lead, led
                if lead is not None:  # its failure counts as this first try's
                    taking, lead = lead, None
                    got = taking.take(part.lo, part.end)
                    if got is not None:  # the mapped file: checked as any buffer
                        led = True
                        return cast(bytes, got)
                led = False
                try:
                    data = store.read_once(name, part.lo, part.end)
                except Exception as e:
                    inc.hand_tail(part, None, e)  # the front reads its span itself, now
                    raise
                if len(data) != part.end - part.lo:
                    inc.hand_tail(part, None)
                return data

            data = fetch(
                read, inc.check(part), what, store.name_url(name), self.host.retry, (FrontFailed,)
            )
            if not led:  # a lead's bytes are in the file already
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
        info = self.host.index.shards[inc.k]
        reader = inc.reader
        try:
            assert reader is not None  # parts are checked only once the front is in
            if inc.lead is not None:
                inc.lead.stop()
            if inc.file_crc() != info.crc32:
                self.fetch_gaps(inc)
            with inc.writer():  # outside the lock: a sync takes long
                os.fsync(inc.arriving.fd)
            with self.host.lock, inc.cond:
                if inc.error is not None:
                    return
                held = self.host.cache.publish(inc.arriving, info.crc32, keep=inc.keep, synced=True)
                self.arrivals.discard(inc.arriving)
                self.streams.pop(inc.k, None)
                if inc.keep:
                    self.host.set_open(inc.k, reader, held, whole=True)
                    self.host.sizes.learn(inc.k, held.bytes)
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
        info = self.host.index.shards[inc.k]
        store = self.host.client()

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

        what = f"{self.host.url}: shard {inc.k} ({info.file})"
        retrying(once, what, store.name_url(info.file), self.host.retry, give_up=(FrontFailed,))

    def failed(self, inc: Incoming, e: BaseException) -> BaseException:
        """``inc`` will not arrive: batches that read it fail until the next epoch with
        its first failure (``note_failure``), returned. Its mapping stays valid for views
        still using it (the file is removed). Once it has failed, a later failure (a part
        that was still in a network read: its write refused) is its echo, not recorded:
        recorded after the failures were forgotten (a new epoch), it would fail the
        shard's next fetch."""
        with inc.cond:
            if inc.error is not None:
                return inc.error
        e = self.host.note_failure(inc.k, e, inc.stopping)
        with inc.cond:
            if inc.error is not None or inc.done:
                return e
            inc.error = e
            while inc.writing:
                inc.cond.wait()
            inc.cond.notify_all()
        if inc.lead is not None:
            inc.lead.stop()
        inc.settle_tail(None, e)  # a front waiting for its last span stops waiting
        with self.host.lock:
            if self.streams.get(inc.k) is inc:
                del self.streams[inc.k]
            got = self.host.open.get(inc.k)
            held = got is not None and got[0] is inc.reader
            if held:
                self.host.set_closed(inc.k)
                self.host.loose.pop(inc.k, None)
                if self.host.dropped is not None:
                    self.host.dropped(inc.k)
        if not held and inc.reader is not None:
            inc.reader.close()  # a fetch ahead's: nothing reads it
        self.let_go_of(inc.arriving, e)
        return e

    def ready(self, k: int, samples: np.ndarray, names: Sequence[str] | None = None) -> bool:
        """Returns once every byte of ``samples`` (shard-local numbers) in fields ``names``
        is verified (the parts they wait for jump the fetch queue): True while the rest of
        the shard is still arriving, when only those bytes may be read."""
        if not self.streams and k in self.host.open:  # nothing arriving (a warm epoch): no lock
            return False
        with self.host.lock:
            inc = self.streams.get(k)
            if inc is None and k not in self.host.open:  # held by the batch, so it failed
                raise self.host.failure(k)
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
        of = np.searchsorted(self.host.starts, flat, side="right") - 1
        by_shard = np.argsort(of, kind="stable")
        bounds = np.searchsorted(of[by_shard], np.arange(len(self.host.shard_sizes) + 1))
        with self.host.lock:
            self.order = (flat, by_shard, bounds)

    def first_reads(self, k: int) -> np.ndarray | None:
        """Per sample of shard ``k``, where this epoch first reads it (read_order); None
        when no order was given (called under the lock)."""
        if self.order is None:
            return None
        flat, by_shard, bounds = self.order
        lo, hi = int(self.host.starts[k]), int(self.host.starts[k + 1])
        return first_reads(flat, lo, hi, by_shard[bounds[k] : bounds[k + 1]])

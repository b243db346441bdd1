"""A remote archive's source stage: shards fetched into the node-local cache on ``ask``
(in the background), held while batches read them, let go of on ``release``.

A shard is held (a shared lock on its cached file, runtime.cache) from the
moment it is mapped until no batch asks for it; only then may any process on
the node evict it. Shards read without an ask (``ds[i]``, a DataLoader over the
Dataset) stay held while they are among the ``loose_shards`` used last.

Ahead of the asks, ``ahead`` hears which shards later batches read first, in
order (runtime.prefetch.Asks): one background thread fetches the first
``ahead_shards`` of them into the cache, not held, while the shards this
process holds plus those ahead fit the budget, so a new window's shards are
in place (a warm cache: only mapped) before its first batch asks for them.

Budget checks count a shard at its size in the cache: for a block-coded (zstd)
shard, the raw copy, bounded from its header (one small ranged read) before
the shard itself is fetched.

After a fork (DataLoader workers) the child starts afresh: it holds nothing its
parent held, and makes its own threads and storage client.
"""

from __future__ import annotations

import functools
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from dlop.formats import FormatError, Index, ShardReader
from dlop.formats.transcode import needs_transcode, transcode_raw

from .cache import CacheDir, Held
from .errors import LoaderError, ShardChangedError, UsageError
from .remote import DEFAULT_RETRY, Retry, checker, fetch_bytes, join
from .remote_sizes import ShardSizes

Filesystem = Callable[[], tuple[Any, str]]  # this process's (filesystem, archive path)


class RemoteSource:
    """Shards of the archive at ``url``, cached under ``folder`` of ``cache``."""

    def __init__(
        self,
        url: str,
        index: Index,
        cache: CacheDir,
        folder: Path,
        filesystem: Filesystem,
        retry: Retry = DEFAULT_RETRY,
        loose_shards: int = 2,
        fetch_threads: int = 2,
        ahead_shards: int = 16,
    ) -> None:
        self.url = url
        self.index = index
        self.cache = cache
        self.folder = folder
        self.filesystem = filesystem
        self.retry = retry
        self.loose_shards = loose_shards
        self.fetch_threads = fetch_threads
        self.ahead_shards = ahead_shards
        self.transcode = needs_transcode(index.fields)
        self.sizes = ShardSizes(url, index, cache.max_bytes, filesystem, retry)
        cache.squeeze = self.squeeze
        self.pid = -1
        self.fresh()

    def fresh(self) -> None:
        """This process's state: nothing held, no fetches under way."""
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.refs = [0] * len(self.index.shards)
        self.open: dict[int, tuple[ShardReader, Held]] = {}
        self.pending: dict[int, Future[ShardReader]] = {}
        self.loose: OrderedDict[int, None] = OrderedDict()
        self.pool: ThreadPoolExecutor | None = None
        self.upcoming: list[int] = []  # shards later batches read first, in order
        self.ahead_job: Future[None] | None = None
        self.ahead_pool: ThreadPoolExecutor | None = None
        self.ahead_skipped: set[int] = set()  # no room, or fetched elsewhere: try at the next ask
        # A failed fetch ahead, raised by the batch that reads the shard: its attempts are spent.
        self.ahead_errors: dict[int, Exception] = {}

    def mine(self) -> None:
        if self.pid != os.getpid():
            self.fresh()  # a forked child: what the parent held is the parent's

    def ask(self, shards: Sequence[int]) -> None:
        """Counts a hold on each shard and starts fetching those not cached here yet."""
        self.mine()
        with self.lock:
            for k in sorted(set(shards)):
                self.refs[k] += 1
            try:
                self.check_in_flight()
            except UsageError:
                for k in set(shards):
                    self.refs[k] -= 1
                raise
            for k in sorted(set(shards)):
                if k not in self.open and k not in self.pending:
                    if self.pool is None:
                        self.pool = ThreadPoolExecutor(self.fetch_threads, "dlop-fetch")
                    self.pending[k] = self.pool.submit(self.load, k)

    def release(self, shards: Sequence[int]) -> None:
        """Drops one hold on each shard. A shard no batch holds stays mapped while it is
        among the ``loose_shards`` let go of last, then may be evicted."""
        self.mine()
        with self.lock:
            for k in sorted(set(shards)):
                self.refs[k] = max(0, self.refs[k] - 1)
                if self.refs[k] == 0:
                    self.loose[k] = None
                    self.loose.move_to_end(k)
            while len(self.loose) > self.loose_shards:
                old, _ = self.loose.popitem(last=False)
                if self.refs[old] == 0:
                    self.drop(old)

    def ahead(self, shards: Sequence[int] | np.ndarray) -> None:
        """Shards later batches read first, in the order they do (none asked for yet):
        the first ``ahead_shards`` are fetched into the cache in the background."""
        self.mine()
        upcoming = [int(k) for k in shards[: self.ahead_shards]]
        with self.lock:
            self.upcoming = upcoming
            self.ahead_skipped.clear()
            if upcoming and (self.ahead_job is None or self.ahead_job.done()):
                if self.ahead_pool is None:
                    self.ahead_pool = ThreadPoolExecutor(1, "dlop-ahead")
                self.ahead_job = self.ahead_pool.submit(self.fetch_ahead)

    def next_ahead(self) -> int | None:
        """The first upcoming shard not cached yet whose fetch keeps what this process
        holds plus the shards before it within the budget (called under the lock)."""
        held = sum(1 for k, r in enumerate(self.refs) if r > 0 or k in self.open)
        fit = self.cache.max_bytes // max(1, self.sizes.largest)
        for i, k in enumerate(self.upcoming):
            if held + i + 1 > fit:
                return None
            if k in self.open or k in self.pending or k in self.ahead_skipped:
                continue
            if k in self.ahead_errors:
                continue
            if not (self.folder / self.index.shards[k].file).exists():
                return k
        return None

    def fetch_ahead(self) -> None:
        """Fetches upcoming shards into the cache, one at a time, until none is left that
        fits (runs on the ahead thread)."""
        while True:
            with self.lock:
                k = self.next_ahead()
            if k is None:
                return
            info = self.index.shards[k]
            path = self.folder / info.file
            what = f"{self.url}: shard {k} ({info.file})"
            try:
                fetch = functools.partial(self.fetch_ahead_one, k, what)
                done = self.cache.prefetch(path, self.sizes.size(k), fetch, self.to_raw(path))
            except Exception as e:
                with self.lock:
                    self.ahead_errors.setdefault(k, e)
                continue
            if not done:
                with self.lock:
                    self.ahead_skipped.add(k)

    def squeeze(self) -> bool:
        """Lets go of the shards kept only because they were read last; True if any."""
        with self.lock:
            loose = [k for k in self.loose if self.refs[k] == 0 and k in self.open]
            for k in loose:
                self.drop(k)
        return bool(loose)

    def check_in_flight(self) -> None:
        """Refuses holds that could never all be cached (called under the lock)."""
        self.sizes.check_in_flight(sum(1 for r in self.refs if r > 0))

    def shard(self, k: int) -> ShardReader:
        """Shard ``k`` mapped from the cache: fetched now, or waited for if under way.
        Callers hold it (``ask``) for as long as they read it."""
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
                future.set_result(self.load(k))
            except BaseException as e:
                future.set_exception(e)
        return future.result()

    def load(self, k: int) -> ShardReader:
        """Fetches (once per node) and maps shard ``k``; called on a fetch thread or inline."""
        info = self.index.shards[k]
        path = self.folder / info.file
        what = f"{self.url}: shard {k} ({info.file})"
        try:
            held = self.cache.get(path, lambda: self.fetch(k, what), self.to_raw(path))
            try:
                reader = self.map(k, held)
            except FormatError as e:
                self.cache.let_go(held)
                raise LoaderError(f"{what}: the cached copy does not read ({e})") from None
            self.sizes.learn(k, held.bytes)
            with self.lock:
                self.open[k] = (reader, held)
                if self.refs[k] == 0 and k not in self.loose:
                    self.loose[k] = None  # fetched for a hold already let go of
            return reader
        finally:
            with self.lock:
                self.pending.pop(k, None)

    def fetch_ahead_one(self, k: int, what: str) -> bytes:
        """``fetch`` for the ahead thread: a failure is noted under the shard's fetch lock,
        so the batch that reads the shard next raises it instead of trying again."""
        try:
            return self.fetch(k, what)
        except Exception as e:
            with self.lock:
                self.ahead_errors[k] = e
            raise

    def fetch(self, k: int, what: str) -> bytes:
        with self.lock:
            failed = self.ahead_errors.pop(k, None)
        if failed is not None:
            raise failed
        if self.transcode:  # its raw copy must fit beside what is held: known before the body
            self.sizes.check_fits(k, what)
            with self.lock:
                self.check_in_flight()
        fs, base = self.filesystem()
        info = self.index.shards[k]
        check = checker(info.bytes, info.crc32)
        return fetch_bytes(fs, join(base, info.file), info.bytes, check, what, self.retry)

    def to_raw(self, path: Path) -> Callable[[bytes], bytes] | None:
        """Decodes a block-coded shard once, as it arrives: the cache keeps it raw."""
        if not self.transcode:
            return None

        def write(data: bytes) -> bytes:
            src = path.with_name(f"{path.name}.tmp-{os.getpid()}-zsrc")
            dst = path.with_name(f"{path.name}.tmp-{os.getpid()}-raw")
            # Outside the budget for a moment: these live in /tmp-like scratch, not the cache.
            scratch = Path(os.environ.get("TMPDIR", "/tmp"))
            src, dst = scratch / src.name, scratch / dst.name
            try:
                src.write_bytes(data)
                transcode_raw(src, dst)
                return dst.read_bytes()
            finally:
                src.unlink(missing_ok=True)
                dst.unlink(missing_ok=True)

        return write

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
        """Unmaps shard ``k`` and lets go of its hold (called under the lock)."""
        self.loose.pop(k, None)
        got = self.open.pop(k, None)
        if got is not None:
            reader, held = got
            reader.close()  # views still in use keep the mapping; the file may go meanwhile
            self.cache.let_go(held)

    def check(self, shards: Sequence[int] | np.ndarray) -> None:
        """Refuses a cached shard that shrank under its mapping (see LocalSource.check)."""
        for k in np.unique(np.asarray(shards, dtype=np.int64)).tolist():
            got = self.open.get(k)
            if got is not None and got[0].mapped_size() < got[1].bytes:
                raise ShardChangedError(
                    f"{got[1].path}: cached shard shrank from {got[1].bytes} to "
                    f"{got[0].mapped_size()} bytes while mapped; nothing but dlop should "
                    "write in the cache folder"
                )

    def held_bytes(self) -> int:
        return sum(h.bytes for _, h in self.open.values())

    def close(self) -> None:
        """Lets go of every shard and stops the fetch threads."""
        with self.lock:
            for k in list(self.open):
                self.drop(k)
            pools = [p for p in (self.pool, self.ahead_pool) if p is not None]
            self.pool = self.ahead_pool = None
            self.upcoming = []
        if self.pid == os.getpid():
            for pool in pools:
                pool.shutdown(wait=True, cancel_futures=True)

"""What each shard of a remote archive takes in the node-local cache, and the budget
checks made on it (runtime.storage.remote_supply).

A raw shard is cached as stored: its size is the index's. A block-coded (zstd)
shard is cached raw (formats.transcode), often several times its stored size:
its size is bounded from its header (one small ranged read, fetched once)
before the shard is fetched, and known exactly once cached.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from dlop.formats import FormatError, Index
from dlop.formats.storage import DEFAULT_RETRY, Retry, Storage
from dlop.formats.transcode import needs_transcode, raw_size_bound

from ..errors import LoaderError, UsageError
from .cache import STAMP_BYTES
from .remote import fetch_head

# The largest shard read from storage (1 TiB, the largest --shard-bytes of a compile): an
# index naming a larger one is damaged or not dlop's, and is refused before any plan.
MAX_REMOTE_SHARD_BYTES = 1 << 40


class ShardSizes:
    """Shard sizes in the cache of the archive at ``url`` under a ``max_bytes`` budget."""

    def __init__(
        self,
        url: str,
        index: Index,
        max_bytes: int,
        client: Callable[[], Storage],
        retry: Retry = DEFAULT_RETRY,
    ) -> None:
        for k, s in enumerate(index.shards):
            if s.bytes > MAX_REMOTE_SHARD_BYTES:
                raise LoaderError(
                    f"{url}: index.json says shard {k} ({s.file}) is {s.bytes} bytes; a shard "
                    f"read from storage is at most {MAX_REMOTE_SHARD_BYTES} (1 TiB), so the "
                    "index is damaged or not a dlop archive's"
                )
        self.url = url
        self.index = index
        self.max_bytes = max_bytes
        self.client = client
        self.retry = retry
        self.lock = threading.Lock()
        self.transcode = needs_transcode(index.fields)
        self.known: list[int | None] = [None if self.transcode else s.bytes for s in index.shards]
        # Stored sizes bound a raw copy from below: the largest counts them until headers say more.
        self.largest = max((s.bytes for s in index.shards), default=0)

    def learn(self, k: int, size: int) -> None:
        """Shard ``k`` takes ``size`` bytes in the cache."""
        with self.lock:  # fetch threads learn sizes side by side
            self.known[k] = size
            self.largest = max(self.largest, size)

    def size(self, k: int) -> int:
        """Shard ``k``'s size in the cache, or for a block-coded shard not cached yet a
        bound on its raw copy read from its header."""
        known = self.known[k]
        if known is None:
            store = self.client()
            info = self.index.shards[k]
            what = f"{self.url}: shard {k} ({info.file}) header"
            head, _ = fetch_head(store, info.file, info.bytes, what, self.retry, info.header_crc32)
            try:
                known = raw_size_bound(head, store.name_url(info.file), info.bytes)
            except FormatError as e:
                raise LoaderError(f"{what}: {e}") from None
            self.learn(k, known)
        return known

    def note(self) -> str:
        return ", cached raw: zstd shards are decoded once" if self.transcode else ""

    def check_in_flight(self, held: int) -> None:
        """Refuses ``held`` shards at once when they could not all be cached."""
        need = held * (self.largest + STAMP_BYTES)
        if need > self.max_bytes:
            raise UsageError(
                f"{self.url}: {held} shards are in flight at once (the batches being made "
                f"and the next ones), up to {held} x ({self.largest} bytes{self.note()} + "
                f"{STAMP_BYTES} for its stamp) = {need}, above cache_bytes {self.max_bytes}; "
                "raise cache_bytes "
                "(DLOP_CACHE_BYTES) to at least that, or use order='window' with fewer "
                "window_shards"
            )

    def check_budget(self, shards_in_flight: int, why: str = "") -> None:
        """Refuses a budget below ``shards_in_flight`` times the largest shard as cached
        (for a block-coded archive, the raw copy of its largest stored shard): the
        shards held at once (``why``: the settings that make it so) could not all be
        cached."""
        stored = [s.bytes for s in self.index.shards]
        if self.transcode and stored:
            self.size(stored.index(max(stored)))
        n = min(shards_in_flight, len(stored))
        need = n * (self.largest + STAMP_BYTES)
        if need > self.max_bytes:
            because = f" ({why})" if why else ""
            raise UsageError(
                f"{self.url}: cache_bytes {self.max_bytes} is below what reading needs "
                f"in flight: {n} shards x ({self.largest} bytes, the largest{self.note()}, "
                f"+ {STAMP_BYTES} for its stamp) = {need}, {n} being what it holds at "
                f"once at most{because}; raise "
                f"cache_bytes (DLOP_CACHE_BYTES) to at least {need}, or hold fewer shards "
                "at once (order='window' with fewer window_shards, a smaller prefetch or "
                "batch_size)"
            )

    def check_fits(self, k: int, what: str) -> None:
        """Refuses shard ``k`` before it is fetched when its raw copy exceeds the budget."""
        size = self.size(k)
        if size > self.max_bytes:
            raise UsageError(
                f"{what}: cached raw it takes up to {size} bytes (stored: "
                f"{self.index.shards[k].bytes}), above cache_bytes {self.max_bytes}; "
                "raise cache_bytes (DLOP_CACHE_BYTES) to at least twice that"
            )

"""Fetching an archive's files from its storage (formats.storage): whole or in ranged
parts fetched in parallel, checked against the index, retried with backoff.

Any fsspec URL works (``s3://``, ``gs://``, ``https://``, ``memory://``...);
the extra that provides the protocol must be installed (``pip install
'dlop[s3]'`` for S3). Clients are made lazily per process, keyed by pid, so a
forked DataLoader worker never uses a client (and its connection pool and
event loop) inherited from its parent.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from dlop.formats import INDEX_NAME, FormatError, storage
from dlop.formats.constants import PREAMBLE
from dlop.formats.header import ShardLayout, parse_header, read_preamble
from dlop.formats.storage import DEFAULT_RETRY, Retry, Storage

from ..errors import LoaderError

T = TypeVar("T")
ENV_PREFIXES = ("AWS_", "GOOGLE_", "GCS", "FSSPEC_")
_clients: dict[tuple[int, str], Storage] = {}
_clients_lock = threading.Lock()


def storage_at(url: str, storage_options: Mapping[str, Any] | None = None) -> Storage:
    """This process's storage of the archive at ``url`` (formats.storage.open_storage),
    its client made once per process, options and storage environment."""
    options = dict(storage_options or {})
    # Clients also read their settings from the environment (AWS_ENDPOINT_URL, ...).
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    key = (os.getpid(), json.dumps([url, options, env], sort_keys=True, default=repr))
    with _clients_lock:
        got = _clients.get(key)
        if got is None:
            got = _clients[key] = storage.open_storage(url, options)
    return got


# A shard's first bytes fetched to read its header: most headers fit, longer ones take a second read.
HEAD_BYTES = 64 << 10


def in_parallel(retry: Retry) -> storage.MapParts | None:
    """Runs a fetch's ranged parts on up to ``retry.parallel_parts`` threads."""
    if retry.parallel_parts < 2:
        return None
    return functools.partial(each_span, retry=retry)


def each_span(
    read: Callable[[tuple[int, int]], T], spans: Iterable[tuple[int, int]], retry: Retry
) -> list[T]:
    """``read`` of each span, in order: side by side on up to ``retry.parallel_parts``
    threads when there are several."""
    spans = list(spans)
    if len(spans) < 2 or retry.parallel_parts < 2:
        return [read(s) for s in spans]
    with ThreadPoolExecutor(min(retry.parallel_parts, len(spans))) as pool:
        return list(pool.map(read, spans))


def fetch_head(
    store: Storage,
    name: str,
    file_size: int,
    what: str,
    retry: Retry = DEFAULT_RETRY,
    header_crc32: int | None = None,
    first: Callable[[int, int], bytes | memoryview | None] | None = None,
) -> tuple[bytes, ShardLayout]:
    """A shard's first bytes through its JSON header (SPEC.md §2) and its layout: one
    ranged read of ``HEAD_BYTES``, a second when the header is longer, tried again
    while they come short or fail the header's checks (a corrupt transfer); a header
    with another CRC than ``header_crc32`` (the index's record of it, SPEC.md §6: the
    object is not the one the index lists) is refused at once. FetchError names
    ``what`` when every try failed. ``first(lo, hi)``: where the first try takes its
    bytes from when it has them (streamed ``Lead.take``), else None."""
    url = store.name_url(name)
    tries = 0

    def read(lo: int, hi: int) -> bytes:
        got = first(lo, hi) if first is not None and tries == 1 else None
        return store.read_once(name, lo, hi) if got is None else bytes(got)

    def once() -> tuple[bytes, ShardLayout]:
        nonlocal tries
        tries += 1
        head = read(0, min(file_size, HEAD_BYTES))
        try:
            hlen, crc = read_preamble(url, head, file_size)
            if header_crc32 is not None and crc != header_crc32:  # no retry changes it
                raise storage.Refused(
                    f"its header's CRC-32 is {crc:#010x}, index.json records "
                    f"{header_crc32:#010x}: the object is not the shard the index lists "
                    "(replaced, by a compile uploaded since the index was read?)"
                )
            span = PREAMBLE.size + hlen
            if span > len(head):
                head = read(0, min(file_size, span))
            if len(head) < span:
                raise storage.Rejected(
                    f"got {len(head)} of its first {span} bytes (truncated transfer?)"
                )
            return head, parse_header(url, head[PREAMBLE.size : span], crc, file_size)
        except FormatError as e:
            raise storage.Rejected(str(e)) from None

    return storage.retrying(once, what, url, retry)


def fetch_index(store: Storage, url: str, max_bytes: int, retry: Retry = DEFAULT_RETRY) -> bytes:
    """The archive's ``index.json`` (bytes, at most ``max_bytes``): one ranged read of
    ``max_bytes + 1`` bytes, so an index over the cap is refused at once without being
    read whole (a server that ignores Range still sends it all)."""
    what = f"{url}: index.json"
    data = store.fetch_range(INDEX_NAME, 0, max_bytes + 1, exact=False, retry=retry, what=what)
    if len(data) > max_bytes:
        raise LoaderError(
            f"{url}: index.json: {store.name_url(INDEX_NAME)} holds more than its "
            f"{max_bytes}-byte cap (SPEC.md §8); point the URL at an archive dlop wrote"
        )
    return data

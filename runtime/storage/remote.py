"""Fetching an archive's files from object storage through fsspec: whole or in ranged
parts fetched in parallel, checked against the index, retried with backoff.

Any fsspec URL works (``s3://``, ``gs://``, ``https://``, ``memory://``...);
the extra that provides the protocol must be installed (``pip install
'dlop[s3]'`` for S3). Clients are made lazily per process, keyed by pid, so a
forked DataLoader worker never uses a client (and its connection pool and
event loop) inherited from its parent.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dlop.formats import INDEX_NAME, FormatError, storage, urls
from dlop.formats.storage import DEFAULT_RETRY, Retry
from dlop.formats.transcode import header_span

from ..errors import LoaderError

ENV_PREFIXES = ("AWS_", "GOOGLE_", "GCS", "FSSPEC_")
_clients: dict[tuple[int, str], tuple[Any, str]] = {}
_clients_lock = threading.Lock()


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """This process's fsspec filesystem for ``url`` and the path within it (formats.urls),
    made once per process, options and storage environment."""
    options = dict(storage_options or {})
    # Clients also read their settings from the environment (AWS_ENDPOINT_URL, ...).
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    key = (os.getpid(), json.dumps([url, options, env], sort_keys=True, default=repr))
    with _clients_lock:
        got = _clients.get(key)
        if got is None:
            try:
                got = _clients[key] = urls.filesystem(url, options)
            except urls.StorageError as e:
                raise LoaderError(str(e)) from None
            storage.retry_here(got[0], options)
    return got


# A shard's first bytes fetched to read its header: most headers fit, longer ones take a second read.
HEAD_BYTES = 64 << 10


def fetch_bytes(
    fs: Any,
    path: str,
    size: int | None,
    check: Callable[[bytes], str | None],
    what: str,
    retry: Retry = DEFAULT_RETRY,
    head: bool = False,
) -> bytes:
    """The object at ``path``, ``size`` bytes when known (then in ranged parts fetched in
    parallel), or with ``head`` its first ``size`` bytes (one ranged read); accepted once
    ``check(data)`` returns None (else a reason); timeouts, resets, 5xx, SlowDown,
    truncated or corrupt data are retried with backoff, and LoaderError names ``what``
    and the URL when every attempt failed."""

    def read() -> bytes:
        if head and size is not None:
            return bytes(fs.cat_file(path, start=0, end=size))
        return fetch_once(fs, path, size, retry)

    try:
        return storage.fetch(read, check, what, path, retry)
    except storage.FetchError as e:
        raise LoaderError(str(e)) from None


def fetch_once(fs: Any, path: str, size: int | None, retry: Retry) -> bytes:
    if size is None or size <= retry.part_bytes or retry.parallel_parts < 2:
        return bytes(fs.cat_file(path))
    cuts = [*range(0, size, retry.part_bytes), size]
    spans = list(itertools.pairwise(cuts))
    with ThreadPoolExecutor(min(retry.parallel_parts, len(spans))) as pool:
        parts = list(pool.map(lambda s: bytes(fs.cat_file(path, start=s[0], end=s[1])), spans))
    return b"".join(parts)


def fetch_head(
    fs: Any, path: str, file_size: int, what: str, retry: Retry = DEFAULT_RETRY
) -> bytes:
    """A shard's first bytes through its JSON header (SPEC.md §2): one ranged read of
    ``HEAD_BYTES``, a second when the header is longer."""

    def check_length(want: int) -> Callable[[bytes], str | None]:
        return storage.length_is(want, f"the shard's first {want}")

    first = min(file_size, HEAD_BYTES)
    data = fetch_bytes(fs, path, first, check_length(first), what, retry, head=True)
    try:
        span = header_span(data, path, file_size)
    except FormatError as e:
        raise LoaderError(f"{what}: {e}") from None
    if span > len(data):
        data = fetch_bytes(fs, path, span, check_length(span), what, retry, head=True)
    return data


def fetch_index(
    fs: Any, base: str, url: str, max_bytes: int, retry: Retry = DEFAULT_RETRY
) -> bytes:
    """``index.json`` of the archive at ``base`` (bytes, at most ``max_bytes``): one
    ranged read of ``max_bytes + 1`` bytes, so an index over the cap is refused at once
    without being read whole (a server that ignores Range still sends it all)."""
    path = join(base, INDEX_NAME)
    data = fetch_bytes(fs, path, max_bytes + 1, lambda _: None, f"{url}: index.json", retry, True)
    if len(data) > max_bytes:
        raise LoaderError(
            f"{url}: index.json: {path} holds more than its {max_bytes}-byte cap "
            "(SPEC.md §8); point the URL at an archive dlop wrote"
        )
    return data


def join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name

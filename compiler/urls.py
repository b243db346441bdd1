"""SOURCE and OUT at fsspec URLs (``s3://``, ``gs://``, ``https://``), over the one
storage interface (formats.storage): every listing, question and byte goes through a
``Storage`` opened once, with its retries and checks.

- SOURCE is listed through ``compiler.corpus.place`` (a ``StoredPlace`` over its
  storage; a local path is a ``LocalPlace``).
- Credentials and endpoints come from the usual environment (for S3-compatible
  servers ``AWS_ENDPOINT_URL``) or from ``--storage-option key=value`` pairs
  (``parse_storage_options``); a missing backend is a StorageError naming the extra.
- ``fetch_inputs(items, options)`` gives a worker the bytes of URL inputs (and of
  their masks) as ``Item.fetched``, for decode to read from memory.
- OUT, local or a URL, is a storage (compiler.output.store over formats.storage).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from dlop.formats import storage
from dlop.formats.urls import is_url, scheme

from .errors import CompileError

# One input fetched into a worker's memory; a larger one is a bad input.
MAX_FETCH_BYTES = 4 << 30


def parse_storage_options(pairs: Sequence[str] | None) -> dict[str, Any]:
    """``key=value`` pairs as fsspec storage options; a value that is JSON (true, 3,
    {"region_name": "x"}) is parsed, anything else stays text."""
    options: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise CompileError(
                f"--storage-option {pair!r}: expected KEY=VALUE, e.g. endpoint_url=http://host:9000"
            )
        try:
            options[key.strip()] = json.loads(value)
        except ValueError:
            options[key.strip()] = value
    return options


# -- input bytes for a worker ---------------------------------------------------------------


def fetch_inputs(
    items: Sequence[Any],
    storage_options: dict[str, Any] | None = None,
    systems: dict[str, Any] | None = None,
) -> None:
    """Fills ``Item.fetched`` with the bytes of every URL an item reads (its input and its
    masks), so decode reads them from memory. An object that is missing, refused (no
    permission, no ranged reads) or over the cap makes the item a bad input naming why;
    a store that could not be reached (every try failed) raises, stopping the unit. Local
    items are left alone. ``systems`` (scheme -> storage) is filled and reused across
    calls when given: a new S3 client costs more than a chunk's fetches."""
    systems = {} if systems is None else systems
    for item in items:
        if item.error is not None:
            continue
        wanted = [item.path, *(item.masks or {}).values()]
        remote = [u for u in wanted if u is not None and is_url(u)]
        if not remote:
            continue
        fetched: dict[str, bytes] = {}
        for url in remote:
            proto = scheme(url) or ""
            if proto not in systems:
                systems[proto] = storage.open_storage(url, storage_options, whole_urls=True)
            try:
                fetched[url] = systems[proto].fetch(url, cap=MAX_FETCH_BYTES)
            except storage.TooLargeError:
                item.error = (
                    f"{url}: larger than the {MAX_FETCH_BYTES}-byte cap on one input read "
                    "into memory"
                )
            except storage.FetchError as e:
                if e.cause is None:  # every try failed: the store, not the input (the unit
                    raise  # stops, and a --resume tries it again)
                missing = isinstance(e.cause, FileNotFoundError)
                item.error = f"{url}: no such object" if missing else f"{url}: cannot be read ({e})"
            if item.error is not None:
                break
        item.fetched = None if item.error is not None else fetched


# -- where OUT may be -------------------------------------------------------------------------


# Schemes that name one storage under two names, for when fsspec's backend for them (which
# lists its names) is not installed.
SCHEME_FAMILIES = {"s3a": "s3", "gcs": "gs", "abfs": "az", "abfss": "az", "adl": "az"}


def _storage_of(url: str) -> tuple[str, str]:
    """(the storage's family: one name for all of its schemes, the path inside it without
    slashes at either end): ``s3a://b/x/`` and ``s3://b/x`` give ("s3", "b/x")."""
    proto = scheme(url) or ""
    family = SCHEME_FAMILIES.get(proto, proto)
    try:
        from fsspec import get_filesystem_class

        names = get_filesystem_class(proto).protocol
        family = names if isinstance(names, str) else names[0]
    except (ImportError, ValueError):
        pass  # backend missing or scheme unknown: the table above
    return family, url[len(proto) + 3 :].strip("/")


def url_inside(inner: str, outer: str) -> bool:
    """Whether URL ``inner`` is ``outer`` or lies below it: the same storage (any of its
    schemes, s3 and s3a alike), bucket and prefix."""
    (fa, a), (fb, b) = _storage_of(inner), _storage_of(outer)
    return fa == fb and (a == b or a.startswith(b + "/") or not b)


def check_url_apart(out: str, source_folders: Sequence[str]) -> None:
    """Refuses a URL OUT that is, holds, or lies inside a folder the corpus is read from."""
    for folder in source_folders:
        if not is_url(folder):
            continue
        if url_inside(out, folder) or url_inside(folder, out):
            raise CompileError(
                f"{out}: the output prefix overlaps the corpus prefix {folder}; a compile writes "
                "(and --overwrite deletes) only outside what it reads. Choose an output prefix "
                "outside the corpus"
            )

"""URLs of object storage (``s3://``, ``gs://``, ``https://``, any fsspec URL): which
texts are URLs, and the fsspec filesystem of one.

Shared by the compiler (SOURCE and OUT, compiler.urls) and the runtime (archives
read through the shard cache, runtime.remote); each turns ``StorageError`` into
its own error type. Pure: fsspec is imported only when a filesystem is asked
for, and nothing here starts threads or keeps clients.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .errors import DlopError

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
# The extra that installs each protocol's fsspec backend.
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "http": "http", "https": "http"}


class StorageError(DlopError):
    """A URL no installed fsspec backend opens, or storage options that do not fit it."""


def scheme(text: str) -> str | None:
    """The URL scheme of ``text`` (lowercase), None for a plain path."""
    m = _SCHEME.match(text)
    return m[1].lower() if m else None


def is_url(text: object) -> bool:
    """Whether ``text`` is a URL that goes through fsspec (a str with any scheme but ``file``)."""
    found = scheme(text) if isinstance(text, str) else None
    return found is not None and found != "file"


def missing_extra(proto: str, e: BaseException) -> str:
    """What to tell a user whose fsspec has no backend for ``proto``."""
    extra = EXTRAS.get(proto)
    how = f"pip install 'dlop[{extra}]'" if extra else f"install the fsspec backend for {proto}://"
    return f"{proto}:// URLs need an fsspec backend that is not installed ({e}); {how}"


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """(a new fsspec filesystem, the path inside it) for ``url``; credentials and
    endpoints come from ``storage_options`` or the usual environment (for
    S3-compatible servers ``AWS_ENDPOINT_URL``). Raises StorageError when the
    backend is missing (naming the extra), the URL unknown or an option unfit."""
    proto = scheme(url) or "file"
    try:
        from fsspec.core import url_to_fs
    except ImportError as e:
        raise StorageError(f"{url}: {missing_extra(proto, e)}") from None
    try:
        # A fresh instance: a cached one would keep the endpoint and credentials the
        # environment held when it was made.
        options = {"skip_instance_cache": True, **(storage_options or {})}
        fs, path = url_to_fs(url, **options)
    except ImportError as e:
        raise StorageError(f"{url}: {missing_extra(proto, e)}") from None
    except ValueError as e:
        raise StorageError(f"{url}: not a URL fsspec knows ({e})") from None
    except TypeError as e:
        raise StorageError(f"{url}: a storage option does not fit {proto}:// ({e})") from None
    return fs, str(path)

"""URLs of object storage (``s3://``, ``gs://``, ``https://``, any fsspec URL): which
texts are URLs, and the fsspec filesystem of one.

Shared by the compiler (SOURCE and OUT, compiler.urls) and the runtime (archives
read through the shard cache, runtime.storage.remote), through formats.storage; its
failures are ``StorageError``s whatever the caller. Pure: fsspec is imported only when a filesystem is asked
for, and nothing here starts threads or keeps clients.

No network wait is endless: every filesystem made here has a connect timeout and
a read timeout (a read that receives nothing for that long fails), CONNECT_S and
READ_S unless ``DLOP_CONNECT_TIMEOUT`` / ``DLOP_READ_TIMEOUT`` (seconds) or the
storage options' own timeout settings say otherwise. A timed-out request fails
like any other: the runtime counts it as one failed attempt of its retry policy.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from .errors import StorageError
from .extras import install_hint

HTTP = ("http", "https")  # schemes whose servers cannot list or write
S3 = ("s3", "s3a")  # schemes s3fs serves
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
# The extra that installs each protocol's fsspec backend.
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "http": "http", "https": "http"}


CONNECT_S = 10.0  # seconds to open a connection
READ_S = 30.0  # seconds a read may receive nothing
TIMEOUT_ENV = {"connect": "DLOP_CONNECT_TIMEOUT", "read": "DLOP_READ_TIMEOUT"}


def env_number(name: str, default: float, ok: Callable[[float], bool], want: str) -> float:
    """The environment variable ``name`` as a finite number passing ``ok``, or ``default``
    when it is not set; StorageError saying ``want`` (what to give) otherwise."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and ok(value)):
        raise StorageError(f"{name}={text!r}: give {want}")
    return value


def timeouts() -> tuple[float, float]:
    """(connect, read) seconds: CONNECT_S and READ_S, or the environment's settings."""
    connect, read = (
        env_number(
            TIMEOUT_ENV[kind], default, lambda v: v > 0, f"the {kind} timeout in seconds, above 0"
        )
        for kind, default in (("connect", CONNECT_S), ("read", READ_S))
    )
    return connect, read


def with_timeouts(proto: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` for a ``proto`` filesystem with the connect and read timeouts added,
    where the options set none of their own (HTTP through aiohttp, S3 through botocore;
    other backends keep their own defaults)."""
    connect, read = timeouts()
    out = dict(options)
    if proto in ("http", "https"):
        client = dict(out.get("client_kwargs") or {})
        if "timeout" not in client:
            import aiohttp

            client["timeout"] = aiohttp.ClientTimeout(
                total=None, connect=connect, sock_connect=connect, sock_read=read
            )
        out["client_kwargs"] = client
    elif proto in S3:
        config = dict(out.get("config_kwargs") or {})
        config.setdefault("connect_timeout", connect)
        config.setdefault("read_timeout", read)
        # one attempt per call at botocore's level: s3fs retries a call (5 attempts with
        # backoff), the runtime's retry policy retries a fetch
        config.setdefault("retries", {"total_max_attempts": 1})
        out["config_kwargs"] = config
    return out


def scheme(text: str) -> str | None:
    """The URL scheme of ``text`` (lowercase), None for a plain path."""
    if "://" not in text:  # most paths a listing names: no pattern match each
        return None
    m = _SCHEME.match(text)
    return m[1].lower() if m else None


def is_url(text: object) -> bool:
    """Whether ``text`` is a URL that goes through fsspec (a str with any scheme but ``file``)."""
    found = scheme(text) if isinstance(text, str) else None
    return found is not None and found != "file"


def local_path(text: str) -> str:
    """A ``file://`` URL as the local path it names; anything else unchanged."""
    if scheme(text) == "file":
        return text[len("file://") :] or "/"
    return text


def missing_extra(proto: str, e: BaseException) -> str:
    """What to tell a user whose fsspec has no backend for ``proto``."""
    extra = EXTRAS.get(proto)
    how = install_hint(extra) if extra else f"install the fsspec backend for {proto}://"
    return f"{proto}:// URLs need an fsspec backend that is not installed ({e}); {how}"


def storage_failure(url: str, e: BaseException) -> str:
    """The message for a request about ``url`` that failed other than by a missing object
    (refused, timed out, an unknown bucket, a storage client's own error)."""
    return (
        f"{url}: the storage did not answer as asked ({type(e).__name__}: {e}); check the "
        "URL, the endpoint and the network (timeouts: DLOP_CONNECT_TIMEOUT, DLOP_READ_TIMEOUT)"
    )


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
        fs, path = url_to_fs(url, **with_timeouts(proto, options))
    except ImportError as e:
        raise StorageError(f"{url}: {missing_extra(proto, e)}") from None
    except ValueError as e:
        raise StorageError(f"{url}: not a URL fsspec knows ({e})") from None
    except TypeError as e:
        raise StorageError(f"{url}: a storage option does not fit {proto}:// ({e})") from None
    return fs, str(path)

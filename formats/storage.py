"""Reading bytes across a storage boundary, the same way everywhere: a fetch is tried
again after a failure that a new try can get past (a timeout, a reset or dropped
connection, a 5xx or SlowDown answer, a short or corrupt body), with backoff, and
accepted only once its bytes pass the caller's check (a length, a CRC-32 the index
records). The compiler's input reads and the runtime's shard fetches both go through
``fetch``; how one try reads (whole, or ranged parts in parallel) is the caller's.

Nothing here starts a thread (the runtime brings its own for parallel parts).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .crc import crc32 as crc_of
from .urls import StorageError


@dataclass(frozen=True)
class Retry:
    """How hard a fetch tries: ``attempts`` in all, sleeping ``backoff_s`` doubled after
    each failure (with jitter, at most ``max_backoff_s``). ``part_bytes`` and
    ``parallel_parts`` say how the runtime cuts one try of a large object into ranged
    reads."""

    attempts: int = 6
    backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    part_bytes: int = 16 << 20
    parallel_parts: int = 4
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)

    def pause(self, attempt: int) -> None:
        delay = min(self.max_backoff_s, self.backoff_s * 2**attempt)
        self.sleep(delay * (0.5 + random.random()))


DEFAULT_RETRY = Retry()

# Errors that retrying cannot fix: the object is not there, or we may not read it.
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError)


def retry_here(fs: Any, storage_options: Mapping[str, Any] | None) -> Any:
    """``fs`` with its client's own retries cut to one attempt (s3fs retries up to five
    times by itself), so that ``fetch``'s Retry alone decides how often a read is tried,
    unless the user set ``retries`` in the storage options."""
    if hasattr(fs, "retries") and "retries" not in (storage_options or {}):
        fs.retries = 1
    return fs


class FetchError(StorageError):
    """Every try of a fetch failed, or one failed in a way no retry fixes (``cause``: that
    error, such as FileNotFoundError)."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause


def fetch(
    read: Callable[[], bytes],
    check: Callable[[bytes], str | None],
    what: str,
    path: str,
    retry: Retry = DEFAULT_RETRY,
    give_up: tuple[type[BaseException], ...] = (),
) -> bytes:
    """``read()``'s bytes, once ``check`` returns None for them (else a reason); other
    failures of ``read`` (the storage client's errors have no common base) are tried
    again up to ``retry.attempts`` times in all. FetchError names ``what`` and ``path``
    with every reason when no try succeeded, or at once for a PERMANENT error. Errors of
    the ``give_up`` types (the caller's own refusals) pass through untouched."""
    reasons: list[str] = []
    for attempt in range(retry.attempts):
        try:
            data = read()
        except give_up:
            raise
        except PERMANENT as e:
            raise FetchError(f"{what}: cannot read {path}: {e}", e) from None
        except Exception as e:
            reasons.append(f"{type(e).__name__}: {e}"[:300])
        else:
            problem = check(data)
            if problem is None:
                return data
            reasons.append(problem)
        if attempt + 1 < retry.attempts:
            retry.pause(attempt)
    raise FetchError(
        f"{what}: {path} failed {retry.attempts} times; last: {reasons[-1]} "
        f"(all: {'; '.join(reasons)[:1500]}); check the storage and the network, or "
        "recompile the archive if the object itself is damaged"
    )


def length_is(want: int, what: str) -> Callable[[bytes], str | None]:
    """A ``check``: exactly ``want`` bytes arrived (``what`` names them in the reason:
    "the shard's first 65536")."""

    def check(data: bytes) -> str | None:
        if len(data) != want:
            return f"got {len(data)} bytes of {what} (truncated transfer?)"
        return None

    return check


def checker(size: int, crc32: int) -> Callable[[bytes], str | None]:
    """A ``check``: the byte count and CRC-32 an archive's index records."""

    def check(data: bytes) -> str | None:
        if len(data) != size:
            return f"got {len(data)} bytes, index.json says {size} (truncated transfer?)"
        crc = crc_of(data)
        if crc != crc32:
            return f"CRC-32 {crc:#010x}, index.json says {crc32:#010x} (corrupted transfer?)"
        return None

    return check

"""Every byte that crosses a storage boundary, one way: ``Storage``.

A storage is a root (a local folder, or an fsspec URL: ``s3://``, ``gs://``,
``https://``...) and '/'-separated names below it. It reads an object whole or
a byte range, writes one atomically (a local temporary name renamed over the
final one; one PUT, which object stores publish whole), publishes a finished
local file (``put``), lists names with their sizes and deletes. The compiler's
inputs and OUT, the runtime's shard fetches into the node-local cache and
``dlop-inspect`` all go through it.

A read is tried again after a failure that a new try can get past (a timeout, a
reset or dropped connection, a 5xx or SlowDown answer, a short or corrupt body),
with backoff, and accepted only once its bytes pass the caller's check (a
length, a CRC-32 the index records): ``fetch`` is that loop. Its errors are
``StorageError``s (a ``DlopError``) naming the URL; callers add context to the
message where they have some, not a type of their own.

A location becomes a storage once, where it enters the program (a command-line
argument, a Python call): ``open_storage``. What a storage can do is stated on
it, not inferred from its scheme: ``lists`` (an HTTP server cannot list),
``writes``.

Nothing here starts a thread (the runtime brings its own for parallel parts).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import io
import itertools
import os
import random
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Self, TypeVar

from . import urls
from .crc import crc32 as crc_of
from .errors import ResourceLimitError, StorageError
from .files import atomic_write
from .limits import FILE_LIMITS, too_many_files

T = TypeVar("T")

# How a caller runs ranged parts side by side: (one part's read, the spans) -> the parts.
MapParts = Callable[
    [Callable[[tuple[int, int]], bytes], Iterable[tuple[int, int]]], Iterable[bytes]
]


# A fetch's default tries: 8 attempts, sleeping 0.25 s doubled after each failure (with
# jitter of +-50%), at most 10 s a sleep: 25.75 s of back-off in all (13 to 39 s), so an
# outage of half a minute or a burst of SlowDown answers is ridden out. The environment's
# DLOP_FETCH_ATTEMPTS and DLOP_FETCH_MAX_BACKOFF (seconds) change the defaults.
ATTEMPTS = 8
BACKOFF_S = 0.25
MAX_BACKOFF_S = 10.0
ATTEMPTS_ENV, MAX_BACKOFF_ENV = "DLOP_FETCH_ATTEMPTS", "DLOP_FETCH_MAX_BACKOFF"


def default_attempts() -> int:
    want = "a whole number of attempts, at least 1"
    return int(urls.env_number(ATTEMPTS_ENV, ATTEMPTS, lambda v: v >= 1 and v.is_integer(), want))


def default_max_backoff() -> float:
    return urls.env_number(MAX_BACKOFF_ENV, MAX_BACKOFF_S, lambda v: v >= 0, "seconds, 0 or more")


@dataclass(frozen=True)
class Retry:
    """How hard a fetch tries: ``attempts`` in all, sleeping ``backoff_s`` doubled after
    each failure (with jitter, at most ``max_backoff_s``). ``part_bytes`` and
    ``parallel_parts`` say how the runtime cuts one try of a large object into ranged
    reads. ``lead``: a raw shard that one wave of such reads covers is asked for in
    byte ranges at once, its header read from the first of them, not first on its
    own (one request fewer a shard; runtime.storage.streamed ``lead_spans``)."""

    attempts: int = field(default_factory=default_attempts)
    backoff_s: float = BACKOFF_S
    max_backoff_s: float = field(default_factory=default_max_backoff)
    part_bytes: int = 16 << 20
    parallel_parts: int = 4
    lead: bool = True
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)

    def pause(self, attempt: int) -> None:
        delay = min(self.max_backoff_s, self.backoff_s * 2**attempt)
        self.sleep(delay * (0.5 + random.random()))


DEFAULT_RETRY = Retry()


def join_name(root: str, name: str) -> str:
    """The object ``name`` under ``root``; for an HTTP(S) URL with a query (a token that
    grants the whole folder, as an Azure SAS does), the name goes before the query."""
    if not name:
        return root
    base, mark, query = root.partition("?")
    if mark and urls.scheme(root) in ("http", "https"):
        return f"{base.rstrip('/')}/{name}?{query}"
    return f"{root.rstrip('/')}/{name}"


# How much of a streamed range (``Storage.read_chunks``) is handed on at a time.
CHUNK_BYTES = 4 << 20


class Refused(Exception):
    """A try whose answer no retry changes (the reason is the message)."""


class RangeIgnored(Refused):
    """A server answered a ranged read with more bytes than asked for: it ignores Range."""

    def __init__(self, start: int, end: int, sent: int | str) -> None:
        super().__init__(
            f"asked for bytes {start}..{end} ({end - start} bytes), the server sent "
            f"{sent}: it ignores HTTP Range requests, and an archive is read in parts (a "
            "shard's header, pieces, a capped index.json); serve it from storage that "
            "honours Range (S3, GCS, Azure, nginx, a CDN)"
        )


# Errors that retrying cannot fix: the object is not there, we may not read it, it is
# not the object asked for, or the server cannot read it in parts.
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, Refused)
# HTTP statuses that refuse the request itself (credentials, permission): never retried.
REFUSED_STATUSES = (401, 403)


def as_permanent(e: Exception) -> Exception:
    """``e``, or a PermissionError in its place when it is an HTTP refusal (401, 403)
    that a storage client reports as its own error type (aiohttp's, for HTTP)."""
    status = getattr(e, "status", None) or getattr(e, "code", None)
    if isinstance(status, int) and status in REFUSED_STATUSES:
        return PermissionError(f"HTTP {status} ({type(e).__name__}: {e})")
    return e


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
    return retrying(lambda: checked(read(), check), what, path, retry, give_up)


class Rejected(Exception):
    """A try whose result the caller's check refused (the reason is the message)."""


def checked(data: bytes, check: Callable[[bytes], str | None]) -> bytes:
    problem = check(data)
    if problem is not None:
        raise Rejected(problem)
    return data


def retrying(
    once: Callable[[], T],
    what: str,
    path: str,
    retry: Retry = DEFAULT_RETRY,
    give_up: tuple[type[BaseException], ...] = (),
) -> T:
    """``once()``, tried again after a failure as ``fetch`` describes (a ``Rejected``
    try counts as a failure with its reason)."""
    reasons: list[str] = []
    checked_out = False  # a try's bytes arrived but failed the caller's check
    said_what = "" if what == path else f"{what}: "  # a URL named once
    # raised as they are: the caller's refusals, and a limit of this process no retry lifts
    passing: tuple[type[BaseException], ...] = (*give_up, ResourceLimitError)
    for attempt in range(retry.attempts):
        try:
            return once()
        except passing:
            raise
        except Rejected as e:
            reasons.append(str(e))
            checked_out = True
        except Exception as e:
            # a full table of open files (which a client may report as a missing object):
            # no retry helps
            if files_full(e):
                raise too_many_files(path, e) from None
            refused = e if isinstance(e, PERMANENT) else as_permanent(e)
            if isinstance(refused, PERMANENT):
                raise FetchError(f"{said_what}cannot read {path}: {refused}", refused) from None
            said = str(e) or f"no message from the storage client, reading {path}"
            reasons.append(f"{type(e).__name__}: {said}"[:300])
        if attempt + 1 < retry.attempts:
            retry.pause(attempt)
    raise FetchError(
        f"{said_what}{path} failed {retry.attempts} times; last: {reasons[-1]} "
        f"(all: {'; '.join(reasons)[:1500]}); check the URL, the endpoint and the network "
        "(timeouts: DLOP_CONNECT_TIMEOUT, DLOP_READ_TIMEOUT)"
        + (", or the object itself: recompile it if its bytes are damaged" if checked_out else "")
    )


def files_full(e: BaseException) -> bool:
    """``e``, or an error it was raised from, is a full table of open files (EMFILE,
    ENFILE): a storage client wraps the socket's or the file's error in its own."""
    seen = 0
    at: BaseException | None = e
    while at is not None and seen < 8:
        if getattr(at, "errno", None) in FILE_LIMITS:
            return True
        at, seen = at.__cause__ or at.__context__, seen + 1
    return False


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


# -- storages ---------------------------------------------------------------------------------


class Storage:
    """Objects under one root (see the module docstring); ``url`` names the root in
    messages. Subclasses read one try (``read_once``) and write, list and delete."""

    url: str
    retry: Retry = DEFAULT_RETRY  # how hard a request is tried, unless a call says
    lists = True  # sizes() and listing below a folder work
    writes = True  # write, put and delete work

    def name_url(self, name: str) -> str:
        return join_name(self.url, name)

    # one try of a read; the storage's own errors pass
    def read_once(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        raise NotImplementedError

    def read_capped_once(self, name: str, cap: int) -> tuple[bytes, int | None]:
        """One try at the first ``cap + 1`` bytes of ``name``, and the size the storage
        says it holds (None: not said)."""
        return self.read_once(name, 0, cap + 1), None

    def read_chunks(
        self, name: str, start: int, end: int, chunk: int = CHUNK_BYTES
    ) -> Generator[bytes | memoryview, None, None]:
        """One try at bytes ``start..end`` of ``name`` (one request), handed on in
        order, at most ``chunk`` at a time, as they arrive where the storage streams a
        body (S3, a local file): a caller writes each while the rest is on its way, and
        holds one chunk, not the range. Fewer bytes in all when the object ends first;
        the storage's own errors pass, as ``read_once``'s (RangeIgnored: more bytes came
        than were asked for). Stopping early (closing the iterator) ends the request.
        Here: the range read whole, then handed on in chunks."""
        data = memoryview(self.read_once(name, start, end))
        for at in range(0, len(data), chunk):
            yield data[at : at + chunk]

    def fetch(
        self,
        name: str,
        check: Callable[[bytes], str | None] | None = None,
        *,
        size: int | None = None,
        retry: Retry | None = None,
        what: str | None = None,
        map_parts: MapParts | None = None,
        cap: int | None = None,
    ) -> bytes:
        """The object ``name`` whole, accepted once ``check`` passes (default: as many
        bytes as the storage says it holds, when it says), tried again through passing
        faults (``fetch``). Given its ``size`` and ``map_parts``, a large object is read
        in ranged parts of ``retry.part_bytes``, run by ``map_parts``. An object over
        ``cap`` bytes is refused at once (TooLargeError). FetchError names ``what``
        (default the object's URL)."""
        what = what or self.name_url(name)
        retry = retry or self.retry
        said: int | None = None  # the size the storage gave with the latest try

        def read() -> bytes:
            nonlocal said
            if cap is not None:
                data, said = self.read_capped_once(name, cap)
                if len(data) > cap or (said is not None and said > cap):
                    raise TooLargeError(f"{what}: larger than its {cap}-byte cap")
                return data
            if size is None or size <= retry.part_bytes or map_parts is None:
                return self.read_once(name)
            cuts = [*range(0, size, retry.part_bytes), size]
            spans = list(itertools.pairwise(cuts))
            return b"".join(map_parts(lambda s: self.read_once(name, s[0], s[1]), spans))

        def whole(data: bytes) -> str | None:
            if said is not None and len(data) != said:
                return f"got {len(data)} bytes of the {said} it holds (truncated transfer?)"
            return None if check is None else check(data)

        with self.missing_confirmed(name):
            return fetch(read, whole, what, self.name_url(name), retry, give_up=(TooLargeError,))

    @contextlib.contextmanager
    def missing_confirmed(self, name: str) -> Iterator[None]:
        """Runs the block; a FetchError that says ``name`` is missing passes only once the
        storage confirms it (``confirm_missing``)."""
        try:
            yield
        except FetchError as e:
            if isinstance(e.cause, FileNotFoundError) and not self.confirm_missing(name):
                raise FetchError(
                    f"{self.name_url(name)}: the storage said it is missing, then that it is there"
                ) from None
            raise

    def confirm_missing(self, name: str) -> bool:
        """After a request was told ``name`` is not there: True when it is indeed missing,
        False when it is there after all. Where the storage reports every failure as a
        missing object (fsspec's HTTP does: a refused connection, a timeout), the real
        failure is found by asking for one byte, and raised as StorageError."""
        return True

    def fetch_range(
        self,
        name: str,
        start: int,
        end: int,
        *,
        exact: bool = True,
        retry: Retry | None = None,
        what: str | None = None,
    ) -> bytes:
        """Bytes ``start:end`` of ``name``: exactly that many (``exact``), or at most that
        many (an object may be shorter), tried again as ``fetch`` is."""
        want = end - start
        retry = retry or self.retry
        check = length_is(want, f"the {want} bytes from {start}") if exact else (lambda _: None)
        what = what or self.name_url(name)
        return fetch(
            lambda: self.read_once(name, start, end), check, what, self.name_url(name), retry
        )

    def open_read(self, name: str) -> IO[bytes]:
        """``name`` opened for reading in a stream, each request one try (``download``
        tries the whole stream again)."""
        raise NotImplementedError

    def open_stream(self, name: str) -> IO[bytes]:
        """``name`` opened for reading in a stream that is read once, never tried again
        whole (a tar read as it goes): its requests keep the client's own retries."""
        return self.open_read(name)

    def download(
        self,
        name: str,
        target: Path,
        limit: int,
        *,
        chunk: int = 8 << 20,
        retry: Retry | None = None,
        what: str | None = None,
    ) -> int:
        """Copies at most ``limit`` bytes of ``name`` into the local file ``target`` a
        ``chunk`` at a time (memory holds one chunk, whatever the object's size), tried
        again from the start after a passing fault; the bytes copied."""

        def once() -> int:
            copied = 0
            with self.open_read(name) as f, open(target, "wb") as out:
                while copied < limit and (part := f.read(min(chunk, limit - copied))):
                    out.write(part)
                    copied += len(part)
            return copied

        with self.missing_confirmed(name):
            return retrying(
                once, what or self.name_url(name), self.name_url(name), retry or self.retry
            )

    def write(self, name: str, data: bytes) -> None:
        """Publishes ``data`` as ``name``, whole or not at all."""
        raise NotImplementedError

    def put(self, local: Path, name: str) -> None:
        """Publishes the finished local file ``local`` as ``name``, whole or not at all
        (the local file is gone after)."""
        raise NotImplementedError

    def sizes(self, prefix: str = "") -> dict[str, int]:
        """Every object (names relative to the root) that starts with ``prefix``, with
        its size, from one listing: no request per object."""
        raise NotImplementedError

    def delete(self, name: str) -> None:
        """Removes ``name``; a missing one is fine."""
        raise NotImplementedError


class LocalStorage(Storage):
    """A local folder, with plain files (no fsspec): writes go to a temporary name,
    are fsynced and renamed over the final one, and the folder is fsynced after; a
    listing holds the regular files directly in the folder."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.url = str(root)

    def read_once(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        with open(self.root / name, "rb") as f:
            f.seek(start or 0)
            return f.read() if end is None else f.read(max(0, end - (start or 0)))

    def read_chunks(
        self, name: str, start: int, end: int, chunk: int = CHUNK_BYTES
    ) -> Generator[bytes | memoryview, None, None]:
        with open(self.root / name, "rb") as f:
            f.seek(start)
            left = end - start
            while left > 0 and (data := f.read(min(chunk, left))):
                left -= len(data)
                yield data

    def open_read(self, name: str) -> IO[bytes]:
        return open(self.root / name, "rb")

    def write(self, name: str, data: bytes) -> None:
        atomic_write(self.root / name, data)
        self.sync_folder()

    def put(self, local: Path, name: str) -> None:
        with open(local, "rb") as f:
            os.fsync(f.fileno())
        os.replace(local, self.root / name)
        self.sync_folder()

    def sizes(self, prefix: str = "") -> dict[str, int]:
        """The regular files in the folder (not links) with their sizes."""
        if not self.root.is_dir():
            return {}
        with os.scandir(self.root) as entries:
            return {
                e.name: e.stat(follow_symlinks=False).st_size
                for e in entries
                if e.is_file(follow_symlinks=False) and e.name.startswith(prefix)
            }

    def delete(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def sync_folder(self) -> None:
        with contextlib.suppress(OSError):  # not every file system lets a folder be fsynced
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


class MemoryStorage(Storage):
    """Objects held in this process's memory (a dict of name -> bytes): a storage for
    tests, with every capability, whose reads never fail of themselves."""

    def __init__(self, url: str = "mem://") -> None:
        self.url = url
        self.objects: dict[str, bytes] = {}

    def read_once(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        try:
            data = self.objects[name]
        except KeyError:
            raise FileNotFoundError(2, "no such object", self.name_url(name)) from None
        return data[start or 0 : end]

    def open_read(self, name: str) -> IO[bytes]:
        return io.BytesIO(self.read_once(name))

    def write(self, name: str, data: bytes) -> None:
        self.objects[name] = bytes(data)

    def put(self, local: Path, name: str) -> None:
        self.objects[name] = local.read_bytes()
        local.unlink(missing_ok=True)

    def sizes(self, prefix: str = "") -> dict[str, int]:
        return {n: len(d) for n, d in self.objects.items() if n.startswith(prefix)}

    def delete(self, name: str) -> None:
        self.objects.pop(name, None)


class TooLargeError(StorageError):
    """An object over the cap its reader set (``Storage.fetch(cap=...)``)."""


class FsspecStorage(Storage):
    """Objects under an fsspec URL (``at`` opens one): one PUT per write (an object
    appears only once its PUT completes), a listing of the whole prefix. ``root`` None
    takes names as whole URLs of ``fs`` (a corpus's inputs).

    Two clients: ``fs``, whose own retries are cut to one, for every request the retry
    policy here tries again (reads, questions, listings); and one that keeps its own
    retries (``retrying``, made on first use) for what is done once: writes and streams
    read as they go."""

    def __init__(
        self, fs: Any, root: str | None, url: str, retrying: Callable[[], Any] | None = None
    ) -> None:
        self.fs = fs
        self.root = None if root is None else root.rstrip("/")
        self.url = url
        self.http = urls.scheme(url) in urls.HTTP  # reports every failure as missing
        self.s3 = urls.scheme(url) in urls.S3  # s3fs's client streams a body (read_chunks)
        self.lists = self.writes = not self.http
        self._retrying = retrying
        self._retrying_fs: Any = None if retrying is not None else fs
        self._lock = threading.Lock()

    @classmethod
    def at(
        cls,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        whole_urls: bool = False,
    ) -> Self:
        """The storage at ``url`` (formats.urls.filesystem: timeouts set, StorageError when
        the backend is missing). ``whole_urls``: names are whole URLs on its filesystem."""
        fs, root = urls.filesystem(url, storage_options)
        again = None
        if "retries" not in (storage_options or {}) and hasattr(fs, "retries"):
            again = functools.partial(_client, url, storage_options)
        cut = retry_here(fs, storage_options)
        return cls(cut, None if whole_urls else root, url, again)

    def client_retrying(self) -> Any:
        """The client that keeps its own retries (made once, on first use)."""
        with self._lock:
            if self._retrying_fs is None and self._retrying is not None:
                self._retrying_fs = self._retrying()
            return self._retrying_fs

    def confirm_missing(self, name: str) -> bool:
        if not self.http:
            return True
        url = self.name_url(name)
        try:  # one byte, asked as a read is: passing faults tried again
            one = lambda: self.fs.cat_file(self.path(name), start=0, end=1)  # noqa: E731
            retrying(one, url, url, self.retry)
        except FetchError as e:
            if isinstance(e.cause, FileNotFoundError):
                return True
            raise FetchError(urls.storage_failure(url, e)) from None
        return False

    def info(self, name: str) -> dict[str, Any] | None:
        """``name``'s kind ("file" or "directory") and size (one request, tried again as a
        read is), None when it is not there."""
        url = self.name_url(name)
        try:
            asked = retrying(
                lambda: self.fs.info(self.path(name)), "looking it up", url, self.retry
            )
            return _entry(asked)
        except FetchError as e:
            if not isinstance(e.cause, FileNotFoundError):
                raise
        # there after all: a server that answers reads but not questions about size
        return None if self.confirm_missing(name) else {"type": "file", "size": 0}

    def below(self, folder: str) -> dict[str, dict[str, Any]]:
        """Every object and folder below ``folder`` (names as ``path`` gives them), with its
        kind and size, from one paginated listing; empty when nothing is there."""
        found = self._find(folder, withdirs=True)
        # the names as asked: a backend may spell them its own way ("/b/x" for "b/x")
        asked = self.path(folder)
        where = str(self.fs._strip_protocol(asked)).rstrip("/")
        out = {}
        for name, info in found.items():
            name = name.rstrip("/")
            if name == where or name.startswith(where + "/"):
                out[asked + name[len(where) :]] = _entry(info)
        return out

    def _find(self, folder: str, withdirs: bool = False) -> dict[str, Any]:
        """fsspec's ``find`` of ``folder`` (a name below the root; "" the root itself), with
        details, tried as a read is; empty when nothing is there."""
        where = self.path(folder)
        try:
            found: dict[str, Any] = retrying(
                lambda: self.fs.find(where, withdirs=withdirs, detail=True),
                "listing",
                self.name_url(folder),
                self.retry,
            )
        except FetchError as e:
            if isinstance(e.cause, FileNotFoundError):
                return {}
            raise
        return found

    def path(self, name: str) -> str:
        return name if self.root is None else join_name(self.root, name)

    def name_url(self, name: str) -> str:
        if self.root is not None:
            return join_name(self.url, name)
        if urls.scheme(name) is None:  # a path of the filesystem: "bucket/key"
            return f"{urls.scheme(self.url)}://{name}"
        return name

    def read_once(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        data = bytes(self.fs.cat_file(self.path(name), start=start, end=end))
        if end is not None and len(data) > end - (start or 0):
            raise RangeIgnored(start or 0, end, len(data))
        return data

    def read_chunks(
        self, name: str, start: int, end: int, chunk: int = CHUNK_BYTES
    ) -> Generator[bytes | memoryview, None, None]:
        if not self.s3:  # no streamed body here: read whole, then handed on
            yield from super().read_chunks(name, start, end, chunk)
            return
        from fsspec.asyn import sync

        fs = self.fs
        bucket, key, version = fs.split_path(self.path(name))
        asked = {"Range": f"bytes={start}-{end - 1}", **({"VersionId": version} if version else {})}
        got = fs.call_s3("get_object", Bucket=bucket, Key=key, **asked)
        body = got["Body"]
        try:
            said = got.get("ContentLength")
            if isinstance(said, int) and said > end - start:
                raise RangeIgnored(start, end, f"{said} bytes")
            left = end - start
            while data := sync(fs.loop, _read_up_to, body, chunk):
                if len(data) > left:
                    raise RangeIgnored(start, end, "more")
                left -= len(data)
                yield data
        finally:  # on the client's loop (the connection is its), not waited for: this
            # may run on that loop's own thread (a generator collected there)
            asyncio.run_coroutine_threadsafe(_close_body(body), fs.loop)

    def read_capped_once(self, name: str, cap: int) -> tuple[bytes, int | None]:
        with self.fs.open(self.path(name), "rb") as f:
            size = getattr(f, "size", None)
            said = size if isinstance(size, int) and not isinstance(size, bool) else None
            if said is not None and said > cap:
                return b"", said  # refused before its bytes are read
            return bytes(f.read(cap + 1)), said

    def open_read(self, name: str) -> IO[bytes]:
        f: IO[bytes] = self.fs.open(self.path(name), "rb")
        return f

    def open_stream(self, name: str) -> IO[bytes]:
        f: IO[bytes] = self.client_retrying().open(self.path(name), "rb")
        return f

    def write(self, name: str, data: bytes) -> None:
        self.client_retrying().pipe_file(self.path(name), data)

    def put(self, local: Path, name: str) -> None:
        self.client_retrying().put_file(os.fspath(local), self.path(name))
        local.unlink(missing_ok=True)

    def sizes(self, prefix: str = "") -> dict[str, int]:
        """Every object below the root (at any depth, '/'-separated names) that starts
        with ``prefix``, from one paginated listing of the deepest folder ``prefix`` names."""
        self.fs.invalidate_cache()
        root = self.path("")
        folder = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        found = self._find(folder)
        out = {}
        for p, info in found.items():
            name = p[len(root) + 1 :] if p.startswith(root + "/") else None
            size = info.get("size")
            if (
                name is not None
                and name.startswith(prefix)
                and info.get("type") == "file"
                and isinstance(size, int)
                and not isinstance(size, bool)
            ):
                out[name] = size
        return out

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(name))


async def _read_up_to(body: Any, n: int) -> bytes:
    """Up to ``n`` bytes of a streamed S3 body: fewer only at its end."""
    parts: list[bytes] = []
    got = 0
    while got < n and (data := await body.read(n - got)):
        parts.append(data)
        got += len(data)
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def _close_body(body: Any) -> None:
    closed = body.close()  # aiohttp's closes at once, httpx's is a coroutine
    if inspect.isawaitable(closed):
        await closed


def _entry(info: Mapping[str, Any]) -> dict[str, Any]:
    kind = "directory" if info.get("type") == "directory" else "file"
    try:
        size = int(info.get("size") or 0)  # some backends say it as a float or a str
    except (TypeError, ValueError):
        size = 0
    return {"type": kind, "size": size}


def open_storage(
    location: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    whole_urls: bool = False,
) -> Storage:
    """The storage at ``location``, chosen once where the location enters: a LocalStorage
    for a local path or ``file://`` URL, an FsspecStorage for any other URL
    (``FsspecStorage.at``). ``whole_urls``: a URL storage takes whole URLs on its
    filesystem as names (a corpus's inputs, wherever they lie)."""
    text = os.fspath(location)
    if not urls.is_url(text):
        return LocalStorage(urls.local_path(text))
    return FsspecStorage.at(text, storage_options, whole_urls=whole_urls)


def _client(url: str, storage_options: Mapping[str, Any] | None) -> Any:
    return urls.filesystem(url, storage_options)[0]

"""SOURCE and OUT at fsspec URLs (``s3://``, ``gs://``, ``https://``), over the one
storage interface (formats.storage): every listing, question and byte below goes
through a ``Storage`` opened once, with its retries and checks.

A local path (or a ``file://`` URL, which ``formats.urls.local_path`` turns into
one) never comes here: the local compile stays on plain files. For a URL:

- ``url_path(url, options)`` is the path the layouts list through: a
  ``pathlib.Path`` subclass (``UrlPath``) whose ``/``, ``name``, ``stem``,
  ``suffix``, ``parent``, ``relative_to`` are the usual ones and whose
  ``exists``, ``is_file``, ``is_dir``, ``iterdir``, ``glob``, ``open``,
  ``read_bytes`` and ``stat`` ask its storage. A folder is listed once, whole,
  with its sizes (one paginated bucket listing), and every later question below
  it is answered from that listing: no per-file round trips. ``str()`` gives the
  URL back. It has no ``os.fspath``: passing one to ``open()`` or ``os.walk``
  raises instead of touching a local path of the same name. ``compiler.corpus.listing``
  (walk_files, subfolders, read_bytes, file_size, like) dispatches on it, so a
  layout written against those helpers and the Path methods above lists URLs too.
  A storage that cannot list (``Storage.lists`` false: HTTP) holds one manifest or
  tar (or a brace pattern of tars) as SOURCE, and its inputs' sizes are not asked
  (the fingerprint is the manifest's or the tars' names and sizes).
- Credentials and endpoints come from the usual environment (for S3-compatible
  servers ``AWS_ENDPOINT_URL``) or from ``--storage-option key=value`` pairs
  (``parse_storage_options``); a missing backend is a StorageError naming the extra.
- ``fetch_inputs(items, options)`` gives a worker the bytes of URL inputs (and of
  their masks) as ``Item.fetched``, for decode to read from memory.
- OUT, local or a URL, is a storage (compiler.output.store over formats.storage).
"""

from __future__ import annotations

import fnmatch
import io
import json
import os
import stat
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path, PosixPath
from typing import Any, TypeVar

from dlop.formats import storage
from dlop.formats.urls import is_url as is_url
from dlop.formats.urls import scheme as scheme

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


T = TypeVar("T")


# -- the path the layouts list through -------------------------------------------------------


class _Tree:
    """One storage (formats.storage, names as whole filesystem paths) and what its
    listings said: each folder is listed at most once, whole.

    Questions (listings, sizes, small reads) go through the storage, so through the
    retry policy every storage read follows; ``open`` streams an object through its
    filesystem."""

    def __init__(self, store: storage.FsspecStorage, url_scheme: str) -> None:
        self.store = store
        self.scheme = url_scheme  # "s3"
        self.listable = store.lists
        self.entries: dict[str, dict[str, Any]] = {}  # fs path -> {"type", "size"}
        self.listed: list[str] = []  # folders whose whole subtree is in entries

    def fs_path(self, path: PosixPath) -> str:
        text = PosixPath.__str__(path)[1:]  # "/bucket/key" -> "bucket/key"
        return f"{self.scheme}://{text}" if not self.listable else text

    def _covered(self, p: str) -> bool:
        return any(p == f or p.startswith(f + "/") for f in self.listed)

    def list_folder(self, p: str) -> None:
        """Lists folder ``p`` whole (sizes included), once."""
        if not self.listable or self._covered(p):
            return
        found = self.store.below(p)
        self.entries.update(found)
        if found:
            self.entries.setdefault(p, {"type": "directory", "size": 0})
        self.listed.append(p)

    def entry(self, p: str) -> dict[str, Any] | None:
        if self._covered(p):
            return self.entries.get(p)
        if p in self.entries:
            return self.entries[p]
        got = self.store.info(p)
        if got is None:
            return None
        self.entries[p] = got
        if got["type"] == "directory":
            self.list_folder(p)
        return got

    def size(self, p: str) -> int:
        """An object's size, listing its whole folder the first time one below it is asked
        (a corpus's inputs share few folders), -1 when missing or not listable."""
        if not self.listable:
            return -1
        if not self._covered(p):
            self.list_folder(p.rsplit("/", 1)[0])
        e = self.entries.get(p)
        return -1 if e is None or e["type"] != "file" else int(e["size"])

    def below(self, p: str) -> list[str]:
        self.list_folder(p)
        return [n for n in self.entries if n.startswith(p + "/")]


class UrlPath(PosixPath):
    """A URL as a ``pathlib.Path`` (see the module docstring); made by ``url_path``."""

    _tree: _Tree

    def __str__(self) -> str:
        text = super().__str__()
        return f"{self._tree.scheme}:/{text}" if self.root == "/" else text

    def __repr__(self) -> str:
        return f"UrlPath({str(self)!r})"

    def __fspath__(self) -> str:
        raise TypeError(f"{self} is a URL, not a local path; read it through its UrlPath methods")

    @property
    def fs_path(self) -> str:
        return self._tree.fs_path(self)

    def _entry(self) -> dict[str, Any] | None:
        return self._tree.entry(self.fs_path)

    def exists(self, *, follow_symlinks: bool = True) -> bool:
        return self._entry() is not None

    def is_file(self) -> bool:
        e = self._entry()
        return e is not None and e["type"] == "file"

    def is_dir(self) -> bool:
        e = self._entry()
        return e is not None and e["type"] == "directory"

    def is_symlink(self) -> bool:
        return False

    def resolve(self, strict: bool = False) -> UrlPath:
        return self

    def absolute(self) -> UrlPath:
        return self

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        e = self._entry()
        if e is None:
            raise FileNotFoundError(2, "no such object", str(self))
        mode = stat.S_IFDIR if e["type"] == "directory" else stat.S_IFREG
        return os.stat_result((mode | 0o444, 0, 0, 1, 0, 0, e["size"], 0, 0, 0))

    def size(self) -> int:
        """The object's size from the listing, -1 when unknown (missing, or not listable)."""
        return self._tree.size(self.fs_path)

    def files_below(self) -> Iterator[UrlPath]:
        """Every object below this folder (one listing), in no set order."""
        for name in self._tree.below(self.fs_path):
            if self._tree.entries[name]["type"] == "file":
                yield self._child_of(name)

    def _child_of(self, fs_name: str) -> UrlPath:
        return self / fs_name[len(self.fs_path) + 1 :]

    def iterdir(self) -> Generator[UrlPath, None, None]:
        base = self.fs_path
        for name in sorted(self._tree.below(base)):
            if "/" not in name[len(base) + 1 :]:
                yield self._child_of(name)

    def glob(self, pattern: str) -> Generator[UrlPath, None, None]:
        """Direct children matching a one-level pattern (``*.tar``)."""
        for child in self.iterdir():
            if fnmatch.fnmatchcase(child.name, pattern):
                yield child

    def open(
        self,
        mode: str = "r",
        buffering: int = -1,
        encoding: str | None = None,
        errors: str | None = None,
        newline: str | None = None,
    ) -> Any:
        if mode not in ("r", "rb"):
            raise CompileError(f"{self}: URLs are read only (asked to open it with mode {mode!r})")
        handle = self._tree.store.open_stream(self.fs_path)
        if mode == "rb":
            return handle
        return io.TextIOWrapper(handle, encoding=encoding, errors=errors, newline=newline)

    def read_bytes(self) -> bytes:
        try:
            return self._tree.store.fetch(self.fs_path, what=str(self))
        except storage.FetchError as e:
            if isinstance(e.cause, FileNotFoundError):
                raise FileNotFoundError(2, "no such object", str(self)) from None
            raise

    def with_url(self, url: str) -> UrlPath:
        """Another URL on the same filesystem, as a path."""
        return _make(type(self), url)


def _make(cls: type[UrlPath], url: str) -> UrlPath:
    proto = scheme(url) or ""
    return cls("/" + url[len(proto) + 3 :].rstrip("/"))


def url_path(url: str, storage_options: dict[str, Any] | None = None) -> UrlPath:
    """``url`` as a path the layouts can list (see the module docstring)."""
    store = storage.FsspecStorage.at(url, storage_options, whole_urls=True)
    tree = _Tree(store, scheme(url) or "")
    # Paths made from this one (/, parent, relative_to) share its class, so its tree.
    cls = type("UrlPath", (UrlPath,), {"_tree": tree})
    return _make(cls, url)


def size_of(path: str, like: Path) -> int:
    """The size of input ``path`` (a URL on ``like``'s filesystem, or local), -1 if unknown."""
    if isinstance(like, UrlPath):
        return like.with_url(path).size() if is_url(path) else -1
    try:
        return os.stat(path).st_size
    except OSError:
        return -1


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

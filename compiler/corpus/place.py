"""Where a corpus's files are: a ``Place`` is a file or folder of SOURCE in the storage
that holds it, chosen once where SOURCE enters (``source_place``).

- A local path (or a ``file://`` URL, the path it names) is a ``LocalPlace``: plain
  files, no fsspec.
- A URL (``s3://``, ``gs://``, ``https://``) is a ``StoredPlace`` over one
  ``formats.storage.FsspecStorage`` opened for it, with that storage's retries and
  checks. A folder is listed once, whole, with its sizes (one paginated listing,
  ``Listing``), and every later question below it is answered from that listing: no
  request per file. A storage that cannot list (``Storage.lists`` false: HTTP) holds
  one manifest or tar (or a brace pattern of tars) as SOURCE, and its inputs' sizes
  are not asked (the fingerprint is the manifest's, or the tars' names and sizes).

Layouts list and read through the ``Place`` interface alone (and the helpers of
``compiler.corpus.listing``), so a layout written once lists a folder and a bucket
alike. A Place is named as a path is (``/``, name, stem, suffix, parent, parents,
relative_to, with_name; ordered part by part, as paths are) and asks its storage the
rest (exists, is_file, is_dir, iterdir, glob, open, read_bytes, size, walk). It is no
``os.PathLike``: passing one to ``open()`` or ``os.walk`` raises instead of touching a
local file of the same name.

The two kinds differ only where their storages do: a local folder has links, followed
where they lead inside the corpus or a folder the user allowed (objects have none), and
a corpus's own paths are confined to SOURCE by where they lead (``confine``).
"""

from __future__ import annotations

import fnmatch
import functools
import io
import os
import posixpath
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path, PurePath, PurePosixPath
from typing import IO, Any, Literal, overload

from dlop.formats import storage
from dlop.formats.constants import ARCHIVE_FORMAT, INDEX_NAME, JOURNAL_NAME
from dlop.formats.urls import is_url, local_path, scheme

from ..errors import CompileError

# The progress journal of an interrupted compile: its folder is output, never input.
PROGRESS_NAME = JOURNAL_NAME
ALLOW_HINT = "pass --allow-path DIR (allow_paths in a recipe) to read from a folder outside it"

Exts = tuple[str, ...] | frozenset[str] | None


def source_place(text: str, storage_options: dict[str, Any] | None = None) -> Place:
    """A location (a path or URL) as the place layouts list and open, its storage chosen
    here: a local folder or file, or an object or prefix of a storage opened once."""
    if is_url(text):
        store = storage.FsspecStorage.at(text, storage_options, whole_urls=True)
        proto = scheme(text) or ""
        return StoredPlace(Listing(store, proto), PurePosixPath("/" + text[len(proto) + 3 :]))
    return LocalPlace(Path(local_path(text)))


@functools.total_ordering
class Place(ABC):
    """A file or folder of a corpus (see the module docstring)."""

    __slots__ = ()

    # -- naming, as a path's ----------------------------------------------------------

    @property
    @abstractmethod
    def pure(self) -> PurePath:
        """The place's name as a path (a local path, or ``/bucket/key``)."""

    @abstractmethod
    def _moved(self, pure: PurePath) -> Place:
        """Another place of the same storage, named ``pure``."""

    @property
    def name(self) -> str:
        return self.pure.name

    @property
    def stem(self) -> str:
        return self.pure.stem

    @property
    def suffix(self) -> str:
        return self.pure.suffix

    @property
    def parts(self) -> tuple[str, ...]:
        return self.pure.parts

    @property
    def parent(self) -> Place:
        return self._moved(self.pure.parent)

    @property
    def parents(self) -> tuple[Place, ...]:
        return tuple(self._moved(p) for p in self.pure.parents)

    def __truediv__(self, name: str) -> Place:
        return self._moved(self.pure / name)

    def with_name(self, name: str) -> Place:
        return self._moved(self.pure.with_name(name))

    def relative_to(self, other: Place) -> PurePath:
        return self.pure.relative_to(other.pure)

    def is_relative_to(self, other: Place) -> bool:
        return type(self) is type(other) and self.pure.is_relative_to(other.pure)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Place) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __lt__(self, other: Place) -> bool:
        return self.pure < other.pure

    def _key(self) -> tuple[Any, ...]:
        return (type(self), self.pure)

    # -- what the storage says ------------------------------------------------------------

    @property
    def local(self) -> Path | None:
        """The file's path when the place is on local disk, so a decoder may open it there."""
        return None

    @abstractmethod
    def exists(self) -> bool: ...

    @abstractmethod
    def is_file(self) -> bool: ...

    @abstractmethod
    def is_dir(self) -> bool: ...

    def is_link(self) -> bool:
        return False

    @abstractmethod
    def iterdir(self) -> Iterator[Place]: ...

    @abstractmethod
    def glob(self, pattern: str) -> Iterator[Place]:
        """The files and folders below matching ``pattern`` (``*.tar``, ``*/*.parquet``)."""

    @abstractmethod
    def open_bytes(self) -> IO[bytes]:
        """The file for reading, as a seekable binary file object."""

    @overload
    def open(self, mode: Literal["rb"]) -> IO[bytes]: ...

    @overload
    def open(
        self, mode: Literal["r"] = "r", *, encoding: str | None = None, errors: str | None = None
    ) -> IO[str]: ...

    def open(
        self, mode: str = "r", *, encoding: str | None = None, errors: str | None = None
    ) -> IO[Any]:
        if mode not in ("r", "rb"):
            raise CompileError(f"{self}: a corpus is read only (asked to open it with {mode!r})")
        handle = self.open_bytes()
        return handle if mode == "rb" else io.TextIOWrapper(handle, encoding, errors)

    @abstractmethod
    def read_bytes(self) -> bytes: ...

    @abstractmethod
    def size(self) -> int:
        """The file's size in bytes, -1 when it cannot be told (missing, unreadable, or an
        object of a storage that cannot list)."""

    @abstractmethod
    def asked_size(self) -> int:
        """The file's size, asked of the storage when no listing holds it (a storage that
        cannot list is asked too); OSError (FileNotFoundError) when there is no such file."""

    @abstractmethod
    def at(self, text: str) -> Place:
        """``text`` (a path, or a URL of this place's storage) as a place."""

    def size_of(self, text: str) -> int:
        """The size of the input a listing names by ``text``, -1 when it cannot be told."""
        return self.at(text).size()

    # -- walking, and where a corpus's own paths may lead ---------------------------------

    @abstractmethod
    def walk(
        self,
        exts: Exts = None,
        *,
        corpus: Place | None = None,
        allowed: tuple[str, ...] | None = None,
    ) -> Iterator[Place]:
        """Files below (by extension, any case), in no set order, never inside a dlop archive.

        Links are followed where they lead inside ``corpus`` (the corpus's folder; this one
        by default), so a subset made of links to another folder of the corpus lists; a
        folder reached twice (two links to it, or a loop) is walked once. A link that leads
        out of the corpus is refused with CompileError, naming it, unless it leads into one
        of the ``allowed`` folders (--allow-path); ``allowed=None`` is a probe (layout
        detection), which passes such links over and leaves the refusal to the listing."""

    def files_below(
        self,
        exts: Exts = None,
        *,
        corpus: Place | None = None,
        allowed: tuple[str, ...] | None = None,
    ) -> list[Place]:
        """``walk`` in sorted path order."""
        return sorted(self.walk(exts, corpus=corpus, allowed=allowed))

    def subfolders(self, allowed: tuple[str, ...] | None = None) -> list[Place]:
        """The folders directly inside that are not dlop archives, sorted; none if this is no
        folder. A link to a folder counts where ``walk`` would follow it (inside this folder,
        or an ``allowed`` one; refused otherwise, or passed over when ``allowed`` is None)."""
        if not self.is_dir():
            return []
        return sorted(
            p
            for p in self.iterdir()
            if p.is_dir() and p._followed(self, allowed) and not is_archive(p)
        )

    def _followed(self, corpus: Place, allowed: tuple[str, ...] | None) -> bool:
        """Whether a walk of ``corpus`` goes on through this place (see ``walk``)."""
        return True

    def confine(self, text: str, allowed: tuple[str, ...] = ()) -> str:
        """The file a corpus's listing names by ``text``, resolved against this place (its
        folder, or its storage prefix). A path that leads outside it (absolute, climbing with
        ``..``, through a link pointing out, or a URL) is refused with ValueError unless it
        lies in one of the ``allowed`` folders or URL prefixes the user named. Nothing is read
        before the check, and its message is the same whether the path exists or not. A
        path holding a NUL byte names no file at all, and is refused as such."""
        if "\0" in text:  # the system's calls would refuse it, each in its own way
            raise ValueError(f"path {text!r} holds a NUL byte, which no file name can")
        url = is_url(text)  # once: a listing may name a million paths
        if url and self._holds_url(text):
            return text
        rooted = not (url or posixpath.isabs(text) or os.path.isabs(text))
        rel = posixpath.normpath(text.replace(os.sep, "/")) if rooted else ""
        if rooted and rel != ".." and not rel.startswith("../"):
            full = self._joined(text)
            if self._leads_inside(full) or _allowed(full, allowed):
                return full
            raise ValueError(f"path {text!r} leads out of the corpus through a link; {ALLOW_HINT}")
        target = self._climbed(text) if rooted else text
        if _allowed(target, allowed):
            return target
        raise ValueError(f"path {text!r} lies outside the corpus; {ALLOW_HINT}")

    def _holds_url(self, url: str) -> bool:
        return False

    def _joined(self, text: str) -> str:
        return str(self / text)

    def _leads_inside(self, full: str) -> bool:
        return True

    def _climbed(self, text: str) -> str:
        return text


class LocalPlace(Place):
    """A file or folder on local disk."""

    __slots__ = ("path",)

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def pure(self) -> PurePath:
        return self.path

    def _moved(self, pure: PurePath) -> Place:
        return LocalPlace(Path(pure))

    def __truediv__(self, name: str) -> Place:
        return LocalPlace(self.path / name)

    def __str__(self) -> str:
        return str(self.path)

    @property
    def local(self) -> Path:
        return self.path

    def exists(self) -> bool:
        return self.path.exists()

    def is_file(self) -> bool:
        return self.path.is_file()

    def is_dir(self) -> bool:
        return self.path.is_dir()

    def is_link(self) -> bool:
        return self.path.is_symlink()

    def iterdir(self) -> Iterator[Place]:
        return (LocalPlace(p) for p in self.path.iterdir())

    def glob(self, pattern: str) -> Iterator[Place]:
        return (LocalPlace(p) for p in self.path.glob(pattern))

    def open_bytes(self) -> IO[bytes]:
        return self.path.open("rb")

    def read_bytes(self) -> bytes:
        return self.path.read_bytes()

    def size(self) -> int:
        return _stat_size(str(self.path))

    def asked_size(self) -> int:
        return self.path.stat().st_size

    def size_of(self, text: str) -> int:
        return _stat_size(text)

    def at(self, text: str) -> Place:
        return LocalPlace(Path(text))

    def walk(
        self,
        exts: Exts = None,
        *,
        corpus: Place | None = None,
        allowed: tuple[str, ...] | None = None,
    ) -> Iterator[Place]:
        inside = _real_folder(str(corpus if corpus is not None else self))
        seen: set[str] = set()
        for dirpath, dirnames, filenames in os.walk(self.path, followlinks=True):
            here = Path(dirpath)
            real = os.path.realpath(here)
            if real in seen:
                dirnames[:] = []
                continue
            seen.add(real)
            dirnames.sort()  # the same first name for a folder reached twice, run after run
            dirnames[:] = [
                d
                for d in dirnames
                if _link_followed(here / d, inside, allowed)
                and not is_archive(LocalPlace(here / d))
            ]
            # the extension first (os.path.splitext's, which is Path.suffix's for every name
            # but dots before an extension): a Path and a stat only for a match
            for f in filenames:
                if exts is not None and os.path.splitext(f)[1].lower() not in exts:
                    continue
                path = here / f
                if path.is_file() and _link_followed(path, inside, allowed):
                    yield LocalPlace(path)

    def _followed(self, corpus: Place, allowed: tuple[str, ...] | None) -> bool:
        return _link_followed(self.path, _real_folder(str(corpus)), allowed)

    def _joined(self, text: str) -> str:
        """``str(self / text)``: for a plain relative name (no empty, ``.`` or trailing part
        for pathlib to drop) the same string joined directly, which costs a fraction of
        making a path object for each of a manifest's lines."""
        if (
            os.sep == "/"
            and text
            and "//" not in text
            and "/./" not in text
            and not text.startswith("./")
            and not text.endswith(("/", "/."))
            and text != "."
        ):
            folder = str(self.path)
            if folder != ".":
                return folder + text if folder.endswith("/") else f"{folder}/{text}"
        return str(self.path / text)

    def _leads_inside(self, full: str) -> bool:
        return _within(_real_path(full), _real_folder(str(self.path)))

    def _climbed(self, text: str) -> str:
        return str(self.path / text)


class Listing:
    """One storage (names as whole filesystem paths) and what its listings said: each folder
    is listed at most once, whole.

    Questions (listings, sizes, small reads) go through the storage, so through the retry
    policy every storage read follows; ``open_stream`` streams an object."""

    def __init__(self, store: storage.FsspecStorage, url_scheme: str) -> None:
        self.store = store
        self.scheme = url_scheme  # "s3"
        self.listable = store.lists
        self.entries: dict[str, dict[str, Any]] = {}  # fs path -> {"type", "size"}
        self.listed: list[str] = []  # folders whose whole subtree is in entries

    def fs_path(self, pure: PurePath) -> str:
        text = str(pure)[1:]  # "/bucket/key" -> "bucket/key"
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


class StoredPlace(Place):
    """An object, or a folder (a key prefix), of a storage reached by URL."""

    __slots__ = ("_pure", "listing")

    def __init__(self, listing: Listing, pure: PurePosixPath) -> None:
        self.listing = listing
        self._pure = PurePosixPath(str(pure).rstrip("/") or "/")

    @property
    def pure(self) -> PurePath:
        return self._pure

    def _moved(self, pure: PurePath) -> Place:
        return StoredPlace(self.listing, PurePosixPath(pure))

    def _key(self) -> tuple[Any, ...]:
        return (StoredPlace, id(self.listing), self._pure)

    def __str__(self) -> str:
        return f"{self.listing.scheme}:/{self._pure}"

    @property
    def fs_path(self) -> str:
        return self.listing.fs_path(self._pure)

    def _entry(self) -> dict[str, Any] | None:
        return self.listing.entry(self.fs_path)

    def exists(self) -> bool:
        return self._entry() is not None

    def is_file(self) -> bool:
        e = self._entry()
        return e is not None and e["type"] == "file"

    def is_dir(self) -> bool:
        e = self._entry()
        return e is not None and e["type"] == "directory"

    def _child(self, fs_name: str) -> StoredPlace:
        return StoredPlace(self.listing, self._pure / fs_name[len(self.fs_path) + 1 :])

    def iterdir(self) -> Iterator[Place]:
        base = self.fs_path
        for name in sorted(self.listing.below(base)):
            if "/" not in name[len(base) + 1 :]:
                yield self._child(name)

    def glob(self, pattern: str) -> Iterator[Place]:
        """From the one listing of this folder: names whose parts below it match the
        pattern's parts, one for one."""
        want = pattern.split("/")
        base = self.fs_path
        for name in sorted(self.listing.below(base)):
            parts = name[len(base) + 1 :].split("/")
            if len(parts) == len(want) and all(
                fnmatch.fnmatchcase(p, w) for p, w in zip(parts, want, strict=True)
            ):
                yield self._child(name)

    def open_bytes(self) -> IO[bytes]:
        return self.listing.store.open_stream(self.fs_path)

    def read_bytes(self) -> bytes:
        try:
            return self.listing.store.fetch(self.fs_path, what=str(self))
        except storage.FetchError as e:
            if isinstance(e.cause, FileNotFoundError):
                raise FileNotFoundError(2, "no such object", str(self)) from None
            raise

    def size(self) -> int:
        return self.listing.size(self.fs_path)

    def asked_size(self) -> int:
        e = self._entry()
        if e is None or e["type"] != "file":
            raise FileNotFoundError(2, "no such object", str(self))
        return int(e["size"])

    def size_of(self, text: str) -> int:
        return self.at(text).size() if is_url(text) else -1

    def at(self, text: str) -> Place:
        if not is_url(text):
            return LocalPlace(Path(text))
        proto = scheme(text) or ""
        return StoredPlace(self.listing, PurePosixPath("/" + text[len(proto) + 3 :]))

    def walk(
        self,
        exts: Exts = None,
        *,
        corpus: Place | None = None,
        allowed: tuple[str, ...] | None = None,
    ) -> Iterator[Place]:
        base = self.fs_path
        files = [
            self._child(n)
            for n in self.listing.below(base)
            if self.listing.entries[n]["type"] == "file"
        ]
        marks = {f.parent for f in files if f.name in (PROGRESS_NAME, INDEX_NAME)}
        archives = [d for d in marks if d != self and is_archive(d)]
        for path in files:
            if exts is not None and path.suffix.lower() not in exts:
                continue
            if not any(a in path.parents for a in archives):
                yield path

    def _holds_url(self, url: str) -> bool:
        return _url_within(url, str(self))


def is_archive(folder: Place) -> bool:
    """A dlop archive (its index.json) or an interrupted compile's output (its progress journal)."""
    if (folder / PROGRESS_NAME).exists():
        return True
    index = folder / INDEX_NAME
    if not index.is_file():
        return False
    try:
        with index.open("rb") as f:
            head = f.read(4096)  # "format" is the index's first key (SPEC.md)
    except OSError:
        return False
    return f'"{ARCHIVE_FORMAT}"'.encode() in head


# -- where links and a corpus's own paths may lead (local folders) ---------------------------


def _stat_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1


@functools.lru_cache(maxsize=64)
def _real_folder(folder: str) -> str:
    """Where a corpus root or an allowed folder leads: asked once per folder, not once
    for each of the millions of paths a manifest may name."""
    return os.path.realpath(folder)


def _real_path(path: str) -> str:
    """``os.path.realpath(path)`` at the cost of one lstat for a file whose folder was asked
    about recently: the folder's real path (_real_folder) joined with the name, unless the
    name is itself a link (then resolved in full). A manifest names its files folder by
    folder, and resolving each one's every parent took longer than decoding a short clip.
    The folders' answers last one listing (forget_real_paths)."""
    folder, name = os.path.split(path)
    if name in ("", ".", "..") or os.path.islink(path):
        return os.path.realpath(path)
    return os.path.join(_real_folder(folder), name)


def forget_real_paths() -> None:
    """Drops the folders' real paths asked so far: a listing, or a unit's inputs streamed,
    starts from where the folders lead now, never from a link made since an earlier
    compile in this process (a notebook, a Dask worker) was listed."""
    _real_folder.cache_clear()


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _allowed(target: str, allowed: tuple[str, ...]) -> bool:
    """Whether ``target`` (a local path or a URL) lies in an allowed folder or URL prefix; a
    local one by where its links lead."""
    for folder in allowed:
        if is_url(folder) or is_url(target):
            if is_url(folder) and is_url(target) and _url_within(target, folder):
                return True
            continue
        if _within(os.path.realpath(target), _real_folder(folder)):
            return True
    return False


def _url_within(url: str, prefix: str) -> bool:
    """Whether ``url`` lies below the URL ``prefix`` once ``..`` and ``.`` are resolved."""
    (proto, _, rest), (want, _, base) = url.partition("://"), prefix.partition("://")
    path, folder = posixpath.normpath("/" + rest), posixpath.normpath("/" + base)
    return proto == want and (path == folder or path.startswith(folder.rstrip("/") + "/"))


def _link_followed(path: Path, inside: str, allowed: tuple[str, ...] | None) -> bool:
    """Whether a walk goes on through ``path``: always unless it is a link out of the
    corpus (``inside``, a real path), which a listing refuses and a probe passes over."""
    if not path.is_symlink():
        return True
    target = os.path.realpath(path)
    if _within(target, inside) or (allowed and _allowed(str(path), allowed)):
        return True
    if allowed is None:
        return False
    raise CompileError(f"{path}: a link that leads out of the corpus (to {target}); {ALLOW_HINT}")

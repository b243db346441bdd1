"""Where a compile publishes its files: OUT as a storage (formats.storage), local or a URL.

Shards are written into a local staging folder and then published whole under
their final name (``put``); small files (commit records, the journal,
``index.json``, ``errors.jsonl``) are published whole from bytes (``write``).
A reader of OUT therefore never sees half a file under a final name. A work
unit publishes its shards first and its commit record last (run.units).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any, Protocol

from dlop.formats import storage, urls
from dlop.formats.constants import MAX_ERRORS_BYTES, MAX_INDEX_BYTES
from dlop.formats.files import read_capped

from ..errors import CompileError

STAGING = ".dlop-staging"  # a local OUT's staging folder, beside the files it publishes
MAX_SMALL_BYTES = 512 << 20  # the largest small file a compile reads back (errors.jsonl: 256 MiB)
# A URL OUT's small files: at most an index plus its errors.jsonl.
MAX_READ_BYTES = MAX_INDEX_BYTES + MAX_ERRORS_BYTES


class Store(Protocol):
    """OUT: a storage (formats.storage: write, put, sizes, delete) with a staging folder."""

    url: str  # OUT as the user wrote it, for messages

    def staging(self) -> Path:
        """A local folder where shards are written before ``put``."""
        ...

    def put(self, local: Path, name: str) -> None:
        """Publishes a finished local file as OUT/name, whole or not at all."""
        ...

    def write(self, name: str, data: bytes) -> None:
        """Publishes small bytes as OUT/name, whole or not at all."""
        ...

    def read(self, name: str, cap: int | None = None) -> bytes | None:
        """OUT/name's bytes (a small file, at most ``cap`` bytes: more is an error before
        more than that is read); None when it does not exist."""
        ...

    def list(self, prefix: str = "") -> list[str]:
        """Names under OUT ('/'-separated, relative to OUT) that start with ``prefix``."""
        ...

    def delete(self, name: str) -> None:
        """Removes OUT/name; a missing name is fine."""
        ...

    def download(self, name: str, target: Path, limit: int) -> int:
        """Copies at most ``limit`` bytes of OUT/name into the local file ``target``."""
        ...

    def sizes(self, prefix: str = "") -> dict[str, int]:
        """Every file under OUT (names as ``list`` gives them) with its size in bytes, from
        one listing: no request per file."""
        ...


class LocalStore(storage.LocalStorage):
    """A local OUT folder: put is a rename from the staging folder inside OUT (one file
    system), write a temporary name then rename; both fsync the file and the folder."""

    def staging(self) -> Path:
        folder = self.root / STAGING
        folder.mkdir(exist_ok=True)
        return folder

    def read(self, name: str, cap: int | None = None) -> bytes | None:
        limit = MAX_SMALL_BYTES if cap is None else cap
        try:
            return read_capped(self.root / name, limit, root=self.root, what=name)
        except FileNotFoundError:
            return None

    def list(self, prefix: str = "") -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.name.startswith(prefix))

    def clear_staging(self) -> None:
        """Removes the staging folder and whatever a stopped compile left in it."""
        folder = self.root / STAGING
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder, ignore_errors=True)


def _remove_if_empty(folder: Path) -> None:
    """Removes ``folder`` and the empty folders in it; anything else in it stays."""
    with contextlib.suppress(OSError):
        for sub in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if sub.is_dir() and not sub.is_symlink():
                with contextlib.suppress(OSError):
                    sub.rmdir()
        folder.rmdir()


class FsspecStore(storage.FsspecStorage):
    """The Store of a URL OUT: shards are written in a local staging folder and uploaded
    whole (an S3 object appears only once its PUT completes); small files are written in
    one PUT and read back through the retrying fetch; names are '/'-separated and
    relative to OUT."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._staging: Path | None = None

    def staging(self) -> Path:
        if self._staging is None or not self._staging.is_dir():
            self._staging = Path(tempfile.mkdtemp(prefix="dlop-staging-"))
            # removed once empty when this store goes (or the process exits): every file
            # staged in it is published (put) or discarded by its unit
            weakref.finalize(self, _remove_if_empty, self._staging)
        return self._staging

    def read(self, name: str, cap: int | None = None) -> bytes | None:
        # writes go through the retrying client: what this one's listing cache holds of
        # the folder may predate them (a file written since would read as missing)
        self.fs.invalidate_cache(self.path(name))
        limit = MAX_READ_BYTES if cap is None else cap
        try:
            return self.fetch(name, cap=limit)
        except storage.TooLargeError:
            raise CompileError(
                f"{self.url}/{name}: larger than its {limit}-byte cap"
                + (" on an archive's own small files" if cap is None else "")
                + "; it is not what a compile writes"
            ) from None
        except storage.FetchError as e:
            if isinstance(e.cause, FileNotFoundError):
                return None
            raise

    def list(self, prefix: str = "") -> list[str]:
        return sorted(self.sizes(prefix))


def open_store(out: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Store:
    """The store of OUT: a LocalStore for a local path, an FsspecStore for a URL (reads
    and listings tried by the retry policy, writes by the client's own retries)."""
    if not urls.is_url(out):
        return LocalStore(out)
    store = FsspecStore.at(os.fspath(out), storage_options)
    if not store.writes or not store.lists:
        raise CompileError(
            f"{store.url}: a compile cannot write its archive there (its storage cannot "
            "write and list objects); choose a local folder or an object store (s3://, gs://)"
        )
    return store

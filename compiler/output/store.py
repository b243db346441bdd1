"""Where a compile publishes its files: one small interface over a local OUT and a URL OUT.

Shards are written into a local staging folder and then published whole under
their final name (``put``); small files (commit records, the journal,
``index.json``, ``errors.jsonl``) are published whole from bytes (``write``).
A reader of OUT therefore never sees half a file under a final name. A work
unit publishes its shards first and its commit record last (units.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any, Protocol

from dlop.formats.files import read_capped

STAGING = ".dlop-staging"  # a local OUT's staging folder, beside the files it publishes
MAX_SMALL_BYTES = 512 << 20  # the largest small file a compile reads back (errors.jsonl: 256 MiB)


class Store(Protocol):
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

    def read(self, name: str) -> bytes | None:
        """OUT/name's bytes; None when it does not exist."""
        ...

    def list(self, prefix: str = "") -> list[str]:
        """Names under OUT ('/'-separated, relative to OUT) that start with ``prefix``."""
        ...

    def delete(self, name: str) -> None:
        """Removes OUT/name; a missing name is fine."""
        ...

    def sizes(self) -> dict[str, int]:
        """Every file under OUT (names as ``list`` gives them) with its size in bytes, from
        one listing: no request per file."""
        ...


class LocalStore:
    """A local OUT folder: put is a rename from the staging folder inside OUT (one file
    system), write a temporary name then rename; both fsync the file and the folder."""

    def __init__(self, out: str | os.PathLike[str]) -> None:
        self.root = Path(out)
        self.url = str(out)

    def staging(self) -> Path:
        folder = self.root / STAGING
        folder.mkdir(exist_ok=True)
        return folder

    def put(self, local: Path, name: str) -> None:
        with open(local, "rb") as f:
            os.fsync(f.fileno())
        os.replace(local, self.root / name)
        self._sync_folder()

    def write(self, name: str, data: bytes) -> None:
        target = self.root / name
        tmp = target.with_name(f".{target.name}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        self._sync_folder()

    def read(self, name: str) -> bytes | None:
        try:
            return read_capped(self.root / name, MAX_SMALL_BYTES, root=self.root, what=name)
        except FileNotFoundError:
            return None

    def list(self, prefix: str = "") -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.name.startswith(prefix))

    def delete(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def sizes(self) -> dict[str, int]:
        """The regular files in OUT (not links) with their sizes."""
        if not self.root.is_dir():
            return {}
        with os.scandir(self.root) as entries:
            return {
                e.name: e.stat(follow_symlinks=False).st_size
                for e in entries
                if e.is_file(follow_symlinks=False)
            }

    def clear_staging(self) -> None:
        """Removes the staging folder and whatever a stopped compile left in it."""
        folder = self.root / STAGING
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder, ignore_errors=True)

    def _sync_folder(self) -> None:
        with contextlib.suppress(OSError):  # not every file system lets a folder be fsynced
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def open_store(out: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Store:
    """The store of OUT: a LocalStore for a local path, an FsspecStore for a URL."""
    from ..urls import FsspecStore, is_url

    if is_url(out):
        return FsspecStore(os.fspath(out), storage_options)
    return LocalStore(out)

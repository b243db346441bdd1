"""The cache's folder: which folder a cache may take, what in it is the cache's, and
its byte budget as given.

A cache folder is marked (``MARK``) when dlop makes the cache, in a new or empty
folder, or one holding nothing but what an earlier dlop wrote there; a folder
holding anything else is never adopted, so listing, eviction, sweeping and
clearing (runtime.storage.cache) never meet a user's files. Inside, only archive
folders named by an archive id count, and links are never followed.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from dlop.formats import DlopError
from dlop.formats.limits import with_room
from dlop.formats.sizes import parse_size

BUDGET_LOCK = ".budget.lock"
WANTED = ".wanted"
MARK = ".dlop-cache"
MARK_TEXT = b"dlop node-local shard cache: dlop removes what it wrote here\n"
ARCHIVE_ID = re.compile(r"[0-9a-f]{24}")  # an archive folder's name (runtime.storage.cached)
OWN_FILES = (BUDGET_LOCK, WANTED, MARK)
FOREIGN = "the cache folder must be writable and hold only what dlop writes there"


class CacheError(DlopError):
    """The shard cache cannot hold what was asked of it (budget, or its folder)."""


def archive_dirs(root: Path) -> list[Path]:
    """The folders under ``root`` named by an archive id that are folders, not links."""
    try:
        with with_room(lambda: os.scandir(root), root) as entries:
            return sorted(
                Path(e.path)
                for e in entries
                if ARCHIVE_ID.fullmatch(e.name) and e.is_dir(follow_symlinks=False)
            )
    except FileNotFoundError:
        return []


def is_cache(root: Path) -> bool:
    """Whether ``root`` carries dlop's cache mark."""
    try:
        return stat.S_ISREG(os.lstat(root / MARK).st_mode)
    except OSError:
        return False


def claim(root: Path) -> None:
    """Makes ``root`` a dlop cache, or refuses: a folder is adopted only when it is new,
    empty, already marked, or holds nothing but what dlop writes in a cache."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CacheError(f"{root}: cannot make the cache folder: {e.strerror or e}") from None
    if not root.is_dir():
        raise CacheError(f"{root}: the cache folder is not a folder: {FOREIGN}")
    if not os.access(root, os.W_OK | os.X_OK):
        raise CacheError(
            f"{root}: the cache folder is not writable by this process; give cache_dir "
            "(DLOP_CACHE_DIR) a folder it may write in"
        )
    if is_cache(root):
        return
    with os.scandir(root) as entries:
        foreign = sorted(
            e.name
            for e in entries
            if not (
                (e.name in OWN_FILES and e.is_file(follow_symlinks=False))
                or (ARCHIVE_ID.fullmatch(e.name) and e.is_dir(follow_symlinks=False))
            )
        )
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise CacheError(
            f"{root}: not a dlop shard cache (no {MARK} mark) and it holds {foreign[0]!r}"
            f"{more}: dlop evicts and sweeps what is in its cache, so it takes only a "
            "folder of its own; give cache_dir (DLOP_CACHE_DIR, dlop-inspect cache DIR) a "
            "new or empty folder"
        )
    try:
        fd = os.open(root / MARK, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except FileExistsError:
        return
    except OSError as e:
        raise CacheError(f"{root}: cannot mark the cache folder: {e.strerror or e}") from None
    try:
        os.write(fd, MARK_TEXT)
    finally:
        os.close(fd)


def default_cache_dir() -> Path:
    """``DLOP_CACHE_DIR``, else ``$XDG_CACHE_HOME/dlop/shards`` (``~/.cache/dlop/shards``)."""
    env = os.environ.get("DLOP_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dlop" / "shards"


def default_cache_bytes() -> int:
    """``DLOP_CACHE_BYTES`` (an integer, or with a K/M/G/T suffix), else 16 GiB."""
    env = os.environ.get("DLOP_CACHE_BYTES", "").strip()
    if not env:
        return 16 << 30
    return parse_bytes(env, "DLOP_CACHE_BYTES")


def parse_bytes(text: str, where: str) -> int:
    """``text`` in bytes, as every size dlop takes is written (dlop.formats.sizes)."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise CacheError(f"{where}: {e}; write e.g. 50000000000 or 50G") from None


def byte_budget(value: object, where: str) -> int:
    """A cache budget as given: a positive int, or a size with units as the command
    line takes them ("100MB", "50G")."""
    if isinstance(value, str):
        return parse_bytes(value, where)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CacheError(
            f"{where}: {value!r} is not a byte budget; give a positive int or a size such as '50G'"
        )
    return value

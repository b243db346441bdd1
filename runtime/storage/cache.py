"""The node-local shard cache: one directory serves every rank and DataLoader worker.

Layout: ``<root>/<archive id>/`` per archive, the id a hash of its index bytes
(two archives never share a folder; the same archive under two URLs does),
holding ``index.json``, ``source.txt`` (where it came from), the cached shards
under their own names, and per shard an empty ``<name>.lock``.

Only files, renames and ``flock`` are used: every lock dies with the process
that holds it, so a crash leaves nothing that blocks the next run.

- A shard becomes visible by rename only, after its checksum was verified;
  what was verified (inode, size, modification time, and the CRC-32 of the
  file's bytes) is then written into its ``<name>.lock``. A shard whose file no
  longer matches that stamp (changed in place, replaced, or cached by a version
  that wrote none) is fetched again instead of served; and before a process
  holds a cached shard for the first time it reads the file once and checks its
  CRC against the stamp's, so bytes that changed on disk with the rest of the
  stamp kept (bit rot, a write that restored the modification time) are fetched
  again too, never served. Use refreshes a shard's access time only, which
  orders eviction, so the modification time stays the content's;
  it is written under ``<name>.tmp-<pid>-<random>`` while its writer holds an
  exclusive lock on it. A temporary file nobody holds is a crashed writer's:
  it is removed when a cache opens (and before eviction gives up).
- One fetch per shard per node: the fetcher holds ``<name>.lock``; others
  wait on it and then find the shard in place.
- Holders: a process reading a cached shard keeps a shared lock on it for as
  long as it holds the shard. Eviction takes an exclusive non-blocking lock,
  so it only ever removes shards no process holds, least recently used first.
- The budget is a hard ceiling on the bytes of every regular file under ``root``:
  room is made and the new file created at its full size under one
  node-wide lock (``<root>/.budget.lock``), before any byte is written.
- A process that waits for room stamps ``<root>/.wanted`` (its mtime); one that
  keeps shards mapped in case it reads them again (loose shards,
  runtime.storage.remote_supply) lets them go at its next batch when the stamp changed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import secrets
import shutil
import stat
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from dlop.formats import ArchiveReader, FormatError
from dlop.formats.crc import crc32
from dlop.formats.errors import ResourceLimitError
from dlop.formats.limits import with_room
from dlop.formats.storage import FetchError
from dlop.formats.transcode import needs_transcode

from .cache_folder import ARCHIVE_ID, BUDGET_LOCK, FOREIGN, WANTED, CacheError, archive_dirs, claim

TMP_MARK = ".tmp-"
LOCK_SUFFIX = ".lock"
STAMP_BYTES = 96  # room kept with each shard for its stamp in <name>.lock (at most 81 bytes)


@dataclass(frozen=True)
class Held:
    """A cached shard this process holds: its path and the descriptor whose shared
    lock keeps it from eviction until ``CacheDir.let_go``."""

    path: Path
    fd: int
    bytes: int


@dataclass(frozen=True)
class Arriving:
    """A shard being written into the cache in place (``CacheDir.arrive``): its
    temporary file, created at full size within the budget and locked exclusively
    (``fd``), and the node's fetch lock on the shard (``lock_fd``, -1: none taken)."""

    path: Path
    tmp: Path
    fd: int
    lock_fd: int
    size: int


def listed(folder: Path) -> list[Path]:
    """What ``folder`` holds (a full table of open files named as such)."""
    return with_room(lambda: list(folder.iterdir()), folder)


def _open(path: Path, flags: int = os.O_RDONLY) -> int:
    # a full table of open files is not the folder's fault: named as what it is
    return with_room(lambda: os.open(path, flags | os.O_CLOEXEC, 0o644), path)


def _try_lock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def take_lock(path: Path, wait: bool = True, shard: Path | None = None) -> int | None:
    """A descriptor of ``path`` (created if missing) holding an exclusive ``flock`` on
    it until closed; without ``wait``, None when it is not free at once. With ``shard``,
    ``path`` is that shard's fetch lock and the wait is bounded (``wait_for_peer``)."""
    try:
        fd = _open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW)
    except OSError as e:  # a folder or a link in its place, a cache folder we may not write...
        raise CacheError(f"{path}: cannot open the lock file ({e}); {FOREIGN}") from None
    try:
        if wait and shard is not None:
            wait_for_peer(path, fd, shard)
        elif wait:
            fcntl.flock(fd, fcntl.LOCK_EX)
        elif not _try_lock(fd, fcntl.LOCK_EX):
            os.close(fd)
            return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def lock_holders(fd: int) -> list[int]:
    """The processes holding a ``flock`` on the file open as ``fd`` (from /proc/locks;
    empty where that is not readable, or the holders live in another pid namespace)."""
    st = os.fstat(fd)
    inode = f":{st.st_ino}"
    out = []
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/locks").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5].endswith(inode):
                dev = parts[5][: -len(inode)].split(":")
                if len(dev) == 2 and os.makedev(int(dev[0], 16), int(dev[1], 16)) == st.st_dev:
                    out.append(int(parts[4]))
    return [pid for pid in out if pid > 0]


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` (R, S, D, T for stopped...), None if gone."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat_line.rsplit(")", 1)[-1].split()[0]


# A peer's fetch is waited for while it makes progress (its temporary file written) or
# the lock's holder runs; a holder stopped this long (SIGSTOP, a suspended job), or no
# progress for PEER_STALL_S, ends the wait with a CacheError naming it.
STOPPED_GRACE_S = 5.0
PEER_STALL_S = 600.0


def writes_of(shard: Path) -> list[tuple[str, int]]:
    """What shows a fetch of ``shard`` going on: its temporary files' modification times."""
    out = []
    for p in shard.parent.glob(f"{shard.name}{TMP_MARK}*"):
        with contextlib.suppress(FileNotFoundError):
            out.append((p.name, p.stat().st_mtime_ns))
    return sorted(out)


def wait_for_peer(lock: Path, fd: int, shard: Path, stall_s: float = PEER_STALL_S) -> None:
    """Takes the exclusive ``flock`` on ``lock`` (open as ``fd``) that a peer process
    holds while it fetches ``shard``, waiting while the peer runs and makes progress."""
    seen: object = None
    progress = stopped_since = time.monotonic()
    delay = 0.005
    while not _try_lock(fd, fcntl.LOCK_EX):
        time.sleep(delay)
        delay = min(delay * 2, 0.25)
        now = time.monotonic()
        mark = writes_of(shard)
        if mark != seen:
            seen, progress = mark, now
        holders = lock_holders(fd)
        states = {pid: process_state(pid) for pid in holders}
        stopped = [pid for pid, st in states.items() if st in ("T", "t")]
        if not stopped:
            stopped_since = now
        elif now - stopped_since > STOPPED_GRACE_S:
            raise CacheError(
                f"{shard}: process {stopped[0]} holds the node's fetch lock of this shard "
                f"({lock.name}) and is stopped (SIGSTOP, a suspended job) for "
                f"{now - stopped_since:.0f} s; resume it (kill -CONT {stopped[0]}) or end "
                "it, and read again"
            )
        if now - progress > stall_s:
            who = f"process {holders[0]}" if holders else "another process"
            raise CacheError(
                f"{shard}: {who} holds the node's fetch lock of this shard ({lock.name}) and "
                f"wrote nothing of it for {now - progress:.0f} s; end that process, or "
                "read again once it has"
            )


class _Inside(threading.local):
    """How many ``locked`` blocks this thread is inside holding their locks."""

    depth = 0


_inside = _Inside()


@contextlib.contextmanager
def locked(path: Path, wait: bool = True, shard: Path | None = None) -> Iterator[bool]:
    """An exclusive ``flock`` on ``path`` (created if missing) for the ``with`` block;
    without ``wait``, only if free at once (the block gets False when it was not);
    ``shard``: as take_lock."""
    fd = take_lock(path, wait, shard)
    held = int(fd is not None)
    _inside.depth += held
    try:
        yield fd is not None
    finally:
        _inside.depth -= held
        close_quietly([fd if fd is not None else -1])  # releases the lock


def holds_node_lock() -> bool:
    """Whether this thread is inside a ``locked`` block that holds its lock (the node's
    budget lock, a shard's fetch lock): whatever it runs there must not wait for a thread
    that may be waiting for that lock (a fetch thread publishing a shard holds its
    supply's lock while it takes the budget's)."""
    return _inside.depth > 0


def close_quietly(fds: Iterable[int]) -> None:
    """Closes each descriptor (-1: none), whatever state it is in."""
    for fd in fds:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


def is_tmp(name: str) -> bool:
    return TMP_MARK in name


def is_shard(name: str) -> bool:
    return not (is_tmp(name) or name.endswith(LOCK_SUFFIX) or name in ("index.json", "source.txt"))


class CacheDir:
    """A cache folder with a byte budget (``max_bytes``) shared by every process on the node."""

    def __init__(self, root: str | os.PathLike[str], max_bytes: int, wait_s: float = 120.0) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.wait_s = wait_s
        # Called when room runs out: lets go of holds kept only in case; True if any went.
        self.squeeze: Callable[[], bool] | None = None
        claim(self.root)
        self.wanted_path = str(self.root / WANTED)
        self.sweep()

    def files(self) -> Iterator[tuple[Path, os.stat_result]]:
        """Every regular file in the archive folders, with its stat (a link, a folder or
        any name outside dlop's archive folders is not listed, so never removed)."""
        for sub in archive_dirs(self.root):
            for p in listed(sub):
                with contextlib.suppress(FileNotFoundError):
                    st = p.lstat()
                    if stat.S_ISREG(st.st_mode):
                        yield p, st

    def used_bytes(self) -> int:
        return sum(st.st_size for _, st in self.files())

    def fixed_bytes(self) -> int:
        """Bytes of the files eviction never removes (indexes, sources, locks)."""
        return sum(st.st_size for p, st in self.files() if not (is_shard(p.name) or is_tmp(p.name)))

    def sweep(self) -> int:
        """Removes temporary files no live writer holds; returns how many."""
        return sum(is_tmp(p.name) and self._remove_if_free(p) for p, _ in self.files())

    def _remove_if_free(self, p: Path) -> bool:
        try:
            fd = _open(p)
        except FileNotFoundError:
            return False
        try:
            if not _try_lock(fd, fcntl.LOCK_EX):
                return False
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
            return True
        finally:
            os.close(fd)

    def want_room(self) -> None:
        """Stamps ``.wanted``: this process waits for room that shards held elsewhere take."""
        with contextlib.suppress(FileExistsError):
            os.close(os.open(self.wanted_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        now = time.time_ns()
        os.utime(self.wanted_path, ns=(now, now))

    def wanted_stamp(self) -> int:
        """The ``.wanted`` stamp (0 before any); when it changes, a process waits for room."""
        try:
            return os.stat(self.wanted_path).st_mtime_ns
        except FileNotFoundError:
            return 0

    def archive_dir(self, archive_id: str) -> Path:
        """The folder of one archive's shards, named by its id (24 hex digits: the only
        names under the root that the cache lists, evicts or clears)."""
        if not ARCHIVE_ID.fullmatch(archive_id):
            raise ValueError(f"an archive id is 24 lowercase hex digits, not {archive_id!r}")
        d = self.root / archive_id
        d.mkdir(exist_ok=True)
        return d

    def hold(self, path: Path) -> Held | None:
        """The cached shard at ``path`` held (shared lock, LRU time refreshed), or None
        when it is not there (or was evicted while we opened it); CacheError when a
        link, a folder or anything but a file is in its place."""
        try:
            fd = _open(path, os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as e:  # ELOOP: a symbolic link
            raise CacheError(f"{path}: cannot open the cached shard ({e}); {FOREIGN}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            st = os.fstat(fd)
            if st.st_nlink == 0 or not stat.S_ISREG(st.st_mode):  # nlink 0: evicted meanwhile
                if st.st_nlink == 0:
                    os.close(fd)
                    return None
                raise CacheError(f"{path}: not a regular file; remove it: {FOREIGN}")
            stamp = _read_stamp(path)
            if not stamp.startswith(_stamp_of(st)) or not content_verified(
                path, fd, st.st_size, stamp
            ):
                os.close(fd)  # changed since it was verified: fetch again
                return None
        except BaseException:  # a full table of files among them: nothing kept held
            close_quietly([fd])
            raise
        with contextlib.suppress(OSError):  # the use, for eviction; the content's time kept
            os.utime(fd, ns=(time.time_ns(), st.st_mtime_ns))
        return Held(path, fd, st.st_size)

    def let_go(self, held: Held) -> None:
        os.close(held.fd)

    def get(self, path: Path, fetch: Callable[[], bytes], write: WriteFn | None = None) -> Held:
        """Shard ``path`` held: from the cache, or fetched once on this node and stored.
        ``fetch`` returns the verified bytes; ``write`` (optional) turns them into the
        file to cache (a raw copy of a compressed shard)."""
        held = self.hold(path)
        if held is not None:
            return held
        lock = path.with_name(path.name + LOCK_SUFFIX)
        with locked(lock, shard=path):
            held = self.hold(path)  # another process fetched it while we waited
            if held is None:
                refuse_failed(lock, path)
                try:
                    data = fetch()
                except FetchError as e:
                    record_failure(lock, e)
                    raise
                held = self.store(path, write(data) if write is not None else data, keep=True)
        if held is None:  # reserve waits for room or raises: never here
            raise CacheError(f"{path}: no room was made for the shard")
        return held

    def prefetch(
        self, path: Path, size: int, fetch: Callable[[], bytes], write: WriteFn | None = None
    ) -> bool:
        """Shard ``path`` (at most ``size`` bytes cached) fetched into the cache ahead of use
        and not held (as ``get``), but only while no other process is fetching it and the
        budget has room now (unheld shards evicted for it, nobody waited for); True if
        it is cached after."""
        if path.exists():
            return True
        with locked(path.with_name(path.name + LOCK_SUFFIX), wait=False) as free:
            if not free:
                return False  # being fetched by another process
            if path.exists():
                return True
            with locked(self.root / BUDGET_LOCK):
                if self.make_room(size + STAMP_BYTES) + size + STAMP_BYTES > self.max_bytes:
                    return False
            data = fetch()
            data = write(data) if write is not None else data
            return self.store(path, data, wait=False) is not None

    def arrive(self, path: Path, size: int, wait: bool = True) -> Held | Arriving | None:
        """Shard ``path`` held, when cached (by another process meanwhile, whose fetch
        is waited for); else its temporary file of ``size`` bytes, made within the
        budget under the node's fetch lock for the caller to write in place and
        ``publish`` (or ``abandon``). Without ``wait``: None when another process is
        fetching it or the budget has no room now."""
        held = self.hold(path)
        if held is not None:
            return held
        lock_fd = take_lock(path.with_name(path.name + LOCK_SUFFIX), wait, path)
        if lock_fd is None:
            return None
        try:
            held = self.hold(path)  # another process fetched it while we waited
            if held is None:
                refuse_failed(path.with_name(path.name + LOCK_SUFFIX), path)
            tmp = self.temp_name(path)
            fd = None if held is not None else self.reserve(tmp, size, wait)
        except BaseException:
            os.close(lock_fd)
            raise
        if fd is None:
            os.close(lock_fd)
            return held
        return Arriving(path, tmp, fd, lock_fd, size)

    def publish(self, a: Arriving, crc: int, keep: bool = False, synced: bool = False) -> Held:
        """Makes the fully written and verified ``a``, whose bytes have CRC-32 ``crc``,
        the cached shard: synced (unless the caller did), its stamp written, renamed
        into place under the budget lock (a ``keep`` lock turns shared, held, before any
        eviction sees the file), the fetch lock let go of. On an error nothing is let
        go of: the caller abandons ``a``."""
        if not synced:
            os.fsync(a.fd)
        stamp = _write_stamp(a.path, os.fstat(a.fd), crc)
        remember(a.path, stamp, True)  # this process wrote what it verified
        with locked(self.root / BUDGET_LOCK):
            os.replace(a.tmp, a.path)
            if keep:
                fcntl.flock(a.fd, fcntl.LOCK_SH)
        if a.lock_fd >= 0:
            os.close(a.lock_fd)
        if not keep:
            os.close(a.fd)
        return Held(a.path, a.fd if keep else -1, a.size)

    def abandon(self, a: Arriving, failure: BaseException | None = None) -> None:
        """Removes a shard that will not arrive whole, and lets go of its locks; a
        ``failure`` of its fetch (FetchError) is first recorded for the node's other
        processes (``record_failure``)."""
        if isinstance(failure, FetchError) and a.lock_fd >= 0:
            record_failure(a.path.with_name(a.path.name + LOCK_SUFFIX), failure)
        with contextlib.suppress(FileNotFoundError):
            a.tmp.unlink()
        close_quietly([a.fd, a.lock_fd])

    def temp_name(self, path: Path) -> Path:
        return path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")

    def store(self, path: Path, data: bytes, wait: bool = True, keep: bool = False) -> Held | None:
        """Writes ``data`` as ``path`` (room made under the budget lock, then published as
        ``publish`` does). Without ``wait``, None when there is no room at once."""
        tmp = self.temp_name(path)
        fd = self.reserve(tmp, len(data), wait)
        if fd is None:
            return None
        a = Arriving(path, tmp, fd, -1, len(data))
        try:
            write_at(fd, data, 0)
            return self.publish(a, crc32(data), keep)
        except BaseException:
            self.abandon(a)
            raise

    def reserve(self, tmp: Path, size: int, wait: bool = True) -> int | None:
        """Creates ``tmp`` at ``size`` bytes, locked, once the budget has room for it;
        evicts unheld shards (least recently used first) to make room, and waits
        while the shards in the way are held (without ``wait``: None at once)."""
        if size > self.max_bytes:
            raise CacheError(
                f"{tmp.parent}: a {size}-byte shard does not fit the cache budget of "
                f"{self.max_bytes} bytes; raise cache_bytes (DLOP_CACHE_BYTES) to at least "
                "twice the largest shard"
            )
        deadline = time.monotonic() + self.wait_s
        while True:
            with locked(self.root / BUDGET_LOCK):
                used = self.make_room(size + STAMP_BYTES)
                if used + size + STAMP_BYTES <= self.max_bytes:
                    fd = _open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL)
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    try:
                        self.allocate(fd, tmp, size)
                    except BaseException:
                        with contextlib.suppress(FileNotFoundError):
                            tmp.unlink()
                        os.close(fd)
                        raise
                    return fd
                fixed = self.fixed_bytes()
            if fixed + size + STAMP_BYTES > self.max_bytes:  # nothing evicted makes room
                raise CacheError(
                    f"{self.root}: a {size}-byte shard does not fit beside the cache's own "
                    f"files ({fixed} bytes: each archive's index.json, source.txt and locks, "
                    f"which are not evicted) under the {self.max_bytes}-byte budget; raise "
                    "cache_bytes (DLOP_CACHE_BYTES), or clear archives no longer read "
                    "(dlop-inspect cache --clear)"
                )
            if not wait:
                return None
            if self.squeeze is not None and self.squeeze():
                continue  # this process let go of a shard it kept only in case
            self.want_room()  # others let go of theirs at their next batch
            if time.monotonic() > deadline:
                raise CacheError(
                    f"{self.root}: {size} bytes needed, {used} of the {self.max_bytes}-byte "
                    f"budget in use by shards that processes still hold (waited "
                    f"{self.wait_s:.0f} s); raise cache_bytes (DLOP_CACHE_BYTES) or read "
                    "fewer shards at once (smaller window_shards, fewer ranks per node)"
                )
            time.sleep(0.05)

    def allocate(self, fd: int, tmp: Path, size: int) -> None:
        """Gives the new file ``tmp`` its ``size`` bytes on disk now (not a sparse file
        that runs out of room mid-write), so a full disk is said at once, with the cache
        folder and its budget."""
        try:
            if size:
                os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                os.ftruncate(fd, size)  # a file system that cannot: written as it comes
                return
            if e.errno != errno.ENOSPC:
                raise
            free = shutil.disk_usage(self.root).free
            raise CacheError(
                f"{self.root}: the disk holding the shard cache is full: a {size}-byte shard "
                f"({tmp.name.split(TMP_MARK)[0]}) does not fit in the {free} bytes it has "
                f"free, though the cache's budget (cache_bytes, DLOP_CACHE_BYTES: "
                f"{self.max_bytes} bytes) has room for it; free space on that disk, put the "
                "cache on a larger one (cache_dir, DLOP_CACHE_DIR), or lower cache_bytes "
                "below what the disk holds"
            ) from None

    def make_room(self, size: int) -> int:
        """Evicts unheld shards, oldest use first, until ``size`` more bytes fit; returns
        the bytes in use after. Called under the budget lock."""
        entries = list(self.files())
        used = sum(st.st_size for _, st in entries)
        for p, st in sorted(entries, key=lambda e: e[1].st_atime_ns):
            if used + size <= self.max_bytes:
                break
            if (is_tmp(p.name) or is_shard(p.name)) and self._remove_if_free(p):
                used -= st.st_size + (_drop_stamp(p) if is_shard(p.name) else 0)
        return used

    def verify(self, progress: Callable[[int], None] | None = None) -> tuple[int, list[str]]:
        """Reads every cached shard (a shared lock held meanwhile, so none is evicted
        under it) and checks its bytes against the CRC-32 its stamp recorded when it was
        verified, and a raw shard's against its archive's index too: (shards checked,
        problems, each naming the file). A shard that fails would be fetched again when
        next read, never served."""
        checked, problems = 0, []
        for sub in archive_dirs(self.root):
            try:
                index = ArchiveReader(sub).index
                crcs = {s.file: s.crc32 for s in index.shards}
                raw = not needs_transcode(index.fields)
            except (FormatError, OSError) as e:
                problems.append(f"{sub}: its index does not read ({e})")
                continue
            for p in sorted(listed(sub)):
                if not is_shard(p.name) or (p.is_dir() and not p.is_symlink()):
                    continue
                try:
                    fd = _open(p, os.O_NOFOLLOW)
                except FileNotFoundError:
                    continue  # evicted meanwhile
                except OSError as e:  # a link in its place
                    problems.append(f"{p}: cannot open the cached shard ({e}); {FOREIGN}")
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH)
                    st = os.fstat(fd)
                    stamp = _read_stamp(p)
                    want = stamp_crc(stamp) if stamp.startswith(_stamp_of(st)) else None
                    got = file_crc(fd, st.st_size)
                finally:
                    os.close(fd)
                checked += 1
                if progress is not None:
                    progress(checked)
                if p.name not in crcs:
                    problems.append(f"{p}: not a shard of the archive its folder holds")
                elif want is None:
                    problems.append(
                        f"{p}: no verified stamp for it (cached by an earlier version, or "
                        "changed since): it is fetched again when next read"
                    )
                elif got != want:
                    problems.append(
                        f"{p}: CRC-32 {got:#010x}, {want:#010x} when it was cached: its bytes "
                        "changed on disk (it is fetched again when next read)"
                    )
                elif raw and got != crcs[p.name]:
                    problems.append(
                        f"{p}: CRC-32 {got:#010x}, index.json says {crcs[p.name]:#010x}"
                    )
        return checked, problems

    def use(self, folder: Path) -> int:
        """A descriptor whose shared lock on ``folder``'s ``index.json`` marks the archive
        folder in use until it is closed (``clear`` removes no folder in use). Call
        under the budget lock, with the index in place."""
        index = folder / "index.json"
        try:
            fd = _open(index, os.O_NOFOLLOW)
        except OSError as e:
            raise CacheError(f"{index}: cannot open the cached index ({e}); {FOREIGN}") from None
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd

    def clear(self) -> int:
        """Removes every shard, temporary file and archive folder no process holds,
        writes or uses (``use``); returns the bytes freed."""
        freed = 0
        with locked(self.root / BUDGET_LOCK):
            for p, st in list(self.files()):
                if (is_shard(p.name) or is_tmp(p.name)) and self._remove_if_free(p):
                    freed += st.st_size + (_drop_stamp(p) if is_shard(p.name) else 0)
            for sub in archive_dirs(self.root):
                if any(is_shard(p.name) or is_tmp(p.name) for p in listed(sub)):
                    continue  # held or being written
                index = sub / "index.json"
                try:
                    fd = _open(index, os.O_NOFOLLOW)
                except FileNotFoundError:
                    fd = -1
                except OSError:
                    continue  # not a file dlop wrote: left alone
                try:
                    if fd >= 0 and not _try_lock(fd, fcntl.LOCK_EX):
                        continue  # a process reads this archive: its locks stay
                    for p in listed(sub):
                        with contextlib.suppress(FileNotFoundError):
                            st = p.lstat()
                            if stat.S_ISREG(st.st_mode):
                                p.unlink()
                                freed += st.st_size
                    with contextlib.suppress(OSError):
                        sub.rmdir()
                finally:
                    close_quietly([fd])
        return freed


WriteFn = Callable[[bytes], bytes]


def write_at(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Writes all of ``data`` at ``offset`` of ``fd``."""
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


# A shard whose fetch failed (every attempt spent) is recorded in its lock file: for this
# long, another process on the node that needs it takes that failure as its answer
# instead of spending the attempts and timeouts again (then the shard is tried afresh).
FAILURE_KEPT_S = 60.0
FAILED_MARK = b"failed "


class PeerFailed(FetchError):
    """Another process on the node failed to fetch this shard moments ago (a process
    answers its own batches with its own failure until its next epoch)."""


def record_failure(lock: Path, failure: BaseException) -> None:
    """Writes ``failure`` into the shard's lock file (held by the caller)."""
    text = " ".join(str(failure).split())[:600]
    with contextlib.suppress(OSError, ResourceLimitError):  # a record, at best
        fd = _open(lock, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
        try:
            os.write(fd, FAILED_MARK + f"{time.time_ns()} {os.getpid()} {text}\n".encode())
        finally:
            os.close(fd)


def refuse_failed(lock: Path, shard: Path) -> None:
    """Raises PeerFailed when the shard's lock file records a failure of its fetch in the
    last FAILURE_KEPT_S seconds (call with the fetch lock held)."""
    try:
        fd = _open(lock, os.O_NOFOLLOW)
    except OSError:
        return
    try:
        data = os.read(fd, 1024)
    finally:
        os.close(fd)
    if not data.startswith(FAILED_MARK):
        return
    fields = data[len(FAILED_MARK) :].decode(errors="replace").split(" ", 2)
    when, pid, text = [*fields, "", ""][:3]
    try:
        age = (time.time_ns() - int(when)) / 1e9
        own = int(pid) == os.getpid()  # its own failures a process keeps itself (an epoch)
    except ValueError:
        return
    if 0 <= age < FAILURE_KEPT_S and not own:
        raise PeerFailed(
            f"{shard.name}: another process on this node failed to fetch it {age:.0f} s ago "
            f"(tried afresh {FAILURE_KEPT_S - age:.0f} s from now): {text.strip()}"
        )


def _stamp_of(st: os.stat_result) -> bytes:
    """What identifies a cached shard's file as the one verified: inode, size, mtime."""
    return f"{st.st_ino} {st.st_size} {st.st_mtime_ns} ".encode()


def _stamp(st: os.stat_result, crc: int) -> bytes:
    """The whole stamp: the file's identity and the CRC-32 of its bytes."""
    return _stamp_of(st) + f"{crc:08x}\n".encode()


def stamp_crc(stamp: bytes) -> int | None:
    """The CRC-32 a stamp records (None: a stamp without one, or not a stamp)."""
    parts = stamp.split(b" ")
    if len(parts) != 4 or len(parts[3]) != 9 or not parts[3].endswith(b"\n"):
        return None
    try:
        return int(parts[3][:8], 16)
    except ValueError:
        return None


def file_crc(fd: int, size: int) -> int:
    """The CRC-32 of the first ``size`` bytes of ``fd``, read through a mapping."""
    if size == 0:
        return 0
    # populated at once: faulting the pages in one by one costs more than the CRC
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mapping = lambda: mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)  # noqa: E731
    with with_room(mapping, f"a cached shard (descriptor {fd})") as mm:
        return crc32(memoryview(mm))


# Cached shards this process has read and checked, (path, stamp) -> whether the bytes
# matched: each is read once a process, and one found changed is warned of once.
_checked: dict[tuple[str, bytes], bool] = {}
_checked_lock = threading.Lock()
MAX_CHECKED = 1 << 20


def remember(path: Path, stamp: bytes, matched: bool) -> None:
    with _checked_lock:
        if len(_checked) >= MAX_CHECKED:
            _checked.clear()
        _checked[(str(path), stamp)] = matched


def content_verified(path: Path, fd: int, size: int, stamp: bytes) -> bool:
    """Whether the cached shard at ``path`` (open as ``fd``, ``size`` bytes, its identity
    matching ``stamp``) holds the bytes its stamp's CRC says: read and checked the first
    time this process holds it, remembered after. A mismatch is warned of (the shard is
    then fetched again)."""
    with _checked_lock:
        known = _checked.get((str(path), stamp))
    if known is not None:
        return known
    want = stamp_crc(stamp)
    if want is None:
        return False  # cached by a version that recorded no CRC: fetched again
    got = file_crc(fd, size)
    remember(path, stamp, got == want)
    if got != want:
        warnings.warn(
            f"{path}: the cached shard's bytes changed on disk since they were verified "
            f"(CRC-32 {got:#010x}, {want:#010x} when cached; bit rot, or a write into the "
            "cache); it is fetched again",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True


def _write_stamp(path: Path, st: os.stat_result, crc: int) -> bytes:
    """Records (and returns) the stamp of the verified shard about to be renamed to
    ``path`` in its ``.lock`` file (whose lock, not content, serializes fetches)."""
    stamp = _stamp(st, crc)
    lock = path.with_name(path.name + LOCK_SUFFIX)
    fd = _open(lock, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW)
    try:
        os.write(fd, stamp)
    finally:
        os.close(fd)
    return stamp


def _drop_stamp(path: Path) -> int:
    """Empties the stamp of the shard just removed from ``path`` (its lock file stays: other
    processes may wait on it); returns the bytes freed."""
    try:
        fd = _open(path.with_name(path.name + LOCK_SUFFIX), os.O_WRONLY | os.O_NOFOLLOW)
    except OSError:
        return 0
    try:
        size = os.fstat(fd).st_size
        os.ftruncate(fd, 0)
        return size
    finally:
        os.close(fd)


def _read_stamp(path: Path) -> bytes:
    try:
        fd = _open(path.with_name(path.name + LOCK_SUFFIX), os.O_NOFOLLOW)
    except OSError:
        return b""
    try:
        return os.read(fd, 128)
    finally:
        os.close(fd)

"""The output folder of a compile: where OUT may be, its lock (a URL OUT has none: the same
checks without it), what --overwrite and --resume may delete, the journal an interrupted
compile resumes from (with the commit records of its finished work units, commit.py),
and what goes once the compile ends: tidied up after its index, or discarded.

A compile deletes only names it writes itself (COMPILE_FILE); OUT holding anything
else makes --overwrite and --resume refuse before anything is deleted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

from dlop.formats import ERRORS_NAME, INDEX_NAME, FormatError
from dlop.formats.constants import (
    ARCHIVE_FORMAT,
    LOCK_NAME,
    MAX_INDEX_BYTES,
)
from dlop.formats.files import loads_bounded, read_capped

from ..errors import CompileError
from ..faults import fault_at
from ..recipe import Recipe
from .commit import COMMIT_PREFIX, UnitRecord, commit_name, parse_record, shards_in_place
from .journal import JOURNAL, Journal
from .store import STAGING, LocalStore, Store

LOCK = LOCK_NAME  # flock'ed for the whole compile; holds "pid N on HOST"
SPILL_PREFIX = ".dlop-chunk-"  # workers' result files in the staging folder, removed as read
# An append's copy of the index it appends to, kept until it ends: its --resume appends
# to the same archive, whether or not the new index was published before it stopped.
BASE_COPY = ".dlop-base.json"

_SHARD = r"(?:shard-\d{5,}|unit-\d{6,}-\d{4,}|group-[a-z][a-z0-9_]{0,31}-r\d+-\d{6,})\.dlop"
_COMMIT = rf"{re.escape(COMMIT_PREFIX)}\d{{6,}}\.json"
_GENERATION = r"errors-\d{4,}\.jsonl|inputs-\d{4,}\.bin"  # formats.generations
_GROUP_JOURNAL = r"\.dlop-group-[a-z][a-z0-9_]{0,31}\.json"  # compiler.groups
# A field group's files, and the journal of one being added: add_fields and drop_fields
# keep or delete them (a revision a reader of an earlier index reads, an interrupted
# group's), never a compile into the archive but --overwrite.
GROUP_FILE = re.compile(rf"group-[a-z][a-z0-9_]{{0,31}}-r\d+-\d{{6,}}\.dlop|{_GROUP_JOURNAL}")
_OWN = "|".join(
    [
        *(re.escape(n) for n in (INDEX_NAME, ERRORS_NAME, JOURNAL, BASE_COPY)),
        _COMMIT,
        _GENERATION,
        _GROUP_JOURNAL,
    ]
)
# Every name a compile writes in OUT: the archive's files (shards named by unit, or
# shard-N.dlop by compiles before units; each generation's errors and inputs files; field
# groups' shards and the journal of a group being added),
# the journal (and an append's copy of its base index), units' commit records, the lock,
# the workers' chunk files, temporary files (".NAME.tmp" of small files; before units a
# shard's ".shard-N.dlop.tmp" and its field spools ".shard-N.dlop.fK.spool"); and the
# staging folder, a directory (STAGING).
COMPILE_FILE = re.compile(
    rf"(?:{_SHARD}|{_OWN}|{re.escape(LOCK)}|{re.escape(SPILL_PREFIX)}\d+-\d+)"
    rf"|\.(?:{_SHARD}|{_OWN})\.tmp|\.{_SHARD}\.f\d+\.spool"
)


def _written_by_a_compile(out: Path, name: str) -> bool:
    """Whether OUT/name is a regular file (not a link) under a name a compile writes, or
    the staging folder (a directory, not a link)."""
    path = out / name
    if path.is_symlink():
        return False
    if name == STAGING:
        return path.is_dir()
    return bool(COMPILE_FILE.fullmatch(name)) and path.is_file()


def _foreign(out: Path, names: list[str]) -> str:
    """The entries of OUT a compile did not write, shown for a message ('' when none)."""
    foreign = [n for n in names if not _written_by_a_compile(out, n)]
    return ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")


# -- where OUT may be --------------------------------------------------------------


def _source_folders(recipe: Recipe) -> list[tuple[Path, bool]]:
    """The folders the layout reads from, resolved, each with whether it is read
    whole (listed recursively). A file source (a manifest, a .tar, a brace pattern)
    counts as the folder holding it, which is not read whole; --images and --masks
    folders are."""
    from dlop.formats.urls import local_path

    source = local_path(recipe.source)  # a file:// SOURCE is the folder it names
    if "{" in source:  # a brace pattern: the folder of the text before the first brace
        base, whole = Path(os.path.dirname(source[: source.index("{")]) or "."), False
    else:
        base, whole = Path(source), Path(source).is_dir()
        base = base if whole else base.parent
    folders = [(base, whole)]
    for extra in (recipe.images, *(recipe.masks or ())):
        if extra:
            folders.append((Path(extra) if Path(extra).is_absolute() else base / extra, True))
    return [(f.resolve(), w) for f, w in folders]


def _source_urls(recipe: Recipe) -> list[str]:
    """A URL SOURCE's prefixes for check_url_apart: SOURCE itself (a folder, read whole; or
    a manifest, tar or brace pattern, whose folder an OUT may lie in but not be) and the
    --images and --masks folders (relative ones below SOURCE)."""
    from dlop.formats.urls import is_url

    base = recipe.source.rstrip("/")
    folders = [base]
    for extra in (recipe.images, *(recipe.masks or ())):
        if extra:
            folders.append(extra if is_url(extra) else f"{base}/{extra.strip('/')}")
    return folders


def check_apart(out: str | os.PathLike[str], recipe: Recipe) -> None:
    """Refuses an OUT that is or holds a folder the corpus is read from, or lies inside
    one that the layout lists (where the next compile would read the archive as input).
    A URL OUT is checked against a URL SOURCE's prefixes (urls.check_url_apart); a URL
    and a local path never overlap."""
    from dlop.formats.urls import is_url

    from ..urls import check_url_apart

    if not recipe.source:  # a user's Dataset: nothing is read from a folder
        return
    if is_url(out) or is_url(recipe.source):
        if is_url(out):
            check_url_apart(os.fspath(out), _source_urls(recipe))
        return
    target = Path(out).resolve()
    for folder, whole in _source_folders(recipe):
        if target == folder:
            how = "is the corpus folder"
        elif whole and folder in target.parents:
            how = f"lies inside the corpus folder {folder}"
        elif target in folder.parents:
            how = f"contains the corpus folder {folder}"
        else:
            continue
        raise CompileError(
            f"{out}: the output folder {how}; a compile writes (and --overwrite deletes) only "
            "outside what it reads. Choose an output folder outside the corpus"
        )


# -- the lock ------------------------------------------------------------------------

_LOCK_FDS: set[int] = set()  # lock descriptors this process holds, closed in forked workers


def close_inherited_locks() -> None:
    """In a forked worker: closes the driver's lock descriptors, so that the lock dies
    with the driver and not with its last worker."""
    for fd in _LOCK_FDS:
        os.close(fd)
    _LOCK_FDS.clear()


class OutputLock:
    """An exclusive advisory lock (flock) on OUT/.dlop-lock, held for the whole compile.

    The lock dies with the process, so a lock file left by a killed compile blocks
    nothing; the file names the holder so that a refused compile can say who. A
    finished compile unlinks the file while holding it; a compile that opened the
    file before that unlink may get its flock on the unlinked file, so a lock
    counts only once the locked file is still the one at the path.
    """

    def __init__(self, out: Path) -> None:
        self.path = out / LOCK
        while True:
            try:
                fd = os.open(
                    self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644
                )
            except OSError as e:
                if e.errno != errno.ELOOP:
                    raise
                raise CompileError(
                    f"{self.path}: is a symbolic link, not the lock file a compile writes; "
                    "remove it and run again"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if self._still_at_path(fd):
                    break
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "pid unknown"
                os.close(fd)
                raise CompileError(
                    f"{out}: another dlop-compile ({holder}) is writing this archive; wait for "
                    "it to finish, or stop it and run again with --resume"
                ) from None
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # locked a file its holder has just unlinked: open the new one
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self.fd = fd
        _LOCK_FDS.add(fd)

    def _still_at_path(self, fd: int) -> bool:
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)

    def release(self) -> None:
        """Removes the lock file (while still holding it) and unlocks."""
        self.path.unlink(missing_ok=True)
        _LOCK_FDS.discard(self.fd)
        os.close(self.fd)


@contextlib.contextmanager
def locked_output(out: Path, resume: bool, overwrite: bool, append: bool = False) -> Iterator[bool]:
    """Creates or checks OUT and holds its lock throughout; yields whether this compile created it."""
    created = False
    if not out.exists():
        if resume:
            raise CompileError(f"{out}: nothing to resume (the directory does not exist)")
        if append:
            raise CompileError(f"{out}: no archive to append to (the directory does not exist)")
        with contextlib.suppress(FileExistsError):  # another compile may create it meanwhile
            out.mkdir(parents=True)
            created = True
    if not out.is_dir():
        raise CompileError(f"{out}: exists and is not a directory")
    lock = OutputLock(out)
    try:
        names = sorted(p.name for p in out.iterdir() if p.name != LOCK)
        if append and not resume:
            check_appendable(str(out), names)
        else:
            _clear_output(out, names, resume, overwrite)
        yield created
    finally:
        lock.release()


def check_appendable(out: str, names: list[str]) -> None:
    """Refuses an --append (not a resume of one) unless OUT holds a finished archive."""
    if JOURNAL in names:
        raise CompileError(
            f"{out}: holds an interrupted compile or append; finish it first with --resume "
            "(and --append when it was an append), then append"
        )
    if INDEX_NAME not in names:
        raise CompileError(
            f"{out}: holds no archive to append to (no {INDEX_NAME}); compile one first, "
            "without --append"
        )


def _clear_output(out: Path, names: list[str], resume: bool, overwrite: bool) -> None:
    """Checks what OUT holds (under the lock); for --overwrite, deletes a previous archive.

    For --resume only the check: what may go is deleted once the journal is read
    and the completed shards are verified (clear_for_resume). An index beside the
    journal is a compile stopped while tidying up after its index (or an append, whose
    base it is): --resume finishes it."""
    has_index, has_journal = INDEX_NAME in names, JOURNAL in names
    if resume:
        if has_index and not has_journal:
            raise CompileError(f"{out}: already a complete archive; nothing to resume")
        if not has_journal:
            raise CompileError(f"{out}: no interrupted compile to resume (no {JOURNAL})")
        foreign = _foreign(out, names)
        if foreign:
            raise CompileError(
                f"{out}: holds {foreign} besides an interrupted compile; --resume deletes only "
                "the files a compile writes, and nothing was deleted. Move them away and run "
                "again with --resume"
            )
        return
    if not names:
        return
    if not has_index and not has_journal:
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise CompileError(
            f"{out}: holds files that are not a dlop archive ({shown}); --overwrite replaces only "
            f"a dlop archive (with {INDEX_NAME}) or an interrupted compile (with {JOURNAL}), and "
            "nothing was deleted. Choose a new or empty folder"
        )
    if not overwrite:
        what = (
            "an archive; choose a new path or --overwrite it"
            if has_index and not has_journal
            else "an interrupted compile; --resume it, --overwrite it, or choose a new path"
        )
        raise CompileError(f"{out}: already holds {what}")
    if has_index:
        _check_archive_index(out / INDEX_NAME)
    foreign = _foreign(out, names)
    if foreign:
        raise CompileError(
            f"{out}: holds {foreign} besides a dlop archive; --overwrite deletes "
            "only an archive's own files, and nothing was deleted. Move them away or choose "
            "another folder"
        )
    # The index goes first, so a crash never leaves a stale but valid-looking archive.
    (out / INDEX_NAME).unlink(missing_ok=True)
    LocalStore(out).clear_staging()
    for n in names:
        (out / n).unlink(missing_ok=True)


def _check_archive_index(path: Path) -> None:
    """Refuses --overwrite unless ``path`` parses as a dlop archive index."""
    try:
        obj = loads_bounded(
            path, read_capped(path, MAX_INDEX_BYTES, root=path.parent, what="index"), "index"
        )
        if not isinstance(obj, dict) or obj.get("format") != ARCHIVE_FORMAT:
            got = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
            raise FormatError(path, f"'format' is {got!r}, expected {ARCHIVE_FORMAT!r}")
    except (FormatError, OSError) as e:
        raise CompileError(
            f"{path}: not a dlop archive index ({getattr(e, 'problem', e)}); --overwrite "
            "replaces only a dlop archive, and nothing was deleted. Choose another folder"
        ) from None


# -- a URL OUT -----------------------------------------------------------------------


@contextlib.contextmanager
def remote_output(
    store: Store, resume: bool, overwrite: bool, append: bool = False
) -> Iterator[None]:
    """A URL OUT: the checks a local OUT gets (no lock: object stores have none). Only names
    a compile writes are ever deleted; anything else under OUT refuses the compile."""
    names = store.list()
    if append and not resume:
        check_appendable(store.url, names)
        yield
        return
    foreign = [n for n in names if not COMPILE_FILE.fullmatch(n)]
    has_index, has_journal = INDEX_NAME in names, JOURNAL in names
    if resume and not has_journal:  # an index beside a journal: tidying up was left (resume)
        why = "already a complete archive" if has_index else f"no interrupted compile ({JOURNAL})"
        raise CompileError(f"{store.url}: {why}; nothing to resume")
    if foreign:
        raise CompileError(
            f"{store.url}: holds {', '.join(foreign[:5])} besides what a compile writes; nothing "
            "was deleted. Choose an empty prefix, or move them away"
        )
    if names and not resume:
        if not overwrite:
            raise CompileError(
                f"{store.url}: already holds an archive or an interrupted compile; --resume it, "
                "--overwrite it, or choose a new prefix"
            )
        store.delete(INDEX_NAME)  # first: a crash never leaves a stale but valid-looking archive
        for name in names:
            store.delete(name)
    yield


# -- the journal ---------------------------------------------------------------------


def committed_units(store: Store, journal: Journal) -> dict[int, UnitRecord]:
    """The units an interrupted compile finished: a commit record that parses as this
    compile's record of that unit, every shard it names in place. Others are redone."""
    listed = store.sizes()  # one listing: no request per shard for a URL OUT
    found: dict[int, UnitRecord] = {}
    first = 0 if journal.append is None else journal.append[0]  # an append's units follow
    for name in sorted(n for n in listed if n.startswith(COMMIT_PREFIX)):
        digits = name[len(COMMIT_PREFIX) : -len(".json")]
        if not digits.isdigit() or name != commit_name(int(digits)) or int(digits) < first:
            continue
        unit = int(digits)
        start = (unit - first) * journal.unit_inputs
        inputs = range(start, min(start + journal.unit_inputs, journal.num_inputs))
        data = store.read(name) if len(inputs) else None
        record = None if data is None else parse_record(data, unit, inputs, journal.digest)
        if record is not None and shards_in_place(store, record, listed):
            found[unit] = record
    return found


def clear_for_resume(
    store: Store, committed: dict[int, UnitRecord], archive: frozenset[str] = frozenset()
) -> None:
    """Deletes what the interrupted compile left besides its journal, its lock, its
    committed units and the files of ``archive``: those of its finished archive when it
    got as far as its index, and for an append those of the archive it appends to (with
    its copy of that index). What goes: shards of unfinished units, records that do not
    count, temporary and chunk files, the staging folder. For a local OUT, _clear_output
    has already refused one holding anything a compile does not write."""
    keep = {JOURNAL, LOCK, BASE_COPY, *archive}
    if INDEX_NAME not in keep:
        store.delete(INDEX_NAME)  # first: a crash never leaves a stale but valid-looking archive
    for record in committed.values():
        keep |= {commit_name(record.unit), *(s.file for s in record.shards)}
    root = store.root if isinstance(store, LocalStore) else None
    if isinstance(store, LocalStore):
        store.clear_staging()
    for name in store.list():
        if name in keep or not COMPILE_FILE.fullmatch(name) or GROUP_FILE.fullmatch(name):
            continue
        if root is None or _written_by_a_compile(root, name):
            store.delete(name)


# -- after the compile ---------------------------------------------------------------


def tidy(store: Store) -> None:
    """After the index: the commit records go, the staging folder, then the journal (and
    an append's copy of its base index, after it: a resume needs it while a journal is)."""
    # listed, not taken from ``committed``: after merge.intact_index, whatever records are left
    records = [n for n in store.list(COMMIT_PREFIX) if COMPILE_FILE.fullmatch(n)]
    for n, name in enumerate(records):
        store.delete(name)
        if n == 0:
            fault_at("tidying")
    if isinstance(store, LocalStore):
        store.clear_staging()
    store.delete(JOURNAL)
    store.delete(BASE_COPY)


def keep_committed(store: Store) -> None:
    """After a bad input under --on-error fail once units are committed: they stay, with
    the journal (a resume, or an --overwrite, is the user's call); only staging goes."""
    if isinstance(store, LocalStore):
        store.clear_staging()


def discard(store: Store, created_dir: bool, base: frozenset[str] = frozenset()) -> None:
    """After a bad input under --on-error fail: removes everything this compile wrote (for
    an append, all but the archive it appends to, whose files are ``base``)."""
    store.delete(JOURNAL)  # first: a unit task still running publishes nothing more
    if isinstance(store, LocalStore):
        store.clear_staging()
        if created_dir:
            shutil.rmtree(store.root, ignore_errors=True)
            return
    for name in store.list():
        if (
            name != LOCK
            and name not in base
            and COMPILE_FILE.fullmatch(name)
            and not (base and GROUP_FILE.fullmatch(name))
        ):
            store.delete(name)

"""The compile driver: items -> worker processes (decode, resample, featurize) -> shards.

Determinism: every item is featurized on its own with one torch thread, and
results are written in corpus order, so the shard bytes depend only on the
corpus and the recipe, never on the worker count or on where a resumed compile
picked up.

Output safety: OUT is refused when it is, holds, or lies inside a folder the
corpus is read from; an exclusive lock (``OUT/.dlop-lock``) is held for the
whole compile; the progress journal exists from the moment OUT is taken, and
shards close only between inputs, so the journal's count of consumed inputs is
exact and a resumed compile writes the same bytes as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import json
import multiprocessing
import os
import re
import shutil
import signal
import socket
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dlop.formats import (
    ERRORS_NAME,
    INDEX_NAME,
    ArchiveWriter,
    DlopError,
    Field,
    Index,
    ShardInfo,
)
from dlop.formats.archive import atomic_write

from .errors import CompileError
from .items import CorpusShape, Outcome, process_item, schema_for
from .recipe import Recipe
from .sources import Corpus, Item, open_corpus, stream_webdataset, text_path

JOURNAL = ".dlop-progress.json"
LOCK = ".dlop-lock"  # flock'ed for the whole compile; holds "pid N on HOST"
SPILL_PREFIX = ".dlop-chunk-"  # workers' result files in the output folder, removed as read
# Inputs per task sent to a worker: enough to amortize the hand-over for small
# audio clips, and one for images, whose decoded size (a 5k x 5k slide core
# with its masks is about 100 MB) bounds the compile's memory.
CHUNK_ITEMS = {"audio": 16, "video": 2, "image": 1}
# For the test suite only: DLOP_TEST_KILL_AT=start|input:N|shard:N|index makes the
# compile send itself DLOP_TEST_SIGNAL (KILL, or e.g. STOP) at that moment, so
# tests interrupt it at exact points (see docs/compile.md).
TEST_KILL_AT = "DLOP_TEST_KILL_AT"
TEST_SIGNAL = "DLOP_TEST_SIGNAL"
# Every file a compile can leave in OUT; --overwrite deletes nothing else.
_ARCHIVE_FILE = re.compile(
    rf"{re.escape(INDEX_NAME)}|{re.escape(ERRORS_NAME)}|shard-\d+\.dlop|"
    rf"{re.escape(JOURNAL)}|{re.escape(LOCK)}|{re.escape(SPILL_PREFIX)}.*|\..+\.(tmp|spool)"
)


# -- worker side -------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _init_worker(recipe_json: dict[str, Any], shape: CorpusShape, spill_dir: str) -> None:
    from .recipe import build_recipe

    torch.set_num_threads(1)
    _die_with_driver()
    for fd in _LOCK_FDS:  # a forked worker must not keep the output lock alive after the driver
        os.close(fd)
    _LOCK_FDS.clear()
    _WORKER.update(
        recipe=build_recipe(recipe_json), shape=shape, spill_dir=spill_dir, chunks=itertools.count()
    )


def _die_with_driver() -> None:
    """Asks Linux to kill this worker when the driver dies (kill -9 included).

    Without it, workers of a killed compile keep decoding until their queue
    drains, holding memory and CPU that a --resume run needs.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return  # best effort: the compile is correct either way


@dataclass(frozen=True)
class _Spilled:
    """An array a worker wrote to its chunk file: where it lies and what it is."""

    offset: int
    dtype: str
    shape: tuple[int, ...]


def _run_chunk(items: list[Item]) -> tuple[list[Outcome], str | None]:
    """Processes a chunk; arrays of 4 KiB or more travel through a file, not the result pipe.

    Pushing ~100 KB feature arrays through the pool's pipe cost about a fifth
    of the compile's CPU on the 2-core build machine (pipe-buffer-sized
    writes, a context switch each); one file write per chunk, read back in
    one call, does not.
    """
    outcomes = [process_item(it, _WORKER["recipe"], _WORKER["shape"]) for it in items]
    path = Path(_WORKER["spill_dir"]) / f"{SPILL_PREFIX}{os.getpid()}-{next(_WORKER['chunks'])}"
    offset = 0
    with open(path, "wb") as f:
        for outcome in outcomes:
            for sample in outcome.samples:
                for name, value in sample.items():
                    if isinstance(value, np.ndarray) and value.nbytes >= 4096:
                        f.write(np.ascontiguousarray(value).data)
                        sample[name] = _Spilled(offset, value.dtype.str, value.shape)
                        offset += value.nbytes
    if not offset:
        path.unlink()
        return outcomes, None
    return outcomes, str(path)


def _unspill(result: tuple[list[Outcome], str | None]) -> list[Outcome]:
    outcomes, path = result
    if path is None:
        return outcomes
    with open(path, "rb") as f:
        data = f.read()
    os.unlink(path)
    for outcome in outcomes:
        for sample in outcome.samples:
            for name, value in sample.items():
                if isinstance(value, _Spilled):
                    count = int(np.prod(value.shape)) if value.shape else 1
                    array = np.frombuffer(data, value.dtype, count, value.offset)
                    sample[name] = array.reshape(value.shape)
    return outcomes


# -- driver --------------------------------------------------------------------------


class _Journal:
    """Progress of an unfinished compile: completed shards, inputs consumed, inputs skipped."""

    def __init__(self, out: Path, digest: str, fingerprint: str) -> None:
        self.path = out / JOURNAL
        self.digest, self.fingerprint = digest, fingerprint
        self.shards: list[ShardInfo] = []
        self.consumed = 0
        self.skipped: list[dict[str, Any]] = []

    def save(self) -> None:
        atomic_write(
            self.path,
            json.dumps(
                {
                    "recipe_digest": self.digest,
                    "fingerprint": self.fingerprint,
                    "consumed": self.consumed,
                    "shards": [s.to_json() for s in self.shards],
                    "skipped": self.skipped,
                }
            ).encode(),
        )

    def load(self) -> None:
        try:
            obj = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CompileError(
                f"{self.path}: cannot read the progress journal ({e}); compile afresh"
            ) from None
        if obj.get("recipe_digest") != self.digest:
            raise CompileError(
                f"{self.path.parent}: --resume with a different recipe than the interrupted compile"
            )
        if obj.get("fingerprint") != self.fingerprint:
            raise CompileError(
                f"{self.path.parent}: the corpus changed since the interrupted compile; compile afresh"
            )
        self.shards = [ShardInfo(**s) for s in obj["shards"]]
        self.consumed = int(obj["consumed"])
        self.skipped = list(obj["skipped"])


def _test_point(moment: str) -> None:
    """Signals this process when the test variable names this moment (see TEST_KILL_AT)."""
    if os.environ.get(TEST_KILL_AT) == moment:
        os.kill(os.getpid(), getattr(signal, "SIG" + os.environ.get(TEST_SIGNAL, "KILL")))


def _source_folders(recipe: Recipe) -> list[tuple[Path, bool]]:
    """The folders the layout reads from, resolved, each with whether it is read
    whole (listed recursively). A file source (a manifest, a .tar, a brace pattern)
    counts as the folder holding it, which is not read whole; --images and --masks
    folders are."""
    source = recipe.source
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


def _check_apart(out: Path, recipe: Recipe) -> None:
    """Refuses an OUT that is or holds a folder the corpus is read from, or lies inside
    one that the layout lists (where the next compile would read the archive as input)."""
    target = out.resolve()
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


_LOCK_FDS: set[int] = set()  # lock descriptors this process holds, closed in forked workers


class _OutputLock:
    """An exclusive advisory lock (flock) on OUT/.dlop-lock, held for the whole compile.

    The lock dies with the process, so a lock file left by a killed compile blocks
    nothing; the file names the holder so that a refused compile can say who.
    """

    def __init__(self, out: Path) -> None:
        self.path = out / LOCK
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "pid unknown"
            os.close(fd)
            raise CompileError(
                f"{out}: another dlop-compile ({holder}) is writing this archive; wait for it "
                "to finish, or stop it and run again with --resume"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self.fd = fd
        _LOCK_FDS.add(fd)

    def release(self) -> None:
        """Removes the lock file (while still holding it) and unlocks."""
        self.path.unlink(missing_ok=True)
        _LOCK_FDS.discard(self.fd)
        os.close(self.fd)


@contextlib.contextmanager
def _locked_output(out: Path, resume: bool, overwrite: bool) -> Iterator[bool]:
    """Creates or checks OUT and holds its lock throughout; yields whether this compile created it."""
    created = False
    if not out.exists():
        if resume:
            raise CompileError(f"{out}: nothing to resume (the directory does not exist)")
        with contextlib.suppress(FileExistsError):  # another compile may create it meanwhile
            out.mkdir(parents=True)
            created = True
    if not out.is_dir():
        raise CompileError(f"{out}: exists and is not a directory")
    lock = _OutputLock(out)
    try:
        _clear_output(out, resume, overwrite)
        yield created
    finally:
        lock.release()


def _clear_output(out: Path, resume: bool, overwrite: bool) -> None:
    """Checks what OUT holds (under the lock); for --overwrite, deletes a previous archive."""
    names = sorted(p.name for p in out.iterdir() if p.name != LOCK)
    has_index, has_journal = INDEX_NAME in names, JOURNAL in names
    if resume:
        if has_index:
            raise CompileError(f"{out}: already a complete archive; nothing to resume")
        if not has_journal:
            raise CompileError(f"{out}: no interrupted compile to resume (no {JOURNAL})")
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
            if has_index
            else "an interrupted compile; --resume it, --overwrite it, or choose a new path"
        )
        raise CompileError(f"{out}: already holds {what}")
    foreign = [n for n in names if not (_ARCHIVE_FILE.fullmatch(n) and (out / n).is_file())]
    if foreign:
        raise CompileError(
            f"{out}: holds {', '.join(foreign[:5])} besides a dlop archive; --overwrite deletes "
            "only an archive's own files, and nothing was deleted. Move them away or choose "
            "another folder"
        )
    # The index goes first, so a crash never leaves a stale but valid-looking archive.
    (out / INDEX_NAME).unlink(missing_ok=True)
    for n in names:
        (out / n).unlink(missing_ok=True)


def _verify_completed(out: Path, journal: _Journal) -> None:
    from dlop.formats import ShardReader

    for info in journal.shards:
        path = out / info.file
        try:
            with ShardReader(path) as r:
                crc, count = r.file_crc32(), r.num_samples
            why = (
                ""
                if (crc, count) == (info.crc32, info.num_samples)
                else f"CRC-32 {crc} and {count} samples, the journal says {info.crc32} and "
                f"{info.num_samples}"
            )
        except (OSError, ValueError, DlopError) as e:
            why = str(e)
        if why:
            raise CompileError(
                f"{path}: completed shard is missing or damaged ({why}); compile afresh "
                "(--overwrite)"
            )
    keep = {s.file for s in journal.shards} | {JOURNAL, LOCK}
    for p in out.iterdir():
        if p.name not in keep and p.is_file():
            p.unlink()  # partial shards, spools and temp files of the interrupted run


def _item_stream(corpus: Corpus, start: int) -> Iterator[Item]:
    if corpus.layout == "webdataset":
        return stream_webdataset(corpus, start)
    return iter(corpus.items[start:])


def _chunks(items: Iterator[Item], size: int) -> Iterator[list[Item]]:
    chunk: list[Item] = []
    for it in items:
        chunk.append(it)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def compile_corpus(
    recipe: Recipe,
    out: str | os.PathLike[str],
    *,
    workers: int | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    on_progress: Callable[[int], None] | None = None,
) -> Index:
    """Compiles recipe.source into an archive at ``out``; returns its index."""
    out = Path(out)
    _check_apart(out, recipe)
    corpus = open_corpus(recipe.source, recipe.layout, recipe.media, recipe.images, recipe.masks)
    if not corpus.items:
        raise CompileError(f"{recipe.source}: no inputs found for layout {corpus.layout}")
    shape = CorpusShape.of(corpus)
    fields = schema_for(recipe, shape)
    with _locked_output(out, resume, overwrite) as created_dir:
        return _compile_into(
            recipe,
            corpus,
            shape,
            fields,
            out,
            created_dir,
            resume=resume,
            workers=workers,
            progress=progress,
            on_progress=on_progress,
        )


def _compile_into(
    recipe: Recipe,
    corpus: Corpus,
    shape: CorpusShape,
    fields: list[Field],
    out: Path,
    created_dir: bool,
    *,
    resume: bool,
    workers: int | None,
    progress: bool,
    on_progress: Callable[[int], None] | None,
) -> Index:
    """The compile proper, in a locked OUT that _locked_output prepared."""
    journal = _Journal(out, recipe.digest(), corpus.fingerprint)
    if resume:
        journal.load()
        _verify_completed(out, journal)
    else:
        journal.save()  # from the start, so that an interruption at any point can --resume
    _test_point("start")
    workers = max(1, workers or os.cpu_count() or 1)
    total = len(corpus.items)
    consumed = journal.consumed

    def checkpoint(_: ShardInfo) -> None:
        # Shards close only between inputs (write_group), so every sample of the
        # inputs counted here lies in a completed shard.
        journal.consumed = consumed
        journal.save()
        _test_point(f"shard:{len(journal.shards)}")

    writer = ArchiveWriter(
        out,
        fields,
        shard_bytes=recipe.shard_bytes,
        recipe=recipe.to_json(),
        provenance={
            "source": {
                "layout": corpus.layout,
                "path": corpus.root,
                "num_inputs": total,
                "fingerprint": corpus.fingerprint,
            }
        },
        metadata={**corpus.metadata, "feature_field": recipe.feature_name},
        shards=journal.shards,
        skipped=journal.skipped,
        on_shard=checkpoint,
    )
    # One record of completed shards and skipped inputs, kept by the writer.
    journal.shards, journal.skipped = writer.shards, writer.skipped
    bar = _progress_bar(total, journal.consumed, progress)
    try:
        for n, outcome in enumerate(
            _results(corpus, shape, recipe, workers, journal.consumed, out), 1
        ):
            consumed += 1
            if outcome.reason is None:
                writer.write_group(outcome.samples)
            elif recipe.on_error == "fail":
                writer.abort()
                (out / JOURNAL).unlink(missing_ok=True)
                if created_dir:
                    shutil.rmtree(out, ignore_errors=True)
                raise CompileError(
                    f"{text_path(outcome.path or outcome.key)}: {outcome.reason} (--on-error fail)"
                )
            else:
                path = text_path(outcome.path or outcome.key)
                writer.skip(path, outcome.reason or "", key=outcome.key)
            _test_point(f"input:{n}")
            bar.update(1)
            if on_progress:
                on_progress(consumed)
        index = writer.close(before_index=lambda: _test_point("index"))
    except BaseException as e:
        writer.abort(keep_completed=True)  # after --on-error fail nothing is left to keep
        if _resumable(e) and (out / JOURNAL).exists():
            print(
                f"dlop-compile: stopped; run again with --resume to continue from {len(writer.shards)} "
                "completed shard(s)",
                file=sys.stderr,
            )
        raise
    finally:
        bar.close()
    (out / JOURNAL).unlink(missing_ok=True)
    return index


def _resumable(e: BaseException) -> bool:
    """Whether running the same command again with --resume can get further: after an
    interruption or a full disk, yes; after a refused write or a bad input or recipe, no."""
    if isinstance(e, OSError):
        return e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS)
    return isinstance(e, KeyboardInterrupt)


def _results(
    corpus: Corpus, shape: CorpusShape, recipe: Recipe, workers: int, start: int, spill_dir: Path
) -> Iterator[Outcome]:
    chunks = _chunks(_item_stream(corpus, start), CHUNK_ITEMS[corpus.media])
    if workers == 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for chunk in chunks:
                for it in chunk:
                    yield process_item(it, recipe, shape)
        finally:
            torch.set_num_threads(threads)
        return
    ctx = _worker_context()
    try:
        with (
            _main_module_hidden(),
            ProcessPoolExecutor(
                workers,
                mp_context=ctx,
                initializer=_init_worker,
                initargs=(recipe.to_json(), shape, str(spill_dir)),
            ) as pool,
        ):
            pending: deque[Future[tuple[list[Outcome], str | None]]] = deque()
            try:
                for chunk in chunks:
                    pending.append(pool.submit(_run_chunk, chunk))
                    if len(pending) >= 8 * workers:  # bounded: a few chunks per worker in flight
                        yield from _unspill(pending.popleft().result())
                while pending:
                    yield from _unspill(pending.popleft().result())
            except BrokenProcessPool:
                raise CompileError(
                    "a worker process died (killed, or out of memory); run again with --resume"
                ) from None
            finally:
                for f in pending:
                    f.cancel()
    finally:
        # Chunks finished but never read (a stopped compile): their files go too.
        for leftover in spill_dir.glob(f"{SPILL_PREFIX}*"):
            leftover.unlink(missing_ok=True)


def _worker_context() -> multiprocessing.context.BaseContext:
    """fork when this process runs a single thread (workers start at once, torch
    already imported); otherwise forkserver, since forking a threaded process can
    copy a lock that another thread holds. Workers use no CUDA either way."""
    if sys.platform == "linux" and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Workers run only dlop code: keep them from re-importing the caller's __main__.

    A forkserver or spawn child re-runs the parent's main script unless it is
    guarded by ``if __name__ == "__main__"``, and fails outright for ``<stdin>``
    or notebooks. Hiding the main module's file and spec while the pool starts
    its children avoids both.
    """
    main = sys.modules.get("__main__")
    saved: dict[str, Any] = {
        a: main.__dict__[a]
        for a in ("__file__", "__spec__")
        if main is not None and a in main.__dict__
    }
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__dict__["__spec__"] = None
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)
            if "__spec__" not in saved:
                main.__dict__.pop("__spec__", None)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, initial: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    tqdm.monitor_interval = 0  # no monitor thread, so workers can be forked

    return tqdm(
        total=total,
        initial=initial,
        unit="input",
        desc="compiling",
        file=sys.stderr,
        dynamic_ncols=True,
        smoothing=0.1,
    )

"""The compile driver: items -> worker processes (decode, resample, featurize) -> shards.

Determinism: workers featurize items in groups with one torch thread, and an
item's features do not depend on the items grouped with it (featurize_clips);
results are written in corpus order, so the shard bytes depend only on the
corpus and the recipe, never on the worker count or on where a resumed compile
picked up.

Output safety (output.py): OUT lies apart from the corpus and is locked for the
whole compile. The progress journal exists from the moment OUT is taken, and
shards close only between inputs, so the journal's count of consumed inputs is
exact and a resumed compile writes the same bytes as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import multiprocessing
import os
import shutil
import signal
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

from dlop.formats import ArchiveWriter, Field, Index, ShardInfo

from .errors import CompileError
from .items import CorpusShape, Outcome, process_items, schema_for
from .layouts import stream_items
from .output import (
    JOURNAL,
    SPILL_PREFIX,
    Journal,
    check_apart,
    clear_for_resume,
    close_inherited_locks,
    locked_output,
)
from .recipe import Recipe
from .sources import Corpus, Item, open_corpus, text_path

# Inputs per task sent to a worker: enough to amortize the hand-over for small
# audio clips, and one for images, whose decoded size (a 5k x 5k slide core
# with its masks is about 100 MB) bounds the compile's memory.
CHUNK_ITEMS = {"audio": 16, "video": 2, "image": 1}
# For the test suite only: DLOP_TEST_KILL_AT=start|input:N|shard:N|index makes the
# compile send itself DLOP_TEST_SIGNAL (KILL, or e.g. STOP) at that moment, so
# tests interrupt it at exact points (see docs/compile.md).
TEST_KILL_AT = "DLOP_TEST_KILL_AT"
TEST_SIGNAL = "DLOP_TEST_SIGNAL"


# -- worker side -------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _init_worker(recipe_json: dict[str, Any], shape: CorpusShape, spill_dir: str) -> None:
    from .recipe import build_recipe

    torch.set_num_threads(1)
    _die_with_driver()
    close_inherited_locks()  # a forked worker must not keep the output lock alive after the driver
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
    outcomes = process_items(items, _WORKER["recipe"], _WORKER["shape"])
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


def _test_point(moment: str) -> None:
    """Signals this process when the test variable names this moment (see TEST_KILL_AT)."""
    if os.environ.get(TEST_KILL_AT) == moment:
        os.kill(os.getpid(), getattr(signal, "SIG" + os.environ.get(TEST_SIGNAL, "KILL")))


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
    check_apart(out, recipe)
    corpus = open_corpus(
        recipe.source, recipe.layout, recipe.media, recipe.images, recipe.masks, **recipe.columns()
    )
    if not corpus.items:
        raise CompileError(f"{recipe.source}: no inputs found for layout {corpus.layout}")
    shape = CorpusShape.of(corpus)
    fields = schema_for(recipe, shape)
    with locked_output(out, resume, overwrite) as created_dir:
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
    """The compile proper, in a locked OUT that locked_output prepared."""
    journal = Journal(out, recipe.digest(), corpus.fingerprint)
    if resume:
        journal.load(len(corpus.items))
        clear_for_resume(out, journal)
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
    # Chunks (the groups featurized together) are cut at multiples of the chunk
    # size counted from the corpus's first input, wherever a resumed compile
    # starts; the bytes do not depend on the grouping either (featurize_clips).
    size = CHUNK_ITEMS[corpus.media]
    stream = stream_items(corpus, start)
    head = list(itertools.islice(stream, -start % size))
    chunks = itertools.chain([head] if head else [], _chunks(stream, size))
    if workers == 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for chunk in chunks:
                yield from process_items(chunk, recipe, shape)
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

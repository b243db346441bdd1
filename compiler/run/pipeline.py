"""The preset compile (compile_corpus) and its local engine: inputs cut into work units
(units.py), each unit's inputs -> worker processes (decode, resample, featurize) -> the
unit's own shards -> its commit record; once every unit is committed, the index lists
them in unit order (driver.py runs a compile on its engine, from taking OUT to its index).

Engines: the local one runs units one after another, in unit order, spreading
each unit's featurizing over a process pool; the Dask one (dask_engine.py) runs
one task per unit on a cluster. Determinism: workers featurize with one torch
thread, an item's features do not depend on the items grouped with it
(featurize_clips), a unit's shards depend only on its inputs, and the index
and errors.jsonl are merged in unit order; so the archive's bytes depend only on
the corpus, the recipe and the unit size, never on the engine, the worker count,
the order units finish in, or where a resumed compile picked up.

Output safety (output/guard.py): a local OUT lies apart from the corpus and is locked
for the whole compile. The journal exists from the moment OUT is taken; a unit
counts once its commit record is published after its shards, so --resume redoes
exactly the units without one.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import math
import mmap
import multiprocessing
import multiprocessing.context
import os
import pickle
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, cast

import numpy as np
import torch

from dlop.formats import Index
from dlop.formats.urls import is_url

from ..audio import numerics
from ..corpus.layouts import open_corpus
from ..corpus.records import Corpus, Item
from ..errors import CompileError
from ..faults import fault_at
from ..output.commit import UnitRecord
from ..output.guard import SPILL_PREFIX, check_apart, close_inherited_locks
from ..output.store import open_store
from ..recipe import Recipe
from . import processes
from .append import list_for_append
from .driver import Run, finish_run
from .items import CorpusShape, Outcome, schema_for
from .units import (
    UNIT_INPUTS,
    UnitWriter,
    by_value,
    chunked,
    unit_items,
)
from .work import CHUNK_ITEMS

__all__ = ["CHUNK_ITEMS", "UNIT_INPUTS", "compile_corpus", "run_compile"]

# -- worker side -------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _init_worker(
    work: Any,
    spill_dir: str,
    driver: int = 0,
    environ: dict[str, str] | None = None,
    decode_threads: int = 0,
) -> None:
    from ..vision.video import set_decode_threads

    if environ is not None:
        # A forkserver keeps the environment of the moment it started (once per process);
        # workers take the compile's, as forked ones would (credentials, endpoints, test hooks).
        os.environ.clear()
        os.environ.update(environ)
    numerics.require()
    torch.set_num_threads(1)
    set_decode_threads(decode_threads)
    processes.die_with_driver(driver)
    close_inherited_locks()  # a forked worker must not keep the output lock alive after the driver
    if isinstance(work, bytes):  # a fork server's worker: by_value's pickle
        work = pickle.loads(work)
    processes.arm_item_limits()  # an input past its time limit ends this worker
    _WORKER.update(
        work=work,
        spill_dir=spill_dir,
        chunks=itertools.count(),
        systems={},  # this compile's storages by scheme in this worker (units.process_fetched)
    )
    gc.freeze()  # what the worker starts with is never garbage; see heap_frozen


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
    one call, does not. Each outcome's arrays are written as it comes, so a
    worker whose Work makes outcomes one at a time holds one input's at a time.
    """
    w = _WORKER
    path = Path(w["spill_dir"]) / f"{SPILL_PREFIX}{os.getpid()}-{next(w['chunks'])}"
    offset = 0
    outcomes = []
    with open(path, "wb") as f:
        for outcome in w["work"].outcomes(items, w["systems"]):
            for sample in outcome.samples:
                for name, value in sample.items():
                    if isinstance(value, bytes) and len(value) >= 4096:
                        value = np.frombuffer(value, np.uint8)  # a bytes field: its bytes
                    if isinstance(value, np.ndarray) and value.nbytes >= 4096:
                        f.write(np.ascontiguousarray(value).data)
                        sample[name] = _Spilled(offset, value.dtype.str, value.shape)
                        offset += value.nbytes
            outcomes.append(outcome)
    if not offset:
        path.unlink()
        return outcomes, None
    return outcomes, str(path)


# What a pool worker sends back for a chunk reaches the driver through the pool's one
# result pipe, in a single write when it is at most PIPE_BUF bytes (4 KiB on Linux), which
# POSIX makes atomic: a worker killed while it answers (the OOM killer, a user's code)
# leaves a whole answer or none. A longer answer goes out in several writes, and a worker
# killed between two of them left the pool's thread waiting for the rest forever (the other
# workers hold the pipe open), and the compile with it. So an answer's pickle larger than
# INLINE_ANSWER_BYTES travels in the chunk's file, after its arrays, and the pipe carries
# where it lies.
INLINE_ANSWER_BYTES = 2048


class Answer(NamedTuple):
    """What a pool worker sends back for a chunk (_answer)."""

    blob: bytes | None  # the pickle of the outcomes, or of what it raised, when small
    name: str | None  # the chunk's file in the spill folder, if it has one
    at: int  # where the pickle lies in that file when it is not inline
    raised: bool  # whether the chunk raised


@dataclass(frozen=True)
class _Raised:
    """What a chunk raised in a pool worker, and its traceback there."""

    error: BaseException
    trace: str


class RemoteTraceback(Exception):
    """The traceback, in the worker, of an error a chunk raised there (its ``__cause__``)."""

    def __str__(self) -> str:
        return str(self.args[0])


def _answer(items: list[Item]) -> Answer:
    """_run_chunk in a pool worker, its answer small enough for one atomic write: the
    outcomes, or what the chunk raised, inline when their pickle is small, else appended
    to the chunk's file (INLINE_ANSWER_BYTES)."""
    name: str | None = None
    try:
        outcomes, path = _run_chunk(items)
        blob, raised = pickle.dumps(outcomes, pickle.HIGHEST_PROTOCOL), False
        name = None if path is None else os.path.basename(path)
    except BaseException as e:
        blob, raised = _pickled_error(e), True
    if len(blob) <= INLINE_ANSWER_BYTES:
        return Answer(blob, name, -1, raised)
    if name is None:
        name = f"{SPILL_PREFIX}{os.getpid()}-{next(_WORKER['chunks'])}"
    try:
        with open(Path(_WORKER["spill_dir"]) / name, "ab") as f:
            at = f.tell()
            f.write(blob)
    except OSError as e:  # a full disk, say: told inline (the chunk's file is left for the driver)
        return Answer(_pickled_error(e, INLINE_ANSWER_BYTES), None, -1, True)
    return Answer(None, name, at, raised)


# What a worker answers for an error it cannot describe otherwise (its words raise, or it
# cannot be pickled even shortened, say while memory runs out).
UNTOLD = pickle.dumps(
    _Raised(RuntimeError("a chunk raised an error its worker could not send"), "")
)


def _pickled_error(error: BaseException, limit: int | None = None) -> bytes:
    """The pickle of ``error`` (being handled) and its traceback, one the driver reads
    back: an error that cannot be pickled, or rebuilt from its pickle (an ``__init__``
    taking other arguments than its ``args``), is sent as a RuntimeError of its type and
    words. Given ``limit``, at most that many bytes: the words and traceback are cut short
    where they are longer (an OSError keeps its number, and loses the file it names).
    Never raises."""
    try:
        trace = traceback.format_exc()
        try:
            blob = pickle.dumps(_Raised(error, trace), pickle.HIGHEST_PROTOCOL)
            pickle.loads(blob)
        except Exception:
            blob = pickle.dumps(_Raised(RuntimeError(_words(error)), trace))
        if limit is None or len(blob) <= limit:
            return blob
        cut = limit // 16  # characters: 4 bytes each at most, for the words and the trace
        if isinstance(error, OSError):
            short: BaseException = OSError(error.errno, _words(error)[:cut])
        else:
            short = RuntimeError(_words(error)[:cut])
        blob = pickle.dumps(_Raised(short, trace[-cut:]), pickle.HIGHEST_PROTOCOL)
        return blob if len(blob) <= limit else UNTOLD
    except BaseException:
        return UNTOLD


def _words(error: BaseException) -> str:
    try:
        return f"{type(error).__name__}: {error}"
    except Exception:  # its __str__ raises
        return type(error).__name__


def _received(answer: Answer, spill_dir: Path) -> tuple[list[Outcome], str | None]:
    """The (outcomes, chunk file) a pool worker's answer stands for (_unspill takes them);
    raises what the chunk raised, with the worker's traceback as its cause."""
    blob, name, at, raised = answer
    path = None if name is None else str(spill_dir / name)
    if blob is None:
        assert path is not None
        with open(path, "rb") as f:
            f.seek(at)
            blob = f.read()
    payload = pickle.loads(blob)
    if raised:
        if path is not None:
            os.unlink(path)
        raise payload.error from RemoteTraceback(payload.trace)
    return payload, path


# A chunk file this large is mapped rather than read: its arrays are never held in this
# process's memory (one item of a user's Dataset may be gigabytes); smaller ones are read
# in one call, cheaper than faulting their pages in.
MAP_SPILLED_BYTES = 64 << 20


def _unspill(result: tuple[list[Outcome], str | None]) -> list[Outcome]:
    """The chunk's outcomes with their arrays back: views of the chunk's file, mapped (its
    pages are the file's, not this process's memory), which goes once they are written."""
    outcomes, path = result
    if path is None:
        return outcomes
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = (
            f.read()
            if size < MAP_SPILLED_BYTES
            else mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        )
    os.unlink(path)
    for outcome in outcomes:
        for sample in outcome.samples:
            for name, value in sample.items():
                if isinstance(value, _Spilled):
                    count = math.prod(value.shape)
                    array = np.frombuffer(data, value.dtype, count, value.offset)
                    sample[name] = array.reshape(value.shape)
    return outcomes


# -- driver --------------------------------------------------------------------------


@contextlib.contextmanager
def heap_frozen() -> Iterator[None]:
    """The objects that exist when a compile starts (the caller's, torch's: a few hundred
    thousand) are left out of the cyclic garbage collector's scans until it ends: each full
    scan of them cost about 65 ms, a few percent of a one-worker compile of 2,000 clips,
    while nothing the compile makes can free them. Objects made during the compile are
    collected as usual. A caller that froze its own heap keeps it frozen; anything frozen
    while the compile runs (by another thread, or an on_progress callback) is unfrozen
    with the rest when it ends."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@heap_frozen()
def compile_corpus(
    recipe: Recipe,
    out: str | os.PathLike[str],
    *,
    workers: int | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    on_progress: Callable[[int], None] | None = None,
    unit_inputs: int | None = None,
    dask: str | None = None,
    storage_options: dict[str, Any] | None = None,
    append: bool = False,
) -> Index:
    """Compiles ``recipe.source`` into an archive at ``out`` (a folder, or a URL prefix);
    returns its index. What ``dlop-compile SOURCE -o OUT`` runs: ``recipe`` is
    build_recipe of the options a recipe file holds, and each keyword is the command's
    option of that name (docs/compile.md).

    ``workers``: local worker processes (None: one per core). ``dask``: a scheduler
    address, or ``local:N`` for a LocalCluster of N worker processes, instead of local
    workers. ``unit_inputs``: inputs per work unit (None: by media, UNIT_INPUTS).
    ``resume`` finishes an interrupted compile in ``out``; ``overwrite`` replaces the
    archive or interrupted compile there; ``append`` adds the inputs the archive there
    does not hold yet, as a generation of its own (docs/compile.md, "Growing an archive"). ``progress``: a bar on stderr (a line every
    30 s where stderr is not a terminal); ``on_progress`` is called with the number of
    inputs done so far. ``storage_options``: fsspec options for a URL SOURCE or OUT.
    """
    if is_url(out):  # before the listing: a refused OUT costs no listing of the corpus
        check_apart(os.fspath(out), recipe)
    # its imports run while the corpus is listed, where the workers will fork from it
    processes.start_fork_server(recipe.source, workers, dask)
    lister = functools.partial(
        open_corpus,
        recipe.source,
        recipe.layout,
        recipe.media,
        recipe.images,
        recipe.masks,
        **recipe.columns(),
        storage_options=storage_options,
        allow_paths=recipe.allow_paths,
    )
    if append:  # the lines of a listing file after the archive's, where it has one
        corpus = list_for_append(
            open_store(out, storage_options), resume, lambda k: lister(known=k)
        )
    else:
        corpus = lister()
    if not corpus.items and not corpus.prefix:
        raise CompileError(f"{recipe.source}: no inputs found for layout {corpus.layout}")
    _note_repeats(corpus)
    shape = CorpusShape.of(corpus)
    run = Run(
        recipe,
        corpus,
        shape,
        tuple(schema_for(recipe, shape)),
        os.fspath(out),
        storage_options,
        unit_size(unit_inputs, corpus.media),
        unit_inputs is not None,
        progress,
        on_progress,
    )

    return run_compile(
        run, workers=workers, dask=dask, resume=resume, overwrite=overwrite, append=append
    )


def run_compile(
    run: Run,
    *,
    workers: int | None,
    dask: str | None,
    resume: bool,
    overwrite: bool,
    append: bool = False,
) -> Index:
    """Runs a compile on its engine: ``workers`` local processes, or the Dask cluster at
    ``dask`` (``local:N``: a LocalCluster of N worker processes)."""
    if dask is None:
        count = processes.local_workers(workers)
        pickled = None  # made once, before OUT is taken: what cannot reach a worker is refused
        if count > 1 and processes.worker_context().get_start_method() != "fork":
            pickled = by_value(run.work())
        local = functools.partial(_local_records, run, workers=count, pickled=pickled)
        return finish_run(run, local, resume=resume, overwrite=overwrite, append=append)
    from .dask_engine import dask_client, dask_records

    # the cluster is reached before OUT is taken: a scheduler that does not answer
    # leaves OUT as it was
    # by value (Dask pickles by reference where it can, and a worker may not import the
    # module a user's Dataset was loaded from); made before OUT is taken: what cannot reach
    # the cluster is refused then
    pickled = by_value(run.work())
    with dask_client(dask, run.progress) as client:
        # a unit whose task killed every worker it ran on runs here, one item at a time
        # where its items die (_results), so the item that kills is recorded
        here = functools.partial(_local_records, run, workers=2, pickled=pickled)
        on_cluster = functools.partial(dask_records, client, run, pickled, here=here)
        return finish_run(run, on_cluster, resume=resume, overwrite=overwrite, append=append)


def _note_repeats(corpus: Corpus) -> None:
    """Says when the listing names an input more than once: each listing is compiled (a
    sample each), and an append tells them apart by their order (SPEC.md §6.2)."""
    corpus.identities()
    if not corpus.repeats:
        return
    first = corpus.items[corpus.repeats[0]].key
    count = len(corpus.repeats)
    print(
        f"dlop-compile: note: {count} input{'s' * (count != 1)} of {corpus.root or 'the corpus'} "
        f"repeat{'s' * (count == 1)} one listed before (the first: {first!r:.200}, input "
        f"{corpus.prefix + corpus.repeats[0]}); each listing is compiled as an input of its own",
        file=sys.stderr,
        flush=True,
    )


def unit_size(unit_inputs: int | None, media: str) -> int:
    # Chunks (the inputs featurized together) are cut from each unit's first input, so
    # they never span two units whatever the unit size.
    size = UNIT_INPUTS[media] if unit_inputs is None else unit_inputs
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise CompileError(f"--unit-inputs {size}: expected a positive number of inputs")
    return size


def _local_records(
    run: Run, pending: list[int], workers: int, pickled: bytes | None = None
) -> Iterator[UnitRecord]:
    """Runs the pending units in unit order on this machine; yields each committed record.
    ``pickled``: the Work by value, when the caller made it already."""
    store, done = run.store(), [0]
    units = [(u, run.inputs_of(u)) for u in pending]

    def after_put(_: object) -> None:
        done[0] += 1
        fault_at(f"shard:{done[0]}")

    sizes: dict[int, str] = {}  # unit -> its inputs' sizes, taken as its inputs go out
    size = shared_chunks(run.work().chunk_items(), sum(len(i) for _, i in units), workers)
    chunks = (
        chunk
        for unit, inputs in units
        for chunk in chunked(unit_items(run.corpus, unit, inputs, sizes), size)
    )
    outcomes = _results(chunks, run, workers, store.staging(), pickled)
    with contextlib.closing(outcomes):
        consumed = 0
        for unit, inputs in units:
            writer = UnitWriter(run.task(), store, unit, inputs, run.recipe.on_error, after_put)
            try:
                for outcome in itertools.islice(outcomes, len(inputs)):
                    consumed += 1
                    if not writer.add(outcome):
                        break
                    run.advance(1)
                    fault_at(f"input:{consumed}")
                writer.input_sizes = sizes.pop(unit, "")
                record = writer.commit()
            except BaseException:
                writer.discard()
                raise
            yield record
            if record.failure is not None:
                return


def shared_chunks(chunk_items: int, inputs: int, workers: int) -> int:
    """Inputs per chunk for ``inputs`` on ``workers``: the Work's ``chunk_items``, or fewer
    where that many would leave a worker idle (a small compile or append: 20 inputs in
    chunks of 16 gave one worker 16 and the other 4, and the compile waited on the one)."""
    return max(1, min(chunk_items, -(-inputs // max(1, workers))))


def _results(
    chunks: Iterator[list[Item]],
    run: Run,
    workers: int,
    spill_dir: Path,
    pickled: bytes | None = None,
) -> Generator[Outcome, None, None]:
    """Every input's outcome, in order, featurized in this process or a pool of ``workers``
    (each fetching its chunks' URL inputs itself). A pool whose worker dies, or whose
    oldest chunk outlasts the Work's item time limit, is stopped; the chunks it had not
    answered run again one input per process (``_guarded``), so the input that kills or
    hangs its worker is recorded as a bad input and the rest compile, then a new pool
    goes on with the chunks after them."""
    work = run.work()
    ctx = processes.worker_context()
    # a forked worker inherits the Work; any other gets it by value (a user's Dataset may
    # be defined in a script or a notebook)
    sent: Any = work
    if workers > 1 or work.guarded():
        try:
            if ctx.get_start_method() == "fork":
                sent = work
            else:
                sent = pickled if pickled is not None else by_value(work)
        except CompileError as e:
            if workers > 1:
                raise
            print(  # one worker: the code runs here, as it always can
                f"dlop-compile: {e}; it runs in this process (an item that exits or hangs "
                "there stops the compile)",
                file=sys.stderr,
                flush=True,
            )
            sent = None
    if sent is None or (workers == 1 and not work.guarded()):
        numerics.require()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            systems: dict[str, Any] = {}
            for chunk in chunks:
                yield from work.outcomes(chunk, systems)
        finally:
            torch.set_num_threads(threads)
        return
    processes.check_can_start(f"{workers} worker process{'es' * (workers != 1)}")
    # absolute: an item may change its worker's directory
    spill = os.path.abspath(spill_dir)
    init = (sent, spill, os.getpid(), dict(os.environ), worker_decode_threads(workers))
    limit = work.item_timeout()
    try:
        while True:
            lost: list[tuple[list[Item], Future[Any]]] = []
            yield from _pooled(chunks, ctx, init, workers, limit, lost, Path(spill))
            if not lost:
                return
            for chunk, future in lost:  # in order: those answered before the loss stand
                if (
                    future.done()
                    and not future.cancelled()
                    and future.exception() is None
                    and not future.result().raised
                ):
                    yield from _unspill(_received(future.result(), Path(spill)))
                    continue
                for item in chunk:
                    yield _guarded(ctx, init, work, item, limit)
    finally:
        # Chunks finished but never read (a stopped compile): their files go too.
        for leftover in spill_dir.glob(f"{SPILL_PREFIX}*"):
            leftover.unlink(missing_ok=True)


def _pooled(
    chunks: Iterator[list[Item]],
    ctx: multiprocessing.context.BaseContext,
    init: tuple[Any, ...],
    workers: int,
    limit: float | None,
    lost: list[tuple[list[Item], Future[Any]]],
    spill_dir: Path,
) -> Generator[Outcome, None, None]:
    """The outcomes of ``chunks`` from one pool, in order, until they end or the pool is
    lost (a worker died, or the oldest chunk outlasted ``limit`` a item): then the pool's
    workers are killed and ``lost`` holds the chunks it was given and not yet answered."""
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=init)
    pending: deque[tuple[list[Item], Future[Any]]] = deque()

    def given(chunk: list[Item]) -> bool:
        """Gives ``chunk`` to the pool; False when the pool is lost already (a worker died
        while the driver read results): the chunk is lost with the others."""
        try:
            with processes.main_module_hidden():
                pending.append((chunk, pool.submit(_answer, chunk)))
        except BrokenProcessPool:
            pending.append((chunk, Future()))  # never run: its inputs run one by one
            lost.extend(pending)
            pending.clear()
            return False
        return True

    workers_of: _Workers | None = None  # once the pool is told to end early
    try:
        for chunk in chunks:
            if not given(chunk):
                return
            if len(pending) >= 8 * workers:  # bounded: a few chunks per worker in flight
                break
        while pending:
            chunk, future = pending[0]
            try:
                # the oldest chunk is running (or done): it ends within its items' limits
                result = future.result(None if limit is None else limit * len(chunk) + 1.0)
            except (BrokenProcessPool, FuturesTimeout):
                lost.extend(pending)
                pending.clear()
                return
            pending.popleft()
            following = next(chunks, None)
            if following is None and not pending:
                # every chunk answered: the workers exit while the last outcomes are written
                workers_of = _Workers.of(pool)
                pool.shutdown(wait=False)
            yield from _unspill(_received(result, spill_dir))
            if following is not None and not given(following):
                return
    finally:
        for _, f in pending:
            f.cancel()
        # a lost pool's workers are killed at once (one may hang in a user's code, and a
        # pool has no call that stops a running task)
        _stop(pool, 0.0 if lost else WORKER_EXIT_S, workers_of)


# How long a pool's idle workers may take to exit before they are killed: one held by a
# thread a user's item started (its exit waits for every non-daemon thread) never does.
WORKER_EXIT_S = 2.0
# How long the pool's own thread may take to end after its workers: it reads what they
# sent last (whole answers: INLINE_ANSWER_BYTES), so this only bounds a thread that would
# not end for a reason of its own.
MANAGER_EXIT_S = 5.0


@dataclass(frozen=True)
class _Workers:
    """A pool's worker processes and its own thread: the executor forgets them once it
    is shut down."""

    procs: tuple[Any, ...]
    manager: threading.Thread | None

    @classmethod
    def of(cls, pool: ProcessPoolExecutor) -> _Workers:
        # typeshed gives the thread the type of its wakeup pipe
        manager = cast("threading.Thread | None", pool._executor_manager_thread)
        return cls(tuple((pool._processes or {}).values()), manager)


def _stop(pool: ProcessPoolExecutor, grace: float, told: _Workers | None = None) -> None:
    """Shuts the pool down, killing the workers that have not exited ``grace`` seconds
    after being told to, then waits (up to MANAGER_EXIT_S) for the pool's thread, so that
    the next pool, or a guarded input, forks from a driver with no thread of this one
    left. The executor's table of its processes and its thread are the one place their
    handles are kept, and it forgets them once shut down (Python 3.14 adds
    ``kill_workers`` for this): ``told``, taken before a shutdown that did not wait, holds
    them then."""
    workers = told or _Workers.of(pool)
    if grace <= 0:
        # killed before the pool is told: from Python 3.12 a broken pool's thread waits for
        # its workers while holding the lock shutdown takes, and a worker whose item
        # ignores SIGTERM would never end
        _killed(workers.procs, time.monotonic())
    pool.shutdown(wait=False, cancel_futures=True)
    _killed(workers.procs, time.monotonic() + grace)
    pool.shutdown(wait=True)
    if workers.manager is not None:
        workers.manager.join(MANAGER_EXIT_S)


def _killed(procs: tuple[Any, ...], deadline: float) -> None:
    """Waits for ``procs`` until ``deadline`` (time.monotonic), killing those still alive."""
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            with contextlib.suppress(OSError, ValueError, AttributeError):
                proc.kill()


def _guarded(
    ctx: Any,
    init: tuple[Any, ...],
    work: Any,
    item: Item,
    limit: float | None,
) -> Outcome:
    """One input's outcome from a process of its own: when that process dies, or runs past
    ``limit`` seconds (then it is killed), the input is recorded as bad with what happened."""
    receive, send = ctx.Pipe(duplex=False)
    with processes.main_module_hidden():
        proc = ctx.Process(target=_run_guarded, args=(send, init, item), daemon=True)
        proc.start()
    send.close()
    result: Any = None
    try:
        result, took = processes.answer_of(receive, limit)
    finally:
        receive.close()
        if result is None and proc.is_alive():
            proc.kill()
        proc.join()
    if result is not None:
        return _unspill(result)[0]
    why = processes.how_it_ended(proc.exitcode, took, limit)
    return Outcome(item.key, reason=why, path=work.name(item))


def _run_guarded(send: Any, init: tuple[Any, ...], item: Item) -> None:
    """A guarded process: one input's outcome (its arrays through a chunk file) sent back."""
    _init_worker(*init)
    send.send(processes.STARTED)  # the item's time counts from here
    send.send(_run_chunk([item]))
    send.close()
    os._exit(0)  # threads the item left behind are not waited for


def worker_decode_threads(workers: int) -> int:
    """The threads each of ``workers`` pool workers decodes a video with: the cores
    this process may use, shared out (at least one each)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity call on this platform
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, workers))

"""The client side of a compile: take OUT, journal, run the pending units on an engine,
merge their commit records in unit order into errors.jsonl and index.json, tidy up.

An engine is a function of the pending units' numbers that yields each unit's
commit record once the unit is published (in any order); pipeline.py has the
local one, dask_engine.py the Dask one.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from dlop.formats import (
    ERRORS_NAME,
    INDEX_NAME,
    Field,
    FormatError,
    Index,
    UnitTable,
    encode_index,
    num_units,
    parse_index,
)
from dlop.formats.archive import now_utc
from dlop.formats.constants import MAX_ERRORS_BYTES, MAX_ERRORS_RECORDS, MAX_SHARDS, MAX_UNITS
from dlop.formats.files import loads_bounded
from dlop.formats.redact import redact
from dlop.formats.skipped import encode_record
from dlop.formats.units import MAX_COUNT

from ..audio import numerics
from ..corpus.records import Corpus
from ..errors import AxisVaries, CompileError
from ..faults import fault_at
from ..output.guard import (
    COMPILE_FILE,
    LOCK,
    check_apart,
    clear_for_resume,
    committed_units,
    locked_output,
)
from ..output.journal import JOURNAL, Journal
from ..output.store import LocalStore, Store, open_store
from ..recipe import Recipe
from .items import CorpusShape
from .units import COMMIT_PREFIX, UnitRecord, UnitTask, input_sizes
from .work import PresetWork

Engine = Callable[[list[int]], Iterator[UnitRecord]]


@dataclass
class Run:
    """One compile: what it compiles, where to, how it is cut into units, its progress."""

    recipe: Recipe
    corpus: Corpus
    shape: CorpusShape
    fields: tuple[Field, ...]
    out: str
    storage_options: dict[str, Any] | None
    unit_inputs: int
    unit_inputs_given: bool
    progress: bool
    on_progress: Callable[[int], None] | None
    consumed: int = 0
    peak_rss: dict[str, int] = field(default_factory=dict)  # worker -> bytes, from records
    journal_run: str = ""  # the journal's run token (Journal.run), once OUT is taken
    # what makes each input's samples when it is not the recipe's decoding and featurizing:
    # a user's own Dataset or function (dlop.compiler.custom)
    custom_work: Any = None
    _store: Store | None = None
    _bar: Any = None

    def store(self) -> Store:
        if self._store is None:
            self._store = open_store(self.out, self.storage_options)
        return self._store

    @property
    def num_units(self) -> int:
        return num_units(len(self.corpus.items), self.unit_inputs)

    def inputs_of(self, unit: int) -> range:
        start = unit * self.unit_inputs
        return range(start, min(start + self.unit_inputs, len(self.corpus.items)))

    def work(self) -> Any:
        """The work.py Work each worker runs."""
        if self.custom_work is not None:
            return self.custom_work
        return PresetWork(
            self.recipe.to_json(), self.recipe.digest(), self.shape, self.storage_options
        )

    def task(self) -> UnitTask:
        return UnitTask(
            self.recipe.to_json(),
            self.recipe.digest(),
            self.shape,
            self.fields,
            self.unit_inputs,
            self.out,
            self.storage_options,
            self.journal_run,
            numerics.resume_key(numerics.target()),
            self.work(),
        )

    def advance(self, inputs: int) -> None:
        """Counts inputs done (for the progress bar and ``on_progress``)."""
        self.consumed += inputs
        if self._bar is not None:
            self._bar.update(inputs)
        if self.on_progress is not None:
            self.on_progress(self.consumed)


def finish_run(run: Run, engine: Engine, *, resume: bool, overwrite: bool) -> Index:
    """Takes OUT (locked when local), then compiles every unit not yet committed."""
    from ..urls import is_url

    if not resume or run.unit_inputs_given:  # else the journal's unit size counts
        check_unit_count(run)  # before OUT is touched
    journal = Journal(
        run.store().url,
        run.recipe.digest(),
        run.corpus.fingerprint,
        run.unit_inputs,
        len(run.corpus.items),
        numerics.resume_key(numerics.target()),
        run.recipe.to_json(),
    )
    journal.encoded()  # a recipe no journal (nor index) could hold: refused before OUT is taken
    remote = is_url(run.out)
    with _full_disk_named(run.out, remote):
        if remote:
            with _remote_output(run.store(), resume, overwrite):
                return _run_units(run, engine, journal, resume, created_dir=False)
        out = Path(run.out)
        check_apart(out, run.recipe)
        with locked_output(out, resume, overwrite) as created_dir:
            return _run_units(run, engine, journal, resume, created_dir)


@contextlib.contextmanager
def _full_disk_named(out: str, remote: bool) -> Iterator[None]:
    """A full disk or quota (an OSError naming no file) becomes a CompileError naming where
    the compile wrote: OUT, or for a URL OUT the staging folder its shards are made in."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT) or e.filename:
            raise
        where = "its staging folder in TMPDIR" if remote else out
        raise CompileError(
            f"{where}: {e.strerror or 'no space left'} while compiling into {out}; free some "
            "space (or set the quota higher), then run the same command with --resume"
        ) from None


def _run_units(
    run: Run, engine: Engine, journal: Journal, resume: bool, created_dir: bool
) -> Index:
    store = run.store()
    total = len(run.corpus.items)
    committed: dict[int, UnitRecord] = {}
    if resume:
        committed, finished = _take_over(run, store, journal)
        if finished is not None:  # stopped after its index: only the tidying up was left
            _tidy(run, store)
            return finished
    # a URL OUT, unlocked: its journal names the compile running now (Journal.check_run)
    remote = not isinstance(store, LocalStore)
    if not resume:
        journal.save(store)  # from the start, so that an interruption at any point can --resume
    run.journal_run = journal.run
    fault_at("start")
    pending = [u for u in range(run.num_units) if u not in committed]
    run.consumed = sum(r.num_inputs for r in committed.values())
    run._bar = _progress_bar(total, run.consumed, run.num_units, len(committed), run.progress)
    totals = Totals()
    for record in sorted(committed.values(), key=lambda r: r.unit):
        totals.add(record)
    records = engine(pending)
    try:
        for n, record in enumerate(records, 1):
            if record.failure is not None:
                if record.widen is not None:  # compiled again from the start, the axis ragged
                    _discard(store, created_dir)
                    raise AxisVaries(record.failure, *record.widen)
                if not committed:  # nothing finished: nothing of this compile is left
                    _discard(store, created_dir)
                    raise CompileError(record.failure)
                _keep_committed(store)
                raise CompileError(
                    f"{record.failure}; the {len(committed)} units committed before it stay in "
                    f"{store.url} (nothing finished is thrown away): fix the input or the code, "
                    "then --resume where the recipe and inputs are unchanged, or start afresh "
                    "with --overwrite"
                )
            totals.add(record)
            committed[record.unit] = record
            if remote:
                journal.check_run(store)
            if record.worker:
                run.peak_rss[record.worker] = max(
                    run.peak_rss.get(record.worker, 0), record.peak_rss
                )
            if run._bar is not None:
                run._bar.set_postfix_str(f"units {len(committed)}/{run.num_units}", refresh=False)
            fault_at(f"unit:{n}")
        if remote:
            journal.check_run(store)
        index = _write_archive(run, store, committed)
    except BaseException as e:
        if run._bar is not None:  # closed first: the bar's last frame would cover the message
            run._bar.close()
            run._bar = None
        if _resumable(e):
            print(
                f"dlop-compile: stopped; run again with --resume to continue after {len(committed)} "
                f"of {run.num_units} completed unit(s)",
                file=sys.stderr,
            )
        raise
    finally:
        with contextlib.suppress(Exception):
            records.close()  # type: ignore[attr-defined]
        if run._bar is not None:
            run._bar.close()
    fault_at("tidy")
    _tidy(run, store)
    return index


@dataclass
class Totals:
    """The archive-wide counts of the records merged so far, held to the bounds of SPEC.md §8
    as each record arrives: a compile stops at the first unit past one, not after its last."""

    shards: int = 0
    skipped: int = 0
    errors_bytes: int = 0  # errors.jsonl

    def add(self, record: UnitRecord) -> None:
        self.shards += len(record.shards)
        self.skipped += len(record.skipped)
        self.errors_bytes += sum(len(encode_record(s, 0)) for s in record.skipped)
        where = f"{self.shards} shards after unit {record.unit}"
        if self.shards > MAX_SHARDS:
            self._stop(f"{where}; an archive holds at most {MAX_SHARDS}", "a larger --shard-bytes")
        if self.skipped > MAX_ERRORS_RECORDS:
            self._stop(
                f"{self.skipped} skipped inputs after unit {record.unit}; errors.jsonl holds at "
                f"most {MAX_ERRORS_RECORDS}",
                "the corpus and the decoders checked",
            )
        if self.errors_bytes > MAX_ERRORS_BYTES:
            self._stop(
                f"errors.jsonl would be {self.errors_bytes} bytes after unit {record.unit}; it "
                f"holds at most {MAX_ERRORS_BYTES}",
                "the corpus and the decoders checked",
            )

    @staticmethod
    def _stop(problem: str, remedy: str) -> NoReturn:
        raise CompileError(
            f"{problem} (SPEC.md §8), so no index could list them; stopped here. Compile again "
            f"with {remedy} (--overwrite)"
        )


def check_unit_count(run: Run) -> None:
    """Refuses a unit size an index cannot hold (SPEC.md §6.1, §8): larger than 2^64-1, or
    cutting the corpus into more units than an index lists."""
    if run.unit_inputs > MAX_COUNT:
        raise CompileError(
            f"--unit-inputs {run.unit_inputs}: an index holds at most 2^64-1 inputs per unit"
        )
    if run.num_units > MAX_UNITS:
        raise CompileError(
            f"--unit-inputs {run.unit_inputs}: the {len(run.corpus.items)} inputs make "
            f"{run.num_units} units, and an archive lists at most {MAX_UNITS}; give "
            f"--unit-inputs {-(-len(run.corpus.items) // MAX_UNITS)} or more"
        )


def _take_over(
    run: Run, store: Store, journal: Journal
) -> tuple[dict[int, UnitRecord], Index | None]:
    """For --resume: the interrupted compile's committed units, everything else of it
    deleted; and its index when it got as far as writing one that the records bear out
    (then the index and errors.jsonl stay, and only the tidying up is left)."""
    journal.load(store, run.unit_inputs_given)
    # names this run from now on: a unit task of the interrupted compile still running
    # (on a Dask cluster) publishes nothing more (UnitWriter.check_run)
    journal.save(store)
    run.unit_inputs = journal.unit_inputs
    check_unit_count(run)
    committed = committed_units(store, journal)
    if run.corpus.unit_sizes:  # the fingerprint left the inputs' sizes to the units
        items = run.corpus.items
        committed = {
            u: r
            for u, r in committed.items()
            if r.input_sizes
            == input_sizes(run.corpus, items[r.first_input : r.first_input + r.num_inputs])
        }
    finished = _finished_index(run, store, committed)
    if finished is None and len(committed) < run.num_units:
        finished = _intact_index(run, store, committed)
        if finished is not None:  # stopped while deleting the records: _tidy deletes the rest
            return committed, finished
    clear_for_resume(store, committed, keep_archive=finished is not None)
    return committed, finished


def _intact_index(run: Run, store: Store, committed: dict[int, UnitRecord]) -> Index | None:
    """The index in OUT when it reads cleanly as this compile's archive (same recipe, corpus
    and units), agrees with the commit records left, and every shard it lists, and
    errors.jsonl when it counts skipped inputs, is in OUT at its size: a compile stopped
    while _tidy deleted the commit records."""
    data = store.read(INDEX_NAME)
    if data is None:
        return None
    try:
        index = parse_index(f"{run.out}/{INDEX_NAME}", data)  # the format's bounds and checks
    except FormatError:
        return None
    source = index.provenance.get("source")
    units = index.units
    if (
        index.recipe != run.recipe.to_json()
        or not isinstance(source, dict)
        or source.get("fingerprint") != run.corpus.fingerprint
        or units is None
        or (units.unit_inputs, units.num_inputs) != (run.unit_inputs, len(run.corpus.items))
    ):
        return None
    first = list(itertools.accumulate(units.shards, initial=0))
    for u, r in committed.items():
        if index.shards[first[u] : first[u + 1]] != r.shards or units.skipped[u] != len(r.skipped):
            return None
    listed = store.sizes()  # one listing: no request per shard for a URL OUT
    if index.skipped_count and ERRORS_NAME not in listed:
        return None
    if any(listed.get(s.file) != s.bytes for s in index.shards):
        return None
    return index


def _finished_index(run: Run, store: Store, committed: dict[int, UnitRecord]) -> Index | None:
    """The index in OUT when it is, byte for byte, the one these records make (with its
    own creation time), with the errors.jsonl they make beside it; else None."""
    data = store.read(INDEX_NAME) if len(committed) == run.num_units else None
    if data is None:
        return None
    try:
        provenance = loads_bounded(INDEX_NAME, data, "index").get("provenance")
        created = provenance.get("created")
    except (FormatError, AttributeError):
        return None
    if not isinstance(created, str):
        return None
    index, errors = _merged(run, committed, created)
    if encode_index(index, INDEX_NAME) != data or store.read(ERRORS_NAME) != errors:
        return None
    return index


def _write_archive(run: Run, store: Store, committed: dict[int, UnitRecord]) -> Index:
    """errors.jsonl, then index.json last, both merged from the records in unit order."""
    index, errors = _merged(run, committed, now_utc())
    if errors is not None:
        store.write(ERRORS_NAME, errors)
    fault_at("index")
    store.write(INDEX_NAME, encode_index(index, f"{store.url}/{INDEX_NAME}"))
    return index


def _merged(run: Run, committed: dict[int, UnitRecord], created: str) -> tuple[Index, bytes | None]:
    """The index and the errors.jsonl bytes (None when nothing was skipped) that the
    records make, merged in unit order."""
    records = [committed[u] for u in range(run.num_units)]
    shards = tuple(s for r in records for s in r.shards)
    skipped = [s for r in records for s in r.skipped]
    errors = b"".join(encode_record(s, k) for k, s in enumerate(skipped)) if skipped else None
    from dlop import __version__

    corpus = run.corpus
    source = {
        "layout": corpus.layout,
        "path": redact(corpus.root),  # never a URL's credentials
        "num_inputs": len(corpus.items),
        "fingerprint": corpus.fingerprint,
    }
    index = Index(
        run.fields,
        shards,
        sum(s.num_samples for s in shards),
        run.recipe.to_json(),
        {
            "dlop_version": __version__,
            "created": created,
            "source": source,
            "numerics": numerics.target(),
        },
        len(skipped),
        {**corpus.metadata, "feature_field": run.recipe.feature_name},
        UnitTable(
            run.unit_inputs,
            len(corpus.items),
            tuple(len(r.shards) for r in records),
            tuple(len(r.skipped) for r in records),
        ),
    )
    return index, errors


def _tidy(run: Run, store: Store) -> None:
    """After the index: the commit records go, the staging folder, and the journal last."""
    # listed, not taken from ``committed``: after _intact_index, whatever records are left
    records = [n for n in store.list(COMMIT_PREFIX) if COMPILE_FILE.fullmatch(n)]
    for n, name in enumerate(records):
        store.delete(name)
        if n == 0:
            fault_at("tidying")
    if isinstance(store, LocalStore):
        store.clear_staging()
    store.delete(JOURNAL)


def _keep_committed(store: Store) -> None:
    """After a bad input under --on-error fail once units are committed: they stay, with
    the journal (a resume, or an --overwrite, is the user's call); only staging goes."""
    if isinstance(store, LocalStore):
        store.clear_staging()


def _discard(store: Store, created_dir: bool) -> None:
    """After a bad input under --on-error fail: removes everything this compile wrote."""
    store.delete(JOURNAL)  # first: a unit task still running publishes nothing more
    if isinstance(store, LocalStore):
        store.clear_staging()
        if created_dir:
            shutil.rmtree(store.root, ignore_errors=True)
            return
    for name in store.list():
        if name != LOCK and COMPILE_FILE.fullmatch(name):
            store.delete(name)


def _resumable(e: BaseException) -> bool:
    """Whether running the same command again with --resume can get further: after an
    interruption or a full disk, yes; after a refused write or a bad input or recipe, no."""
    if isinstance(e, OSError):
        return e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS)
    return isinstance(e, KeyboardInterrupt)


@contextlib.contextmanager
def _remote_output(store: Store, resume: bool, overwrite: bool) -> Iterator[None]:
    """A URL OUT: the checks a local OUT gets (no lock: object stores have none). Only names
    a compile writes are ever deleted; anything else under OUT refuses the compile."""
    names = store.list()
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


LOG_EVERY_S = 30.0  # a progress line this often when stderr is not a terminal


class _LogProgress:
    """Progress for a log file (stderr not a terminal): a whole line at most every
    LOG_EVERY_S seconds and one at the end, never the carriage returns a bar draws with.
    Offers the part of tqdm's interface the compile uses."""

    def __init__(self, total: int, initial: int) -> None:
        self.total, self.done, self.first = total, initial, initial
        self.postfix = ""
        self.started = self.shown = time.monotonic()

    def update(self, n: int) -> None:
        self.done += n
        if time.monotonic() - self.shown >= LOG_EVERY_S:
            self.line()

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text

    def line(self) -> None:
        self.shown = time.monotonic()
        rate = (self.done - self.first) / max(self.shown - self.started, 1e-9)
        left = (self.total - self.done) / rate if rate > 0 else float("nan")
        eta = f", about {left:.0f} s left" if left == left else ""
        print(
            f"compiling: {self.done}/{self.total} inputs ({self.done / max(self.total, 1):.0%}), "
            f"{self.postfix}, {rate:.0f} inputs/s{eta}",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self.done != self.first:
            self.line()


def _tqdm() -> Any:
    """tqdm's bar, or None without the compile extra (a compile of one's own Dataset
    needs none of it): progress is then told in lines, as off a terminal."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


def _progress_bar(total: int, initial: int, units: int, units_done: int, enabled: bool) -> Any:
    if not enabled:
        return None
    tqdm = _tqdm() if sys.stderr.isatty() else None
    if tqdm is None:
        log = _LogProgress(total, initial)
        log.set_postfix_str(f"units {units_done}/{units}")
        return log
    tqdm.monitor_interval = 0  # no monitor thread, so workers can be forked

    bar = tqdm(
        total=total,
        initial=initial,
        unit="input",
        desc="compiling",
        file=sys.stderr,
        dynamic_ncols=True,
        smoothing=0.1,
    )
    bar.set_postfix_str(f"units {units_done}/{units}", refresh=False)
    return bar

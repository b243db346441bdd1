"""A compile's run, from taking OUT to its index: the Run (what it compiles, where to, how
its inputs are cut into units, its progress) and finish_run, the client side: take OUT
(output.guard), journal, run the pending units on an engine, have their commit records
merged in unit order into errors.jsonl and index.json (output.merge), tidy up.

An engine is a function of the pending units' numbers that yields each unit's
commit record once the unit is published (in any order); pipeline.py has the
local one, dask_engine.py the Dask one.
"""

from __future__ import annotations

import contextlib
import errno
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlop.formats import Field, Index, num_units
from dlop.formats.constants import MAX_UNITS
from dlop.formats.generations import MAX_GENERATION_INPUTS
from dlop.formats.units import MAX_COUNT
from dlop.formats.urls import is_url

from ..audio import numerics
from ..audio.decode import probe_rate
from ..corpus.records import Corpus
from ..errors import AxisVaries, CompileError, CompileWarning
from ..faults import fault_at
from ..output.commit import UnitRecord
from ..output.guard import (
    check_apart,
    clear_for_resume,
    committed_units,
    discard,
    keep_committed,
    locked_output,
    remote_output,
    tidy,
)
from ..output.journal import Journal
from ..output.merge import IndexPlan, Totals, finished_index, intact_index, write_archive
from ..output.store import LocalStore, Store, open_store
from ..recipe import Recipe
from .append import files_of, take_base
from .items import CorpusShape
from .units import UnitTask, input_sizes
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
    # an append (append.py): the archive it appends to, the names of its files, the
    # sha256 of its index, and the number of this compile's first unit (after the base's)
    base: Index | None = None
    base_files: frozenset[str] = frozenset()
    base_digest: str = ""
    first_unit: int = 0
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

    @property
    def units(self) -> range:
        """This compile's unit numbers (an append's follow the archive's)."""
        return range(self.first_unit, self.first_unit + self.num_units)

    def inputs_of(self, unit: int) -> range:
        start = (unit - self.first_unit) * self.unit_inputs
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
            self.first_unit,
        )

    def journal(self) -> Journal:
        return Journal(
            self.store().url,
            self.recipe.digest(),
            self.corpus.fingerprint,
            self.unit_inputs,
            len(self.corpus.items),
            numerics.resume_key(numerics.target()),
            self.recipe.to_json(),
            None if self.base is None else (self.first_unit, self.base_digest),
        )

    def index_plan(self) -> IndexPlan:
        """What the index holds besides the units' records, by the unit size as it is now
        (a resume takes the journal's)."""
        return IndexPlan(
            self.recipe, self.corpus, self.fields, self.unit_inputs, self.base, self.first_unit
        )

    def advance(self, inputs: int) -> None:
        """Counts inputs done (for the progress bar and ``on_progress``)."""
        self.consumed += inputs
        if self._bar is not None:
            self._bar.update(inputs)
        if self.on_progress is not None:
            self.on_progress(self.consumed)


def finish_run(
    run: Run, engine: Engine, *, resume: bool, overwrite: bool, append: bool = False
) -> Index:
    """Takes OUT (locked when local), then compiles every unit not yet committed. With
    ``append``, OUT holds an archive and only the inputs it does not hold are compiled,
    into a generation of their own (append.py)."""
    if append and overwrite:
        raise CompileError(
            f"{run.out}: --append adds to the archive there and --overwrite replaces it; "
            "give one of them"
        )
    if not resume or run.unit_inputs_given:  # else the journal's unit size counts
        check_unit_count(run)  # before OUT is touched
    # a recipe no journal (nor index) could hold: refused before OUT is taken
    run.journal().encoded()
    remote = is_url(run.out)
    with _full_disk_named(run.out, remote):
        if remote:
            with remote_output(run.store(), resume, overwrite, append):
                return _run_units(run, engine, resume, False, append)
        out = Path(run.out)
        check_apart(out, run.recipe)
        with locked_output(out, resume, overwrite, append) as created_dir:
            return _run_units(run, engine, resume, created_dir, append)


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


def _run_units(run: Run, engine: Engine, resume: bool, created_dir: bool, append: bool) -> Index:
    store = run.store()
    if append:
        taken = take_base(store, resume, run.recipe, run.corpus, run.fields)
        if isinstance(taken, Index):
            if resume:  # it had published its index: only the tidying up was left
                tidy(store)
            return taken  # else every input is in the archive already: nothing written
        run.corpus, run.first_unit = taken.corpus, taken.first_unit
        run.base, run.base_files, run.base_digest = taken.base, taken.files, taken.digest
        check_unit_count(run)  # its units are numbered after the archive's
    if run.custom_work is None:  # a preset's compile: its rate may be a guess
        _warn_on_a_guessed_rate(run.recipe, run.corpus)
    journal = run.journal()
    total = len(run.corpus.items)
    if total > MAX_GENERATION_INPUTS:
        raise CompileError(
            f"{run.out}: {total} inputs; one compile records at most {MAX_GENERATION_INPUTS} "
            "(SPEC.md §6.2): compile part of the corpus, then add the rest with --append"
        )
    committed: dict[int, UnitRecord] = {}
    if resume:
        committed, finished = _take_over(run, store, journal)
        if finished is not None:  # stopped after its index: only the tidying up was left
            tidy(store)
            return finished
    # a URL OUT, unlocked: its journal names the compile running now (Journal.check_run)
    remote = not isinstance(store, LocalStore)
    if not resume:
        journal.save(store)  # from the start, so that an interruption at any point can --resume
    run.journal_run = journal.run
    fault_at("start")
    pending = [u for u in run.units if u not in committed]
    run.consumed = sum(r.num_inputs for r in committed.values())
    run._bar = _progress_bar(total, run.consumed, run.num_units, len(committed), run.progress)
    totals = Totals(0 if run.base is None else len(run.base.shards))
    for record in sorted(committed.values(), key=lambda r: r.unit):
        totals.add(record)
    records = engine(pending)
    try:
        for n, record in enumerate(records, 1):
            if record.failure is not None:
                if record.widen is not None and run.base is not None:
                    discard(store, created_dir, run.base_files)
                    raise CompileError(
                        f"{record.failure}: the archive appended to holds that axis fixed, "
                        "so these inputs cannot join it; nothing was appended. Compile the "
                        "whole corpus afresh (--overwrite), or declare the axis ragged with "
                        "schema= there"
                    )
                if record.widen is not None:  # compiled again from the start, the axis ragged
                    discard(store, created_dir)
                    raise AxisVaries(record.failure, *record.widen)
                if not committed:  # nothing finished: nothing of this compile is left
                    discard(store, created_dir, run.base_files)
                    raise CompileError(record.failure)
                keep_committed(store)
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
        index = write_archive(run.index_plan(), store, committed)
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
    tidy(store)
    return index


PROBED_INPUTS = 16  # audio headers read before a compile whose rate the preset chose


def _warn_on_a_guessed_rate(recipe: Recipe, corpus: Corpus) -> None:
    """A CompileWarning when the preset's sample rate (not one the user gave) would resample
    inputs down by more than 2x: most of their bandwidth would be dropped without a word.
    Reads the headers of a few local inputs spread over the inputs compiled (an append's:
    those it adds), nothing else."""
    if recipe.media != "audio" or "sample_rate" not in recipe.guessed or is_url(recipe.source):
        return
    target = recipe.feature.sample_rate
    count = len(corpus.items)
    probed: list[int] = []
    for n in sorted({k * count // PROBED_INPUTS for k in range(PROBED_INPUTS)}):
        item = corpus.items[n]
        if item.error:
            continue
        if item.data is not None and item.member is not None:
            source: str | bytes | None = item.data.get(item.member[1])
        else:
            source = item.path if item.path is not None and not is_url(item.path) else None
        rate = None if source is None else probe_rate(source)
        if rate is not None:
            probed.append(rate)
    if probed and max(probed) > 2 * target:
        low, high = min(probed), max(probed)
        rates = f"{high} Hz" if low == high else f"{low}-{high} Hz"
        warnings.warn(
            CompileWarning(
                f"{recipe.source}: inputs are {rates} ({len(probed)} of {count} read), "
                f"resampled to {target} Hz, the {recipe.feature.preset} preset's rate: "
                f"everything above {target // 2} Hz is dropped; pass --sample-rate to keep more"
                " (or to confirm this rate and silence this warning)"
            ),
            stacklevel=2,
        )


def check_unit_count(run: Run) -> None:
    """Refuses a unit size an index cannot hold (SPEC.md §6.1, §8): larger than 2^64-1, or
    cutting the corpus into more units than an index lists."""
    if run.unit_inputs > MAX_COUNT:
        raise CompileError(
            f"--unit-inputs {run.unit_inputs}: an index holds at most 2^64-1 inputs per unit"
        )
    if run.first_unit + run.num_units > MAX_UNITS:
        room = MAX_UNITS - run.first_unit
        after = f" after the archive's {run.first_unit}" if run.first_unit else ""
        raise CompileError(
            f"--unit-inputs {run.unit_inputs}: the {len(run.corpus.items)} inputs make "
            f"{run.num_units} units{after}, and an archive lists at most {MAX_UNITS}; give "
            f"--unit-inputs {-(-len(run.corpus.items) // max(room, 1))} or more"
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
    finished = finished_index(run.index_plan(), store, committed)
    if finished is None and len(committed) < run.num_units:
        finished = intact_index(run.index_plan(), store, committed)
        if finished is not None:  # stopped while deleting the records: tidy deletes the rest
            return committed, finished
    archive = run.base_files
    if finished is not None:
        archive |= files_of(finished)
    clear_for_resume(store, committed, archive)
    return committed, finished


def _resumable(e: BaseException) -> bool:
    """Whether running the same command again with --resume can get further: after an
    interruption or a full disk, yes; after a refused write or a bad input or recipe, no."""
    if isinstance(e, OSError):
        return e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS)
    return isinstance(e, KeyboardInterrupt)


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

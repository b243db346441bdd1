"""Work units: consecutive inputs compiled into their own shards, committed by one record.

Inputs carry a fixed global number from the corpus listing; unit k holds inputs
[k * unit_inputs, (k + 1) * unit_inputs). A unit's shards are named by unit and
shard number (``unit-000003-0001.dlop``, formats/units.py), close only between
inputs, and never span two units, so a unit's files depend only on its inputs
and the recipe. A unit is published shards first, then its commit record
(``.dlop-unit-000003.json``, output/commit.py); it counts as done only when its record
exists, parses, and every shard it names is in OUT under that name (locally: with the
recorded size and CRC-32). Any engine (local processes, Dask) runs units in any order and
as often as it likes; the client merges the records in unit order into the index.

``run_unit`` is the whole of a unit's work in one function of (task, inputs): what
a Dask task runs, and what a local compile runs with its featurizing spread over
a process pool (pipeline.py feeds a UnitWriter the same way).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import pickle
import resource
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dlop.formats import ArchiveWriter, Field, ShardInfo, unit_shard_name

from ..audio import numerics
from ..corpus.layouts import stream_items
from ..corpus.listing import text_path
from ..corpus.place import source_place
from ..corpus.records import Corpus, Item, fingerprint
from ..errors import CompileError
from ..faults import unit_delay, worker_dies
from ..output.commit import WITNESSES, UnitRecord, commit_name
from ..output.journal import Journal
from ..output.store import Store, open_store
from . import processes
from .items import CorpusShape, Outcome
from .work import PresetWork

# Default inputs per unit, by media: a few minutes of one worker's time for typical inputs.
# A user's own Dataset or function ("custom"): items of any size, so a middle way.
UNIT_INPUTS = {"audio": 8192, "video": 256, "image": 256, "custom": 4096}


def witness_positions(count: int) -> set[int]:
    """Which of a unit's ``count`` inputs (positions 0..count-1) are its witnesses."""
    return {k * count // WITNESSES for k in range(WITNESSES)}


def sample_digest(samples: list[dict[str, Any]]) -> str:
    """sha256 of the samples one input wrote (each field's name, dtype, shape and bytes;
    a str's UTF-8): the same on every engine, a bytes field given as bytes or as the
    uint8 array a worker's chunk file hands back."""
    h = hashlib.sha256()
    for sample in samples:
        for name in sorted(sample):
            value = sample[name]
            if isinstance(value, bytes | bytearray | memoryview):
                value = np.frombuffer(value, np.uint8)
            if isinstance(value, torch.Tensor):
                value = value.numpy()
            data: Any
            if isinstance(value, str):
                data, kind = value.encode("utf-8"), "str"
            elif isinstance(value, np.ndarray | np.generic):
                array = np.ascontiguousarray(value)  # a view when it is already (no copy)
                data = array.reshape(-1).view(np.uint8)
                kind = f"{array.dtype.str}{list(array.shape)}"
            else:
                data, kind = repr(value).encode(), type(value).__name__
            h.update(f"{name}\0{kind}\0{len(data)}\0".encode())
            h.update(data)
    return h.hexdigest()


# -- doing a unit --------------------------------------------------------------------


@dataclass(frozen=True)
class UnitTask:
    """Everything a unit needs besides its inputs; small, and the same for every unit."""

    recipe: dict[str, Any]  # Recipe.to_json()
    digest: str
    shape: CorpusShape
    fields: tuple[Field, ...]
    unit_inputs: int
    out: str
    storage_options: dict[str, Any] | None = None
    # The journal's run token of the compile (Journal.run): names its Dask tasks, and a
    # unit publishes only while OUT's journal still names it (UnitWriter.check_run).
    run: str = ""
    # numerics.resume_key of the driver: every worker must write with the same
    numerics: dict[str, Any] = field(default_factory=dict)
    # what makes each input's samples (work.py); None: PresetWork of ``recipe``
    work: Any = None
    # the number of the compile's first unit: an append's follow the archive's (run.append)
    first_unit: int = 0

    def worker(self) -> Any:
        """The Work a unit runs."""
        if isinstance(self.work, bytes):  # by_value: loaded once per worker process
            key = hashlib.sha256(self.work).hexdigest()
            work = _WORKS.get(key)
            if work is None:
                _WORKS.clear()  # the compile running now only
                work = _WORKS[key] = pickle.loads(self.work)
            return work
        if self.work is not None:
            return self.work
        return PresetWork(self.recipe, self.digest, self.shape, self.storage_options)


_WORKS: dict[str, Any] = {}  # a worker process's unpickled Work, by its pickle's sha256


def by_value(work: Any) -> bytes:
    """A Work pickled with cloudpickle, which sends functions and classes of ``__main__``
    (a script, a notebook) and of modules registered by value as their code: what a user's
    Dataset needs to reach a forkserver's or a Dask cluster's workers."""
    try:
        import cloudpickle

        dumps = cloudpickle.dumps
    except ImportError:
        dumps = pickle.dumps
    try:
        data: bytes = dumps(work)
    except Exception as e:  # what the user's object holds (a lock, an open handle)
        raise CompileError(
            f"the Dataset or function cannot be sent to worker processes ({type(e).__name__}: "
            f"{e}); open such handles in __getitem__ on first use, or compile with workers=1"
        ) from None
    return data


@dataclass
class UnitWriter:
    """Writes one unit's outcomes, in input order, into its own shards; ``commit`` publishes
    the record. Shards are written in a staging folder of their own and put into OUT as
    each closes."""

    task: UnitTask
    store: Store
    unit: int
    inputs: range
    on_error: str
    after_put: Callable[[ShardInfo], None] | None = None  # called once a shard is in OUT
    failure: str | None = None
    widen: tuple[str, int] | None = None  # UnitRecord.widen
    input_sizes: str = ""  # UnitRecord.input_sizes, set before commit

    def __post_init__(self) -> None:
        self.added = 0  # outcomes given to add so far
        self.witnessed = witness_positions(len(self.inputs))
        self.witnesses: list[tuple[int, str]] = []
        self.staging = Path(tempfile.mkdtemp(prefix=f"u{self.unit}-", dir=self.store.staging()))
        self.writer = ArchiveWriter(
            self.staging,
            self.task.fields,
            shard_bytes=int(self.task.recipe["shard_bytes"]),
            name_shard=lambda j: unit_shard_name(self.unit, j),
            on_shard=self._put,
        )

    def check_run(self) -> None:
        """Refuses to publish once OUT's journal no longer names this compile's run: OUT was
        taken over (--overwrite, --resume) or discarded, and a task still running after its
        client stopped (Dask cannot stop a running task) must write nothing more there."""
        if not self.task.run:
            return
        journal = Journal(self.store.url, self.task.digest, "", self.task.unit_inputs, 0)
        journal.run = self.task.run
        journal.check_run(self.store)

    def _put(self, info: ShardInfo) -> None:
        self.check_run()
        self.store.put(self.staging / info.file, info.file)
        if self.after_put is not None:
            self.after_put(info)

    def add(self, outcome: Outcome) -> bool:
        """Writes one input's samples, or records it as skipped; False once a bad input
        stops an --on-error fail compile (``failure`` says which)."""
        if outcome.stop is not None:  # not the input's fault: the compile cannot go on
            self.failure, self.widen = outcome.stop, outcome.widen
            return False
        at, self.added = self.added, self.added + 1
        if outcome.reason is None:
            if at in self.witnessed and outcome.samples:
                self.witnesses.append((self.inputs.start + at, sample_digest(outcome.samples)))
            self.writer.write_group(outcome.samples)
            return True
        path = text_path(outcome.path or outcome.key)
        if self.on_error == "fail":
            self.failure = f"{path}: {outcome.reason} (--on-error fail)"
            return False
        self.writer.skip(path, outcome.reason or "", key=outcome.key)
        return True

    def commit(self) -> UnitRecord:
        """Puts the last shard, then the commit record; returns the record."""
        try:
            if self.failure is not None:
                self.writer.abort()
                return UnitRecord(
                    self.unit,
                    self.inputs.start,
                    len(self.inputs),
                    failure=self.failure,
                    widen=self.widen,
                )
            shards = self.writer.finish_shards()
            record = UnitRecord(
                self.unit,
                self.inputs.start,
                len(self.inputs),
                tuple(shards),
                tuple(self.writer.skipped),
                worker=f"{socket.gethostname()}:{os.getpid()}",
                peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                input_sizes=self.input_sizes,
                witnesses=tuple(self.witnesses),
            )
            data = json.dumps(record.to_json(self.task.digest)).encode()
            self.check_run()
            self.store.write(commit_name(self.unit), data)
            return record
        finally:
            self.discard()

    def discard(self) -> None:
        """Drops the shard in progress and the staging folder (shards put stay in OUT)."""
        self.writer.abort(keep_completed=True)
        shutil.rmtree(self.staging, ignore_errors=True)


def run_unit(task: UnitTask, unit: int, corpus: Corpus) -> UnitRecord:
    """Compiles one unit, whose inputs are ``corpus.items`` (a corpus holding only this
    unit's inputs), into OUT; returns its commit record. Pure and idempotent: running it
    again writes the same files under the same names."""
    unit_delay(unit)
    if multiprocessing.parent_process() is not None:  # a Dask worker process, not the driver
        processes.arm_item_limits()
    work = task.worker()
    numerics.require()
    here = numerics.resume_key(numerics.environment())
    if here != task.numerics:
        raise CompileError(
            f"unit {unit}: this worker's numeric environment differs from the compile's "
            f"({'; '.join(numerics.differences(task.numerics, here))}): "
            "its bytes would differ from other workers'; give every worker the same torch, "
            "numpy and dlop install"
        )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread per worker: the bytes do not depend on it
    store = open_store(task.out, task.storage_options)
    start = (unit - task.first_unit) * task.unit_inputs
    inputs = range(start, start + len(corpus.items))
    writer = UnitWriter(task, store, unit, inputs, str(task.recipe["on_error"]))
    sizes: dict[int, str] = {}
    systems: dict[str, Any] = {}
    try:
        outcomes = (
            o
            for chunk in chunked(unit_items(corpus, unit, None, sizes), work.chunk_items())
            for o in work.outcomes(chunk, systems)
        )
        for n, outcome in enumerate(outcomes, 1):
            if not writer.add(outcome):
                break
            worker_dies(unit, n)
        writer.input_sizes = sizes.get(unit, "")
        return writer.commit()
    except BaseException:
        writer.discard()
        raise
    finally:
        torch.set_num_threads(threads)


def unit_corpus(corpus: Corpus, inputs: range) -> Corpus:
    """The corpus cut down to one unit's inputs (what a unit's task carries)."""
    return replace(
        corpus, items=corpus.items[inputs.start : inputs.stop], ids=None, sizes_place=None
    )


def input_sizes(corpus: Corpus, items: Iterable[Item]) -> str:
    """sha256 over the inputs' (key, size, offset, duration): what a unit of a corpus whose
    fingerprint leaves out its inputs' sizes (Corpus.unit_sizes) records as it starts,
    and what a resume compares, redoing the unit when they differ."""
    if corpus.sizes_place is None:
        corpus.sizes_place = source_place(corpus.root, corpus.storage_options)
    return fingerprint(items, b"", corpus.sizes_place)


def unit_items(
    corpus: Corpus, unit: int, inputs: range | None, sizes: dict[int, str]
) -> Iterator[Item]:
    """The unit's inputs (``inputs`` of the corpus, or all of a unit's corpus when None), in
    order; for a Corpus.unit_sizes corpus their sizes go into ``sizes[unit]`` before the
    first is given out (so before any of them is read)."""
    start, stop = (0, None) if inputs is None else (inputs.start, inputs.stop)
    if not corpus.unit_sizes:
        yield from stream_items(corpus, start, stop)
        return
    items = list(stream_items(corpus, start, stop))
    sizes[unit] = input_sizes(corpus, items)
    yield from items


def chunked(items: Iterable[Item], size: int) -> Iterator[list[Item]]:
    chunk: list[Item] = []
    for it in items:
        chunk.append(it)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk

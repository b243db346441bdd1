"""The Dask engine: one task per work unit on a Dask distributed cluster.

Each task is ``units.run_unit`` on one unit's inputs (their descriptions, not their
features): the worker writes the unit's shards and commit record into OUT itself
and returns only the small record, so no feature array travels through the
scheduler. Tasks are pure and idempotent: a worker that dies mid-unit (its
nanny starts a new one) costs only that unit, which the scheduler runs again,
overwriting whatever the dead attempt had published. At most a few units per
worker are submitted at a time (the workers counted again before each
submit), so the client holds a bounded slice of the listing in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from dlop.formats import urls
from dlop.formats.extras import needs_extra

from ..errors import CompileError
from ..output.commit import UnitRecord
from .driver import Run
from .units import run_unit, unit_corpus

UNITS_PER_WORKER = 2  # units in flight per worker, besides one more each to start on


@contextlib.contextmanager
def dask_client(address: str, progress: bool) -> Iterator[Any]:
    """A client of the cluster at ``address`` (``local:N``: a LocalCluster of N processes,
    started here and stopped when the block ends; with ``progress``, on a terminal, its
    dashboard's address is printed)."""
    with needs_extra("dask", "--dask"):
        import distributed as dd
    with _client(dd, address, progress) as client:
        yield client


def dask_records(
    client: Any,
    run: Run,
    pickled: bytes,
    pending: list[int],
    here: Callable[[list[int]], Iterator[UnitRecord]],
) -> Iterator[UnitRecord]:
    """Runs the pending units on the cluster of ``client``; yields each record as its
    unit commits. A unit whose task killed every worker it was given (an item that exits,
    crashes, or outlasts its time limit) runs ``here`` instead, where the item that kills
    is found and recorded as bad."""
    distributed: Any = importlib.import_module("distributed")  # annotations are partial
    task = replace(run.task(), work=pickled)  # the recipe, schema, OUT; the Work by value
    todo = iter(pending)
    running = distributed.as_completed()
    futures: dict[Any, int] = {}

    def top_up() -> None:
        # the workers read again each time: they may join (or leave) while it runs
        slots = (UNITS_PER_WORKER + 1) * max(1, len(client.nthreads()))
        while len(futures) < slots and submit():
            pass

    def submit() -> bool:
        unit = next(todo, None)
        if unit is None:
            return False
        inputs = run.inputs_of(unit)
        future = client.submit(
            run_unit,
            task,
            unit,
            unit_corpus(run.corpus, inputs),
            # a scheduler shares a task among clients by key: the run's own token
            # keeps two compiles of one recipe (into any OUT) apart
            key=f"dlop-unit-{task.run}-{unit}",
            pure=False,
            retries=2,  # an error in the task (a network hiccup); a dead worker retries anyway
        )
        futures[future] = unit
        running.add(future)
        return True

    top_up()
    try:
        for future in running:
            try:
                record: UnitRecord = future.result()
            except distributed.KilledWorker:
                (record,) = here([futures[future]])  # run to its end: its pool stops
            futures.pop(future, None)
            future.release()
            run.advance(record.num_inputs)
            yield record
            if record.failure is not None:
                return
            top_up()
    finally:
        client.cancel(list(futures))


@contextlib.contextmanager
def _client(distributed: Any, address: str, progress: bool) -> Iterator[Any]:
    if not address.startswith("local:"):
        connect, read = urls.timeouts()  # those of every network wait (formats.urls)
        try:
            # the client waits for the scheduler's first answer without a limit
            asyncio.run(asyncio.wait_for(_identity(distributed, address, connect), connect + read))
            client = distributed.Client(address, timeout=f"{connect}s")
        except (OSError, TimeoutError) as e:
            raise CompileError(
                f"--dask {address}: cannot reach the Dask scheduler ({e}); start one "
                "(dask scheduler; dask worker ADDRESS) or use --dask local:N"
            ) from None
        with client:
            yield client
        return
    count = address.partition(":")[2]
    if not count.isdigit() or int(count) < 1:
        raise CompileError(
            f"--dask {address}: expected a scheduler address (tcp://host:8786) or local:N with "
            "N worker processes, N >= 1"
        )
    with _interrupt_deferred() as interrupted:
        # Ctrl-C while the cluster starts would leave it half made (and distributed
        # failing an assertion): it is held until the start is done, then raised
        cluster = distributed.LocalCluster(
            n_workers=int(count),
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            # a free port on loopback: a second compile's cluster, or a notebook's on
            # 8787, takes none from another (nor warns that it moved)
            dashboard_address="127.0.0.1:0",
            silence_logs=logging.ERROR,
        )
    with cluster:
        if interrupted:
            raise KeyboardInterrupt
        with distributed.Client(cluster) as client:
            if progress and sys.stderr.isatty():
                print(f"dlop-compile: Dask dashboard: {client.dashboard_link}", file=sys.stderr)
            yield client


async def _identity(distributed: Any, address: str, connect: float) -> None:
    """Asks the scheduler at ``address`` who it is (one request and its answer)."""
    comm = await distributed.comm.connect(address, timeout=connect)
    try:
        await comm.write({"op": "identity", "reply": True})
        await comm.read()
    finally:
        comm.abort()


@contextlib.contextmanager
def _interrupt_deferred() -> Iterator[list[bool]]:
    """Holds SIGINT for the block (in the main thread): the list it gives says whether
    one came. A second SIGINT raises KeyboardInterrupt at once."""
    got: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return

    def note(signum: int, frame: Any) -> None:
        if got:
            raise KeyboardInterrupt
        got.append(True)

    before = signal.signal(signal.SIGINT, note)
    try:
        yield got
    finally:
        signal.signal(signal.SIGINT, before)

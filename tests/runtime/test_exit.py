"""A process that leaves a Loader iterator unfinished exits 0, every time.

A runtime thread still ending (running torch's and OpenMP's thread-local
teardown) while the interpreter shuts down aborted such processes now and then
("terminate called without an active exception", exit status 134). The
driver imports torch once and forks 20 children (DLOP_EXIT_RUNS; ``make fuzz``
runs 300), two at a time; each runs a script to its end and exits through the
normal interpreter shutdown, which waits for every runtime thread.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .helpers import make_archive

RUNS = int(os.environ.get("DLOP_EXIT_RUNS", "20"))

DRIVER = textwrap.dedent(
    """
    import atexit, os, sys, threading

    def check_threads():
        # Runs after the runtime's own exit hooks (registered later, run earlier).
        from dlop.runtime.gather.threads import live_threads
        left = [t.name for t in threading.enumerate() if t.name.startswith("dlop")]
        natives = [
            t.native_id for t in live_threads()
            if os.path.exists(f"/proc/self/task/{t.native_id}")
        ]
        if left or natives:
            print("threads left at exit:", left, natives, file=sys.stderr)
            os._exit(3)

    atexit.register(check_threads)
    import torch  # noqa: F401
    from dlop.runtime import Loader, open_archive

    def work(path, variant):
        loader = Loader(path, 4, seed=variant)
        it = iter(loader)
        for _ in range(len(loader) // 2):
            next(it)
        state = loader.state_dict()
        if variant % 2:  # drop the first Loader and its iterator: collected, perhaps on its thread
            del loader, it
        other = Loader(path, 4, seed=variant)
        other.load_state_dict(state)
        for batch in other:
            pass
        if variant % 3 == 0:
            open_archive(path).__getitems__([0, 5, 9])

    path, runs = sys.argv[1], int(sys.argv[2])
    running, bad = {}, []
    for i in range(runs):
        while len(running) >= 2:
            pid, status = os.wait()
            if status:
                bad.append((running[pid], os.waitstatus_to_exitcode(status)))
            del running[pid]
        pid = os.fork()
        if pid == 0:
            work(path, i)
            sys.exit(0)  # the normal interpreter shutdown, atexit hooks included
        running[pid] = i
    for pid, i in running.items():
        status = os.waitpid(pid, 0)[1]
        if status:
            bad.append((i, os.waitstatus_to_exitcode(status)))
    print("bad runs:", bad)
    """
)


@pytest.mark.slow
def test_exit_with_an_unfinished_iterator_is_clean_every_time(tmp_path: Path) -> None:
    path = make_archive(tmp_path / "a", n=60, shard_bytes=3000)
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, str(path), str(RUNS)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "bad runs: []", done.stdout + done.stderr[-3000:]

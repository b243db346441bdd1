"""Ctrl-C while a shard's fetch is stalled: the Loader closes and the process exits at
once, not after the stalled requests' timeouts times their attempts (minutes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runtime.helpers import make_archive

STALLED = """
import os, signal, sys, threading
from pathlib import Path
from tests.faultproxy import FaultProxy
from dlop.runtime import Loader

root = Path(sys.argv[1])
with FaultProxy(root=root) as proxy:
    proxy.fail("shard-", "hang", times=None)  # every shard request stalls
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    loader = Loader(proxy.url + "/a", 4, cache_dir=str(root / "c"))
    if sys.argv[2] == "caught":
        try:
            for batch in loader:
                pass
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        finally:
            loader.close()
            print("closed", flush=True)
    else:  # the traceback, then the interpreter's exit
        for batch in loader:
            pass
"""


@pytest.mark.parametrize("how", ["caught", "uncaught"])
def test_ctrl_c_during_a_stalled_fetch_ends_the_process_at_once(tmp_path: Path, how: str) -> None:
    make_archive(tmp_path / "a")
    # the default attempts, and reads that wait an hour for a byte: a close that waited
    # for a fetch thread inside its read (a stalled part, a stalled header) would hang
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DLOP_FETCH_", "DLOP_READ"))}
    env["DLOP_READ_TIMEOUT"] = "3600"
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    run = subprocess.run(
        [sys.executable, "-c", STALLED, str(tmp_path), how],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,  # a hang detector: close waits a second for fetch threads
    )
    if how == "caught":
        assert run.stdout.split() == ["interrupted", "closed"], run.stderr
        assert run.returncode == 0
    else:
        assert "KeyboardInterrupt" in run.stderr and run.returncode != 0

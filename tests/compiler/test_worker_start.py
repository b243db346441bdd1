"""Where workers will come from a fork server, it is started while the driver still
imports and lists the corpus: by the command line before torch is loaded, by
``compile_corpus`` before the listing. A driver that forks its workers starts none."""

from __future__ import annotations

import json
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dlop.compiler.recipe import build_recipe
from dlop.compiler.run import pipeline, processes

from .fixtures import esc50_corpus

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork servers start early on Linux")

SERVER = multiprocessing.forkserver._forkserver


def _server_running() -> bool:
    pid = SERVER._forkserver_pid
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def no_fork_server() -> object:
    SERVER._stop()
    assert not _server_running()
    yield None


def test_a_threaded_driver_starts_the_server_before_it_lists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_fork_server: object
) -> None:
    corpus = esc50_corpus(tmp_path / "esc", [("wav", 16000, 1)] * 3, seconds=0.3)
    monkeypatch.setattr(threading, "active_count", lambda: 2)  # a notebook's driver
    monkeypatch.setattr(processes, "cuda_in_use", lambda: False)
    seen: list[bool] = []
    listing = pipeline.open_corpus

    def listed(*args: object, **kwargs: object) -> object:
        seen.append(_server_running())
        return listing(*args, **kwargs)

    monkeypatch.setattr(pipeline, "open_corpus", listed)
    recipe = build_recipe({"source": str(corpus), "duration": 0.3})
    index = pipeline.compile_corpus(recipe, tmp_path / "out", workers=2, progress=False)
    assert index.num_samples == 3
    assert seen == [True]


@pytest.mark.parametrize(
    ("source", "workers", "dask", "threads", "started"),
    [
        ("/data/esc", 2, None, 1, False),  # forked workers: nothing to start
        ("/data/esc", 2, None, 2, True),
        ("s3://bucket/esc", 2, None, 1, True),  # its filesystem runs a thread by then
        ("memory://bucket/esc", 2, None, 1, False),  # a synchronous filesystem: forked
        ("s3://bucket/esc", 1, None, 1, False),  # compiled in this process
        ("s3://bucket/esc", 2, "local:2", 1, False),  # Dask starts its own workers
    ],
)
def test_which_compiles_start_a_server(
    monkeypatch: pytest.MonkeyPatch,
    source: str,
    workers: int,
    dask: str | None,
    threads: int,
    started: bool,
) -> None:
    pytest.importorskip("s3fs")
    monkeypatch.setattr(threading, "active_count", lambda: threads)
    monkeypatch.setattr(processes, "cuda_in_use", lambda: False)
    monkeypatch.setattr(processes, "mkl_on_another_path", lambda: False)
    calls: list[None] = []  # the decision alone: the tests around start a real server
    monkeypatch.setattr(multiprocessing.forkserver, "ensure_running", lambda: calls.append(None))
    assert processes.start_fork_server(source, workers, dask) is started
    assert len(calls) == int(started)


def test_the_command_line_starts_the_server_before_loading_torch(tmp_path: Path) -> None:
    corpus = esc50_corpus(tmp_path / "esc", [("wav", 16000, 1)] * 3, seconds=0.3)
    # a driver with a thread running: its workers will come from the fork server
    script = f"""
import json, sys, threading
from dlop.compiler.run import processes
calls = []
real = processes.start_fork_server
def start(*args):
    started = real(*args)
    calls.append({{"torch": "torch" in sys.modules, "started": started}})
    return started
processes.start_fork_server = start
threading.Thread(target=threading.Event().wait, daemon=True).start()
from dlop.tools.compile_cli import main
code = main([{str(corpus)!r}, "-o", {str(tmp_path / "out")!r}, "--workers", "2",
             "--duration", "0.3", "-q"])
print(json.dumps({{"code": code, "calls": calls}}))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["code"] == 0
    assert result["calls"][0] == {"torch": False, "started": True}


def test_the_server_ignores_ctrl_c_from_its_start(
    monkeypatch: pytest.MonkeyPatch, no_fork_server: object
) -> None:
    # A Ctrl-C while the driver lists reaches its whole process group: a server still
    # importing must not die of it (it ignores SIGINT itself only after its imports).
    monkeypatch.setattr(threading, "active_count", lambda: 2)
    assert processes.start_fork_server("/data/esc", 2, None)
    status = Path(f"/proc/{SERVER._forkserver_pid}/status").read_text()
    ignored = int(
        next(v for k, v in (line.split(":") for line in status.splitlines()) if k == "SigIgn"), 16
    )
    assert ignored & (1 << (signal.SIGINT - 1))
    assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN  # the driver's own is back


def test_a_handler_set_outside_python_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # getsignal gives None for a handler a C library installed: it could not be put back
    monkeypatch.setattr(threading, "active_count", lambda: 2)
    monkeypatch.setattr(multiprocessing.forkserver, "ensure_running", lambda: None)
    monkeypatch.setattr(signal, "getsignal", lambda number: None)
    set_to: list[object] = []
    monkeypatch.setattr(signal, "signal", lambda number, handler: set_to.append(handler))
    assert processes.start_fork_server("/data/esc", 2, None)
    assert set_to == []


@pytest.mark.parametrize(("mode", "method"), [("COMPATIBLE", "fork"), ("AVX2", "forkserver")])
def test_workers_fork_only_where_they_can_take_mkl_s_path(
    monkeypatch: pytest.MonkeyPatch, mode: str, method: str
) -> None:
    from dlop.compiler.audio import numerics

    monkeypatch.setattr(threading, "active_count", lambda: 1)
    monkeypatch.setattr(processes, "cuda_in_use", lambda: False)
    monkeypatch.setattr(numerics, "prefer", lambda: None)
    monkeypatch.setattr(numerics, "mkl_mode", lambda: mode)
    assert processes.worker_context().get_start_method() == method


def test_a_script_that_ran_mkl_first_still_compiles_on_workers(tmp_path: Path) -> None:
    """A matrix product before the compile leaves this process's MKL on its default path,
    which a forked worker would inherit and refuse; workers start fresh instead."""
    corpus = esc50_corpus(tmp_path / "esc", [("wav", 16000, 1)] * 3, seconds=0.3)
    script = f"""
import torch
torch.randn(64, 64) @ torch.randn(64, 64)
from dlop.compiler import build_recipe, compile_corpus
recipe = build_recipe({{"source": {str(corpus)!r}, "duration": 0.3}})
index = compile_corpus(recipe, {str(tmp_path / "out")!r}, workers=2, progress=False)
print(index.num_samples)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "3"

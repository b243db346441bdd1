"""The Dask engine on a LocalCluster of 2 worker processes: the archive is byte-identical to
the local compile's, whatever order the units finish in, and when a worker is killed
in the middle of a unit."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from dlop.compiler.faults import KILL_WORKER as TEST_KILL_WORKER
from dlop.compiler.faults import UNIT_DELAY as TEST_UNIT_DELAY
from dlop.tools.compile_cli import main

from .fixtures import dask_cluster, esc50_corpus

pytest.importorskip("distributed")

EPOCH = "1700000000"


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], dict[str, bytes]]:
    """(compile arguments without -o, the local compile's archive): 4 units of 16 clips."""
    root = tmp_path_factory.mktemp("dask")
    corpus = esc50_corpus(root / "corpus", [("wav", 16000, 1)] * 60, seconds=0.25)
    (corpus / "audio" / "3-1002-A-2.wav").write_bytes(b"")  # skipped: errors.jsonl too
    args = [str(corpus), "--duration", "0.5", "--shard-bytes", "40KB", "--unit-inputs", "16", "-q"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SOURCE_DATE_EPOCH", EPOCH)
        assert main([*args, "--workers", "1", "-o", str(root / "local")]) == 0
    whole = files(root / "local")
    assert "errors.jsonl" in whole and len([n for n in whole if n.startswith("unit-000003")])
    return args, whole


@pytest.mark.slow
def test_dask_archive_is_the_local_one_in_any_unit_order(
    clips: tuple[list[str], dict[str, bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args, whole = clips
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    assert main([*args, "--dask", "local:2", "-o", str(tmp_path / "a")]) == 0
    assert files(tmp_path / "a") == whole
    # units 0 and 1 start late: 2 and 3 finish first
    monkeypatch.setenv(TEST_UNIT_DELAY, "0:1.5,1:1")
    assert main([*args, "--dask", "local:2", "-o", str(tmp_path / "b")]) == 0
    assert files(tmp_path / "b") == whole


@pytest.mark.slow
def test_a_worker_killed_mid_unit_costs_only_that_unit(
    clips: tuple[list[str], dict[str, bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args, whole = clips
    marker = tmp_path / "killed"
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    monkeypatch.setenv(TEST_KILL_WORKER, f"1:9:{marker}")  # unit 1, after its 9th input
    assert main([*args, "--dask", "local:2", "-o", str(tmp_path / "out")]) == 0
    assert marker.exists()  # a worker did die there
    assert files(tmp_path / "out") == whole


@pytest.mark.slow
def test_task_keys_differ_between_compiles_of_one_recipe(
    clips: tuple[list[str], dict[str, bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduler reuses a task by its key across clients: two compiles of the same recipe
    into different outputs (or the same one, again) must not share a key, or one would count
    a unit the other wrote elsewhere."""
    import distributed

    args, whole = clips
    keys: dict[str, list[str]] = {}
    submit = distributed.Client.submit

    def recording(self: distributed.Client, *a: object, **kw: object) -> object:
        keys.setdefault(current, []).append(str(kw["key"]))
        return submit(self, *a, **kw)

    monkeypatch.setattr(distributed.Client, "submit", recording)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    with dask_cluster() as address:  # one scheduler for all three, as a shared cluster is
        for current in ("a", "b", "b2"):
            out = tmp_path / current[0]
            extra = ["--overwrite"] if current == "b2" else []
            assert main([*args, "--dask", address, "-o", str(out), *extra]) == 0
            assert files(out) == whole
    assert all(len(k) == 4 for k in keys.values()), keys
    assert not set(keys["a"]) & set(keys["b"]) and not set(keys["b"]) & set(keys["b2"]), keys


@pytest.mark.slow
def test_units_in_flight_follow_workers_that_join(
    clips: tuple[list[str], dict[str, bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client reads the cluster's workers before each submit: as if two more workers
    joined after it connected, it keeps more units in flight than one worker's share."""
    import distributed

    args, _ = clips
    asked, flying, most = [0], [0], [0]
    submit, result = distributed.Client.submit, distributed.Future.result

    def nthreads(self: distributed.Client, *a: object, **kw: object) -> dict[str, int]:
        asked[0] += 1
        return {"tcp://a": 1} if asked[0] == 1 else {"tcp://a": 1, "tcp://b": 1, "tcp://c": 1}

    def counting(self: distributed.Client, *a: object, **kw: object) -> object:
        flying[0] += 1
        most[0] = max(most[0], flying[0])
        return submit(self, *a, **kw)

    def done(self: distributed.Future, *a: object, **kw: object) -> object:
        flying[0] -= 1
        return result(self, *a, **kw)

    monkeypatch.setattr(distributed.Client, "nthreads", nthreads)
    monkeypatch.setattr(distributed.Client, "submit", counting)
    monkeypatch.setattr(distributed.Future, "result", done)
    out = tmp_path / "out"
    # 15 units of 4 clips, on one real worker
    assert main([*args, "--unit-inputs", "4", "--dask", "local:1", "-o", str(out)]) == 0
    assert most[0] > 3, most  # one worker's share is 3 (UNITS_PER_WORKER + 1)


def test_a_bad_dask_address_is_a_clear_error(
    clips: tuple[list[str], dict[str, bytes]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args, _ = clips
    assert main([*args, "--dask", "local:zero", "-o", str(tmp_path / "out")]) == 1
    assert "local:N" in capsys.readouterr().err


_INTERRUPTED = """
import os, signal, sys, threading
from dlop.tools.compile_cli import main
threading.Timer(float(sys.argv[3]), os.kill, (os.getpid(), signal.SIGINT)).start()
sys.exit(main([sys.argv[1], "-o", sys.argv[2], "-q", "--dask", "local:1"]))
"""


def test_ctrl_c_while_the_cluster_starts_ends_cleanly(
    clips: tuple[list[str], dict[str, bytes]], tmp_path: Path
) -> None:
    import subprocess
    import sys

    args, _ = clips
    for delay in ("0.2", "1.0"):  # early in the cluster's start, and later
        out = tmp_path / f"o{delay}"
        proc = subprocess.run(
            [sys.executable, "-c", _INTERRUPTED, args[0], str(out), delay],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 130, proc.stderr
        assert "Traceback" not in proc.stderr and "AssertionError" not in proc.stderr


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_local_cluster_takes_a_free_dashboard_port_and_names_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another cluster's dashboard on 8787 (Dask's default port) costs a local compile's
    cluster nothing, not even a warning (the suite runs with warnings as errors); on a
    terminal the compile prints where its dashboard is."""
    import socket

    from dlop.compiler.run.dask_engine import dask_client

    held = socket.socket()
    try:
        held.bind(("127.0.0.1", 8787))
        held.listen()
    except OSError:  # taken already: by another process, which holds it as well
        pass
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    try:
        with dask_client("local:1", True) as client:
            link = client.dashboard_link
            assert client.submit(sum, [1, 2]).result() == 3
    finally:
        held.close()
    assert f"Dask dashboard: {link}" in terminal.getvalue()
    assert link.startswith("http://127.0.0.1:") and ":8787/" not in link

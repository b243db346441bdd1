"""kill -9 at chosen moments, then --resume: the archive is byte-identical to an uninterrupted one.

The compile runs as a subprocess and kills itself at an exact moment through the
test-only DLOP_TEST_KILL_AT hook (start, input:N, shard:N, unit:N, index, tidy: before
any shard, inside the first or a later shard, right after a shard, right after a unit's
commit record, before the index, after the index but before the commit records and the
journal are removed, and once some of the records are removed); the resume runs in-process. Corpora: ESC-50 style clips (one sample per input), dense video
clips (several samples per input, cut from one file) and image tiles (many
samples per input), each with a tiny --shard-bytes so there are several shards, and units of 2 to 4
inputs so there are several units.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dlop.compiler.faults import KILL_AT as TEST_KILL_AT
from dlop.compiler.faults import SIGNAL as TEST_SIGNAL
from dlop.compiler.output.commit import COMMIT_PREFIX
from dlop.compiler.output.guard import LOCK
from dlop.compiler.output.journal import JOURNAL
from dlop.formats import ArchiveReader, ArchiveWriter, Field
from dlop.tools.compile_cli import main

from .fixtures import esc50_corpus, write_audio
from .media import write_image, write_video
from .signals import make_signal

EPOCH = "1700000000"


def _clips(root: Path) -> list[str]:
    esc50_corpus(root, [("wav", 16000, 1)] * 7, seconds=0.5)
    (root / "audio" / "3-1002-A-2.wav").write_bytes(b"")  # one skipped input: errors.jsonl too
    return [str(root), "--duration", "1", "--shard-bytes", "20KB", "--unit-inputs", "3"]


def _segments(root: Path) -> list[str]:
    for n in range(6):
        write_video(root / ("a" if n % 2 else "b") / f"v{n}.mp4", frames=30)
    (root / "a" / "v3x.mp4").write_bytes(b"")  # skipped, between two good videos
    # 3 clips of 4 frames (37 KB each) per video: a shard fills in the middle of a video
    return [
        str(root),
        "--clip",
        "dense",
        "--clips",
        "3",
        "--clip-frames",
        "4",
        *("--shard-bytes", "150KB"),
        *("--unit-inputs", "4"),
    ]


def _tiles(root: Path) -> list[str]:
    rng = np.random.default_rng(0)
    for n in range(6):
        write_image(root / "images" / f"im{n}.png", rng.integers(0, 256, (64, 64, 3), np.uint8))
        write_image(root / "Maps1" / f"im{n}.png", rng.integers(0, 6, (64, 64), np.uint8))
    (root / "images" / "im9.png").write_bytes(b"")  # skipped
    # 16 tiles (about 17 KB) per image: a shard fills in the middle of an image
    return [str(root), "--tile", "16", "--shard-bytes", "25KB", "--unit-inputs", "2"]


CORPORA = {"clips": _clips, "segments": _segments, "tiles": _tiles}
# The input after which each corpus is inside its second shard, not at its end: the
# first shard closes with input 2 in all three; input 3 of clips and segments is the
# skipped one, so their second shard is open from input 4.
INSIDE_SECOND_SHARD = {"clips": 4, "segments": 4, "tiles": 3}


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


@pytest.fixture(scope="module", params=sorted(CORPORA))
def corpus(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[list[str], dict[str, bytes]]]:
    """(compile arguments without -o, every file of the uninterrupted archive)."""
    root = tmp_path_factory.mktemp(request.param)
    args = [*CORPORA[request.param](root / "corpus"), "--workers", "1", "-q"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SOURCE_DATE_EPOCH", EPOCH)
        assert main([*args, "-o", str(root / "whole")]) == 0
    whole = files(root / "whole")
    assert len([n for n in whole if n.endswith(".dlop")]) >= 3 and "errors.jsonl" in whole
    assert JOURNAL not in whole and LOCK not in whole
    yield args, whole


def compile_until(args: list[str], out: Path, moment: str, sig: str = "KILL") -> subprocess.Popen:
    env = {**os.environ, "SOURCE_DATE_EPOCH": EPOCH, TEST_KILL_AT: moment, TEST_SIGNAL: sig}
    cmd = [sys.executable, "-m", "dlop.tools.compile_cli", *args, "-o", str(out)]
    return subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)


def committed(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith(COMMIT_PREFIX))


@pytest.mark.slow
@pytest.mark.parametrize(
    "moment",
    [
        "start",
        "input:1",
        "inside-shard:2",
        "shard:2",
        "unit:1",
        "unit:2",
        "index",
        "tidy",
        "tidying",
    ],
)
def test_kill_9_then_resume_is_byte_identical(
    corpus: tuple[list[str], dict[str, bytes]],
    moment: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    args, whole = corpus
    out = tmp_path / "out"
    if moment == "inside-shard:2":
        moment = f"input:{INSIDE_SECOND_SHARD[request.node.callspec.params['corpus']]}"
    proc = compile_until(args, out, moment)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err.decode()
    assert (out / "index.json").exists() == (moment in ("tidy", "tidying"))
    assert json.loads((out / JOURNAL).read_text())["unit_inputs"]  # exists from the start
    if moment in ("start", "input:1"):  # before the first unit's commit
        assert committed(out) == []
    if request.node.callspec.params["moment"] == "inside-shard:2":
        # a shard is open in the staging folder, holding what followed the last one
        assert any(p.name.endswith(".spool") for p in (out / ".dlop-staging").rglob("*"))
    if moment.startswith("unit:"):
        assert len(committed(out)) == int(moment[5:])
    if moment in ("index", "tidy"):
        # every unit committed; the index not yet written, or written and kept as it is
        assert len(committed(out)) == len(json.loads(whole["index.json"])["units"]["shards"])
    if moment == "tidying":  # killed while deleting the commit records: some are gone
        assert 0 < len(committed(out)) < len(json.loads(whole["index.json"])["units"]["shards"])
    if moment == "index":
        (out / ".index.json.tmp").write_bytes(b'{"half": ')  # as if killed inside the write
    kept = None
    if moment in ("tidy", "tidying"):
        archive = [p for p in out.iterdir() if p.name.endswith(".dlop") or p.name == "index.json"]
        kept = {p.name: p.stat().st_ino for p in archive}
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    assert main([*args, "-o", str(out), "--resume"]) == 0
    assert files(out) == whole
    if kept is not None:  # the index and its shards are kept, not written again
        assert {n: (out / n).stat().st_ino for n in kept} == kept


@pytest.mark.slow
@pytest.mark.parametrize("corpus", ["tiles"], indirect=True)
def test_a_second_compile_into_the_same_out_is_refused(
    corpus: tuple[list[str], dict[str, bytes]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args, whole = corpus
    out = tmp_path / "out"
    proc = compile_until(args, out, "shard:1", sig="STOP")  # holds the lock, stopped
    try:
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        before = files(out)
        for extra in ([], ["--overwrite"], ["--resume"]):
            assert main([*args, "-o", str(out), *extra]) == 1
            err = capsys.readouterr().err
            assert f"another dlop-compile (pid {proc.pid} on " in err, err
            assert files(out) == before  # the running compile's files are untouched
    finally:
        proc.kill()
        proc.wait()
    # the killed holder's lock file is left behind but blocks nothing
    assert (out / LOCK).exists()
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    assert main([*args, "-o", str(out), "--resume"]) == 0
    assert files(out) == whole


def test_shards_close_only_between_groups(tmp_path: Path) -> None:
    fields = [Field("x", "u8", (None,))]
    closed: list[int] = []
    w = ArchiveWriter(
        tmp_path, fields, shard_bytes=10, on_shard=lambda s: closed.append(s.num_samples)
    )
    w.write_group([{"x": np.zeros(6, np.uint8)}] * 3)  # 18 bytes in one group: one shard
    w.write_group([{"x": np.zeros(4, np.uint8)}])
    w.write_group([{"x": np.zeros(4, np.uint8)}] * 2)
    w.write({"x": np.zeros(20, np.uint8)})
    index = w.close()
    assert closed == [3, 3, 1] and [s.num_samples for s in index.shards] == [3, 3, 1]
    with ArchiveReader(tmp_path) as r:
        assert [len(r.get("x", i)) for i in range(r.num_samples)] == [6, 6, 6, 4, 4, 4, 20]


def _processes_naming(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue  # gone, or not ours to read
            if text.encode() in cmdline:
                found.append(int(entry.name))
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux's")
@pytest.mark.parametrize("corpus", ["clips"], indirect=True)
def test_workers_die_with_a_killed_driver(
    corpus: tuple[list[str], dict[str, bytes]], tmp_path: Path
) -> None:
    args, _ = corpus
    args = [a if a != "1" or args[i - 1] != "--workers" else "2" for i, a in enumerate(args)]
    out = tmp_path / "out-orphans"
    proc = compile_until(args, out, "input:3")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err.decode()
    for _ in range(100):  # the kernel signals them at once; allow for scheduling
        left = _processes_naming(str(out))
        if not left:
            break
        subprocess.run(["sleep", "0.1"], check=True)
    assert not left, f"worker processes outlived the killed compile: {left}"


@pytest.mark.slow
@pytest.mark.parametrize("corpus", ["clips"], indirect=True)
def test_kill_9_of_a_dask_client_then_resume_is_byte_identical(
    corpus: tuple[list[str], dict[str, bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client of a --dask local:2 compile killed after its second unit's record; the
    same command with --resume on the local engine finishes the identical archive."""
    pytest.importorskip("distributed")
    args, whole = corpus
    out = tmp_path / "out"
    env = {**os.environ, "SOURCE_DATE_EPOCH": EPOCH, TEST_KILL_AT: "unit:2"}
    cmd = [sys.executable, "-m", "dlop.tools.compile_cli", *args, "--dask", "local:2"]
    # a session of its own: the cluster's processes go with the killed client
    proc = subprocess.Popen(
        [*cmd, "-o", str(out)], env=env, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL, err.decode()
    assert not (out / "index.json").exists() and (out / JOURNAL).exists()
    assert len(committed(out)) >= 2
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    assert main([*args, "-o", str(out), "--resume"]) == 0
    assert files(out) == whole


@pytest.mark.slow
def test_resume_redoes_a_unit_whose_clip_changed_after_its_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ESC-50 corpus's fingerprint is its CSV; each unit records its clips' sizes as it
    starts. A clip rewritten after its unit committed makes --resume compile that unit
    again (the archive is the one a fresh compile makes), not keep its stale samples."""
    corpus = esc50_corpus(tmp_path / "corpus", [("wav", 16000, 1)] * 4, seconds=0.25)
    args = [str(corpus), "--duration", "0.5", "--unit-inputs", "2", "--workers", "1", "-q"]
    out = tmp_path / "out"
    proc = compile_until(args, out, "unit:1")  # killed right after unit 0's commit record
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err.decode()
    assert committed(out) == [".dlop-unit-000000.json"]
    first = corpus / "audio" / "1-1000-A-0.wav"  # the first clip listed: unit 0's
    write_audio(first, make_signal(16000, 0.4, seed=9), 16000)  # other audio, another size
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    assert main([*args, "-o", str(out), "--resume"]) == 0
    assert main([*args, "-o", str(tmp_path / "fresh")]) == 0
    assert files(out) == files(tmp_path / "fresh")

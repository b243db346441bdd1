"""A compile from s3:// to s3:// against S3 over HTTP on loopback (moto's server, the ``s3``
fixture): the archive read back equals the local compile of the same corpus, passes
``dlop-inspect verify``, and is the same after a kill -9 and --resume; what OUT may be
and what a second compile writing the same prefix meets.

The archive read back differs from the local one only where it names the source:
``recipe.source`` and ``provenance.source.path`` in index.json, and each skipped
input's ``path`` in errors.jsonl (the input's URL instead of its local path).
Shards are byte for byte the same.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlop.compiler.corpus.records import Item
from dlop.compiler.errors import CompileError
from dlop.compiler.faults import KILL_AT as TEST_KILL_AT
from dlop.compiler.output.guard import check_apart
from dlop.compiler.output.journal import JOURNAL
from dlop.compiler.recipe import build_recipe
from dlop.compiler.run.items import CorpusShape
from dlop.compiler.run.pipeline import compile_corpus
from dlop.compiler.run.work import process_fetched
from dlop.tools import inspect_cli
from dlop.tools.compile_cli import main
from tests.objectstore import s3_server

from .fixtures import esc50_corpus
from .media import write_image

pytest.importorskip("s3fs")
pytest.importorskip("moto")

EPOCH = "1700000000"
ARGS = ["--duration", "0.5", "--shard-bytes", "20KB", "--unit-inputs", "4", "-q"]


def upload(fs: Any, local: Path, prefix: str) -> None:
    """Every file below ``local`` to ``prefix``, one explicit target per file (fs.put of a
    folder into an existing prefix would nest it one level deeper)."""
    for p in sorted(local.rglob("*")):
        if p.is_file():
            fs.put_file(str(p), f"{prefix}/{p.relative_to(local).as_posix()}")


def download(fs: Any, prefix: str) -> dict[str, bytes]:
    return {n[len(prefix) + 1 :]: fs.cat_file(n) for n in sorted(fs.find(prefix))}


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def same_archive(got: dict[str, bytes], whole: dict[str, bytes], source: str, local: str) -> None:
    """``got`` (compiled from ``source``) is ``whole`` (compiled from ``local``) but for the
    fields that name the source."""
    assert sorted(got) == sorted(whole)
    for name in whole:
        if name.endswith(".dlop"):
            assert got[name] == whole[name], name
    index, expected = json.loads(got["index.json"]), json.loads(whole["index.json"])
    assert index["recipe"].pop("source") == source
    assert index["provenance"]["source"].pop("path") == source
    expected["recipe"].pop("source")
    expected["provenance"]["source"].pop("path")
    assert index == expected
    if "errors.jsonl" in whole:
        assert got["errors.jsonl"] == whole["errors.jsonl"].replace(local.encode(), source.encode())


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """(an ESC-50 corpus of 10 clips, one empty, in 3 units; its local compile's files)."""
    root = tmp_path_factory.mktemp("s3clips")
    corpus = esc50_corpus(root / "corpus", [("wav", 16000, 1)] * 10, seconds=0.25)
    (corpus / "audio" / "3-1002-A-2.wav").write_bytes(b"")  # skipped: errors.jsonl too
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SOURCE_DATE_EPOCH", EPOCH)
        assert main([str(corpus), *ARGS, "--workers", "1", "-o", str(root / "local")]) == 0
    whole = files(root / "local")
    assert "errors.jsonl" in whole and len([n for n in whole if n.endswith(".dlop")]) == 3
    return corpus, whole


@pytest.fixture
def in_s3(s3: Any, clips: tuple[Path, dict[str, bytes]]) -> Any:
    s3.make_bucket("corpus")
    s3.make_bucket("out")
    fs = s3.filesystem()
    upload(fs, clips[0], "corpus/esc")
    return fs


def test_s3_to_s3_is_the_local_archive_and_verifies(
    in_s3: Any,
    clips: tuple[Path, dict[str, bytes]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    corpus, whole = clips
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    assert main(["s3://corpus/esc", *ARGS, "--workers", "1", "-o", "s3://out/a"]) == 0
    assert not Path("s3:").exists()  # OUT went to the bucket, not to a local s3:/out/a
    same_archive(download(in_s3, "out/a"), whole, "s3://corpus/esc", str(corpus))
    assert inspect_cli.main(["verify", "-q", "s3://out/a"]) == 0
    assert "OK s3://out/a" in capsys.readouterr().out


def test_storage_options_reach_listing_inputs_and_out(
    s3: Any, in_s3: Any, clips: tuple[Path, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus, whole = clips
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    given = ["--storage-option", f"endpoint_url={s3.endpoint}"]
    assert main(["s3://corpus/esc", *ARGS, *given, "--workers", "1", "-o", "s3://out/b"]) == 0
    same_archive(download(in_s3, "out/b"), whole, "s3://corpus/esc", str(corpus))


def test_a_missing_object_is_a_recorded_bad_input(in_s3: Any) -> None:
    recipe = build_recipe({"source": "s3://corpus/esc", "duration": 0.5})
    there = "s3://corpus/esc/audio/1-1000-A-0.wav"
    items = [Item("gone", path="s3://corpus/esc/audio/gone.wav"), Item("there", path=there)]
    outcomes = process_fetched(items, recipe, CorpusShape(False, False, {}), None, {})
    assert outcomes[0].reason is not None and "gone.wav: no such object" in outcomes[0].reason
    assert outcomes[1].reason is None and len(outcomes[1].samples) == 1
    assert all(it.fetched is None and it.error is None for it in items)  # given items unchanged


def test_segmentation_images_and_masks_read_from_s3(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(0)
    corpus = tmp_path / "seg"
    for n in range(3):
        write_image(corpus / "images" / f"im{n}.png", rng.integers(0, 256, (32, 32, 3), np.uint8))
        write_image(corpus / "Maps1" / f"im{n}.png", rng.integers(0, 6, (32, 32), np.uint8))
    write_image(corpus / "Maps2" / "im1.png", rng.integers(0, 6, (32, 32), np.uint8))
    args = ["--tile", "16", "--workers", "1", "-q"]
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    assert main([str(corpus), *args, "-o", str(tmp_path / "local")]) == 0
    s3.make_bucket("seg")
    upload(s3.filesystem(), corpus, "seg/c")
    assert main(["s3://seg/c", *args, "-o", str(tmp_path / "remote")]) == 0  # to a local OUT
    same_archive(files(tmp_path / "remote"), files(tmp_path / "local"), "s3://seg/c", str(corpus))


def test_out_overlapping_the_source_prefix_is_refused_before_listing(
    in_s3: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    for out in ("s3://corpus/esc/archive", "s3://corpus", "s3://corpus/esc"):
        assert main(["s3://corpus/esc", *ARGS, "-o", out]) == 1
        assert "overlaps the corpus prefix s3://corpus/esc" in capsys.readouterr().err
    assert in_s3.find("corpus/esc/archive") == []
    # a manifest's folder may hold the archive, as for a local manifest, but not be it
    manifest = build_recipe({"source": "s3://corpus/m/a.jsonl", "layout": "manifest"})
    check_apart("s3://corpus/m/archive", manifest)
    with pytest.raises(CompileError, match=r"overlaps the corpus prefix s3://corpus/m/a\.jsonl"):
        check_apart("s3://corpus/m", manifest)


def test_a_local_out_is_apart_from_a_url_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Read as a local path, s3://b/c would be ./s3:/b/c, which this OUT lies in
    monkeypatch.chdir(tmp_path)
    check_apart(
        Path("s3:/bbb/c/out"),
        build_recipe({"source": "s3://bbb/c", "layout": "folder", "media": "audio"}),
    )
    check_apart("s3://bbb/out", build_recipe({"source": str(tmp_path), "layout": "folder"}))


def test_a_compile_whose_out_is_taken_over_stops_before_the_index(
    in_s3: Any, clips: tuple[Path, dict[str, bytes]]
) -> None:
    recipe = build_recipe({"source": "s3://corpus/esc", "duration": 0.5})
    taken = []

    def take_over(done: int) -> None:  # as a second compile with --overwrite would
        if not taken:
            in_s3.pipe_file(f"out/c/{JOURNAL}", json.dumps({"run": "another"}).encode())
            taken.append(done)

    with pytest.raises(CompileError, match="another compile took this output over"):
        compile_corpus(
            recipe, "s3://out/c", workers=1, progress=False, unit_inputs=4, on_progress=take_over
        )
    names = download(in_s3, "out/c")
    assert "index.json" not in names and len(taken) == 1
    # taken over during unit 0: the unit published neither its shard nor its record
    assert not [n for n in names if n.endswith(".dlop") or n.startswith(".dlop-unit-")]


@pytest.mark.slow
def test_kill_9_then_resume_of_an_s3_out_is_the_same_archive(
    s3: Any,
    in_s3: Any,
    clips: tuple[Path, dict[str, bytes]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    corpus, whole = clips
    args = ["s3://corpus/esc", *ARGS, "--workers", "2", "-o", "s3://out/k"]
    env = {**os.environ, **s3.environ, "SOURCE_DATE_EPOCH": EPOCH, TEST_KILL_AT: "unit:1"}
    proc = subprocess.run(
        [sys.executable, "-m", "dlop.tools.compile_cli", *args],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    left = download(in_s3, "out/k")
    assert JOURNAL in left and "index.json" not in left
    assert ".dlop-unit-000000.json" in left  # unit 0 committed, the others not
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    assert main([*args, "--resume"]) == 0
    same_archive(download(in_s3, "out/k"), whole, "s3://corpus/esc", str(corpus))


@pytest.mark.slow
def test_dask_from_s3_to_s3_is_the_local_archive(
    in_s3: Any, clips: tuple[Path, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("distributed")
    corpus, whole = clips
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    assert main(["s3://corpus/esc", *ARGS, "--dask", "local:2", "-o", "s3://out/d"]) == 0
    same_archive(download(in_s3, "out/d"), whole, "s3://corpus/esc", str(corpus))


def test_workers_take_the_compiles_environment_not_an_older_forkservers(
    tmp_path: Path, clips: tuple[Path, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a second thread alive, workers come from a forkserver, which is started once per
    process and keeps the environment of that moment. Credentials and endpoints set later
    (here: the S3 server's) must still reach the workers of a later compile."""
    corpus, whole = clips
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    hold = threading.Event()
    thread = threading.Thread(target=hold.wait, daemon=True)
    thread.start()
    try:
        assert main([str(corpus), *ARGS, "--workers", "2", "-o", str(tmp_path / "a")]) == 0
        with s3_server() as s3:
            s3.make_bucket("corpus")
            s3.make_bucket("out")
            fs = s3.filesystem()
            upload(fs, corpus, "corpus/esc")
            assert main(["s3://corpus/esc", *ARGS, "--workers", "2", "-o", "s3://out/e"]) == 0
            same_archive(download(fs, "out/e"), whole, "s3://corpus/esc", str(corpus))
    finally:
        hold.set()


@pytest.mark.parametrize(
    ("what", "fault"),
    [
        ("5-1004-A-1.wav", "drop"),
        ("5-1004-A-1.wav", "slowdown"),
        ("5-1004-A-1.wav", "truncate"),
        ("=/corpus", "drop"),
        ("=/corpus", "slowdown"),
    ],
)
def test_reads_of_the_corpus_survive_storage_faults(
    s3: Any,
    in_s3: Any,
    clips: tuple[Path, dict[str, bytes]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    what: str,
    fault: str,
) -> None:
    """The compile's input reads and its bucket listing (``=/corpus``) retry as the
    runtime's fetches do: a dropped connection, a 503 SlowDown or a truncated body, twice,
    and the archive is still the local compile's (no input lost to a passing fault)."""
    from tests.faultproxy import FaultProxy

    corpus, whole = clips
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    with FaultProxy(upstream=s3.endpoint) as proxy:
        proxy.fail(what, fault, times=2)
        given = ["--storage-option", f"endpoint_url={proxy.url}"]
        args = ["s3://corpus/esc", *ARGS, *given, "--workers", "1", "-o", str(tmp_path / "f")]
        assert main(args) == 0
        asked = proxy.gets["/corpus"] if what == "=/corpus" else proxy.count(what)
        assert asked >= 3  # two faults, then the good answer
    same_archive(files(tmp_path / "f"), whole, "s3://corpus/esc", str(corpus))

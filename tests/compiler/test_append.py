"""--append: an archive compiled from part of a corpus, then appended with the rest, holds
the same samples, byte for byte, as one compiled from the whole corpus; the earlier files
are never written again; kill -9 at any moment of an append then --append --resume equals
the uninterrupted append; a reader that opened the archive before reads it to its end;
what an append refuses, and what it says when there is nothing to add.

Corpus: ESC-50 style clips, a first part listed in the metadata CSV, then the whole,
with one skipped input in each part, several shards and several units per part.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlop.compiler.corpus.place import LocalPlace
from dlop.compiler.output.guard import BASE_COPY
from dlop.compiler.output.journal import JOURNAL
from dlop.formats import ArchiveReader, FormatError, read_index
from dlop.runtime import open_archive
from dlop.tools import inspect_cli
from dlop.tools.compile_cli import main

from .fixtures import esc50_corpus, esc50_row, write_esc50_csv
from .test_resume import committed, compile_until

EPOCH = "1700000000"
CLIPS = 12
FIRST = 5  # clips in the first part
EMPTY = ("3-1002-A-2.wav", "5-1009-A-0.wav")  # one skipped input in each part
ARGS = ["--duration", "0.5", "--shard-bytes", "20KB", "--unit-inputs", "2", "--workers", "1"]


def names(n: int) -> list[str]:
    return [f"{1 + k % 5}-{1000 + k}-A-{k % 3}.wav" for k in range(n)]


def list_first(corpus: Path, n: int) -> None:
    """The corpus's metadata lists its first n clips only."""
    write_esc50_csv(corpus, [esc50_row(name, k) for k, name in enumerate(names(n))])


def samples_by_key(out: Path) -> dict[str, dict[str, bytes]]:
    with ArchiveReader(out) as r:
        got: dict[str, dict[str, bytes]] = {}
        for i in range(len(r)):
            s = r.sample(i)
            got[str(s["key"])] = {
                k: (v.encode() if isinstance(v, str) else np.ascontiguousarray(v).tobytes())
                for k, v in s.items()
            }
        return got


def refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The error dlop-compile ends with (exit status 1), one line."""
    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("dlop-compile: error: ") and err.count("\n") == 1, err
    return err


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def grown(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The corpus (listing all clips), the archive of its first part ("part"), the append of
    the rest to a copy of it ("appended", with its files), and the whole corpus compiled at
    once ("whole")."""
    root = tmp_path_factory.mktemp("append")
    corpus = esc50_corpus(root / "corpus", [("wav", 16000, 1)] * CLIPS, seconds=0.25)
    for name in EMPTY:
        (corpus / "audio" / name).write_bytes(b"")
    args = [str(corpus), *ARGS, "-q"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SOURCE_DATE_EPOCH", EPOCH)
        assert main([*args, "-o", str(root / "whole")]) == 0
        list_first(corpus, FIRST)
        assert main([*args, "-o", str(root / "part")]) == 0
        write_esc50_csv(corpus, [esc50_row(n, k) for k, n in enumerate(names(CLIPS))])
        shutil.copytree(root / "part", root / "appended")
        assert main([*args, "--append", "-o", str(root / "appended")]) == 0
    return {
        "root": root,
        "args": args,
        "part": files(root / "part"),
        "appended": files(root / "appended"),
    }


def test_an_appended_archive_holds_the_whole_corpus_byte_for_byte(grown: dict[str, Any]) -> None:
    root = grown["root"]
    whole, appended = samples_by_key(root / "whole"), samples_by_key(root / "appended")
    assert len(whole) == CLIPS - len(EMPTY) and appended == whole
    index = read_index(root / "appended")
    first, second = index.generations
    assert (first.inputs, first.skipped) == (FIRST, 1)
    assert (second.inputs, second.skipped) == (CLIPS - FIRST, 1)
    assert index.units is None and index.skipped_count == 2
    # the first part's files are there as they were, the new ones under new names
    part = grown["part"]
    assert {n: grown["appended"][n] for n in part if n != "index.json"} == {
        n: b for n, b in part.items() if n != "index.json"
    }
    new = sorted(set(grown["appended"]) - set(part))
    assert "errors-0001.jsonl" in new and "inputs-0001.bin" in new
    assert all(n.startswith("unit-") for n in new if n.endswith(".dlop"))
    assert JOURNAL not in grown["appended"] and BASE_COPY not in grown["appended"]
    with ArchiveReader(root / "appended") as r:
        assert r.verify() == []
        skipped = [e["key"] for e in r.errors()]
    assert skipped == [f"audio/{n}" for n in EMPTY]


def test_an_older_reader_reads_every_sample_and_the_first_skipped_inputs(
    grown: dict[str, Any],
) -> None:
    """What a reader that predates generations finds: the shard list and the top-level
    skipped count, which is the first generation's (errors.jsonl as it was)."""
    index = json.loads(grown["appended"]["index.json"])
    assert "units" not in index and index["skipped"]["count"] == 1
    assert index["num_samples"] == sum(s["num_samples"] for s in index["shards"])
    assert grown["appended"]["errors.jsonl"] == grown["part"]["errors.jsonl"]


def test_nothing_to_append_writes_nothing(
    grown: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "again"
    shutil.copytree(grown["root"] / "appended", out)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert main([*grown["args"], "--append", "-o", str(out)]) == 0
    assert "nothing to append" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_an_append_checks_and_sizes_only_the_clips_it_adds(
    grown: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The clips the archive holds are listed (their rows and keys), never confined to the
    corpus nor asked their size: an append's listing grows with the corpus, and those are
    the costs of a clip that is read."""
    out = tmp_path / "grown"
    shutil.copytree(grown["root"] / "part", out)
    asked: dict[str, list[str]] = {"confine": [], "size_of": []}
    for name in asked:
        original = getattr(LocalPlace, name)

        def counted(
            self: LocalPlace, text: str, *more: Any, _f: Any = original, _n: str = name
        ) -> Any:
            asked[_n].append(os.path.basename(text))
            return _f(self, text, *more)

        monkeypatch.setattr(LocalPlace, name, counted)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    assert main([*grown["args"], "--append", "-o", str(out)]) == 0  # --workers 1: here
    added = names(CLIPS)[FIRST:]
    assert set(asked["confine"]) == set(added)  # (the rate check makes a few Items again)
    assert sorted(asked["size_of"]) == sorted(added)
    assert files(out) == grown["appended"]


@pytest.mark.slow
# killed at "tidy", once the index is in: test_an_append_killed_after_its_index_finishes...
@pytest.mark.parametrize("moment", ["start", "input:2", "unit:1", "index", "tidying"])
def test_kill_9_during_an_append_then_resume_is_the_uninterrupted_append(
    grown: dict[str, Any],
    moment: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "out"
    shutil.copytree(grown["root"] / "part", out)
    base = {p.name: p.stat().st_ino for p in out.iterdir()}
    proc = compile_until([*grown["args"], "--append"], out, moment)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err.decode()
    assert (out / JOURNAL).exists() and (out / BASE_COPY).exists()
    if moment.startswith("unit:"):
        assert len(committed(out)) == int(moment[5:])
    # the archive stays readable throughout: the first part's until the new index is in
    index = read_index(out)
    assert len(index.generations) == (2 if moment in ("tidy", "tidying") else 1)
    assert re.search(
        "interrupted compile or append",
        refused(capsys, [*grown["args"], "--append", "-o", str(out)]),
    )
    assert re.search("was an append", refused(capsys, [*grown["args"], "--resume", "-o", str(out)]))
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    assert main([*grown["args"], "--append", "--resume", "-o", str(out)]) == 0
    assert files(out) == grown["appended"]
    kept = {n: i for n, i in base.items() if n != "index.json"}
    assert {n: (out / n).stat().st_ino for n in kept} == kept  # never written again


def test_a_reader_that_opened_the_archive_reads_it_to_its_end(
    grown: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "live"
    shutil.copytree(grown["root"] / "part", out)
    reader, dataset = ArchiveReader(out), open_archive(out)
    before = [dataset[i] for i in range(len(dataset))]
    reader.sample(0)  # one shard mapped before the append, the others after it
    assert main([*grown["args"], "--append", "-o", str(out)]) == 0
    assert len(reader) == len(dataset) == len(before) == FIRST - 1
    for i in range(len(reader)):
        again = dataset[i]
        assert {k: bytes(np.asarray(v).tobytes()) for k, v in again.items()} == {
            k: bytes(np.asarray(v).tobytes()) for k, v in before[i].items()
        }
        assert reader.sample(i)["key"] == before[i]["key"]
    assert reader.verify() == []  # its own generation's files, as they were
    assert len(open_archive(out)) == CLIPS - len(EMPTY)


def test_what_an_append_refuses(
    grown: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args, root = grown["args"], grown["root"]
    out = tmp_path / "out"
    assert re.search(
        "no archive to append to", refused(capsys, [*args, "--append", "-o", str(out)])
    )
    out.mkdir()
    assert re.search(
        "no archive to append to", refused(capsys, [*args, "--append", "-o", str(out)])
    )
    shutil.rmtree(out)
    shutil.copytree(root / "part", out)
    listed = sorted(os.listdir(out))
    assert re.search(
        "--overwrite replaces it",
        refused(capsys, [*args, "--append", "--overwrite", "-o", str(out)]),
    )
    assert re.search(
        r"another recipe .*duration 0\.5 -> 1",
        refused(capsys, [*args, "--append", "--duration", "1", "-o", str(out)]),
    )
    no_append = refused(capsys, [*args, "--append", "--resume", "-o", str(out)])
    assert "nothing to resume" in no_append
    assert sorted(os.listdir(out)) == listed  # nothing written, nothing deleted


def test_an_archive_without_input_identities_is_not_appended_to(
    grown: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "old"
    shutil.copytree(grown["root"] / "part", out)
    index = json.loads((out / "index.json").read_text())
    del index["generations"]  # as a dlop that predates generations wrote it
    (out / "index.json").write_text(json.dumps(index))
    (out / "inputs-0000.bin").unlink()
    assert re.search(
        "records no input identities", refused(capsys, [*grown["args"], "--append", "-o", str(out)])
    )


def test_a_damaged_inputs_file_is_named(
    grown: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rot"
    shutil.copytree(grown["root"] / "appended", out)
    data = bytearray((out / "inputs-0001.bin").read_bytes())
    data[3] ^= 1
    (out / "inputs-0001.bin").write_bytes(bytes(data))
    assert re.search(
        r"inputs-0001\.bin: CRC-32 differs",
        refused(capsys, [*grown["args"], "--append", "-o", str(out)]),
    )
    with ArchiveReader(out) as r:
        assert [p.message for p in r.verify()] == ["CRC-32 differs from index.json's"]
    assert inspect_cli.main(["verify", "-q", str(out)]) != 0


def test_generations_that_do_not_add_up_are_refused(grown: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "bad"
    good = json.loads(grown["appended"]["index.json"])
    cases = {
        "shards": lambda ix: ix["generations"][1].__setitem__("shards", 1),
        "num_samples": lambda ix: ix["generations"][0].__setitem__("num_samples", 1),
        "skipped": lambda ix: ix["generations"][0].__setitem__("skipped", 0),
        "units": lambda ix: ix.__setitem__("units", ix["generations"][0]["units"]),
        "unit names": lambda ix: ix["generations"][1]["units"].__setitem__(
            "num_inputs", ix["generations"][1]["units"]["num_inputs"] + 2
        ),
        "inputs": lambda ix: ix["generations"][1]["inputs"].__setitem__("count", 1 << 30),
    }
    for what, damage in cases.items():
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(grown["root"] / "appended", out)
        index = json.loads(json.dumps(good))
        damage(index)
        (out / "index.json").write_text(json.dumps(index))
        with pytest.raises(FormatError, match=r"SPEC\.md §6") as e:
            read_index(out)
        assert "index.json" in str(e.value), what


def test_classes_may_grow_at_their_end_and_never_change(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A class list the append extends (new classes after the archive's) is taken; one that
    names a class index otherwise than the archive does is refused: its labels would mean
    another class."""
    corpus = esc50_corpus(tmp_path / "corpus", [("wav", 16000, 1)] * 6, seconds=0.25)
    rows = [esc50_row(n, k) for k, n in enumerate(names(6))]
    write_esc50_csv(corpus, rows[:2])  # classes 0 and 1
    args = [str(corpus), *ARGS, "-q"]
    out = tmp_path / "out"
    assert main([*args, "-o", str(out)]) == 0
    assert read_index(out).metadata["classes"] == ["class0", "class1"]
    write_esc50_csv(corpus, rows[:4])  # class 2 joins after them
    assert main([*args, "--append", "-o", str(out)]) == 0
    assert read_index(out).metadata["classes"] == ["class0", "class1", "class2"]
    for r in rows:
        r["category"] = {"class0": "class1", "class1": "class0"}.get(r["category"], r["category"])
    write_esc50_csv(corpus, rows)
    listed = sorted(os.listdir(out))
    assert re.search("classes differ", refused(capsys, [*args, "--append", "-o", str(out)]))
    assert sorted(os.listdir(out)) == listed


def test_an_append_to_object_storage_writes_what_a_local_one_does(
    grown: dict[str, Any], s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("s3fs")
    from .test_s3_compile import download, upload

    s3.make_bucket("out")
    fs = s3.filesystem()
    upload(fs, grown["root"] / "part", "out/grows")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    assert main([*grown["args"], "--append", "-o", "s3://out/grows"]) == 0
    assert download(fs, "out/grows") == grown["appended"]
    assert inspect_cli.main(["verify", "-q", "s3://out/grows"]) == 0


def killed_append(
    tmp_path: Path, listed: int, moment: str
) -> tuple[Path, list[dict[str, object]], list[str], Path]:
    """A corpus of 6 clips, its first 2 compiled into OUT, then an --append of its first
    ``listed`` killed at ``moment``: (corpus, its 6 metadata rows, arguments, OUT)."""
    corpus = esc50_corpus(tmp_path / "corpus", [("wav", 16000, 1)] * 6, seconds=0.25)
    rows = [esc50_row(n, k) for k, n in enumerate(names(6))]
    args = [str(corpus), *ARGS, "-q"]
    out = tmp_path / "out"
    write_esc50_csv(corpus, rows[:2])
    assert main([*args, "-o", str(out)]) == 0
    write_esc50_csv(corpus, rows[:listed])
    proc = compile_until([*args, "--append"], out, moment)
    assert proc.wait(timeout=120) == -signal.SIGKILL
    return corpus, rows, args, out


def test_an_append_killed_after_its_index_finishes_though_the_corpus_grew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed while tidying up after publishing its index, an append is done: its resume
    only tidies up, whatever the corpus lists by then; the next --append adds the rest."""
    corpus, rows, _, out = killed_append(tmp_path, 4, "tidy")
    write_esc50_csv(corpus, rows)  # two more clips listed since
    monkeypatch.chdir(tmp_path)  # SOURCE named otherwise: the same folder
    again = ["corpus/", *ARGS, "-q", "-o", str(out)]
    assert main([*again, "--append", "--resume"]) == 0
    assert not (out / JOURNAL).exists() and not (out / BASE_COPY).exists()
    assert [g.inputs for g in read_index(out).generations] == [2, 2]
    assert main([*again, "--append"]) == 0
    assert [g.inputs for g in read_index(out).generations] == [2, 2, 2]
    assert len(samples_by_key(out)) == 6


def test_a_corpus_read_from_elsewhere_or_a_generation_without_units_is_refused(
    grown: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    moved = tmp_path / "moved"
    shutil.copytree(Path(grown["args"][0]), moved)
    out = tmp_path / "out"
    shutil.copytree(grown["root"] / "part", out)
    err = refused(capsys, [str(moved), *ARGS, "-q", "--append", "-o", str(out)])
    assert "reads its corpus from" in err and "the archive's was read from" in err
    # a generation whose units are not recorded: its shards' names are not known
    assert main([*grown["args"], "--append", "-o", str(out)]) == 0
    index = json.loads((out / "index.json").read_text())
    del index["generations"][1]["units"]
    (out / "index.json").write_text(json.dumps(index))
    err = refused(capsys, [*grown["args"], "--append", "-o", str(out)])
    assert "generation 1 records no work units" in err


def test_an_interrupted_append_of_a_changed_corpus_is_told_to_list_it_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Never --overwrite alone as the way out of an interrupted append: it would drop every
    generation, not only the append."""
    corpus, rows, args, out = killed_append(tmp_path, 5, "unit:1")
    write_esc50_csv(corpus, rows)  # one more clip listed since the append began
    err = refused(capsys, [*args, "--append", "--resume", "-o", str(out)])
    assert "the corpus changed since the interrupted append" in err
    assert "list the corpus as it was when the append began" in err
    write_esc50_csv(corpus, rows[:5])
    assert main([*args, "--append", "--resume", "-o", str(out)]) == 0
    assert [g.inputs for g in read_index(out).generations] == [2, 3]


def keys(out: Path) -> list[str]:
    with ArchiveReader(out) as r:
        return [str(r.sample(i)["key"]) for i in range(len(r))]


def test_a_file_spelt_two_ways_is_one_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``./a.wav`` in the CSV named another input than ``a.wav``: an append compiled the
    clip a second time, and a listing naming both held it twice."""
    corpus = esc50_corpus(tmp_path / "c", [("wav", 16000, 1)] * 3, seconds=0.25)
    clips = names(3)
    out = tmp_path / "out"
    write_esc50_csv(corpus, [esc50_row(clips[0], 0), esc50_row(clips[1], 1)])
    assert main([str(corpus), *ARGS, "-q", "-o", str(out)]) == 0
    respelt = [f"./{clips[0]}", f"sub/../{clips[1]}", clips[2]]
    write_esc50_csv(corpus, [esc50_row(name, k) for k, name in enumerate(respelt)])
    assert main([str(corpus), *ARGS, "-q", "--append", "-o", str(out)]) == 0
    assert keys(out) == [f"audio/{name}" for name in clips]


def test_an_input_listed_twice_is_compiled_twice_and_appends_go_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A CSV row repeated was compiled twice without a word, and every append after it was
    refused (the two rows had one identity), a dead end a fresh compile led back to. Now
    the compile says so, each repeat is an input of its own (the identity counts it), and
    an append adds the new rows, a third listing of the same file included."""
    corpus = esc50_corpus(tmp_path / "c", [("wav", 16000, 1)] * 3, seconds=0.25)
    a, b, c = names(3)
    out = tmp_path / "out"
    rows = [esc50_row(a, 0), esc50_row(b, 1), esc50_row(a, 0)]
    write_esc50_csv(corpus, rows)
    capsys.readouterr()
    assert main([str(corpus), *ARGS, "-q", "-o", str(out)]) == 0
    assert "1 input of" in capsys.readouterr().err
    assert keys(out) == [f"audio/{a}", f"audio/{b}", f"audio/{a}"]
    write_esc50_csv(corpus, [*rows, esc50_row(c, 2), esc50_row(a, 0)])
    assert main([str(corpus), *ARGS, "-q", "--append", "-o", str(out)]) == 0
    assert keys(out) == [f"audio/{n}" for n in (a, b, a, c, a)]
    capsys.readouterr()
    assert main([str(corpus), *ARGS, "-q", "--append", "-o", str(out)]) == 0
    assert "nothing to append" in capsys.readouterr().err

"""OUT is never the corpus, --overwrite deletes only a dlop archive, --resume advice only when it helps."""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

import pytest

from dlop.compiler.errors import CompileError
from dlop.compiler.output import JOURNAL, LOCK, OutputLock
from dlop.formats import ArchiveWriter
from dlop.tools.compile_cli import main

from .fixtures import esc50_corpus, manifest_corpus


def tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return esc50_corpus(tmp_path / "corpus", [("wav", 16000, 1)] * 2, seconds=0.5)


def refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main([*args, "-q", "--workers", "1"]) == 1
    return capsys.readouterr().err


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_out_may_not_be_in_or_around_the_corpus(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], overwrite: list[str]
) -> None:
    before = tree(tmp_path)
    (tmp_path / "link").symlink_to(corpus)
    for out, said in (
        (corpus, "is the corpus folder"),
        (tmp_path / "link", "is the corpus folder"),
        (corpus / "audio", "lies inside the corpus folder"),
        (corpus / "new" / "archive", "lies inside the corpus folder"),
        (tmp_path, "contains the corpus folder"),
    ):
        err = refused([str(corpus), "-o", str(out), *overwrite], capsys)
        assert said in err and "outside the corpus" in err, err
        assert tree(tmp_path) == before  # nothing deleted, nothing written
    assert not (corpus / "new").exists()


def test_a_file_source_counts_as_its_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = manifest_corpus(tmp_path / "m")
    before = tree(tmp_path)
    for out, said in ((manifest.parent, "is the corpus folder"), (tmp_path, "contains the corpus")):
        err = refused([str(manifest), "-o", str(out), "--overwrite"], capsys)
        assert said in err, err
        assert tree(tmp_path) == before
    # the manifest reads only the files it lists: an archive beside it is fine
    assert main([str(manifest), "-o", str(manifest.parent / "out"), "-q", "--workers", "1"]) == 0


def test_overwrite_replaces_only_a_dlop_archive(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "photos"
    (other / "2019").mkdir(parents=True)
    (other / "2019" / "a.jpg").write_bytes(b"holiday")
    (other / "notes.txt").write_text("keep me")
    for extra in ([], ["--overwrite"]):
        err = refused([str(corpus), "-o", str(other), *extra], capsys)
        assert "not a dlop archive" in err and "nothing was deleted" in err, err
    assert tree(other) == {"2019/a.jpg": b"holiday", "notes.txt": b"keep me"}

    out = tmp_path / "archive"
    assert main([str(corpus), "-o", str(out), "-q"]) == 0
    (out / "README").write_text("mine")  # a file the archive did not write
    before = tree(out)
    err = refused([str(corpus), "-o", str(out), "--overwrite"], capsys)
    assert "README besides a dlop archive" in err and "nothing was deleted" in err
    assert tree(out) == before
    (out / "README").unlink()
    assert main([str(corpus), "-o", str(out), "-q", "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["index.json", "shard-00000.dlop"]


def test_overwrite_replaces_an_interrupted_compile(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "archive"
    out.mkdir()
    (out / JOURNAL).write_text("{}")
    (out / ".shard-00000.dlop.f0.spool").write_bytes(b"partial")
    err = refused([str(corpus), "-o", str(out)], capsys)
    assert "already holds an interrupted compile" in err
    assert main([str(corpus), "-o", str(out), "-q", "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["index.json", "shard-00000.dlop"]


@pytest.mark.parametrize(
    ("error", "advised"),
    [
        (PermissionError(13, "Permission denied"), False),
        (OSError(28, "No space left on device"), True),
        (KeyboardInterrupt(), True),
    ],
)
def test_resume_is_advised_only_when_it_can_continue(
    corpus: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    error: BaseException,
    advised: bool,
) -> None:
    def fail(self: ArchiveWriter, samples: object) -> None:
        raise error

    monkeypatch.setattr(ArchiveWriter, "write_group", fail)
    main([str(corpus), "-o", str(tmp_path / "out"), "-q", "--workers", "1"])
    assert ("run again with --resume" in capsys.readouterr().err) == advised
    assert (tmp_path / "out" / JOURNAL).exists()  # the journal exists from the start


# -- --resume and --overwrite touch only what a compile wrote --------------------------

SMALL_SHARDS = ["--shard-bytes", "4KiB", "-q", "--workers", "1"]  # one clip a shard


def interrupted(
    corpus: Path, out: Path, monkeypatch: pytest.MonkeyPatch, after_inputs: int = 2
) -> None:
    """A compile stopped by Ctrl-C while writing input after_inputs + 1 (one shard per input)."""
    calls = iter(range(1 << 30))
    real = ArchiveWriter.write_group

    def write_group(self: ArchiveWriter, samples: object) -> None:
        if next(calls) == after_inputs:
            raise KeyboardInterrupt
        real(self, samples)  # type: ignore[arg-type]

    with monkeypatch.context() as mp:
        mp.setattr(ArchiveWriter, "write_group", write_group)
        assert main([str(corpus), "-o", str(out), *SMALL_SHARDS]) == 130
    assert len(json.loads((out / JOURNAL).read_text())["shards"]) == after_inputs


@pytest.fixture
def clips(tmp_path: Path) -> Path:
    return esc50_corpus(tmp_path / "clips", [("wav", 16000, 1)] * 4, seconds=0.5)


def test_resume_deletes_only_what_a_compile_wrote(
    clips: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    whole = tmp_path / "whole"
    assert main([str(clips), "-o", str(whole), *SMALL_SHARDS]) == 0
    out = tmp_path / "out"
    interrupted(clips, out, monkeypatch)
    capsys.readouterr()
    (out / "NOTES.md").write_text("my notes")
    (out / "train.yaml").write_text("lr: 0.1")
    (out / "logs").mkdir()
    (out / ".shard-00002.dlop.f0.spool").write_bytes(b"partial")  # as a kill -9 leaves them
    (out / ".dlop-chunk-123-0").write_bytes(b"chunk")
    before = tree(out)
    err = refused([str(clips), "-o", str(out), "--resume", *SMALL_SHARDS], capsys)
    assert "NOTES.md, logs, train.yaml" in err and "nothing was deleted" in err, err
    assert err.count("\n") == 1, err
    assert tree(out) == before and (out / "logs").is_dir()
    for name in ("NOTES.md", "train.yaml", "logs"):
        (out / name).unlink() if name != "logs" else (out / name).rmdir()
    assert main([str(clips), "-o", str(out), "--resume", *SMALL_SHARDS]) == 0
    assert tree(out) == tree(whole)


def test_overwrite_needs_a_dlop_index(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "shard-00000.dlop").write_bytes(b"my own data")
    for index in (b'{"format": "something-else", "shards": []}', b"[" * 200_000, b"\xff\xfe"):
        (out / "index.json").write_bytes(index)
        before = tree(out)
        err = refused([str(corpus), "-o", str(out), "--overwrite"], capsys)
        assert "index.json" in err and "not a dlop archive" in err, err
        assert "nothing was deleted" in err and err.count("\n") == 1, err
        assert tree(out) == before


def _edit(obj: dict, how: str) -> object:
    shards = obj["shards"]
    if how == "no shards":
        del obj["shards"]
    elif how == "negative consumed":
        obj["consumed"] = -1
    elif how == "consumed past the inputs":
        obj["consumed"] = 99
    elif how == "consumed as text":
        obj["consumed"] = "2"
    elif how == "consumed as bool":
        obj["consumed"] = True
    elif how == "shards out of order":
        shards.reverse()
    elif how == "shard outside OUT":
        shards[0]["file"] = "../shard-00000.dlop"
    elif how == "negative num_samples":
        shards[1]["num_samples"] = -1
    elif how == "crc32 as float":
        shards[0]["crc32"] = 1.5
    elif how == "unknown shard key":
        shards[0]["extra"] = 1
    elif how == "shard missing a key":
        del shards[0]["bytes"]
    elif how == "shard not an object":
        shards[0] = "shard-00000.dlop"
    elif how == "shards an object":
        obj["shards"] = {"file": "shard-00000.dlop"}
    elif how == "skipped record not an object":
        obj["skipped"] = ["a.wav"]
    elif how == "not an object":
        return [obj]
    return obj


@pytest.mark.parametrize(
    ("how", "field"),
    [
        ("no shards", "shards"),
        ("negative consumed", "consumed"),
        ("consumed past the inputs", "consumed"),
        ("consumed as text", "consumed"),
        ("consumed as bool", "consumed"),
        ("shards out of order", "shards[0].file"),
        ("shard outside OUT", "shards[0].file"),
        ("negative num_samples", "shards[1].num_samples"),
        ("crc32 as float", "shards[0].crc32"),
        ("unknown shard key", "shards[0]"),
        ("shard missing a key", "shards[0]"),
        ("shard not an object", "shards[0]"),
        ("shards an object", "shards"),
        ("skipped record not an object", "skipped[0]"),
        ("not an object", "object"),
        ("nested 200000 deep", "nests"),
        ("not UTF-8", "UTF-8"),
    ],
)
def test_a_damaged_journal_is_a_clear_error(
    clips: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    how: str,
    field: str,
) -> None:
    out = tmp_path / "out"
    interrupted(clips, out, monkeypatch)
    capsys.readouterr()
    if how == "nested 200000 deep":
        text = b'{"shards": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    elif how == "not UTF-8":
        text = b'{"recipe_digest": "\xff"}'
    else:
        text = json.dumps(_edit(json.loads((out / JOURNAL).read_text()), how)).encode()
    (out / JOURNAL).write_bytes(text)
    before = tree(out)
    err = refused([str(clips), "-o", str(out), "--resume", *SMALL_SHARDS], capsys)
    assert JOURNAL in err and field in err and err.count("\n") == 1, err
    assert "--overwrite" in err, err
    assert tree(out) == before


def test_the_output_lock_has_one_holder_across_a_release(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B opens the lock file, A releases (unlinks it) and C takes a new one, then B locks:
    B holds a lock on a file no longer at the path and must not count as holding OUT."""
    first = OutputLock(tmp_path)
    taken: list[OutputLock] = []
    real = fcntl.flock

    def flock(fd: int, operation: int) -> None:
        if not taken and fd != first.fd:  # B, between its open and its flock
            first.release()
            taken.append(OutputLock(tmp_path))  # C
        real(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    with pytest.raises(CompileError, match="another dlop-compile"):
        OutputLock(tmp_path)  # B
    (third,) = taken
    third.release()
    monkeypatch.undo()
    OutputLock(tmp_path).release()  # free again


def test_a_lock_file_that_is_a_link_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").write_text("")
    (tmp_path / LOCK).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CompileError, match="symbolic link"):
        OutputLock(tmp_path)
    assert (tmp_path / LOCK).is_symlink()

"""OUT is never the corpus, --overwrite deletes only a dlop archive, --resume advice only when it helps."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlop.compiler.pipeline import JOURNAL
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

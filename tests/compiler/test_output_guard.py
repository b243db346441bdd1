"""OUT is never the corpus, --overwrite deletes only a dlop archive, --resume advice only when it helps."""

from __future__ import annotations

import fcntl
import json
import shutil
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from unittest.mock import Mock

import pytest

from dlop.compiler.errors import CompileError
from dlop.compiler.output.commit import UnitRecord, commit_name
from dlop.compiler.output.guard import LOCK, OutputLock, committed_units
from dlop.compiler.output.journal import JOURNAL, MAX_JOURNAL_BYTES, Journal, changed_options
from dlop.compiler.output.store import open_store
from dlop.compiler.run import driver
from dlop.formats import ArchiveWriter, ShardInfo, unit_shard_name
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
    assert sorted(p.name for p in out.iterdir()) == [
        "index.json",
        "inputs-0000.bin",
        "unit-000000-0000.dlop",
    ]


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
    assert sorted(p.name for p in out.iterdir()) == [
        "index.json",
        "inputs-0000.bin",
        "unit-000000-0000.dlop",
    ]


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
    err = capsys.readouterr().err
    assert ("run again with --resume" in err) == advised
    assert (tmp_path / "out" / JOURNAL).exists()  # the journal exists from the start
    if isinstance(error, OSError) and error.errno == 28:  # a full disk names where
        assert f"{tmp_path / 'out'}: No space left on device while compiling into" in err


# -- --resume and --overwrite touch only what a compile wrote --------------------------

SMALL_SHARDS = ["--shard-bytes", "4KiB", "-q", "--workers", "1"]  # one clip a shard


def interrupted(
    corpus: Path,
    out: Path,
    monkeypatch: pytest.MonkeyPatch,
    after_inputs: int = 2,
    extra: Sequence[str] = (),
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
        assert main([str(corpus), "-o", str(out), *SMALL_SHARDS, *extra]) == 130
    # one shard per input, each put into OUT as it closes
    assert len(list(out.glob("unit-*.dlop"))) == after_inputs


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


# -- damaged journals and commit records ------------------------------------------------

UNITS_OF_ONE = [*SMALL_SHARDS, "--unit-inputs", "1"]  # one clip a unit, one shard a unit
RECORD0, SHARD0, SHARD1 = ".dlop-unit-000000.json", "unit-000000-0000.dlop", "unit-000001-0000.dlop"


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(corpus, its whole archive, a compile stopped by Ctrl-C in input 3 of 5 with units 0
    and 1 committed): 5 clips, the fourth empty (skipped, so errors.jsonl is written)."""
    root = tmp_path_factory.mktemp("stopped")
    corpus = esc50_corpus(root / "corpus", [("wav", 16000, 1)] * 5, seconds=0.5)
    empty = sorted((corpus / "audio").iterdir())[3]
    empty.write_bytes(b"")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SOURCE_DATE_EPOCH", "1700000000")
        assert main([str(corpus), "-o", str(root / "whole"), *UNITS_OF_ONE]) == 0
        interrupted(corpus, root / "stopped", mp, extra=["--unit-inputs", "1"])
    assert (root / "whole" / "errors.jsonl").exists()
    assert sorted(p.name for p in (root / "stopped").glob(".dlop-unit-*")) == [
        RECORD0,
        ".dlop-unit-000001.json",
    ]
    return corpus, root / "whole", root / "stopped"


def witness(path: Path, elsewhere: Path) -> Path:
    """A hard link to ``path`` outside OUT: the same file while ``path`` is not replaced
    (and its inode cannot be reused by a replacement meanwhile)."""
    link = elsewhere / f"witness-{path.name}"
    link.hardlink_to(path)
    return link


def copy_of(folder: Path, to: Path) -> Path:
    shutil.copytree(folder, to, symlinks=True)
    return to


def _edit_journal(obj: dict, how: str) -> object:
    key, _, value = how.partition("=")
    if how == "not an object":
        return [obj]
    if not value:
        del obj[key]
    else:
        obj[key] = json.loads(value)
    return obj


@pytest.mark.parametrize(
    ("how", "field"),
    [
        ("unit_inputs", "'unit_inputs'"),
        ("unit_inputs=0", "'unit_inputs'"),
        ("unit_inputs=-1", "'unit_inputs'"),
        ('unit_inputs="1"', "'unit_inputs'"),
        ("unit_inputs=true", "'unit_inputs'"),
        ("unit_inputs=1.0", "'unit_inputs'"),
        ("unit_inputs=18446744073709551616", "'unit_inputs'"),  # past 2^64-1: no index holds it
        ("num_inputs", "'num_inputs'"),
        ("num_inputs=-5", "'num_inputs'"),
        ("num_inputs=[5]", "'num_inputs'"),
        ("num_inputs=18446744073709551616", "'num_inputs'"),
        ("recipe_digest", "'recipe_digest'"),
        ("recipe_digest=7", "'recipe_digest'"),
        ("fingerprint", "'fingerprint'"),
        ('fingerprint=""', "'fingerprint'"),
        ("not an object", "object"),
        ("nested 20000 deep", "nests"),
        ("not UTF-8", "UTF-8"),
        ("over its bound", str(MAX_JOURNAL_BYTES)),
    ],
)
def test_a_damaged_journal_is_a_clear_error(
    stopped: tuple[Path, Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    how: str,
    field: str,
) -> None:
    corpus, _, template = stopped
    out = copy_of(template, tmp_path / "out")
    if how == "nested 20000 deep":  # within the journal's bound
        text = b'{"unit_inputs": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    elif how == "not UTF-8":
        text = b'{"recipe_digest": "\xff"}'
    elif how == "over its bound":  # that of the index, which holds the same recipe
        text = b" " * MAX_JOURNAL_BYTES + (out / JOURNAL).read_bytes()
    else:
        text = json.dumps(_edit_journal(json.loads((out / JOURNAL).read_text()), how)).encode()
    (out / JOURNAL).write_bytes(text)
    before = tree(out)
    err = refused([str(corpus), "-o", str(out), "--resume", *UNITS_OF_ONE], capsys)
    assert JOURNAL in err and field in err and err.count("\n") == 1, err
    assert "damaged" in err and "--overwrite" in err, err
    assert tree(out) == before


@pytest.mark.parametrize(
    ("how", "said"),
    [
        ("num_inputs=4", "the corpus changed"),
        ('fingerprint="0123"', "the corpus changed"),
        ('recipe_digest="0123"', "different recipe"),
        ("--unit-inputs 2", "--unit-inputs 2, the interrupted compile used 1"),
    ],
)
def test_a_journal_of_another_compile_is_refused(
    stopped: tuple[Path, Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    how: str,
    said: str,
) -> None:
    corpus, _, template = stopped
    out = copy_of(template, tmp_path / "out")
    args = [*SMALL_SHARDS, "--unit-inputs", "1"]
    if how.startswith("--"):
        args[-1] = how.split()[1]
    else:
        text = json.dumps(_edit_journal(json.loads((out / JOURNAL).read_text()), how))
        (out / JOURNAL).write_text(text)
    before = tree(out)
    err = refused([str(corpus), "-o", str(out), "--resume", *args], capsys)
    assert said in err and err.count("\n") == 1, err
    assert tree(out) == before


def _damage_unit_0(out: Path, how: str) -> None:
    record = json.loads((out / RECORD0).read_text())
    shard = record["shards"][0]
    edits: dict[str, Callable[[], None]] = {
        "other recipe": lambda: record.update(recipe_digest="0" * 64),
        "other unit": lambda: record.update(unit=1),
        "first_input off": lambda: record.update(first_input=1),
        "num_inputs off": lambda: record.update(num_inputs=2),
        "another unit's shard": lambda: shard.update(file=SHARD1),
        "shard outside OUT": lambda: shard.update(file=f"../{SHARD0}"),
        "negative num_samples": lambda: shard.update(num_samples=-1),
        "bytes off by one": lambda: shard.update(bytes=shard["bytes"] + 1),
        "wrong crc32": lambda: shard.update(crc32=shard["crc32"] ^ 1),
        "crc32 as float": lambda: shard.update(crc32=1.5),
        "shards an object": lambda: record.update(shards=shard),
        "skipped record not an object": lambda: record.update(skipped=["a.wav"]),
        "more skipped than inputs": lambda: record.update(skipped=[{"path": "a"}] * 2),
    }
    text = None
    if how in edits:
        edits[how]()
        text = json.dumps(record).encode()
    elif how == "not JSON":
        text = b'{"unit": 0, '
    elif how == "not UTF-8":
        text = b'{"recipe_digest": "\xff"}'
    elif how == "nested 200000 deep":
        text = b'{"shards": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    elif how == "not an object":
        text = json.dumps([record]).encode()
    elif how == "shard missing":
        (out / SHARD0).unlink()
    elif how == "shard truncated":
        data = (out / SHARD0).read_bytes()
        (out / SHARD0).write_bytes(data[:-1])
    elif how == "shard changed, same size":
        data = bytearray((out / SHARD0).read_bytes())
        data[-1] ^= 0xFF
        (out / SHARD0).write_bytes(bytes(data))
    if text is not None:
        (out / RECORD0).write_bytes(text)


@pytest.mark.parametrize(
    "how",
    [
        "other recipe",
        "other unit",
        "first_input off",
        "num_inputs off",
        "another unit's shard",
        "shard outside OUT",
        "negative num_samples",
        "bytes off by one",
        "wrong crc32",
        "crc32 as float",
        "shards an object",
        "skipped record not an object",
        "more skipped than inputs",
        "not JSON",
        "not UTF-8",
        "nested 200000 deep",
        "not an object",
        "shard missing",
        "shard truncated",
        "shard changed, same size",
    ],
)
def test_a_damaged_commit_record_has_its_unit_redone(
    stopped: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    corpus, whole, template = stopped
    out = copy_of(template, tmp_path / "out")
    _damage_unit_0(out, how)
    # a record for a unit the corpus does not have counts for nothing, and goes
    (out / ".dlop-unit-000099.json").write_bytes((template / RECORD0).read_bytes())
    kept = witness(out / SHARD1, tmp_path)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    assert main([str(corpus), "-o", str(out), "--resume", *UNITS_OF_ONE]) == 0
    assert tree(out) == tree(whole)
    assert (out / SHARD1).samefile(kept)  # unit 1 was not compiled again


def stopped_after_index(corpus: Path, out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resumes a stopped compile in OUT up to its index, then stops it before it removes
    the commit records and the journal."""
    with monkeypatch.context() as mp:
        mp.setattr(driver, "tidy", Mock(side_effect=KeyboardInterrupt))
        assert main([str(corpus), "-o", str(out), "--resume", *UNITS_OF_ONE]) == 130
    assert (out / "index.json").exists() and (out / JOURNAL).exists() and (out / RECORD0).exists()


@pytest.mark.parametrize(
    "how", ["as left", "index differs", "errors.jsonl missing", "a record already removed"]
)
def test_resume_after_the_index_finishes_the_tidying_up(
    stopped: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    corpus, whole, template = stopped
    out = copy_of(template, tmp_path / "out")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    stopped_after_index(corpus, out, monkeypatch)
    index = out / "index.json"
    if how == "index differs":
        obj = json.loads(index.read_text())
        obj["shards"][0]["crc32"] ^= 1
        index.write_text(json.dumps(obj, indent=1) + "\n")
    elif how == "errors.jsonl missing":
        (out / "errors.jsonl").unlink()
    elif how == "a record already removed":  # stopped in the middle of the tidying up
        (out / RECORD0).unlink()
    kept = witness(index, tmp_path)
    assert main([str(corpus), "-o", str(out), "--resume", *UNITS_OF_ONE]) == 0
    assert tree(out) == tree(whole)
    # the index the records bear out stays as it was, as does one whose records were being
    # deleted (its shards all in place); any other is written again
    assert index.samefile(kept) == (how in ("as left", "a record already removed"))
    assert main([str(corpus), "-o", str(out), "--resume", *UNITS_OF_ONE]) == 1  # complete now


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


# -- a URL OUT ------------------------------------------------------------------------------


def test_a_url_store_gives_sizes_with_one_listing(s3: Any) -> None:
    store = open_store(f"{s3.make_bucket('sizes')}/out")
    assert store.sizes() == {}
    store.write("a.bin", b"12345")
    store.write("sub/b.bin", b"")
    assert store.sizes() == {"a.bin": 5, "sub/b.bin": 0}


def test_a_local_store_gives_regular_files_sizes(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"12345")
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.bin").symlink_to(tmp_path / "a.bin")
    assert open_store(tmp_path).sizes() == {"a.bin": 5}
    assert open_store(tmp_path / "missing").sizes() == {}


def test_resume_of_a_url_out_asks_no_request_per_shard(s3: Any) -> None:
    """committed_units checks every committed shard's size from one listing, not one
    metadata request (a HEAD) per shard."""
    store = open_store(f"{s3.make_bucket('heads')}/out")
    journal = Journal(store.url, "d" * 64, "f" * 64, 4, 8)
    shards = []
    for unit, j in ((0, 0), (0, 1), (1, 0)):
        name, data = unit_shard_name(unit, j), bytes(10 + unit + j)
        store.write(name, data)
        shards.append(ShardInfo(name, 1, len(data), zlib.crc32(data)))
    for unit, mine in ((0, shards[:2]), (1, shards[2:])):
        record = UnitRecord(unit, unit * 4, 4, tuple(mine))
        store.write(commit_name(unit), json.dumps(record.to_json(journal.digest)).encode())
    store.write(unit_shard_name(1, 0), b"other size")  # unit 1 is redone
    info = Mock(wraps=store.fs.info)  # type: ignore[attr-defined]
    store.fs.info = info  # type: ignore[attr-defined]
    assert sorted(committed_units(store, journal)) == [0]
    # (reading a commit record may ask its size: one request per unit, not per shard)
    assert [c for c in info.call_args_list if str(c.args[0]).endswith(".dlop")] == []


def test_resume_into_a_url_redoes_a_unit_whose_shard_changed_size(
    stopped: tuple[Path, Path, Path], s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus, whole, _ = stopped
    url = f"{s3.make_bucket('resume')}/out"
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    real, calls = ArchiveWriter.write_group, iter(range(3))

    def write_group(self: ArchiveWriter, samples: object) -> None:
        if next(calls, 2) == 2:
            raise KeyboardInterrupt  # Ctrl-C in the third input
        real(self, samples)  # type: ignore[arg-type]

    with monkeypatch.context() as mp:
        mp.setattr(ArchiveWriter, "write_group", write_group)
        assert main([str(corpus), "-o", url, *UNITS_OF_ONE]) == 130
    fs = s3.filesystem()
    path = url.removeprefix("s3://")
    assert fs.exists(f"{path}/{RECORD0}") and fs.exists(f"{path}/.dlop-unit-000001.json")
    fs.pipe_file(f"{path}/{SHARD0}", b"not the shard")  # same name, other size: redone
    assert main([str(corpus), "-o", url, "--resume", *UNITS_OF_ONE]) == 0
    got = {p.rsplit("/", 1)[1]: fs.cat_file(p) for p in fs.find(path)}
    assert got == tree(whole)


def test_reading_an_unfinished_output_says_whether_it_is_compiling(tmp_path: Path) -> None:
    from dlop.formats import FormatError, read_index

    with pytest.raises(FormatError, match=r"no index\.json: no such folder"):
        read_index(tmp_path / "missing")
    (tmp_path / "plain").mkdir()
    with pytest.raises(FormatError, match=r"no index\.json: not a dlop archive"):
        read_index(tmp_path / "plain")
    out = tmp_path / "out"
    out.mkdir()
    (out / JOURNAL).write_text("{}")
    lock = OutputLock(out)  # a compile running now, in this process
    try:
        with pytest.raises(FormatError, match=r"being compiled now \(pid \d+ on .+\)"):
            read_index(out)
    finally:
        lock.release()
    (out / LOCK).write_text("pid 1 on elsewhere\n")  # a killed compile's lock: held by none
    with pytest.raises(FormatError, match=r"did not finish .*again with --resume"):
        read_index(out)


def test_a_full_disk_names_out_to_library_callers_too(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dlop.compiler.recipe import build_recipe
    from dlop.compiler.run.pipeline import compile_corpus

    def full(self: ArchiveWriter, samples: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ArchiveWriter, "write_group", full)
    out = tmp_path / "out"
    recipe = build_recipe({"source": str(corpus), "layout": "esc50"})
    with pytest.raises(CompileError, match=rf"{out}: No space left on device while compiling"):
        compile_corpus(recipe, out, workers=1, progress=False)


def test_a_resume_with_another_option_names_only_what_differs(
    stopped: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus, _, template = stopped
    out = copy_of(template, tmp_path / "out")
    before = tree(out)
    err = refused(
        [str(corpus), "-o", str(out), "--resume", *UNITS_OF_ONE, "--n-mels", "64"], capsys
    )
    assert "--resume with a different recipe" in err
    # the one option that differs, dotted, and nothing said of the options that match
    said = err.split("options that differ: ")[1].split(")")[0]
    assert said.startswith("features.n_mels ") and said.endswith(" -> 64")
    assert ";" not in said and "none by name" not in err
    assert tree(out) == before


def test_options_that_differ_only_in_their_digest_say_so_once() -> None:
    same = {"features": {"n_mels": 128, "f_min": 0}, "sample_rate": 16000}
    assert changed_options(same, json.loads(json.dumps(same))) == [
        "none by name (the digest differs)"
    ]
    other = {"features": {"n_mels": 64, "f_min": 0}, "sample_rate": 16000, "decode": {"mono": 1}}
    with_decode = {**same, "decode": {"mono": 1}}
    assert changed_options(with_decode, other) == ["features.n_mels 128 -> 64"]

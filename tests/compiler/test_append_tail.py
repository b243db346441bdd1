"""An append lists the lines of ESC-50's CSV after the ones its archive listed, when the
CSV begins with the very bytes the archive's last generation records (SPEC.md §6.2,
``listing``), and lists the whole CSV otherwise. Either way the archive it writes is the
same, byte for byte: each case below appends twice, once as dlop does and once with the
tail listing turned off, and compares every file.

Whole listings: earlier rows changed, a new row naming an earlier clip (its repeat's
number counts the earlier ones), a new row whose class disagrees with the archive's,
a new class where the archive skipped inputs, a quote in the earlier rows, a CSV whose
last line had no end, a record the index holds that does not match the CSV.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dlop.compiler.corpus.layouts import esc50, manifest
from dlop.compiler.corpus.records import Corpus
from dlop.compiler.run import pipeline
from dlop.formats import FormatError, read_index
from dlop.tools import inspect_cli
from dlop.tools.compile_cli import main

from .fixtures import dask_cluster, esc50_corpus

EPOCH = "1700000000"
CLIPS = 10
ARGS = ["--duration", "0.5", "--unit-inputs", "3", "--workers", "1", "-q"]
HEADER = b"filename,fold,target,category,esc10,src_file,take\n"


def row(n: int, category: str | None = None, target: int | None = None, name: str = "") -> bytes:
    target = n % 3 if target is None else target
    name = name or f"{1 + n % 5}-{1000 + n}-A-{n % 3}.wav"
    return f"{name},{1 + n % 5},{target},{category or f'class{target}'},False,{n},A\n".encode()


def rows(ns: range | list[int]) -> bytes:
    return b"".join(row(n) for n in ns)


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tail")
    return esc50_corpus(root / "clips", [("wav", 16000, 1)] * CLIPS, seconds=0.25)


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def tail_listings(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each append from now on listed the new lines only (Corpus.after)."""
    tails: list[bool] = []
    listed = pipeline.list_for_append

    def spied(*args: Any) -> Corpus:
        corpus = listed(*args)
        tails.append(corpus.after is not None)
        return corpus

    monkeypatch.setattr(pipeline, "list_for_append", spied)
    return tails


def appended(
    clips: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    before: bytes,
    after: bytes,
    damage: Callable[[dict[str, Any]], None] | None = None,
    listing: str = "meta/esc50.csv",
    code: int = 0,
) -> tuple[bool, dict[str, bytes]]:
    """Compiles the corpus whose listing file (ESC-50's CSV, or a manifest: SOURCE) is
    ``before``, then appends to it with that file ``after``: whether the append listed the
    new lines only, and its archive's files, checked equal to those of the same append
    listing the whole file (or both refused, exiting ``code``)."""
    corpus = tmp_path / "corpus"
    shutil.copytree(clips, corpus)
    csv = corpus / listing
    csv.write_bytes(before)
    source = corpus if listing == "meta/esc50.csv" else csv
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    assert main([str(source), *ARGS, "-o", str(tmp_path / "base")]) == 0
    if damage is not None:
        index = json.loads((tmp_path / "base" / "index.json").read_text())
        damage(index)
        (tmp_path / "base" / "index.json").write_text(json.dumps(index))
    csv.write_bytes(after)
    tails = tail_listings(monkeypatch)
    results = []
    for tail in (True, False):
        out = tmp_path / f"grown-{tail}"
        shutil.copytree(tmp_path / "base", out)
        with monkeypatch.context() as m:
            if not tail:
                m.setattr(esc50, "_tail", lambda *a: None)
                m.setattr(manifest, "_tail", lambda *a: None)
            assert main([str(source), *ARGS, "--append", "-o", str(out)]) == code
        results.append(files(out))
    assert results[0] == results[1]
    assert tails[1] is False
    return tails[0], results[0]


def listing_of(got: dict[str, bytes], generation: int = -1) -> dict[str, Any] | None:
    return json.loads(got["index.json"])["generations"][generation].get("listing")


def test_an_append_lists_the_new_lines_only(
    clips: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    before, after = HEADER + rows(range(6)), HEADER + rows(range(CLIPS))
    tail, got = appended(clips, tmp_path, monkeypatch, before, after)
    assert tail
    assert listing_of(got, 0) == {
        "bytes": len(before),
        "sha256": hashlib.sha256(before).hexdigest(),
        "inputs": 6,
    }
    assert listing_of(got)["bytes"] == len(after) and listing_of(got)["inputs"] == CLIPS
    index = read_index(tmp_path / "grown-True")
    assert [g.inputs for g in index.generations] == [6, CLIPS - 6]
    assert index.metadata["classes"] == ["class0", "class1", "class2"]
    capsys.readouterr()
    assert inspect_cli.main(["info", str(tmp_path / "grown-True")]) == 0
    info = capsys.readouterr().out
    assert f"its listing file: {CLIPS} input(s) in {len(after)} bytes" in info
    assert inspect_cli.main(["verify", "-q", str(tmp_path / "grown-True")]) == 0


def test_a_new_class_after_the_archives_is_listed_from_the_new_lines(
    clips: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = HEADER + row(0) + row(1)  # classes 0 and 1
    tail, got = appended(clips, tmp_path, monkeypatch, before, before + row(2) + row(5))
    assert tail
    assert json.loads(got["index.json"])["metadata"]["classes"] == ["class0", "class1", "class2"]


def test_crlf_lines_and_a_byte_order_mark_are_listed_from_the_new_lines(
    clips: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crlf(data: bytes) -> bytes:
        return data.replace(b"\n", b"\r\n")

    before = b"\xef\xbb\xbf" + crlf(HEADER + rows(range(4)))
    tail, got = appended(clips, tmp_path, monkeypatch, before, before + crlf(rows(range(4, 9))))
    assert tail and listing_of(got)["inputs"] == 9


def test_nothing_new_lists_nothing_and_writes_nothing(
    clips: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    csv = HEADER + rows(range(4))
    capsys.readouterr()
    tail, got = appended(clips, tmp_path, monkeypatch, csv, csv)
    assert tail and "holds all 4 inputs" in capsys.readouterr().err
    assert got == files(tmp_path / "base")


@pytest.mark.parametrize(
    "case",
    [
        "an earlier row changed",
        "a new row names an earlier clip",
        "a new row's class disagrees with the archive's",
        "a new row's category is an earlier class's",
        "a new class where the archive skipped inputs",
        "a quote in the earlier rows",
        "the last line had no end",
        "a bad new row",
    ],
)
def test_the_whole_csv_is_listed_where_the_new_lines_alone_cannot_tell(
    case: str, clips: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before, new = HEADER + rows(range(5)), rows(range(5, 8))
    after = before + new
    if case == "an earlier row changed":
        after = HEADER + row(0) + row(1, name="x.wav") + rows(range(2, 8))
    elif case == "a new row names an earlier clip":
        after = before + new + row(2)
    elif case == "a new row's class disagrees with the archive's":
        after = before + row(5, category="other", target=2)
    elif case == "a new row's category is an earlier class's":
        after = before + row(5, category="class1", target=7)
    elif case == "a new class where the archive skipped inputs":
        before = HEADER + row(0) + row(1, name="missing.wav")
        after = before + row(2)
    elif case == "a quote in the earlier rows":
        before = HEADER + row(0) + row(1).replace(b",False,", b',"False",') + row(2)
        after = before + new
    elif case == "the last line had no end":
        before = before.rstrip(b"\n")
        after = before + b"\n" + new
    elif case == "a bad new row":
        after = before + row(5, target=99)
    tail, got = appended(clips, tmp_path, monkeypatch, before, after)
    assert not tail
    if case == "the last line had no end":
        assert listing_of(got, 0) is None and listing_of(got) is not None


@pytest.mark.parametrize(
    "damage",
    ["another sha256", "more bytes than the CSV", "fewer bytes", "fewer inputs"],
)
def test_a_listing_record_that_does_not_match_the_csv_lists_it_whole(
    damage: str, clips: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An index's record of its listing is checked against the CSV's bytes: one that does
    not match them (a CSV rewritten, a record altered) is not followed."""

    def altered(index: dict[str, Any]) -> None:
        listing = index["generations"][-1]["listing"]
        if damage == "another sha256":
            listing["sha256"] = "0" * 64
        elif damage == "more bytes than the CSV":
            listing["bytes"] += 10_000
        elif damage == "fewer bytes":
            listing["bytes"] -= len(row(4))
        else:
            listing["inputs"] -= 1  # more than the archive holds: test_a_malformed_...

    before = HEADER + rows(range(5))
    tail, _ = appended(clips, tmp_path, monkeypatch, before, before + rows(range(5, 8)), altered)
    assert not tail


@pytest.mark.parametrize(
    "listing",
    [
        {"bytes": -1, "sha256": "0" * 64, "inputs": 1},
        {"bytes": 10, "sha256": "0" * 63, "inputs": 1},
        {"bytes": 10, "sha256": "A" * 64, "inputs": 1},
        {"bytes": 10, "sha256": "0" * 64, "inputs": 6},  # more than the archive holds
        {"bytes": 10, "sha256": "0" * 64},
        [10, "0" * 64, 1],
    ],
)
def test_a_malformed_listing_record_is_a_format_error(
    listing: Any, clips: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = tmp_path / "corpus"
    shutil.copytree(clips, corpus)
    (corpus / "meta" / "esc50.csv").write_bytes(HEADER + rows(range(5)))
    out = tmp_path / "out"
    assert main([str(corpus), *ARGS, "-o", str(out)]) == 0
    index = json.loads((out / "index.json").read_text())
    index["generations"][0]["listing"] = listing
    (out / "index.json").write_text(json.dumps(index))
    with pytest.raises(FormatError, match=r"'listing' is .*SPEC\.md §6\.2"):
        read_index(out)


def test_an_archive_changed_while_the_corpus_was_listed_is_not_appended_to(
    clips: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Another append publishing its index between this one's listing and its taking OUT:
    the rows this one skipped are not the ones that archive's listing holds."""
    corpus = tmp_path / "corpus"
    shutil.copytree(clips, corpus)
    csv = corpus / "meta" / "esc50.csv"
    csv.write_bytes(HEADER + rows(range(4)))
    out = tmp_path / "out"
    assert main([str(corpus), *ARGS, "-o", str(out)]) == 0
    csv.write_bytes(HEADER + rows(range(8)))
    listed = pipeline.list_for_append

    def raced(*args: Any) -> Corpus:
        got = listed(*args)
        index = json.loads((out / "index.json").read_text())
        index["generations"][-1]["listing"]["sha256"] = "f" * 64
        (out / "index.json").write_text(json.dumps(index))
        before.update(files(out))
        return got

    monkeypatch.setattr(pipeline, "list_for_append", raced)
    before: dict[str, bytes] = {}
    capsys.readouterr()
    assert main([str(corpus), *ARGS, "--append", "-o", str(out)]) == 1
    assert "changed while its corpus was listed" in capsys.readouterr().err
    assert files(out) == before


def line(n: int, **more: Any) -> bytes:
    name = f"{1 + n % 5}-{1000 + n}-A-{n % 3}.wav"
    obj = {"audio_filepath": f"audio/{name}", "duration": 0.25, "text": f"clip {n}", **more}
    return json.dumps(obj).encode() + b"\n"


def lines(ns: range | list[int]) -> bytes:
    return b"".join(line(n) for n in ns)


def test_a_manifest_append_lists_the_new_lines_only(
    clips: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = lines(range(6))
    tail, got = appended(
        clips, tmp_path, monkeypatch, before, before + lines(range(6, CLIPS)), listing="m.jsonl"
    )
    assert tail
    assert listing_of(got, 0)["inputs"] == 6 and listing_of(got)["inputs"] == CLIPS
    index = read_index(tmp_path / "grown-True")
    assert [g.inputs for g in index.generations] == [6, CLIPS - 6]
    assert "text" in [f.name for f in index.fields]


def test_a_manifest_whose_new_lines_give_no_text_keeps_the_archives(
    clips: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = lines(range(4))
    new = b"".join(
        json.dumps({"audio_filepath": f"audio/{1 + n % 5}-{1000 + n}-A-{n % 3}.wav"}).encode()
        + b"\n"
        for n in range(4, 7)
    )
    tail, _ = appended(clips, tmp_path, monkeypatch, before, before + new, listing="m.jsonl")
    assert tail and "text" in [f.name for f in read_index(tmp_path / "grown-True").fields]


@pytest.mark.parametrize(
    "case",
    [
        "labels in the archive",
        "labels in the new lines",
        "empty labels before",
        "a label key spelt with escapes before",
        "a bad new line",
        "a blank line before",
        "a new line names an earlier clip",
        "an earlier line changed",
    ],
)
def test_a_manifest_is_listed_whole_where_the_new_lines_alone_cannot_tell(
    case: str, clips: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before, new = lines(range(5)), lines(range(5, 8))
    after = before + new
    if case == "labels in the archive":
        before = b"".join(line(n, label=f"c{n % 2}") for n in range(5))
        after = before + b"".join(line(n, label=f"c{n % 2}") for n in range(5, 8))
    elif case == "labels in the new lines":
        after = before + line(5, label="c0")
    elif case in ("empty labels before", "a label key spelt with escapes before"):
        # no labels field in the archive (no line gives one), yet the whole listing finds
        # the new lines without them bad
        key = "labels" if case == "empty labels before" else "\\u006cabels"
        before = b"".join(line(n)[:-2] + f', "{key}": []}}\n'.encode() for n in range(5))
        after = before + new
    elif case == "a blank line before":
        before = line(0) + b"  \n" + lines(range(1, 5))
        after = before + new
    elif case == "a new line names an earlier clip":
        after = before + new + line(1)
    elif case == "an earlier line changed":
        after = line(0, text="changed") + lines(range(1, 8))
    elif case == "a bad new line":
        after = before + b"{not json\n" + new
    # labels where the archive has none: a field it lacks, refused either way
    code = int(case == "labels in the new lines")
    tail, _ = appended(clips, tmp_path, monkeypatch, before, after, listing="m.jsonl", code=code)
    assert not tail


def test_an_out_that_is_a_file_is_named_as_for_any_append(
    clips: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    out.write_bytes(b"not an archive")
    capsys.readouterr()
    assert main([str(clips), *ARGS, "--append", "-o", str(out)]) == 1
    assert f"{out}: exists and is not a directory" in capsys.readouterr().err


@pytest.mark.slow
def test_a_tail_append_on_dask_writes_the_bytes_of_a_local_one(
    clips: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new rows' Items are made on the cluster's workers from the tail listing (its
    line numbers and places after the archive's)."""
    corpus = tmp_path / "corpus"
    shutil.copytree(clips, corpus)
    csv = corpus / "meta" / "esc50.csv"
    (corpus / "audio" / "7-bad.wav").write_bytes(b"")  # a new row skipped
    csv.write_bytes(HEADER + rows(range(4)))
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    for name in ("local", "dask"):
        assert main([str(corpus), *ARGS, "-o", str(tmp_path / name)]) == 0
    csv.write_bytes(HEADER + rows(range(4)) + row(4, name="7-bad.wav") + rows(range(5, 9)))
    tails = tail_listings(monkeypatch)
    assert main([str(corpus), *ARGS, "--append", "-o", str(tmp_path / "local")]) == 0
    with dask_cluster(1) as address:
        argv = [str(corpus), *ARGS, "--dask", address, "--append", "-o", str(tmp_path / "dask")]
        assert main(argv) == 0
    assert tails == [True, True]
    local = files(tmp_path / "local")
    assert "errors-0001.jsonl" in local and files(tmp_path / "dask") == local

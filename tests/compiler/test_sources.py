"""Corpus listing: classes are folders of media, labels are bounded, odd inputs are named."""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from dlop.compiler.corpus.layouts import charades, detect_layout, open_corpus
from dlop.compiler.corpus.listing import key_name, name_key
from dlop.compiler.corpus.place import LocalPlace
from dlop.compiler.corpus.records import Item, ListOptions
from dlop.compiler.errors import CompileError, InputError
from dlop.compiler.run.items import CorpusShape, _labels
from dlop.formats import ArchiveReader
from dlop.tools.compile_cli import main

from .fixtures import librispeech_corpus, webdataset_corpus, write_esc50_csv
from .signals import make_signal


def compile_ok(*args: str) -> ArchiveReader:
    out = args[args.index("-o") + 1]
    assert main([*args, "-q", "--workers", "1", "--features", "waveform"]) == 0
    return ArchiveReader(out)


def wav(path: Path, seconds: float = 0.1) -> Path:
    """A short WAV at ``path``, whose name may hold bytes that are not UTF-8."""
    buf = io.BytesIO()
    sf.write(buf, make_signal(16000, seconds), 16000, format="WAV")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return path


def skipped(r: ArchiveReader) -> dict[str, str]:
    return {e["key"]: e["reason"] for e in r.errors()}


def esc_row(name: str, target: object, category: str = "c", fold: object = 1) -> dict:
    return {
        "filename": name,
        "fold": fold,
        "target": target,
        "category": category,
        "esc10": "False",
        "src_file": 1,
        "take": "A",
    }


# -- item 2: a folder without media is no class; archives are never input ----------------


def test_archives_and_empty_folders_are_not_classes(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    wav(root / "cat" / "a.wav")
    wav(root / "dog" / "b.wav")
    before = compile_ok(str(root), "-o", str(tmp_path / "first"))
    assert before.index.metadata["classes"] == ["cat", "dog"]
    # an archive moved inside the corpus, an interrupted compile and an empty folder
    shutil.move(tmp_path / "first", root / "aa.dlop")
    (root / "ab-partial").mkdir()
    (root / "ab-partial" / ".dlop-progress.json").write_text("{}")
    wav(root / "ab-partial" / "stray.wav")  # inside an interrupted compile's folder: not input
    (root / "empty").mkdir()
    (root / "notes").mkdir()
    (root / "notes" / "readme.txt").write_text("no media here")
    corpus = open_corpus(str(root), None)
    assert corpus.layout == "folder" and corpus.metadata["classes"] == ["cat", "dog"]
    after = compile_ok(str(root), "-o", str(tmp_path / "second"))
    assert after.index.metadata["classes"] == ["cat", "dog"]
    assert [after.sample(i)["label"] for i in range(len(after))] == [0, 1]
    assert [after.sample(i)["key"] for i in range(len(after))] == ["cat/a.wav", "dog/b.wav"]


def test_an_archive_is_never_a_source(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    wav(root / "cat" / "a.wav")
    compile_ok(str(root), "-o", str(tmp_path / "arch"))
    with pytest.raises(CompileError, match="dlop archive"):
        detect_layout(LocalPlace(tmp_path / "arch"))
    only = tmp_path / "only"
    compile_ok(str(root), "-o", str(only / "old"))
    with pytest.raises(CompileError, match="cannot tell the layout"):
        detect_layout(LocalPlace(only))
    # librispeech transcripts inside an archive folder are not found either
    (only / "old" / "1-2.trans.txt").write_text("1-2-3 HELLO\n")
    with pytest.raises(CompileError, match="cannot tell the layout"):
        detect_layout(LocalPlace(only))


# -- item 3: labels are bounded and consistent ---------------------------------------------


def test_esc50_targets_are_bounded_and_consistent(tmp_path: Path) -> None:
    root = tmp_path / "esc"
    names = ["a.wav", "neg.wav", "huge.wav", "word.wav", "clash.wav", "b.wav", "name.wav"]
    for n in names:
        wav(root / "audio" / n)
    write_esc50_csv(
        root,
        [
            esc_row("a.wav", 0, "dog"),
            esc_row("neg.wav", -5, "dog"),
            esc_row("huge.wav", 10**12, "dog"),
            esc_row("word.wav", "three", "dog"),
            esc_row("clash.wav", 0, "cat"),  # target 0 is dog on line 2
            esc_row("b.wav", 1, "cat"),
            esc_row("name.wav", 2, "dog"),  # dog is target 0 on line 2
        ],
    )
    corpus = open_corpus(str(root), None)
    assert corpus.metadata["classes"] == ["dog", "cat"]
    errors = {it.key: it.error for it in corpus.items if it.error}
    assert set(errors) == {f"audio/{n}" for n in names} - {"audio/a.wav", "audio/b.wav"}
    assert "meta/esc50.csv line 3" in errors["audio/neg.wav"] and "-5" in errors["audio/neg.wav"]
    assert "line 4" in errors["audio/huge.wav"]
    assert "line 6" in errors["audio/clash.wav"] and "line 2" in errors["audio/clash.wav"]
    assert "line 8" in errors["audio/name.wav"]
    r = compile_ok(str(root), "-o", str(tmp_path / "a"))
    assert [(r.sample(i)["key"], r.sample(i)["label"]) for i in range(len(r))] == [
        ("audio/a.wav", 0),
        ("audio/b.wav", 1),
    ]
    assert r.index.skipped_count == 5 and "line 4" in skipped(r)["audio/huge.wav"]


def test_esc50_bad_target_fails_cleanly_under_fail(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "esc"
    wav(root / "audio" / "a.wav")
    write_esc50_csv(root, [esc_row("a.wav", 0), esc_row("a.wav", 10**12)])
    out = tmp_path / "a"
    assert main([str(root), "-o", str(out), "--on-error", "fail", "-q", "--workers", "1"]) == 1
    err = capsys.readouterr().err
    assert "esc50.csv line 3" in err and "Traceback" not in err
    assert not out.exists()


def test_manifest_and_tar_labels_are_bounded(tmp_path: Path) -> None:
    wav(tmp_path / "m" / "a.wav")
    lines = [
        {"audio_filepath": "a.wav", "id": "good", "label": 2, "labels": [0, 3]},
        {"audio_filepath": "a.wav", "id": "neg", "label": -5, "labels": [1]},
        {"audio_filepath": "a.wav", "id": "huge", "label": 1, "labels": [10**12]},
        {"audio_filepath": "a.wav", "id": "word", "label": "seven", "labels": [1]},
    ]
    (tmp_path / "m" / "m.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    corpus = open_corpus(str(tmp_path / "m" / "m.jsonl"), None)
    errors = {it.key: it.error for it in corpus.items if it.error}
    assert set(errors) == {"neg", "huge", "word"}
    assert corpus.num_labels == 4
    good = corpus.items[0]
    assert good.label == 2 and good.labels == [0, 3]

    root = tmp_path / "wds"
    root.mkdir()
    with tarfile.open(root / "t.tar", "w") as tf:
        for key, cls in (("k0", b"-3"), ("k1", b"1")):
            buf = io.BytesIO()
            sf.write(buf, make_signal(16000, 0.1), 16000, format="FLAC")
            for ext, data in (("flac", buf.getvalue()), ("cls", cls)):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    r = compile_ok(str(root), "-o", str(tmp_path / "a"))
    assert len(r) == 1 and r.sample(0)["label"] == 1
    assert "-3" in skipped(r)["k0"]


def test_labels_checks_what_it_stores() -> None:
    shape = CorpusShape(True, False, {}, num_labels=3)
    assert _labels(Item(key="k", label=2, labels=[0, 2]), shape, "k")["label"] == 2
    for item in (
        Item(key="k", label=-1, labels=[0]),
        Item(key="k", label=True, labels=[0]),
        Item(key="k", label=1, labels=[3]),
        Item(key="k", label=1, labels=[-1]),
    ):
        with pytest.raises(InputError):
            _labels(item, shape, "k")


# -- item 10: odd inputs are named, never a traceback --------------------------------------


def test_non_utf8_file_names_round_trip(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    odd = os.fsdecode(b"caf\xe9 \\ x.wav")
    wav(root / "cat" / odd)
    wav(root / "dog" / "b.wav")
    corpus = open_corpus(str(root), None)
    keys = [it.key for it in corpus.items]
    assert keys == ["cat/caf\\xe9 \\\\ x.wav", "dog/b.wav"]
    assert key_name(keys[0]) == os.path.join("cat", odd)
    for name in ("plain.wav", "a\\b", "\\xe9", os.fsdecode(b"\xff\xfe\\x41"), "ü.wav"):
        assert key_name(name_key(name)) == name
        name_key(name).encode("utf-8")
    r = compile_ok(str(root), "-o", str(tmp_path / "a"))
    assert [r.sample(i)["key"] for i in range(len(r))] == keys
    (root / "dog" / os.fsdecode(b"bad\xff.wav")).write_text("not audio")
    r = compile_ok(str(root), "-o", str(tmp_path / "b"))
    (error,) = r.errors()
    assert error["key"] == "dog/bad\\xff.wav" and error["path"].endswith("/dog/bad\\xff.wav")
    error["path"].encode("utf-8")


def test_non_utf8_manifest_lines_are_bad_inputs(tmp_path: Path) -> None:
    out, tmp_path = tmp_path / "a", tmp_path / "m"
    wav(tmp_path / "a.wav")
    good = json.dumps({"audio_filepath": "a.wav", "text": "fine"}).encode()
    raw = good + b"\n" + b'{"audio_filepath": "a.wav", "text": "caf\xe9"}\n' + good + b"\n"
    (tmp_path / "m.jsonl").write_bytes(raw)
    corpus = open_corpus(str(tmp_path / "m.jsonl"), None)
    assert [it.error is None for it in corpus.items] == [True, False, True]
    bad = corpus.items[1].error or ""
    where = raw.index(b"\xe9")
    assert "line 2" in bad and f"byte {where}" in bad and "UTF-8" in bad
    r = compile_ok(str(tmp_path / "m.jsonl"), "-o", str(out))
    assert len(r) == 2 and r.index.skipped_count == 1

    (tmp_path / "u16.jsonl").write_bytes(good.decode().encode("utf-16"))
    with pytest.raises(CompileError, match=r"u16.jsonl.*line 1.*byte 0"):
        open_corpus(str(tmp_path / "u16.jsonl"), None)


def test_bad_esc50_rows_are_bad_inputs(tmp_path: Path) -> None:
    root = tmp_path / "esc"
    wav(root / "audio" / "a.wav")
    wav(root / "audio" / "b.wav")
    write_esc50_csv(root, [esc_row("a.wav", 0), esc_row("b.wav", 0)])
    csv_path = root / "meta" / "esc50.csv"
    lines = csv_path.read_bytes().splitlines(keepends=True)
    lines.insert(2, b"short.wav,1,0\r\n")
    lines.insert(3, b"caf\xe9.wav,1,0,c,False,1,A\r\n")
    csv_path.write_bytes(b"".join(lines))
    corpus = open_corpus(str(root), None)
    errors = [it.error for it in corpus.items]
    assert errors[0] is None and errors[3] is None
    assert "line 3" in (errors[1] or "") and "columns" in (errors[1] or "")
    assert "line 4" in (errors[2] or "") and "UTF-8" in (errors[2] or "")
    r = compile_ok(str(root), "-o", str(tmp_path / "a"))
    assert len(r) == 2 and r.index.skipped_count == 2
    for e in r.errors():
        e["key"].encode("utf-8")

    csv_path.write_bytes("filename,fold,target,category\n".encode("utf-16"))
    with pytest.raises(CompileError, match=r"esc50.csv.*UTF-8.*byte 0"):
        open_corpus(str(root), None)


def test_non_utf8_transcript_line_is_a_bad_input(tmp_path: Path) -> None:
    root = librispeech_corpus(tmp_path / "ls")
    trans = root / "dev-clean" / "26" / "495" / "26-495.trans.txt"
    trans.write_bytes(trans.read_bytes().replace(b"UTTERANCE 1", b"UTTERANCE \xff"))
    corpus = open_corpus(str(root), None)
    bad = [it for it in corpus.items if it.error]
    assert [it.key for it in bad] == ["dev-clean/26/495/26-495-0001.flac"]
    assert "26-495.trans.txt line 2" in (bad[0].error or "") and "UTF-8" in (bad[0].error or "")
    assert sum(it.error is None for it in corpus.items) == 4


def test_truncated_tar_member_is_a_bad_input(tmp_path: Path) -> None:
    root = webdataset_corpus(tmp_path / "wds", shards=2, per_shard=3)
    first = root / "train-000.tar"
    data = first.read_bytes()
    with tarfile.open(first) as tf:
        last = next(m for m in tf if m.name == "s0_002.flac")
    first.write_bytes(data[: last.offset_data + 100])  # its header claims more than is left
    (root / "train-002.tar").write_bytes(b"this is not a tar file" * 40)
    corpus = open_corpus(str(root), None)
    errors = {it.key: it.error for it in corpus.items if it.error}
    assert set(errors) == {"s0_002", "train-002.tar"}
    assert f"byte {last.offset_data}" in errors["s0_002"]
    r = compile_ok(str(root), "-o", str(tmp_path / "a"))
    keys = [r.sample(i)["key"] for i in range(len(r))]
    assert keys == ["s0_000", "s0_001", "s1_000", "s1_001", "s1_002"]
    assert set(skipped(r)) == {"s0_002", "train-002.tar"}


def test_short_charades_row_is_a_bad_input(tmp_path: Path) -> None:
    root = tmp_path / "ch"
    root.mkdir()
    (root / "Charades_v1_train.csv").write_bytes(
        b"id,subject,scene,actions\nAB12,s,kitchen,c001 0.0 1.0\nCD34\nEF\xff56,s,x,\n"
    )
    corpus = charades.list_corpus(LocalPlace(root), ListOptions(media="video"))
    errors = [it.error or "" for it in corpus.items]
    assert "line 3" in errors[1] and "columns" in errors[1]
    assert "line 4" in errors[2] and "UTF-8" in errors[2]
    for it in corpus.items:
        it.key.encode("utf-8")


def test_fingerprint_of_an_odd_name_is_stable(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    wav(root / os.fsdecode(b"\xff") / os.fsdecode(b"x\xfe.wav"))
    a = open_corpus(str(root), "folder")
    b = open_corpus(str(root), "folder")
    assert a.fingerprint == b.fingerprint and a.metadata["classes"] == ["\\xff"]
    assert np.array_equal(
        np.frombuffer(os.fsencode(key_name(a.items[0].key)), np.uint8),
        np.frombuffer(b"\xff/x\xfe.wav", np.uint8),
    )

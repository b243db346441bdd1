"""--layout peoples-speech: the original release's JSON-lines manifest with FLAC in tar shards."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlop.compiler.corpus.layouts import detect_layout, open_corpus, stream_items
from dlop.compiler.corpus.place import LocalPlace
from dlop.formats import ArchiveReader
from dlop.tools.compile_cli import main

from .fixtures import write_audio
from .signals import make_signal

# document -> its segments' transcripts; each document's segments go to one tar shard
DOCS = {
    "gov_DOT_a": ["and the court heard", "  spaces kept  ", "ünïcödé — text"],
    "org_DOT_b": ["second document", "its last segment"],
}


def seg_name(doc: str, i: int) -> str:
    return f"{doc}/{doc}_DOT_mp3_{i:05d}.flac"


def write_tar(path: Path, members: dict[str, bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def ps_corpus(root: Path, tars: bool = True) -> Path:
    """``train/clean.json`` and its audio in ``train/clean/`` (tar shards or plain files); the
    same FLAC files under ``plain/`` with a NeMo manifest, for compiling them as files."""
    lines, plain = [], []
    for d, (doc, texts) in enumerate(DOCS.items()):
        members = {}
        for i, text in enumerate(texts):
            name = seg_name(doc, i)
            path = write_audio(
                root / "plain" / name, make_signal(16000, 0.3 + 0.1 * i, seed=d * 9 + i), 16000
            )
            members[name] = path.read_bytes()
            plain.append(json.dumps({"audio_filepath": name, "text": text}) + "\n")
            if not tars:
                write_audio(
                    root / "train" / "clean" / name,
                    make_signal(16000, 0.3 + 0.1 * i, seed=d * 9 + i),
                    16000,
                )
        if tars:
            write_tar(root / "train" / "clean" / f"clean_{d:06d}.tar", members)
        training = {
            "duration_ms": [300 + 100 * i for i in range(len(texts))],
            "label": texts,
            "name": [seg_name(doc, i) for i in range(len(texts))],
        }
        lines.append(
            {
                "audio_document_id": f"{doc}.mp3",
                "identifier": doc,
                "text_document_id": f"{doc}.srt",
                "training_data": training,
            }
        )
    (root / "train" / "clean.json").write_text(
        "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines), encoding="utf-8"
    )
    (root / "plain" / "plain.jsonl").write_text("".join(plain), encoding="utf-8")
    return root / "train"


def compile_ok(*args: str) -> None:
    assert main([*args, "-q", "--workers", "1"]) == 0


@pytest.mark.parametrize("tars", [True, False], ids=["tar-shards", "folders"])
def test_segments_compile_like_the_same_flac_files(tmp_path: Path, tars: bool) -> None:
    source = ps_corpus(tmp_path / "ps", tars=tars)
    assert detect_layout(LocalPlace(source)) == "peoples-speech"
    compile_ok(str(source), "-o", str(tmp_path / "a"))
    compile_ok(str(tmp_path / "ps" / "plain" / "plain.jsonl"), "-o", str(tmp_path / "b"))
    a, b = ArchiveReader(tmp_path / "a"), ArchiveReader(tmp_path / "b")
    assert len(a) == len(b) == 5 and a.index.skipped_count == 0
    feature = a.index.metadata["feature_field"]
    expected = [(doc, i, t) for doc, texts in DOCS.items() for i, t in enumerate(texts)]
    for n, (doc, i, text) in enumerate(expected):
        s = a.sample(n)
        assert s["key"] == seg_name(doc, i)
        assert s["text"].encode() == text.encode()
        assert (s["duration_ms"], s["audio_document_id"]) == (300 + 100 * i, f"{doc}.mp3")
        assert np.array_equal(s[feature], b.sample(n)[feature])


def test_tars_are_read_in_one_pass_from_any_start(tmp_path: Path) -> None:
    source = ps_corpus(tmp_path / "ps")
    corpus = open_corpus(str(source), "peoples-speech")
    got = list(stream_items(corpus, 2, 4))  # the first tar's last segment, the second's first
    assert [it.key for it in got] == [seg_name("gov_DOT_a", 2), seg_name("org_DOT_b", 0)]
    plain = tmp_path / "ps" / "plain"
    assert got[1].data == {"flac": (plain / seg_name("org_DOT_b", 0)).read_bytes()}
    assert all(it.data is None for it in corpus.items)  # the corpus's items stay light
    assert list(source.rglob("*.flac")) == []  # nothing extracted to disk


def test_bad_lines_and_missing_members_are_skipped_and_named(tmp_path: Path) -> None:
    source = ps_corpus(tmp_path / "ps")
    manifest = source / "clean.json"
    extra = {
        "audio_document_id": "gone.mp3",
        "training_data": {
            "duration_ms": [100],
            "label": ["lost"],
            "name": ["gone/gone_00000.flac"],
        },
    }
    uneven = {"training_data": {"duration_ms": [1, 2], "label": ["x"], "name": ["a", "b"]}}
    with manifest.open("a", encoding="utf-8") as f:
        f.write(json.dumps(extra) + "\n{not json\n" + json.dumps(uneven) + "\n")
    # a member whose bytes are no audio
    write_tar(source / "clean" / "clean_000002.tar", {"junk/junk_00000.flac": b"not flac" * 50})
    junk = {
        "audio_document_id": "junk",
        "training_data": {"duration_ms": [5], "label": ["j"], "name": ["junk/junk_00000.flac"]},
    }
    with manifest.open("a", encoding="utf-8") as f:
        f.write(json.dumps(junk) + "\n")
    compile_ok(str(source), "-o", str(tmp_path / "a"))
    r = ArchiveReader(tmp_path / "a")
    assert len(r) == 5 and r.index.skipped_count == 4
    reasons = " | ".join(e["reason"] for e in r.errors())
    assert "'gone/gone_00000.flac' is a member of none of the 3 tar shards" in reasons
    assert "clean.json line 4 (byte" in reasons and "JSONDecodeError" in reasons
    assert "clean.json line 5" in reasons and "differ in length" in reasons
    assert "cannot decode" in reasons
    out = tmp_path / "f"
    assert main([str(source), "-o", str(out), "--on-error", "fail", "-q", "--workers", "1"]) == 1


def test_a_manifest_file_is_ambiguous_with_the_nemo_manifest_until_told(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = ps_corpus(tmp_path / "ps")
    manifest = str(source / "clean.json")
    assert main([manifest, "-o", str(tmp_path / "x"), "-q"]) == 1
    assert "ambiguous" in capsys.readouterr().err
    compile_ok(manifest, "--layout", "peoples-speech", "-o", str(tmp_path / "a"))
    assert len(ArchiveReader(tmp_path / "a")) == 5


@pytest.mark.slow
def test_the_same_corpus_lists_streams_and_compiles_from_s3(s3: Any, tmp_path: Path) -> None:
    source = ps_corpus(tmp_path / "ps")
    s3.make_bucket("psdata")
    s3.filesystem().put(str(source), "psdata/train", recursive=True)
    url = "s3://psdata/train"
    local, remote = open_corpus(str(source), None), open_corpus(url, None)
    assert remote.layout == "peoples-speech" and remote.fingerprint == local.fingerprint
    assert [(it.key, it.text, it.extras) for it in remote.items] == [
        (it.key, it.text, it.extras) for it in local.items
    ]
    assert [it.data for it in stream_items(remote, 1, 4)] == [
        it.data for it in stream_items(local, 1, 4)
    ]
    compile_ok(str(source), "-o", str(tmp_path / "a"))
    compile_ok(url, "-o", str(tmp_path / "b"))
    assert len(ArchiveReader(tmp_path / "b")) == 5
    shards = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.dlop"))
    assert shards == sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*.dlop"))
    for name in shards:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_a_repeated_segment_is_skipped_alone(tmp_path: Path) -> None:
    source = ps_corpus(tmp_path / "ps")
    manifest = source / "clean.json"
    first = seg_name("gov_DOT_a", 0)
    again = {  # a second line naming the first document's first segment
        "audio_document_id": "again.mp3",
        "training_data": {"duration_ms": [300], "label": ["again"], "name": [first]},
    }
    twice = {  # one line naming a segment twice
        "audio_document_id": "twice.mp3",
        "training_data": {
            "duration_ms": [500, 500],
            "label": ["x", "y"],
            "name": [seg_name("org_DOT_b", 1)] * 2,
        },
    }
    with manifest.open("a", encoding="utf-8") as f:
        f.write(json.dumps(again) + "\n" + json.dumps(twice) + "\n")
    compile_ok(str(source), "-o", str(tmp_path / "a"))
    compile_ok(str(ps_corpus(tmp_path / "clean")), "-o", str(tmp_path / "b"))
    a, b = ArchiveReader(tmp_path / "a"), ArchiveReader(tmp_path / "b")
    assert len(a) == len(b) == 5 and a.index.skipped_count == 3
    feature = a.index.metadata["feature_field"]
    for n in range(5):  # every segment, with its first line's transcript
        sa, sb = a.sample(n), b.sample(n)
        assert (sa["key"], sa["text"]) == (sb["key"], sb["text"])
        assert np.array_equal(sa[feature], sb[feature])
    reasons = [e["reason"] for e in a.errors()]
    assert sum(f"{first!r} was already named at clean.json line 1 segment 0" in r for r in reasons)
    assert sum("was already named at clean.json line 2 segment 1" in r for r in reasons) == 2
    assert not any("changed since the listing" in r for r in reasons)

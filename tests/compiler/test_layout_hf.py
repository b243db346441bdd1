"""--layout hf: Parquet written by Hugging Face ``datasets`` with an Audio column."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlop.compiler.corpus.layouts import hf, open_corpus, stream_items
from dlop.compiler.corpus.place import LocalPlace
from dlop.compiler.errors import CompileError
from dlop.compiler.recipe import build_recipe
from dlop.formats import ArchiveReader
from dlop.tools.compile_cli import main

from .fixtures import write_audio
from .signals import make_signal

TEXTS = ["the first one", "zweite Äußerung", "trois — «guillemets»", "  padded  ", "fünf\tfive"]
CLASSES = ["cat", "dog", "owl"]


def compile_ok(*args: str) -> None:
    assert main([*args, "-q", "--workers", "1"]) == 0


def write_parquet(path: Path, columns: dict[str, list[Any]], features: dict[str, Any]) -> None:
    """A Parquet file as ``datasets`` writes it, rows in groups of two; the Audio cells are
    built as the feature's bytes/path struct (no torchcodec encode)."""
    import pyarrow as pa
    from datasets import Dataset, DatasetInfo, Features

    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    arrays = {
        k: pa.array(v, type=struct) if k in ("audio", "image") else pa.array(v)
        for k, v in columns.items()
    }
    table = pa.table(arrays).cast(Features(features).arrow_schema)
    dataset = Dataset(table, info=DatasetInfo(features=Features(features)))
    path.parent.mkdir(parents=True, exist_ok=True)
    dataset.to_parquet(str(path), batch_size=2)


def hf_corpus(root: Path, embed: tuple[bool, ...] = (True, False, True, False, True)) -> Path:
    """Five clips (WAV and FLAC, 16 and 8 kHz); each row embeds its bytes or keeps a relative
    path; plus a manifest of the same files for compiling them as plain files."""
    from datasets import Audio, ClassLabel, Value

    cells, lines = [], []
    for i, keep_bytes in enumerate(embed):
        name = f"clips/c{i}.{'flac' if i % 2 else 'wav'}"
        rate = 8000 if i == 2 else 16000
        write_audio(root / name, make_signal(rate, 0.4 + 0.1 * i, seed=i), rate)
        data = (root / name).read_bytes() if keep_bytes else None
        cells.append({"bytes": data, "path": Path(name).name if keep_bytes else name})
        lines.append(json.dumps({"audio_filepath": name, "text": TEXTS[i]}) + "\n")
    (root / "plain.jsonl").write_text("".join(lines), encoding="utf-8")
    columns = {
        "id": [f"utt-{i}" for i in range(len(embed))],
        "audio": cells,
        "text": TEXTS[: len(embed)],
        "label": [i % 3 for i in range(len(embed))],
        "speaker": [f"spk{i // 2}" for i in range(len(embed))],
        "duration_ms": [400 + 100 * i for i in range(len(embed))],
    }
    features = {
        "id": Value("string"),
        "audio": Audio(sampling_rate=16000),
        "text": Value("string"),
        "label": ClassLabel(names=CLASSES),
        "speaker": Value("string"),
        "duration_ms": Value("int64"),
    }
    write_parquet(root / "data" / "train-00000-of-00001.parquet", columns, features)
    return root


def test_parquet_compiles_like_the_same_audio_from_plain_files(tmp_path: Path) -> None:
    root = hf_corpus(tmp_path / "hf")
    compile_ok(str(root), "-o", str(tmp_path / "a"), "--keep-columns", "speaker,duration_ms")
    compile_ok(str(root / "plain.jsonl"), "-o", str(tmp_path / "b"))
    a, b = ArchiveReader(tmp_path / "a"), ArchiveReader(tmp_path / "b")
    assert a.index.recipe["layout"] == "hf" and a.index.recipe["keep_columns"] == [
        "speaker",
        "duration_ms",
    ]
    assert len(a) == len(b) == 5 and a.index.skipped_count == 0
    assert a.index.metadata["classes"] == CLASSES
    assert a.index.metadata["hf"]["sampling_rate"] == 16000
    for i in range(5):
        s, plain = a.sample(i), b.sample(i)
        assert s["key"] == f"utt-{i}"
        assert s["text"].encode() == TEXTS[i].encode()  # byte-exact, whitespace kept
        assert (s["label"], s["speaker"], s["duration_ms"]) == (
            i % 3,
            f"spk{i // 2}",
            400 + 100 * i,
        )
        feature = a.index.metadata["feature_field"]
        assert np.array_equal(s[feature], plain[feature])


def test_listing_reads_no_media_bytes_and_stream_reads_only_its_row_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pyarrow.parquet as pq

    root = hf_corpus(tmp_path / "hf")
    read: list[tuple[list[int] | None, list[str], int]] = []
    real_batches = pq.ParquetFile.iter_batches

    def batches(self: Any, *a: Any, columns: list[str], **kw: Any) -> Any:
        read.append((kw.get("row_groups"), columns, kw.get("batch_size", 0)))
        return real_batches(self, *a, columns=columns, **kw)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", batches)
    corpus = open_corpus(str(root), None)
    assert corpus.layout == "hf" and len(corpus.items) == 5
    assert all("audio" not in c and "audio.bytes" not in c for _, c, _ in read)
    read.clear()
    got = list(stream_items(corpus, 3, 4))
    # rows 2-3 form row group 1, read a few rows at a time
    assert [it.key for it in got] == ["utt-3"] and read == [([1], ["audio"], 16)]
    assert got[0].path == str(root / "clips/c3.flac") and got[0].data is None
    first = next(stream_items(corpus, 0, 1))
    assert first.data == {"wav": (root / "clips/c0.wav").read_bytes()}
    assert corpus.items[0].data is None  # the corpus's items stay light


def test_bad_rows_are_skipped_and_named(tmp_path: Path) -> None:
    from datasets import Audio, Value

    root = tmp_path / "bad"
    write_audio(root / "ok.wav", make_signal(16000, 0.3), 16000)
    cells = [
        {"bytes": (root / "ok.wav").read_bytes(), "path": "ok.wav"},
        {"bytes": None, "path": None},
        {"bytes": b"this is not audio at all" * 20, "path": "junk.wav"},
        {"bytes": None, "path": "gone/missing.flac"},
        None,
    ]
    columns = {"audio": cells, "sentence": ["a", "b", "c", "d", "e"]}
    write_parquet(root / "x.parquet", columns, {"audio": Audio(), "sentence": Value("string")})
    compile_ok(str(root), "-o", str(tmp_path / "a"))
    r = ArchiveReader(tmp_path / "a")
    assert [r.get("key", i) for i in range(len(r))] == ["x.parquet row 0"]
    assert r.sample(0)["text"] == "a"  # the sentence column is a transcript
    errors = [(e.get("key"), e["reason"]) for e in r.errors()]
    assert r.index.skipped_count == 4, errors
    reasons = " | ".join(reason for _, reason in errors)
    assert "x.parquet row 1: the media cell holds neither bytes nor a path" in reasons
    assert "x.parquet row 4" in reasons
    assert "cannot decode" in reasons and "not found" in reasons
    out = tmp_path / "f"
    assert main([str(root), "-o", str(out), "--on-error", "fail", "-q", "--workers", "1"]) == 1


def test_a_truncated_or_damaged_parquet_file_is_a_named_error(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    root = hf_corpus(tmp_path / "hf")
    data = root / "data" / "train-00000-of-00001.parquet"
    whole = data.read_bytes()
    for cut in (whole[: len(whole) // 2], whole[:-8] + (1 << 30).to_bytes(4, "little") + b"PAR1"):
        data.write_bytes(cut)
        with pytest.raises(CompileError, match=r"train-00000-of-00001\.parquet: not a readable"):
            open_corpus(str(root), "hf")
    # the footer intact, the page header of row group 1's media bytes overwritten: the rows
    # not read before pyarrow met it (it reads ahead) are bad inputs naming their row
    data.write_bytes(whole)
    corpus = open_corpus(str(root), "hf")
    offset = pq.ParquetFile(data).metadata.row_group(1).column(1).data_page_offset
    data.write_bytes(whole[:offset] + b"\xff" * 12 + whole[offset + 12 :])
    got = list(stream_items(corpus, 0, None))
    assert [it.key for it in got] == [f"utt-{i}" for i in range(5)]
    flags = [it.error is not None for it in got]
    assert flags == sorted(flags) and sum(flags) >= 3  # the rows from the damage on
    bad = [it.error for it in got if it.error is not None]
    for row, error in zip(range(5 - len(bad), 5), bad, strict=True):
        assert error.startswith(f"train-00000-of-00001.parquet row {row}: the file could not ")
        assert "Deserializing page header failed" in error


@pytest.mark.parametrize("bytes_type", ["string", "int64"])
def test_a_media_struct_of_other_types_is_refused(tmp_path: Path, bytes_type: str) -> None:
    """A ``bytes`` field holding a string is never taken for a path to open."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Audio

    root = tmp_path / "odd"
    root.mkdir()
    write_audio(root / "ok.wav", make_signal(16000, 0.3), 16000)
    struct = pa.struct([("bytes", pa.type_for_alias(bytes_type)), ("path", pa.string())])
    value = str(root / "ok.wav") if bytes_type == "string" else 0
    table = pa.table({"audio": pa.array([{"bytes": value, "path": "ok.wav"}], type=struct)})
    features = {"audio": {"_type": "Audio"}}
    meta = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    pq.write_table(table.replace_schema_metadata(meta), root / "x.parquet")
    with pytest.raises(CompileError, match=f"'audio' holds struct<bytes: {bytes_type}"):
        open_corpus(str(root), "hf")
    # a later file of the split with those types: its rows are bad inputs
    good = {"bytes": (root / "ok.wav").read_bytes(), "path": "ok.wav"}
    write_parquet(root / "a.parquet", {"audio": [good]}, {"audio": Audio()})
    corpus = open_corpus(str(root), "hf")
    got = list(stream_items(corpus, 0, None))
    assert got[0].error is None and got[0].data is not None
    assert got[1].error is not None and "not binary bytes and a string path" in got[1].error
    assert got[1].data is None and got[1].path is None


def test_column_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = hf_corpus(tmp_path / "hf", embed=(True, True))
    out = tmp_path / "a"
    compile_ok(
        str(root), "-o", str(out), "--text-column", "speaker", "--label-column", "duration_ms"
    )
    r = ArchiveReader(out)
    assert [r.sample(i)["text"] for i in range(2)] == ["spk0", "spk0"]
    assert [r.sample(i)["label"] for i in range(2)] == [400, 500]
    assert "classes" not in r.index.metadata  # duration_ms is no ClassLabel
    recipe = build_recipe({"source": str(root), **r.index.recipe})
    assert (recipe.text_column, recipe.label_column) == ("speaker", "duration_ms")
    for args, expected in (
        (["--text-column", "nope"], "--text-column 'nope' is not a column"),
        (["--keep-columns", "audio"], "--keep-columns 'audio'"),
        (["--keep-columns", "a,,b"], "keep_columns: expected column names"),
    ):
        assert main([str(root), "-o", str(tmp_path / "x"), "-q", *args]) == 1
        assert expected in capsys.readouterr().err
    with pytest.raises(CompileError, match="layout hf"):
        build_recipe({"source": str(root / "plain.jsonl"), "text_column": "text"})


def test_peoples_speech_hub_form(tmp_path: Path) -> None:
    """People's Speech on the hub: id, audio (16 kHz), duration_ms, text."""
    from datasets import Audio, Value

    write_audio(tmp_path / "a.flac", make_signal(16000, 0.5), 16000)
    cells = [{"bytes": (tmp_path / "a.flac").read_bytes(), "path": "a.flac"}] * 3
    columns = {
        "id": ["doc/a_000.flac", "doc/a_001.flac", "doc/a_002.flac"],
        "audio": cells,
        "duration_ms": [500, 500, 500],
        "text": ["one", "two", "three"],
    }
    features = {
        "id": Value("string"),
        "audio": Audio(sampling_rate=16000),
        "duration_ms": Value("int32"),
        "text": Value("string"),
    }
    source = tmp_path / "microset" / "train-00000-of-00001.parquet"
    write_parquet(source, columns, features)
    compile_ok(str(source), "-o", str(tmp_path / "out"), "--keep-columns", "duration_ms")
    r = ArchiveReader(tmp_path / "out")
    assert [r.sample(i)["key"] for i in range(3)] == columns["id"]
    assert [r.sample(i)["text"] for i in range(3)] == columns["text"]
    assert r.sample(2)["duration_ms"] == 500
    assert hf.detect(LocalPlace(source)) and hf.detect(LocalPlace(tmp_path))


@pytest.mark.slow
def test_the_same_corpus_lists_streams_and_compiles_from_s3(s3: Any, tmp_path: Path) -> None:
    root = hf_corpus(tmp_path / "hf")
    s3.make_bucket("hfdata")
    s3.filesystem().put(str(root), "hfdata/corpus", recursive=True)
    url = "s3://hfdata/corpus"
    local, remote = open_corpus(str(root), None), open_corpus(url, None)
    assert remote.layout == "hf" and remote.fingerprint == local.fingerprint
    assert [(it.key, it.text, it.label) for it in remote.items] == [
        (it.key, it.text, it.label) for it in local.items
    ]
    got = list(stream_items(remote, 0, None))
    for a, b in zip(stream_items(local, 0, None), got, strict=True):
        assert a.data == b.data
        assert (a.path is None) == (b.path is None)
        if a.path is not None:  # a path row: the same file, by URL
            assert b.path == url + a.path[len(str(root)) :]
    # every row embedding its bytes: the archive is the same, byte for byte
    whole = hf_corpus(tmp_path / "whole", embed=(True,) * 5)
    s3.filesystem().put(str(whole), "hfdata/whole", recursive=True)
    compile_ok(str(whole), "-o", str(tmp_path / "a"), "--keep-columns", "speaker")
    compile_ok("s3://hfdata/whole", "-o", str(tmp_path / "b"), "--keep-columns", "speaker")
    assert len(ArchiveReader(tmp_path / "b")) == 5
    shards = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.dlop"))
    assert shards == sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*.dlop"))
    for name in shards:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_an_image_column_compiles_from_embedded_bytes_as_from_paths(tmp_path: Path) -> None:
    """The Image feature's struct: rows embedding their JPEG bytes give the samples that the
    same files named by path give."""
    from datasets import ClassLabel, Value
    from datasets import Image as ImageFeature
    from PIL import Image

    rng = np.random.default_rng(0)
    names = []
    for i in range(3):
        name = f"pics/p{i}.jpg"
        (tmp_path / "pics").mkdir(exist_ok=True)
        pixels = rng.integers(0, 255, (48 + 8 * i, 64, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(tmp_path / name, quality=90)
        names.append(name)
    features = {"image": ImageFeature(), "label": ClassLabel(names=CLASSES), "id": Value("string")}
    for form in ("bytes", "paths"):
        cells = [
            {"bytes": (tmp_path / n).read_bytes(), "path": Path(n).name}
            if form == "bytes"
            else {"bytes": None, "path": n}
            for n in names
        ]
        columns = {"image": cells, "label": [0, 2, 1], "id": [f"img-{i}" for i in range(3)]}
        write_parquet(tmp_path / form / "data" / "train.parquet", columns, features)
        if form == "paths":  # the files inside the corpus (a link out of it is refused)
            shutil.copytree(tmp_path / "pics", tmp_path / form / "pics")
        compile_ok(
            str(tmp_path / form),
            "--layout",
            "hf",
            "--media",
            "image",
            "--size",
            "32",
            "-o",
            str(tmp_path / f"out-{form}"),
        )
    got = {}
    for form in ("bytes", "paths"):
        with ArchiveReader(tmp_path / f"out-{form}") as r:
            assert len(r) == 3 and r.index.skipped_count == 0
            got[form] = [r.sample(i) for i in range(3)]
    for a, b in zip(got["bytes"], got["paths"], strict=True):
        assert a["label"] == b["label"] and a["key"] == b["key"]
        assert np.array_equal(a["image"], b["image"])


@pytest.mark.slow
def test_rows_naming_files_compile_from_s3_to_the_same_archive(s3: Any, tmp_path: Path) -> None:
    """Rows with relative paths (no bytes) read those files from the bucket."""
    root = hf_corpus(tmp_path / "hf", embed=(False,) * 5)
    s3.make_bucket("hfpaths")
    s3.filesystem().put(str(root), "hfpaths/corpus", recursive=True)
    compile_ok(str(root), "--layout", "hf", "-o", str(tmp_path / "a"))
    compile_ok("s3://hfpaths/corpus", "--layout", "hf", "-o", str(tmp_path / "b"))
    assert len(ArchiveReader(tmp_path / "b")) == 5
    names = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.dlop"))
    assert names == sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*.dlop"))
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_a_row_group_too_large_to_read_at_once_is_skipped_with_its_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hf, "MAX_GROUP_BYTES", 4000)  # the embedded clips' groups exceed it
    root = hf_corpus(tmp_path / "ds", embed=(False, False, True, False, False))
    compile_ok(str(root), "--layout", "hf", "-o", str(tmp_path / "a"))
    r = ArchiveReader(tmp_path / "a")
    assert len(r) == 3 and r.index.skipped_count == 2  # rows 2 and 3 share a group of 2
    reasons = [e["reason"] for e in r.errors()]
    assert all(
        "its row group 1 holds" in x and "more than the 4000 read at once" in x for x in reasons
    )
    assert [s["key"] for s in (r.sample(i) for i in range(3))] == ["utt-0", "utt-1", "utt-4"]

"""Inputs a layout's listing must refuse or name as bad, and URL overlaps of OUT and SOURCE."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlop.compiler.corpus.layouts import open_corpus
from dlop.compiler.errors import CompileError

from .fixtures import write_audio
from .signals import make_signal
from .test_layout_hf import CLASSES, write_parquet


def clip_cells(root: Path, n: int) -> list[dict[str, object]]:
    write_audio(root / "a.wav", make_signal(16000, 0.3), 16000)
    return [{"bytes": (root / "a.wav").read_bytes(), "path": "a.wav"}] * n


def test_hf_label_past_the_class_names_is_a_named_bad_input(tmp_path: Path) -> None:
    from datasets import Audio, ClassLabel

    columns = {"audio": clip_cells(tmp_path, 3), "label": [0, 2, 7]}
    features = {"audio": Audio(), "label": ClassLabel(names=CLASSES)}
    write_parquet(tmp_path / "x.parquet", columns, features)
    corpus = open_corpus(str(tmp_path), "hf")
    assert [it.label for it in corpus.items] == [0, 2, None]
    assert [it.error for it in corpus.items][:2] == [None, None]
    assert "x.parquet row 2: label 7 is not a class index from 0 to 2" in str(corpus.items[2].error)
    assert "names 3 classes" in str(corpus.items[2].error)


def test_hf_string_labels_without_class_names_are_refused(tmp_path: Path) -> None:
    from datasets import Audio, Value

    columns = {"audio": clip_cells(tmp_path, 2), "label": ["cat", "dog"]}
    write_parquet(tmp_path / "x.parquet", columns, {"audio": Audio(), "label": Value("string")})
    with pytest.raises(CompileError, match=r"label column 'label' holds strings .* no ClassLabel"):
        open_corpus(str(tmp_path), "hf")


@pytest.mark.parametrize(
    ("out", "source"),
    [
        ("s3a://b/corpus/out", "s3://b/corpus"),
        ("s3://b/corpus/", "s3a://b/corpus"),
        ("gs://b/corpus/out", "gcs://b/corpus"),
        ("s3://b/x", "s3a://b/x/y/manifest.jsonl"),
    ],
)
def test_a_url_out_overlapping_source_under_another_scheme_is_refused(
    out: str, source: str
) -> None:
    from dlop.compiler.urls import check_url_apart

    with pytest.raises(CompileError, match="overlaps the corpus prefix"):
        check_url_apart(out, [source])


def test_url_out_apart_from_source_passes() -> None:
    from dlop.compiler.urls import check_url_apart

    check_url_apart("s3://b/corpus-out", ["s3a://b/corpus"])
    check_url_apart("s3://c/corpus/out", ["s3://b/corpus"])
    check_url_apart("gs://b/corpus/out", ["s3://b/corpus"])


def test_a_file_url_source_is_its_folder_for_the_output_check(tmp_path: Path) -> None:
    from dlop.compiler.output.guard import check_apart
    from dlop.compiler.recipe import build_recipe

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    recipe = build_recipe({"source": f"file://{corpus}", "layout": "folder"})
    with pytest.raises(CompileError, match="lies inside the corpus folder"):
        check_apart(corpus / "out", recipe)
    check_apart(tmp_path / "out", recipe)


def test_a_lhotse_supervision_past_its_recording_is_a_named_bad_input(tmp_path: Path) -> None:
    import json

    write_audio(tmp_path / "r.wav", make_signal(16000, 1.0), 16000)
    rec = {
        "id": "r",
        "sources": [{"type": "file", "channels": [0], "source": "r.wav"}],
        "sampling_rate": 16000,
        "num_samples": 16000,
        "duration": 1.0,
        "channel_ids": [0],
    }
    (tmp_path / "recordings.jsonl").write_text(json.dumps(rec) + "\n")
    spans = [("in", 0.0, 0.5), ("to_the_end", 0.75, 0.25), ("past_end", 0.75, 2.0)]
    sups = [
        {"id": i, "recording_id": "r", "start": a, "duration": d, "channel": 0, "text": i}
        for i, a, d in spans
    ]
    (tmp_path / "supervisions.jsonl").write_text("".join(json.dumps(s) + "\n" for s in sups))
    corpus = open_corpus(str(tmp_path / "supervisions.jsonl"), "lhotse")
    assert [it.error for it in corpus.items][:2] == [None, None]
    error = str(corpus.items[2].error)
    assert "supervisions.jsonl line 3: 'past_end' spans 0.75 s to 2.75 s" in error
    assert "past the end of its recording 'r' (1 s)" in error


def test_a_lhotse_channel_its_recording_lacks_is_a_named_bad_input(tmp_path: Path) -> None:
    """Not silently the first source's audio: Lhotse itself refuses such a channel."""
    import json

    for name in ("left", "right"):
        write_audio(tmp_path / f"{name}.wav", make_signal(16000, 1.0), 16000)
    rec = {
        "id": "r",
        "sources": [
            {"type": "file", "channels": [0], "source": "left.wav"},
            {"type": "file", "channels": [1], "source": "right.wav"},
        ],
        "sampling_rate": 16000,
        "num_samples": 16000,
        "duration": 1.0,
    }
    (tmp_path / "recordings.jsonl").write_text(json.dumps(rec) + "\n")
    channels = [("right", 1), ("both", [0, 1]), ("five", 5), ("one_of_two_gone", [1, 7])]
    sups = [
        {"id": i, "recording_id": "r", "start": 0.0, "duration": 0.5, "channel": c}
        for i, c in channels
    ]
    (tmp_path / "supervisions.jsonl").write_text("".join(json.dumps(s) + "\n" for s in sups))
    items = open_corpus(str(tmp_path / "supervisions.jsonl"), "lhotse").items
    assert [it.path for it in items[:2]] == [
        str(tmp_path / "right.wav"),
        str(tmp_path / "left.wav"),
    ]
    assert [it.error for it in items[:2]] == [None, None]
    assert items[2].error == (
        "supervisions.jsonl line 3: 'five' names channel 5, but its recording holds channels [0, 1]"
    )
    assert items[3].path is None and "names channel [1, 7]" in str(items[3].error)

"""A manifest's compact listing: Items made on demand from the manifest's bytes, a
fingerprint of those bytes (no stat per input), and the inputs' sizes recorded per work
unit so that --resume redoes a unit whose media changed."""

from __future__ import annotations

import json
import pickle
import signal
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from dlop.compiler.corpus.layouts import open_corpus, stream_items
from dlop.compiler.corpus.layouts.manifest import ManifestItems
from dlop.compiler.corpus.records import Item
from dlop.compiler.run.units import unit_corpus, unit_items
from dlop.tools.compile_cli import main

from .fixtures import manifest_corpus, write_audio
from .signals import make_signal
from .test_resume import EPOCH, committed, compile_until, files

LINES = 20_000


def _long_manifest(path: Path, lines: int = LINES) -> Path:
    path.write_text(
        "".join(
            f'{{"audio_filepath": "audio/{n // 1000:05d}/{n:08d}.flac", '
            f'"duration": {1 + n % 17 * 0.75}, "text": "utterance {n % 977}", '
            f'"label": "c{n % 7}"}}\n'
            for n in range(lines)
        )
    )
    return path


def test_a_listing_keeps_the_manifest_bytes_and_a_few_numbers_an_input(tmp_path: Path) -> None:
    manifest = _long_manifest(tmp_path / "m.jsonl")
    tracemalloc.start()
    try:
        corpus = open_corpus(str(manifest), "manifest", "audio")
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(corpus.items) == LINES
    # the bytes, plus well under 100 bytes an input (an Item each held about 570)
    assert kept < manifest.stat().st_size + 100 * LINES


def test_items_are_made_on_demand_as_a_sequence(tmp_path: Path) -> None:
    manifest = manifest_corpus(tmp_path / "m")
    with open(manifest, "a") as f:
        f.write('\nnot json\n{"audio_filepath": "wav/b.flac", "offset": 0.25, "label": "no"}\n')
    items = open_corpus(str(manifest), None).items
    assert isinstance(items, ManifestItems) and len(items) == 5
    assert [it.key for it in items] == [
        "wav/long.wav@0.5",
        "wav/long.wav@2",
        "wav/b.flac",
        "train.jsonl line 5",
        "wav/b.flac@0.25",
    ]
    assert items[-1] == items[4] and items[4].label == 0 and items[4].text is None
    assert items[0].path == str(manifest.parent / "wav" / "long.wav")
    assert (items[0].offset, items[0].duration, items[0].label) == (0.5, 1.0, 1)
    assert items[3].error is not None and "JSONDecodeError" in items[3].error
    assert items[1:3] == [items[1], items[2]] and isinstance(items[1:3], list)
    assert items[::2] == [items[0], items[2], items[4]]
    np.testing.assert_array_equal(items.duration[:3], [1.0, 0.8, 1.0])
    with pytest.raises(IndexError):
        items[5]


def test_a_unit_is_made_from_its_own_inputs_and_carries_only_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = _long_manifest(tmp_path / "m.jsonl")
    corpus = open_corpus(str(manifest), "manifest", "audio")
    made: list[int] = []
    original = ManifestItems.item

    def counted(self: ManifestItems, i: int) -> Item:
        made.append(i)
        return original(self, i)

    monkeypatch.setattr(ManifestItems, "item", counted)
    got = list(stream_items(corpus, LINES - 3, LINES))
    assert [it.key for it in got] == [f"audio/00019/{n:08d}.flac" for n in range(LINES - 3, LINES)]
    assert made == [LINES - 3, LINES - 2, LINES - 1]  # none before the unit's first input
    unit = unit_corpus(corpus, range(100, 110))
    assert isinstance(unit.items, list) and len(unit.items) == 10
    assert len(pickle.dumps(unit)) < manifest.stat().st_size // 50


def test_the_keys_come_without_making_items(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What an append asks of every input (its identity) costs a parse of its line, not an
    Item and a path check: those are for the inputs it compiles."""
    manifest = manifest_corpus(tmp_path / "m")
    with open(manifest, "a") as f:
        f.write("\nnot json\n")
    corpus = open_corpus(str(manifest), None)
    expected = [it.key for it in corpus.items]
    monkeypatch.setattr(ManifestItems, "item", lambda self, i: pytest.fail(f"item {i} made"))
    assert list(corpus.identity_texts()) == expected
    assert expected[-1] == "train.jsonl line 5" and len(corpus.identities()) == 4


def test_the_fingerprint_is_the_manifest_bytes_not_the_media_sizes(tmp_path: Path) -> None:
    manifest = manifest_corpus(tmp_path / "m")
    before = open_corpus(str(manifest), None).fingerprint
    write_audio(manifest.parent / "wav" / "b.flac", make_signal(8000, 2.0, seed=7), 8000)
    assert open_corpus(str(manifest), None).fingerprint == before  # no stat per input
    manifest.write_bytes(manifest.read_bytes().replace(b"other", b"another"))
    assert open_corpus(str(manifest), None).fingerprint != before


def test_a_unit_takes_its_inputs_sizes_before_giving_out_the_first(tmp_path: Path) -> None:
    corpus = open_corpus(str(manifest_corpus(tmp_path / "m")), None)
    sizes: dict[int, str] = {}
    stream = unit_items(corpus, 1, range(1, 3), sizes)
    assert next(stream).key == "wav/long.wav@2" and len(sizes[1]) == 64


@pytest.mark.slow
def test_resume_redoes_a_unit_whose_media_changed_after_its_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = manifest_corpus(tmp_path / "m")
    args = [str(manifest), "--unit-inputs", "1", "--workers", "1", "-q"]
    out = tmp_path / "out"
    proc = compile_until(args, out, "unit:1")  # killed right after unit 0's commit record
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, err.decode()
    assert committed(out) == [".dlop-unit-000000.json"]
    record = json.loads((out / ".dlop-unit-000000.json").read_text())
    assert len(record["input_sizes"]) == 64
    # unit 0's input (and unit 1's) now holds other audio, of another size
    write_audio(manifest.parent / "wav" / "long.wav", make_signal(16000, 4.0, seed=9), 16000)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    assert main([*args, "-o", str(out), "--resume"]) == 0
    assert main([*args, "-o", str(tmp_path / "fresh")]) == 0
    assert files(out) == files(tmp_path / "fresh")  # unit 0 compiled again from the new audio

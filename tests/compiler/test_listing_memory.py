"""A long manifest is listed without a list of its lines beside the items, and an Item
has no per-instance __dict__: the listing's memory per input stays bounded."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

from dlop.compiler.corpus.layouts import open_corpus
from dlop.compiler.corpus.listing import lines
from dlop.compiler.corpus.records import Item

LINES = 20_000


def test_listing_a_manifest_holds_its_bytes_and_items_only(tmp_path: Path) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(
        "".join(
            f'{{"audio_filepath": "audio/{n // 1000:05d}/{n:08d}.flac", '
            f'"duration": {1 + n % 17 * 0.75}, "text": "utterance {n % 977}"}}\n'
            for n in range(LINES)
        )
    )
    tracemalloc.start()
    try:
        corpus = open_corpus(str(manifest), "manifest", "audio")
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(corpus.items) == LINES
    # Beyond the items it returns, the listing held the manifest's bytes while it read
    # them (and little else); a list of every line as well would double that.
    assert peak - kept < 1.5 * manifest.stat().st_size


def test_an_item_has_no_instance_dict() -> None:
    assert not hasattr(Item("k", path="a.wav"), "__dict__")


def test_lines_numbers_and_offsets_as_before() -> None:
    raw = b"\xef\xbb\xbfa\r\nbb\n\nc"
    assert list(lines(raw)) == [(1, 3, b"a"), (2, 6, b"bb"), (3, 9, b""), (4, 10, b"c")]
    assert list(lines(b"a\n")) == [(1, 0, b"a"), (2, 2, b"")]
    assert list(lines(b"")) == [(1, 0, b"")]

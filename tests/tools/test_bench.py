"""Benchmarks run in CI untimed, at toy sizes: every row is measured and well formed."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlop.tools.bench import vision_bench


def test_vision_bench_rows(tmp_path: Path) -> None:
    rows = vision_bench.run(tmp_path, videos=2, images=2, workers=1, repeats=1, loader_mib=4)
    names = [(r.workload.split(":")[0], r.pipeline.split(" (")[0]) for r in rows]
    for media in ("video", "images"):
        assert (media, "dlop-compile") in names
        assert (media, "dlop Loader") in names
        assert (media, "np.copyto of the same fields' bytes") in names
    for r in rows:
        assert r.samples_per_s and r.samples_per_s > 0
    loaders = [r for r in rows if r.pipeline.startswith("dlop Loader")]
    assert all(r.baseline == "memcpy" and r.extra["vs_naive"] > 0 for r in loaders)


def test_speech_corpus_is_librispeech(tmp_path: Path) -> None:
    import soundfile as sf

    from dlop.compiler.corpus.layouts import detect_layout
    from dlop.tools.bench import speech_peers

    root, seconds = speech_peers.speech_corpus(tmp_path / "c", 3)
    assert detect_layout(root) == "librispeech"
    utts = speech_peers._utterances(root)
    assert len(utts) == 3
    lengths = [sf.info(path).duration for _, path, _ in utts]
    assert all(0.5 <= s <= 30.0 for s in lengths)
    assert abs(sum(lengths) - seconds) < 1e-3


@pytest.mark.slow
def test_speech_peers_rows(tmp_path: Path) -> None:
    """Runs only where make bench-peers installed the peers (.venv-peers)."""
    for name in ("lhotse", "lilcom", "datasets", "transformers"):
        pytest.importorskip(name)
    from dlop.tools.bench import speech_peers

    rows = speech_peers.run(tmp_path, utts=4, workers=1, repeats=1)
    compiled = [r for r in rows if r.workload.startswith("speech peers, compile")]
    read = [r for r in rows if r.workload.startswith("speech peers, read")]
    assert [r.pipeline.split()[0] for r in compiled[:3]] == ["dlop-compile,", "Lhotse", "datasets"]
    assert len(read) == 4
    for r in compiled[:3] + read:
        assert r.samples_per_s and r.samples_per_s > 0
    assert all("dlop_over_this" in r.extra for r in compiled[1:3] + read[1:])

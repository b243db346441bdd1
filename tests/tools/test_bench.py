"""Benchmarks run in CI untimed, at toy sizes: every row is measured and well formed."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlop.compiler.corpus.place import LocalPlace
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
    assert detect_layout(LocalPlace(root)) == "librispeech"
    utts = speech_peers.utterances(root)
    assert len(utts) == 3
    lengths = [sf.info(path).duration for _, path, _ in utts]
    assert all(0.5 <= s <= 30.0 for s in lengths)
    assert abs(sum(lengths) - seconds) < 1e-3


def test_short_corpus_is_a_manifest_of_short_wavs(tmp_path: Path) -> None:
    import soundfile as sf

    from dlop.compiler.corpus.layouts import detect_layout
    from dlop.tools.bench import speech_peers

    manifest, seconds = speech_peers.short_corpus(tmp_path / "c", 40)
    assert detect_layout(LocalPlace(manifest)) == "manifest"
    utts = speech_peers.utterances(manifest)
    assert len(utts) == 40 and all(text for _, _, text in utts)
    infos = [sf.info(path) for _, path, _ in utts]
    assert {(i.samplerate, i.subtype, i.format) for i in infos} == {(16000, "PCM_16", "WAV")}
    lengths = [i.duration for i in infos]
    assert all(0.5 <= s <= 8.0 for s in lengths)
    assert sum(0.8 <= s <= 1.0 for s in lengths) >= 8  # two in five, about
    assert abs(sum(lengths) - seconds) < 1e-3


def test_summary_seconds_reads_the_compiles_own_line() -> None:
    from dlop.tools.bench.speech_peers import summary_seconds

    line = "wrote out: 2500 samples in 1 shard(s), 77.4 MiB, 0 skipped; 3.1 s, 812 inputs/s; x"
    assert summary_seconds(line) == pytest.approx(2500 / 812)
    with pytest.raises(RuntimeError, match="no summary line"):
        summary_seconds("nothing")


@pytest.mark.slow
def test_speech_peers_rows(tmp_path: Path) -> None:
    """Runs only where make bench-peers installed the peers (.venv-peers)."""
    for name in ("lhotse", "lilcom", "datasets", "transformers"):
        pytest.importorskip(name)
    from dlop.tools.bench import speech_peers

    rows = speech_peers.run(tmp_path, utts=4, workers=1, repeats=1, short_utts=4)
    compiled = [r for r in rows if r.workload.startswith("speech peers, compile")]
    read = [r for r in rows if r.workload.startswith("speech peers, read")]
    assert [r.pipeline.split()[0] for r in compiled[:3]] == ["dlop-compile,", "Lhotse", "datasets"]
    assert len(read) == 4
    for r in compiled[:3] + read:
        assert r.samples_per_s and r.samples_per_s > 0
    assert all("dlop_over_this" in r.extra for r in compiled[1:3] + read[1:])
    short = [r for r in rows if r.workload.startswith("speech peers, short utterances")]
    assert [r.pipeline.split()[0] for r in short] == ["dlop-compile,", "Lhotse", "datasets"]
    assert all(r.samples_per_s and r.extra["wall_s"] > 0 for r in short)
    assert all(len(r.extra["dlop_over_this_rounds"]) == 1 for r in short[1:])

"""Featurization in groups: a clip's bytes do not depend on the clips featurized with it.

Unit level: clips featurized one by one, as one batch, split into groups at
arbitrary boundaries and chunked at other row counts give bit-identical float32
(and so float16) features, for every preset. End to end: 1 and 2 workers,
other group sizes and a kill -9 + --resume in the middle give identical archives.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dlop.compiler.audio import features
from dlop.compiler.audio import options as feature_options
from dlop.compiler.audio.features import (
    ROW_BLOCK,
    featurize,
    featurize_clips,
    frame_segments,
    frame_signal,
)
from dlop.compiler.audio.options import PRESETS, FeatureConfig, feature_config
from dlop.compiler.faults import KILL_AT as TEST_KILL_AT
from dlop.compiler.output.commit import COMMIT_PREFIX
from dlop.compiler.output.journal import JOURNAL
from dlop.compiler.run import items, pipeline
from dlop.tools.compile_cli import main

from .fixtures import esc50_row, write_audio, write_esc50_csv
from .signals import make_signal

KINDS = [
    ("librosa", "logmel", {}),
    ("librosa", "mfcc", {}),
    ("librosa", "logmel", {"fft_dtype": "float64"}),
    ("torchaudio", "logmel", {}),
    ("whisper", "logmel", {}),
    ("panns", "logmel", {}),
    ("kaldi", "fbank", {}),
    ("kaldi", "fbank", {"fft_dtype": "float64"}),
    ("ast", "fbank", {}),
]
EPOCH = "1700000000"


def ragged(rate: int) -> list[torch.Tensor]:
    """Clips of many lengths: empty, shorter than a frame, a few frames, several row blocks."""
    lengths = [int(rate * s) for s in (0.37, 0.05, 1.21, 0.6, 0.0, 0.9, 0.013, 0.44)]
    return [
        torch.from_numpy(make_signal(rate, n / rate, seed=i).astype(np.float32))
        if n
        else torch.zeros(0)
        for i, n in enumerate(lengths)
    ]


def as_bytes(feats: list[torch.Tensor]) -> list[bytes]:
    return [f.contiguous().numpy().tobytes() for f in feats]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize(("preset", "kind", "options"), KINDS)
def test_grouping_and_chunking_never_change_a_clips_bytes(
    preset: str, kind: str, options: dict[str, str], compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not compiled:  # the torch products that serve when the kernels were not built
        monkeypatch.setattr(features, "_native", None)
    elif features._native is None:
        pytest.skip("the compiled kernels were not built")
    cfg = feature_config(preset, kind, **options)
    clips = ragged(cfg.sample_rate)
    alone = [featurize_clips([c], cfg)[0] for c in clips]
    assert [f.shape[0] for f in alone] == [cfg.num_output_frames(len(c)) for c in clips]
    want = as_bytes(alone)
    assert as_bytes(featurize_clips(clips, cfg)) == want
    for cuts in ([1, 4], [2, 3, 7], [5]):
        split = []
        for a, b in zip([0, *cuts], [*cuts, len(clips)], strict=True):
            split += featurize_clips(clips[a:b], cfg)
        assert as_bytes(split) == want, cuts
    for rows in (ROW_BLOCK, 3 * ROW_BLOCK):
        assert as_bytes(featurize_clips(clips, cfg, chunk_frames=rows)) == want, rows
    half = [f.to(torch.float16) for f in featurize_clips(clips[::-1], cfg)][::-1]
    assert as_bytes(half) == as_bytes([f.to(torch.float16) for f in alone])


@pytest.mark.parametrize("seconds", [0.8, 0.05])  # 0.05 s: 3 frames, a short product
@pytest.mark.parametrize(("preset", "kind", "options"), KINDS)
def test_a_stacked_batch_is_bit_identical_to_its_clips(
    preset: str, kind: str, options: dict[str, str], seconds: float
) -> None:
    cfg = feature_config(preset, kind, **options)
    batch = torch.stack(
        [
            torch.from_numpy(make_signal(cfg.sample_rate, seconds, seed=s).astype(np.float32))
            for s in range(5)
        ]
    )
    together = featurize(batch, cfg)
    for i in range(len(batch)):
        assert torch.equal(together[i], featurize(batch[i], cfg)), i
    grid = featurize(batch[:4].reshape(2, 2, -1), cfg)
    assert torch.equal(grid.reshape(together[:4].shape), together[:4])


def test_clips_must_be_one_dimensional() -> None:
    with pytest.raises(ValueError, match=r"clip 1: expected a \(time,\) waveform"):
        featurize_clips([torch.zeros(100), torch.zeros(2, 100)], feature_config("kaldi"))


# -- end to end ---------------------------------------------------------------------


def speech_corpus(root: Path) -> list[str]:
    """Eleven clips of different lengths at two rates (one resampled), one unreadable."""
    rows = []
    for n in range(12):
        rate = 16000 if n % 3 else 22050
        name = f"{1 + n % 5}-{1000 + n}-A-{n % 3}.wav"
        path = root / "audio" / name
        if n == 6:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"RIFF")  # skipped: errors.jsonl too
        else:
            write_audio(path, make_signal(rate, 0.2 + 0.17 * n, seed=n), rate)
        rows.append(esc50_row(name, n))
    write_esc50_csv(root, rows)
    # units of 7: chunks of 7 and 5 by default, other cuts with other chunk sizes
    return [str(root), "--preset", "kaldi", "--shard-bytes", "12KB", "--unit-inputs", "7", "-q"]


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.mark.slow
def test_archive_bytes_do_not_depend_on_workers_groups_or_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = speech_corpus(tmp_path / "corpus")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    assert main([*args, "--workers", "1", "-o", str(tmp_path / "one")]) == 0
    whole = files(tmp_path / "one")
    assert len([n for n in whole if n.endswith(".dlop")]) >= 3 and "errors.jsonl" in whole

    assert main([*args, "--workers", "2", "-o", str(tmp_path / "two")]) == 0
    assert files(tmp_path / "two") == whole

    # other chunk sizes, and groups cut inside a chunk by the sample budget
    monkeypatch.setitem(pipeline.CHUNK_ITEMS, "audio", 5)
    monkeypatch.setattr(items, "GROUP_SAMPLES", 20000)
    assert main([*args, "--workers", "1", "-o", str(tmp_path / "small")]) == 0
    assert files(tmp_path / "small") == whole
    monkeypatch.undo()

    # killed in the middle (2 workers), resumed in-process with other group sizes
    out = tmp_path / "resumed"
    env = {**os.environ, "SOURCE_DATE_EPOCH": EPOCH, TEST_KILL_AT: "input:9"}
    cmd = [sys.executable, "-m", "dlop.tools.compile_cli", *args, "--workers", "2", "-o", str(out)]
    proc = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert (out / JOURNAL).exists()
    records = [json.loads(p.read_text()) for p in out.glob(f"{COMMIT_PREFIX}*.json")]
    consumed = sum(r["num_inputs"] for r in records)
    assert 0 < consumed <= 9 and consumed % 3  # unit 0 kept: 7 inputs, not whole chunks of 3
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    monkeypatch.setitem(pipeline.CHUNK_ITEMS, "audio", 3)
    assert main([*args, "--workers", "1", "--resume", "-o", str(out)]) == 0
    assert files(out) == whole


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_each_preset_computes_in_float32_and_records_it(preset: str) -> None:
    cfg = feature_config(preset)
    assert cfg.fft_dtype == "float32" and cfg.to_json()["fft_dtype"] == "float32"
    exact = feature_config(preset, fft_dtype="float64")
    assert FeatureConfig.from_json(exact.to_json()).fft_dtype == "float64"
    assert exact.to_json()["fft_dtype"] == "float64"


@pytest.mark.parametrize("pad_mode", ["constant", "reflect"])
@pytest.mark.parametrize(("frame", "hop"), [(16, 4), (16, 16), (15, 7), (8, 11), (2, 1)])
def test_frame_segments_are_the_centred_frames_in_pieces(
    pad_mode: str, frame: int, hop: int
) -> None:
    """Framing without padding the whole clip gives the rows padding it would, for lengths
    around every edge case (shorter than the padding, one frame, a few frames)."""
    for length in range(0, 5 * frame + 3 * hop):
        x = torch.arange(1, length + 1, dtype=torch.float32)
        for center in (True, False):
            want = frame_signal(x, frame, hop, center, pad_mode)
            pieces = frame_segments(x, frame, hop, center, pad_mode)
            got = torch.cat([p.reshape(-1, frame) for p in pieces])
            assert torch.equal(got, want.reshape(-1, frame)), (length, center)


@pytest.mark.parametrize(("preset", "options"), [("kaldi", {}), ("ast", {"fft_dtype": "float64"})])
def test_kaldi_power_of_frames_given_at_the_fft_length(
    preset: str, options: dict[str, str]
) -> None:
    """Frames gathered zero-padded to the FFT length give the bytes of frames padded later."""
    from dlop.compiler.audio import features

    cfg = feature_config(preset, "fbank", **options)
    size, _, padded = feature_options.kaldi_frame_sizes(cfg)
    x = torch.from_numpy(make_signal(cfg.sample_rate, 0.3, seed=4).astype(np.float32))
    frames = frame_signal(x, size, size // 2, center=False, pad_mode="constant")
    narrow = features._kaldi_power(frames.clone(), cfg)
    wide = features._kaldi_power(torch.nn.functional.pad(frames, (0, padded - size)), cfg)
    assert narrow.shape == (frames.shape[0], padded // 2 + 1)
    assert torch.equal(narrow, wide)

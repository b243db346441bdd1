"""Long recordings are featurized and resampled in bounded chunks, with the output of one pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dlop.compiler.audio import features
from dlop.compiler.audio.features import ROW_BLOCK, featurize
from dlop.compiler.audio.options import FeatureConfig, feature_config
from dlop.compiler.audio.resample import resample

KINDS = [
    ("librosa", "logmel"),
    ("librosa", "mfcc"),
    ("torchaudio", "logmel"),
    ("whisper", "logmel"),
    ("panns", "logmel"),
    ("kaldi", "fbank"),
    ("ast", "fbank"),
]


def quiet_then_loud(rate: int, seconds: float) -> torch.Tensor:
    """Noise 100 dB down for the first half, a loud tone mix after: the clip's peak comes late."""
    rng = np.random.default_rng(3)
    n = round(rate * seconds)
    t = np.arange(n) / rate
    x = 1e-5 * rng.standard_normal(n)
    x[n // 2 :] += 0.5 * np.sin(2 * np.pi * 440 * t[n // 2 :]) + 0.2 * np.sin(
        2 * np.pi * 3000 * t[n // 2 :]
    )
    return torch.from_numpy(x.astype(np.float32))


@pytest.mark.parametrize(("preset", "kind"), KINDS)
@pytest.mark.parametrize("fft_dtype", ["float64", "float32"])
def test_chunked_features_are_byte_identical_to_one_pass(
    preset: str, kind: str, fft_dtype: str
) -> None:
    cfg = feature_config(preset, kind, fft_dtype=fft_dtype)
    x = quiet_then_loud(cfg.sample_rate, 4.3)
    whole = featurize(x, cfg, chunk_frames=1 << 30)
    assert whole.shape[0] > 3 * ROW_BLOCK or cfg.num_frames is not None
    for chunk in (ROW_BLOCK, 2 * ROW_BLOCK + 5):  # rounded up to whole ROW_BLOCKs
        chunked = featurize(x, cfg, chunk_frames=chunk)
        assert chunked.shape == whole.shape
        assert torch.equal(chunked, whole), f"{preset} {kind} chunk {chunk}"
    batch = torch.stack([x, 0.5 * x.flip(0)])
    assert torch.equal(
        featurize(batch, cfg, chunk_frames=1), featurize(batch, cfg, chunk_frames=1 << 30)
    )


def test_clip_clamps_use_the_whole_clips_peak() -> None:
    """top_db and Whisper's max - 8 are taken against the peak of the whole clip, not of a chunk."""
    x = quiet_then_loud(22050, 4.3)
    cfg = feature_config("librosa")
    out = featurize(x, cfg, chunk_frames=ROW_BLOCK)
    first = out[:ROW_BLOCK]
    assert float(out.max()) - float(first.max()) > 20  # the first chunk's own peak is far lower
    assert float(out.min()) == pytest.approx(float(out.max()) - 80.0)
    whisper = feature_config("whisper")
    w = featurize(quiet_then_loud(16000, 4.3), whisper, chunk_frames=ROW_BLOCK)
    assert float(w.min()) == pytest.approx(float(w.max()) - 2.0)  # (max - 8 + 4) / 4 spans 2


def test_default_chunking_bounds_the_spectrogram(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a chunk size, the FFT runs on at most CHUNK_SAMPLES samples of frames at a time."""
    seen: list[int] = []
    real = features._stft_spectrum

    def spy(frames: torch.Tensor, cfg: FeatureConfig) -> torch.Tensor:
        seen.append(frames.shape[-2])
        return real(frames, cfg)

    monkeypatch.setattr(features, "_stft_spectrum", spy)
    monkeypatch.setattr(features, "CHUNK_SAMPLES", 2048 * 2 * ROW_BLOCK)
    x = quiet_then_loud(22050, 5.0)
    out = featurize(x, feature_config("librosa"))
    assert seen[:-1] == [2 * ROW_BLOCK] * (len(seen) - 1) and 0 < seen[-1] <= 2 * ROW_BLOCK
    assert out.shape[0] == 216  # rows: its frames, zero-padded to whole ROW_BLOCKs
    assert sum(seen) == -(-216 // ROW_BLOCK) * ROW_BLOCK
    assert torch.equal(out, featurize(x, feature_config("librosa"), chunk_frames=1 << 30))


@pytest.mark.parametrize(
    ("orig", "new"), [(48000, 16000), (48000, 22050), (44100, 16000), (16000, 22050), (8000, 16000)]
)
def test_chunked_resample_is_byte_identical_to_one_pass(orig: int, new: int) -> None:
    rng = np.random.default_rng(orig + new)
    for n in (1, 999, 2 * orig + 17):
        x = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
        whole = resample(x, orig, new, chunk_samples=1 << 30)
        assert whole.shape == (-(-n * new // orig),)
        for chunk in (1, 777, orig // 3):
            assert torch.equal(resample(x, orig, new, chunk_samples=chunk), whole)
    batch = torch.from_numpy(rng.standard_normal((2, 3, 5001)).astype(np.float32))
    split = resample(batch, orig, new, chunk_samples=700)
    assert torch.equal(split, resample(batch, orig, new, chunk_samples=1 << 30))
    assert torch.equal(split[1, 2], resample(batch[1, 2], orig, new, chunk_samples=300))

"""Resampler quality: tone SNR and log-mel agreement with soxr HQ."""

from __future__ import annotations

import librosa
import numpy as np
import pytest
import torch

from dlop.compiler.audio.features import featurize
from dlop.compiler.audio.options import feature_config
from dlop.compiler.audio.resample import resample

from .signals import make_signal


def tone_snr_db(orig: int, new: int, freq: float, dtype: torch.dtype) -> float:
    seconds = 1.0
    t_in = np.arange(int(orig * seconds)) / orig
    x = torch.from_numpy(np.sin(2 * np.pi * freq * t_in + 0.1)).to(dtype)
    y = resample(x, orig, new).double().numpy()
    t_out = np.arange(len(y)) / new
    ideal = np.sin(2 * np.pi * freq * t_out + 0.1)
    edge = int(0.1 * new)  # the kernel sees zeros beyond the ends
    err = y[edge:-edge] - ideal[edge:-edge]
    return float(10 * np.log10(np.sum(ideal[edge:-edge] ** 2) / np.sum(err**2)))


@pytest.mark.parametrize(
    ("orig", "new"), [(44100, 16000), (48000, 16000), (8000, 16000), (22050, 32000)]
)
def test_tone_snr_above_100_db_to_0_8_nyquist(orig: int, new: int) -> None:
    nyquist = min(orig, new) / 2
    for frac in (0.05, 0.3, 0.6, 0.8):
        snr = tone_snr_db(orig, new, frac * nyquist, torch.float64)
        assert snr >= 100, f"{orig}->{new} at {frac} Nyquist: {snr:.1f} dB"


def test_output_length_and_dtype() -> None:
    for n in (0, 1, 2, 441, 44101):
        y = resample(torch.zeros(n), 44100, 16000)
        assert y.shape == (int(np.ceil(n * 16000 / 44100)),) and y.dtype == torch.float32
    batch = resample(torch.zeros(3, 2, 4800), 48000, 16000)
    assert batch.shape == (3, 2, 1600)
    with pytest.raises(ValueError, match="positive"):
        resample(torch.zeros(10), 0, 16000)


@pytest.mark.parametrize("orig", [44100, 48000, 8000])
def test_logmel_below_0_8_nyquist_matches_soxr_hq(orig: int) -> None:
    x = make_signal(orig, seconds=2.0)
    ours = resample(torch.from_numpy(x), orig, 16000)
    ref = torch.from_numpy(librosa.resample(x, orig_sr=orig, target_sr=16000, res_type="soxr_hq"))
    assert ours.shape == ref.shape
    f_max = 0.8 * min(orig, 16000) / 2
    cfg = feature_config("torchaudio", n_mels=40, f_max=f_max, hop_length=160)
    a, b = featurize(ours, cfg).double(), featurize(ref, cfg).double()
    inner = slice(10, -10)  # resamplers differ in how they treat the clip's ends
    diff = (a[inner] - b[inner]).abs().max().item()
    assert diff < 0.01, f"{diff:.4f} dB"


def test_float32_input_keeps_high_snr() -> None:
    assert tone_snr_db(44100, 16000, 0.8 * 8000, torch.float32) >= 100

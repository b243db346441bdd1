"""Mel scales and filterbanks, computed in float64 with numpy.

Scales: HTK (2595 log10(1 + f/700)), Slaney (Auditory Toolbox: linear below
1 kHz, logarithmic above) and Kaldi (1127 ln(1 + f/700)); triangles and the
Slaney area norm as librosa.filters.mel and torchaudio.functional.melscale_fbanks
define them, and Kaldi's mel-domain triangles as kaldi/src/feat/mel-computations.cc.
"""

from __future__ import annotations

import functools
import math

import numpy as np


def hz_to_mel(f: np.ndarray | float, scale: str) -> np.ndarray:
    f = np.asarray(f, dtype=np.float64)
    if scale == "htk":
        return 2595.0 * np.log10(1.0 + f / 700.0)
    if scale == "kaldi":
        return 1127.0 * np.log(1.0 + f / 700.0)
    if scale == "slaney":
        f_sp, min_log_hz = 200.0 / 3, 1000.0
        min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
        linear = f / f_sp
        return np.where(
            f >= min_log_hz,
            min_log_mel + np.log(np.maximum(f, 1e-300) / min_log_hz) / logstep,
            linear,
        )
    raise ValueError(f"unknown mel scale {scale!r} (htk, slaney, kaldi)")


def mel_to_hz(m: np.ndarray | float, scale: str) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    if scale == "htk":
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)
    if scale == "kaldi":
        return 700.0 * (np.exp(m / 1127.0) - 1.0)
    if scale == "slaney":
        f_sp, min_log_hz = 200.0 / 3, 1000.0
        min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
        return np.where(
            m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), f_sp * m
        )
    raise ValueError(f"unknown mel scale {scale!r} (htk, slaney, kaldi)")


@functools.lru_cache(maxsize=32)
def mel_filterbank(
    sample_rate: int, n_fft: int, n_mels: int, f_min: float, f_max: float, scale: str, norm: str
) -> np.ndarray:
    """Triangles in Hz at bins ``k * sr / n_fft`` (librosa/torchaudio): ``[n_fft//2+1, n_mels]``."""
    freqs = np.linspace(0.0, sample_rate / 2.0, 1 + n_fft // 2)
    edges = mel_to_hz(
        np.linspace(hz_to_mel(f_min, scale), hz_to_mel(f_max, scale), n_mels + 2), scale
    )
    fdiff = np.diff(edges)
    ramps = edges[:, None] - freqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    if norm == "slaney":
        weights *= (2.0 / (edges[2 : n_mels + 2] - edges[:n_mels]))[:, None]
    elif norm != "none":
        raise ValueError(f"unknown mel norm {norm!r} (slaney, none)")
    out = np.ascontiguousarray(weights.T)
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=32)
def kaldi_filterbank(
    sample_rate: int, padded_window: int, n_mels: int, low_freq: float, high_freq: float
) -> np.ndarray:
    """Kaldi's triangles in the mel domain, no norm, Nyquist column zero: ``[padded/2+1, n_mels]``."""
    nyquist = 0.5 * sample_rate
    if high_freq <= 0.0:
        high_freq += nyquist
    if not 0.0 <= low_freq < high_freq <= nyquist:
        raise ValueError(
            f"fbank needs 0 <= low_freq < high_freq <= Nyquist, got {low_freq}, {high_freq}"
        )
    n_bins = padded_window // 2
    mel_low, mel_high = hz_to_mel(low_freq, "kaldi"), hz_to_mel(high_freq, "kaldi")
    delta = (mel_high - mel_low) / (n_mels + 1)
    b = np.arange(n_mels, dtype=np.float64)[:, None]
    left, centre, right = mel_low + b * delta, mel_low + (b + 1) * delta, mel_low + (b + 2) * delta
    mel = hz_to_mel(sample_rate / padded_window * np.arange(n_bins, dtype=np.float64), "kaldi")[
        None, :
    ]
    up = (mel - left) / (centre - left)
    down = (right - mel) / (right - centre)
    banks = np.maximum(0.0, np.minimum(up, down))
    out = np.ascontiguousarray(np.concatenate([banks, np.zeros((n_mels, 1))], axis=1).T)
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=8)
def dct_matrix(n_mels: int, n_mfcc: int) -> np.ndarray:
    """Orthonormal DCT-II: ``[n_mels, n_mfcc]`` (scipy.fft.dct type 2, norm='ortho')."""
    n = np.arange(n_mels, dtype=np.float64)[:, None]
    k = np.arange(n_mfcc, dtype=np.float64)[None, :]
    m = np.cos(math.pi / n_mels * (n + 0.5) * k) * math.sqrt(2.0 / n_mels)
    m[:, 0] /= math.sqrt(2.0)
    m.flags.writeable = False
    return m

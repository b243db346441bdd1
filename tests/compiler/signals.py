"""Deterministic test signals: tones, chirps and formant-like sweeps over a noise floor."""

from __future__ import annotations

import numpy as np


def make_signal(
    sample_rate: int, seconds: float = 1.3, seed: int = 0, channels: int = 1
) -> np.ndarray:
    """float64 ``[time]`` (or ``[time, channels]``) in about [-0.9, 0.9]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(sample_rate * seconds)) / sample_rate
    nyq = sample_rate / 2
    x = 0.3 * np.sin(2 * np.pi * 0.05 * nyq * t + 0.3)
    x += 0.2 * np.sin(2 * np.pi * (0.02 * nyq + 0.3 * nyq * t / seconds) * t)  # chirp
    env = 0.5 + 0.5 * np.sin(2 * np.pi * 3 * t)
    for formant in (0.06, 0.15, 0.3):  # speech-like harmonic bursts
        x += (
            0.08
            * env
            * np.sin(2 * np.pi * formant * nyq * t * (1 + 0.05 * np.sin(2 * np.pi * 2 * t)))
        )
    x += 10 ** (-50 / 20) * rng.standard_normal(len(t))  # noise floor 50 dB down
    x = 0.9 * x / np.abs(x).max()
    if channels > 1:
        x = np.stack([x * (1 - 0.1 * c) for c in range(channels)], axis=1)
    return x

"""A small ESC-50-layout corpus of synthetic sounds, in several formats, rates and channel counts."""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dlop.formats.extras import needs_extra

CLASSES = ("tone", "chirp", "noise_burst", "formant_sweep", "click_train")
# (extension, soundfile format, subtype, sample rate, channels), cycled over clips
FORMATS = (
    ("wav", "WAV", "PCM_16", 44100, 1),
    ("flac", "FLAC", "PCM_16", 48000, 2),
    ("wav", "WAV", "FLOAT", 22050, 1),
    ("ogg", "OGG", "VORBIS", 32000, 2),
    ("wav", "WAV", "PCM_16", 16000, 1),
)


def synth(kind: str, rate: int, seconds: float, rng: np.random.Generator) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    x: np.ndarray
    if kind == "tone":
        f = rng.uniform(200, 2000)
        x = np.sin(2 * np.pi * f * t) + 0.3 * np.sin(2 * np.pi * 2 * f * t)
    elif kind == "chirp":
        f0, f1 = rng.uniform(100, 500), rng.uniform(2000, 7000)
        x = np.sin(2 * np.pi * (f0 * t + (f1 - f0) * t**2 / (2 * seconds)))
    elif kind == "noise_burst":
        x = rng.standard_normal(len(t)) * ((t * rng.uniform(2, 6)) % 1 < 0.3)
    elif kind == "formant_sweep":
        pitch = rng.uniform(90, 220) * (1 + 0.1 * np.sin(2 * np.pi * 0.7 * t))
        phase = 2 * np.pi * np.cumsum(pitch) / rate
        x = np.sum([np.sin(k * phase) / k for k in range(1, 30)], axis=0)
        formant = 500 + 1500 * (0.5 + 0.5 * np.sin(2 * np.pi * rng.uniform(0.2, 1.0) * t))
        x = x * (1 + np.sin(2 * np.pi * formant * t) * 0.5)
    else:
        period = int(rate / rng.uniform(3, 20))
        x = np.zeros(len(t))
        x[::period] = 1.0
        x = np.convolve(x, np.exp(-np.arange(200) / 20), mode="same")
    x = x + 0.003 * rng.standard_normal(len(t))
    out: np.ndarray = (0.7 * x / (np.abs(x).max() + 1e-9)).astype(np.float32)
    return out


def make_demo_corpus(
    root: str | Path,
    clips_per_class: int = 40,
    seconds: float = 5.0,
    seed: int = 0,
    on_clip: Callable[[int, int], None] | None = None,
) -> Path:
    """Writes ``root/audio/*`` and ``root/meta/esc50.csv``; returns root. ``on_clip(done,
    total)`` is called after each clip written."""
    with needs_extra("compile", "writing the demo corpus"):
        import soundfile as sf

    root = Path(root)
    (root / "audio").mkdir(parents=True, exist_ok=True)
    (root / "meta").mkdir(exist_ok=True)
    rng = np.random.default_rng(seed)
    rows = []
    total = clips_per_class * len(CLASSES)
    for n in range(total):
        target = n % len(CLASSES)
        ext, fmt, subtype, rate, channels = FORMATS[(n // len(CLASSES)) % len(FORMATS)]
        fold = 1 + n % 5
        name = f"{fold}-{100000 + n}-A-{target}.{ext}"
        x = synth(CLASSES[target], rate, seconds, rng)
        if channels == 2:
            x = np.stack([x, 0.8 * x], axis=1)
        sf.write(root / "audio" / name, x, rate, format=fmt, subtype=subtype)
        rows.append(
            {
                "filename": name,
                "fold": fold,
                "target": target,
                "category": CLASSES[target],
                "esc10": "False",
                "src_file": 100000 + n,
                "take": "A",
            }
        )
        if on_clip is not None:
            on_clip(n + 1, total)
    with open(root / "meta" / "esc50.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return root


# The ESC-50 benchmark shape: 5 s at 44.1 kHz, 128-mel log-mel, n_fft 1024, hop 512 -> [431, 128].
DEMO_RECIPE = {
    "preset": "librosa",
    "sample_rate": 44100,
    "n_fft": 1024,
    "hop_length": 512,
    "n_mels": 128,
    "duration": 5.0,
    "dtype": "float16",
}

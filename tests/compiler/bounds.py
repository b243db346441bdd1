"""Error bounds of the float32 feature pipeline against float64 references.

A test's tolerance comes from these bounds, not from one machine's observed error.
u = 2^-24 is float32's unit roundoff. For a frame whose float64 spectrum is X
(N points, ||X||_2 over all N bins):

- the windowed frame carries the window's and the product's rounding, 2u per
  sample, and the caller's time-domain steps ``time_terms`` more (Kaldi's DC
  removal and pre-emphasis), each relative to the frame's own norm;
- a float32 FFT errs by at most 7 u ceil(log2 N) ||X||_2 in 2-norm (Higham,
  Accuracy and Stability of Numerical Algorithms, 2nd ed., Thm 24.2: log2(N) eta
  with eta = mu + gamma_4 (sqrt 2 + mu) < 6.7u for twiddles accurate to u), so
  every bin errs by at most E = u (7 ceil(log2 N) + 2 + time_terms) ||X||_2;
- a power |X_k|^2 errs by at most 2|X_k| E + E^2, plus its own rounding 2u |X_k|^2;
- a filterbank band m = sum_k w_k p_k errs by at most sum_k w_k dp_k + (K + 2) u m
  (float32 weights and a sum of K terms);
- log10 of a band errs by at most dm / (ln 10 max(m - dm, amin)) + u |log10 m|.

Clamps (top_db, Whisper's max - 8) move by the bound at the clip's maximum, which
is added to every element.
"""

from __future__ import annotations

import math

import librosa
import numpy as np

U = 2.0**-24


def frame_norms(spectrum: np.ndarray, n_fft: int) -> np.ndarray:
    """||X||_2 over all n_fft bins of each frame, from the one-sided float64 spectrum
    ``[bins, frames]`` (bins = n_fft // 2 + 1)."""
    p = np.abs(spectrum) ** 2
    total = p[0] + 2 * p[1:].sum(axis=0)
    if n_fft % 2 == 0:
        total -= p[-1]  # the Nyquist bin stands once
    return np.sqrt(total)


def band_bound(
    spectrum: np.ndarray,
    fb: np.ndarray,
    n_fft: int,
    extra: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(float64 bands m, their bound dm), both ``[frames, bands]``, for the power
    spectrum |X|^2 of ``spectrum`` ``[bins, frames]`` through ``fb`` ``[bands, bins]``.

    ``extra``: a further absolute error per bin of each frame (time-domain steps)."""
    mag = np.abs(spectrum)
    e = U * (7 * math.ceil(math.log2(n_fft)) + 2) * frame_norms(spectrum, n_fft)
    if extra is not None:
        e = e + extra
    dp = 2 * mag * e + e**2 + 2 * U * mag**2
    m = fb @ mag**2
    k = np.count_nonzero(fb, axis=1)[:, None]
    dm = fb @ dp + (k + 2) * U * m
    return m.T, dm.T


def log10_bound(m: np.ndarray, dm: np.ndarray, amin: float) -> np.ndarray:
    """The bound of log10(max(m, amin)) computed in float32, elementwise."""
    return log_bound(m, dm, amin) / math.log(10)


def log_bound(m: np.ndarray, dm: np.ndarray, amin: float) -> np.ndarray:
    """The bound of ln(max(m, amin)) computed in float32, elementwise."""
    floor = np.maximum(m - dm, amin)
    return dm / floor + U * np.abs(np.log(np.maximum(m, amin)))


def clamped(bound: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """``bound`` plus the bound at the reference's maximum: a clamp below the clip's
    maximum moves with it."""
    return bound + bound.flat[int(np.argmax(reference))]


def librosa_logmel(
    x: np.ndarray,
    sr: int,
    n_fft: int,
    hop: int,
    n_mels: int,
    pad_mode: str,
    fmin: float = 0.0,
    fmax: float | None = None,
    top_db: float | None = 80.0,
) -> tuple[np.ndarray, np.ndarray]:
    """librosa's log-mel in dB and its float32 bound (tests/compiler/bounds.py), both
    ``[frames, n_mels]``."""
    mel = librosa.feature.melspectrogram(
        y=x,
        sr=sr,
        n_fft=n_fft,
        hop_length=hop,
        n_mels=n_mels,
        pad_mode=pad_mode,
        fmin=fmin,
        fmax=fmax,
        power=2.0,
    )
    want = librosa.power_to_db(mel, ref=1.0, amin=1e-10, top_db=top_db).T
    spec = librosa.stft(x, n_fft=n_fft, hop_length=hop, center=True, pad_mode=pad_mode)
    fb = librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=n_mels, fmin=fmin, fmax=fmax)
    m, dm = band_bound(spec, fb, n_fft)
    bound = 10 * log10_bound(m, dm, 1e-10)
    return want, clamped(bound, m) if top_db is not None else bound

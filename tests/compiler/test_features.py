"""Feature parity with librosa 0.11 and with float64 references of the documented algorithms."""

from __future__ import annotations

import librosa
import numpy as np
import pytest
import torch

from dlop.compiler.audio.features import featurize
from dlop.compiler.audio.options import feature_config

from .bounds import U, band_bound, clamped, librosa_logmel, log10_bound, log_bound
from .signals import make_signal as _make_signal


def ours(x: np.ndarray, preset: str, **kw) -> np.ndarray:
    cfg = feature_config(preset, **kw)
    return featurize(torch.from_numpy(x.astype(np.float32)), cfg).numpy().astype(np.float64)


def make_signal(*args, **kw) -> np.ndarray:
    """Decoded audio is float32: references get the same rounded samples, in float64."""
    return _make_signal(*args, **kw).astype(np.float32).astype(np.float64)


@pytest.mark.parametrize("seed", [0, 1])
def test_librosa_preset(seed: int) -> None:
    x = make_signal(22050, seed=seed)
    want, bound = librosa_logmel(x, 22050, 2048, 512, 128, "constant")
    got = ours(x, "librosa")
    assert got.shape == want.shape
    assert (np.abs(got - want) <= bound).all()


def test_librosa_preset_at_other_settings() -> None:
    x = make_signal(44100)
    want, bound = librosa_logmel(x, 44100, 1024, 512, 128, "constant")
    got = ours(x, "librosa", sample_rate=44100, n_fft=1024, hop_length=512)
    assert (np.abs(got - want) <= bound).all()


def test_panns_preset() -> None:
    x = make_signal(32000)
    want, bound = librosa_logmel(
        x, 32000, 1024, 320, 64, "reflect", fmin=50, fmax=14000, top_db=None
    )
    got = ours(x, "panns")
    assert got.shape == want.shape
    assert (np.abs(got - want) <= bound).all()


@pytest.mark.filterwarnings("ignore:Empty filters detected")
@pytest.mark.parametrize("n_mels", [80, 128])
def test_whisper_preset(n_mels: int) -> None:
    x = make_signal(16000, seconds=2.0)
    stft = librosa.stft(
        x, n_fft=400, hop_length=160, window="hann", center=True, pad_mode="reflect"
    )
    power = np.abs(stft[:, :-1]) ** 2
    fb = librosa.filters.mel(sr=16000, n_fft=400, n_mels=n_mels)
    mel = fb @ power
    log = np.log10(np.maximum(mel, 1e-10))
    log = (np.maximum(log, log.max() - 8.0) + 4.0) / 4.0
    got = ours(x, "whisper", n_mels=n_mels)
    assert got.shape == log.T.shape
    m, dm = band_bound(stft[:, :-1], fb, 400)
    bound = clamped(log10_bound(m, dm, 1e-10), m) / 4 + U * np.abs(log.T)
    assert (np.abs(got - log.T) <= bound).all()


def test_mfcc_matches_librosa() -> None:
    import scipy.fft

    x = make_signal(22050)
    want = librosa.feature.mfcc(y=x, sr=22050, n_mfcc=20).T
    got = ours(x, "librosa", features="mfcc")
    db, db_bound = librosa_logmel(x, 22050, 2048, 512, 128, "constant")
    dct = np.abs(scipy.fft.dct(np.eye(128), type=2, norm="ortho", axis=0)[:20])
    # the dB values' bounds through the DCT, and the product's own float32 sum
    bound = db_bound @ dct.T
    bound += 130 * U * (np.abs(db) @ dct.T)
    assert (np.abs(got - want) <= bound).all()


@pytest.mark.filterwarnings(
    "ignore:Empty filters detected"
)  # 128 HTK mels on a 400-point FFT, as torchaudio does
@pytest.mark.parametrize("fft_dtype", ["float32", "float64"])
def test_torchaudio_preset_against_float64_reference(fft_dtype: str) -> None:
    """float64 matches in every band. float32, the default, matches where the signal
    stands within 60 dB of the clip's peak (no top_db here: bands reach -100 dB), and
    deeper bands err no more than torchaudio's own float32 computation (torch.stft)."""
    x = make_signal(16000)
    stft = librosa.stft(
        x, n_fft=400, hop_length=200, window="hann", center=True, pad_mode="reflect"
    )
    fb = librosa.filters.mel(sr=16000, n_fft=400, n_mels=128, htk=True, norm=None)
    want = (10 * np.log10(np.maximum(fb @ np.abs(stft) ** 2, 1e-10))).T
    got = ours(x, "torchaudio", fft_dtype=fft_dtype)
    assert got.shape == want.shape
    err = np.abs(got - want)
    # The float32 FFT's bound holds for both: the float64 FFT rounds each bin to
    # complex64, but its bands were seen to err up to 46u, more than that rounding
    # alone would give, so it is held to the float32 bound only.
    m, dm = band_bound(stft, fb, 400)
    assert (err <= 10 * log10_bound(m, dm, 1e-10)).all()
    if fft_dtype == "float64":
        return
    spec = torch.stft(
        torch.from_numpy(x.astype(np.float32)),
        400,
        200,
        window=torch.hann_window(400),
        center=True,
        pad_mode="reflect",
        return_complex=True,
    )
    mel = (spec.abs() ** 2).T @ torch.from_numpy(fb.T.astype(np.float32))
    theirs = (10 * torch.log10(mel.clamp_min(1e-10))).double().numpy()
    assert err.max() <= np.abs(theirs - want).max()


def kaldi_reference(
    x: np.ndarray, sr: int, n_bins: int, window: str, scale: float
) -> tuple[np.ndarray, np.ndarray]:
    """Kaldi fbank written out from its documentation, float64, one frame at a time;
    and its bound (tests/compiler/bounds.py), both ``[frames, n_bins]``.

    The bound adds the time-domain steps' float32 rounding: the scaled samples, the
    mean (a sum of ``size`` terms, u size max|f| at most), pre-emphasis and window,
    at most u (2 size + 6) ||f||_2 per frame in 2-norm, sqrt(padded) times that
    per bin."""
    size, shift = int(sr * 0.025), int(sr * 0.010)
    padded = 1
    while padded < size:
        padded *= 2
    n = np.arange(size)
    hann = 0.5 - 0.5 * np.cos(2 * np.pi * n / (size - 1))
    win = hann**0.85 if window == "povey" else hann
    mel = lambda f: 1127.0 * np.log(1.0 + f / 700.0)  # noqa: E731
    lo, hi = mel(20.0), mel(sr / 2)
    delta = (hi - lo) / (n_bins + 1)
    bank = np.zeros((n_bins, padded // 2 + 1))
    for b in range(n_bins):
        left, centre, right = lo + b * delta, lo + (b + 1) * delta, lo + (b + 2) * delta
        for k in range(padded // 2):
            m = mel(k * sr / padded)
            if left < m < right:
                bank[b, k] = (
                    (m - left) / (centre - left) if m <= centre else (right - m) / (right - centre)
                )
    spectra, extra = [], []
    for start in range(0, len(x) - size + 1, shift):
        f = x[start : start + size] * scale
        extra.append(U * (2 * size + 6) * np.linalg.norm(f) * np.sqrt(padded))
        f = f - f.mean()
        f = np.concatenate([[f[0] - 0.97 * f[0]], f[1:] - 0.97 * f[:-1]])
        spectra.append(np.fft.rfft(f * win, padded))
    spec = np.array(spectra).T.reshape(padded // 2 + 1, -1)
    eps = float(np.finfo(np.float32).eps)
    m, dm = band_bound(spec, bank, padded, extra=np.array(extra))
    return np.log(np.maximum(m, eps)), log_bound(m, dm, eps)


def test_kaldi_preset_against_float64_reference() -> None:
    x = make_signal(16000, seconds=0.7)
    want, bound = kaldi_reference(x, 16000, 23, "povey", 32768.0)
    got = ours(x, "kaldi")
    assert got.shape == want.shape == (1 + (len(x) - 400) // 160, 23)
    assert (np.abs(got - want) <= bound).all()


def test_ast_preset_against_float64_reference() -> None:
    x = make_signal(16000, seconds=0.7)
    fbank, fbank_bound = kaldi_reference(x, 16000, 128, "hanning", 1.0)
    padded = np.zeros((512, 128))
    padded[: len(fbank)] = fbank
    want = (padded + 6.6268077) / (2 * 5.358466)
    bound = np.zeros((512, 128))
    bound[: len(fbank)] = fbank_bound / (2 * 5.358466)
    bound += 4 * U * np.abs(want)  # the shift and the division, rounded in float32
    got = ours(x, "ast")
    assert got.shape == (512, 128)
    assert (np.abs(got - want) <= bound).all()


def test_torchaudio_itself_where_it_imports() -> None:
    try:
        import torchaudio
    except Exception as e:
        pytest.skip(f"torchaudio does not import here: {type(e).__name__}")
    x = torch.from_numpy(make_signal(16000).astype(np.float32))
    mel = torchaudio.transforms.MelSpectrogram(sample_rate=16000, n_fft=400, n_mels=128)(x)
    want = torchaudio.transforms.AmplitudeToDB(stype="power")(mel).T.numpy()
    assert np.abs(ours(x.numpy(), "torchaudio") - want).max() < 5e-4
    fb = torchaudio.compliance.kaldi.fbank(x[None] * 32768, dither=0.0).numpy()
    assert np.abs(ours(x.numpy(), "kaldi") - fb).max() < 5e-3


@pytest.mark.parametrize("preset", ["librosa", "whisper", "panns", "torchaudio", "kaldi", "ast"])
def test_batched_equals_per_clip(preset: str) -> None:
    cfg = feature_config(preset)
    clips = torch.stack(
        [
            torch.from_numpy(make_signal(cfg.sample_rate, seconds=0.8, seed=s)).float()
            for s in range(3)
        ]
    )
    batched = featurize(clips, cfg)
    for i in range(3):
        single = featurize(clips[i], cfg)
        torch.testing.assert_close(batched[i], single, rtol=1e-6, atol=1e-5)


def test_short_and_silent_clips() -> None:
    for preset in ("librosa", "whisper", "panns", "torchaudio", "kaldi", "ast"):
        cfg = feature_config(preset)
        for n in (0, 1, 7):
            out = featurize(torch.zeros(n), cfg)
            assert out.shape[-1] == cfg.bins and out.shape[0] == cfg.num_output_frames(n)
            assert torch.isfinite(out).all()
        silent = featurize(torch.zeros(cfg.sample_rate), cfg)
        assert torch.isfinite(silent).all()


def test_num_output_frames_matches() -> None:
    for preset in ("librosa", "whisper", "panns", "torchaudio", "kaldi"):
        cfg = feature_config(preset)
        for n in (399, 400, 401, 16000, 22050):
            assert featurize(torch.zeros(n), cfg).shape[0] == cfg.num_output_frames(n)


def test_bad_options_are_named() -> None:
    with pytest.raises(ValueError, match="unknown preset"):
        feature_config("htk")
    with pytest.raises(ValueError, match="win_length"):
        feature_config("librosa", win_length=4096)
    with pytest.raises(ValueError, match="fbank needs"):
        feature_config("librosa", features="fbank")
    with pytest.raises(ValueError, match="f_max"):
        feature_config("librosa", f_max=30000.0)


def test_float32_fft_error_is_as_documented() -> None:
    x = make_signal(22050)
    want, _ = librosa_logmel(x, 22050, 2048, 512, 128, "constant")
    err = np.abs(ours(x, "librosa", fft_dtype="float32") - want).max()
    assert 0 < err < 5e-3

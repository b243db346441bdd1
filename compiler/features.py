"""Audio featurizers as pure torch functions, and the presets that configure them.

Every function maps ``(..., time)`` to ``(..., frames, bins)`` (time-major)
and treats each leading index as its own clip: per-clip clamps (``top_db``,
Whisper's max-8) are never computed across a batch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .filterbanks import dct_matrix, kaldi_filterbank, mel_filterbank

KALDI_EPSILON = float(np.finfo(np.float32).eps)  # 1.1920928955078125e-07
FEATURES = ("logmel", "fbank", "mfcc", "waveform")


@dataclass(frozen=True)
class FeatureConfig:
    """Every parameter of a feature convention, explicit (recorded in the archive's recipe)."""

    features: str = "logmel"
    preset: str = "librosa"
    sample_rate: int = 22050
    # STFT log-mel (features logmel / mfcc)
    n_fft: int = 2048
    hop_length: int = 512
    win_length: int | None = None  # None: n_fft
    window: str = "hann"  # hann (periodic) | hanning | hamming | povey | rectangular
    center: bool = True
    pad_mode: str = "constant"  # constant | reflect
    n_mels: int = 128
    f_min: float = 0.0
    f_max: float | None = None  # None: Nyquist; for fbank, <= 0 is an offset from Nyquist
    mel_scale: str = "slaney"  # htk | slaney
    norm: str = "slaney"  # slaney | none
    power: float = 2.0
    log: str = "db"  # db (10 log10) | log10 | ln | none
    amin: float = 1e-10
    top_db: float | None = 80.0
    post: str = "none"  # none | whisper | ast
    drop_last_frame: bool = False
    # Kaldi fbank (features fbank)
    frame_length_ms: float = 25.0
    frame_shift_ms: float = 10.0
    preemphasis: float = 0.97
    remove_dc: bool = True
    round_to_power_of_two: bool = True
    input_scale: float = 1.0
    # MFCC
    n_mfcc: int = 20
    # fixed frame count (pad with zeros / crop) before normalisation, as AST does
    num_frames: int | None = None
    norm_mean: float = 0.0
    norm_std: float = 1.0
    # Precision of framing, FFT and power. float64 matches the references to
    # about 1e-6 dB in every band; float32 is about 1.6x faster per clip but
    # errs up to ~2e-3 dB in bands 75 dB below a clip's peak. Filterbank, log and
    # clamps run in float32 either way: sums of positive powers keep their
    # relative precision.
    fft_dtype: str = "float64"

    def __post_init__(self) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(f"feature config: {msg}")

        if self.features not in FEATURES:
            raise bad(f"features {self.features!r} is not one of {FEATURES}")
        if self.sample_rate <= 0:
            raise bad(f"sample_rate {self.sample_rate} must be positive")
        if self.fft_dtype not in ("float32", "float64"):
            raise bad(f"fft_dtype {self.fft_dtype!r} must be float32 or float64")
        if self.features in ("logmel", "mfcc"):
            if self.n_fft <= 0 or self.hop_length <= 0:
                raise bad(f"n_fft {self.n_fft} and hop_length {self.hop_length} must be positive")
            if self.win_length is not None and not 0 < self.win_length <= self.n_fft:
                raise bad(f"win_length {self.win_length} must be in 1..n_fft ({self.n_fft})")
            if self.pad_mode not in ("constant", "reflect"):
                raise bad(f"pad_mode {self.pad_mode!r} must be constant or reflect")
            if self.mel_scale not in ("htk", "slaney"):
                raise bad(f"mel_scale {self.mel_scale!r} must be htk or slaney")
            if self.norm not in ("slaney", "none"):
                raise bad(f"norm {self.norm!r} must be slaney or none")
            f_max = self.sample_rate / 2 if self.f_max is None else self.f_max
            if not 0 <= self.f_min < f_max <= self.sample_rate / 2:
                raise bad(
                    f"need 0 <= f_min ({self.f_min}) < f_max ({f_max}) <= Nyquist ({self.sample_rate / 2})"
                )
        if self.features == "fbank" and (self.frame_length_ms <= 0 or self.frame_shift_ms <= 0):
            raise bad("frame_length_ms and frame_shift_ms must be positive")
        if self.features != "waveform" and self.n_mels <= 0:
            raise bad(f"n_mels {self.n_mels} must be positive")
        if self.features == "mfcc" and not 0 < self.n_mfcc <= self.n_mels:
            raise bad(f"n_mfcc {self.n_mfcc} must be in 1..n_mels ({self.n_mels})")
        if self.log not in ("db", "log10", "ln", "none"):
            raise bad(f"log {self.log!r} must be db, log10, ln or none")
        if self.window not in ("hann", "hanning", "hamming", "povey", "rectangular"):
            raise bad(
                f"window {self.window!r} is not one of hann, hanning, hamming, povey, rectangular"
            )

    @property
    def dtype(self) -> torch.dtype:
        return torch.float64 if self.fft_dtype == "float64" else torch.float32

    @property
    def bins(self) -> int:
        return self.n_mfcc if self.features == "mfcc" else self.n_mels

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def num_output_frames(self, num_samples: int) -> int:
        """Frames produced for a clip of num_samples (at sample_rate)."""
        if self.num_frames is not None:
            return self.num_frames
        if self.features == "waveform":
            return num_samples
        if self.features == "fbank":
            size, shift, _ = kaldi_frame_sizes(self)
            return 0 if num_samples < size else 1 + (num_samples - size) // shift
        padded = num_samples + (2 * (self.n_fft // 2) if self.center else 0)
        frames = 0 if padded < self.n_fft else 1 + (padded - self.n_fft) // self.hop_length
        return max(0, frames - 1) if self.drop_last_frame else frames


PRESETS: dict[str, dict[str, Any]] = {
    # librosa.feature.melspectrogram + power_to_db(ref=1, amin=1e-10, top_db=80)
    "librosa": dict(
        features="logmel",
        sample_rate=22050,
        n_fft=2048,
        hop_length=512,
        window="hann",
        center=True,
        pad_mode="constant",
        n_mels=128,
        mel_scale="slaney",
        norm="slaney",
        log="db",
        amin=1e-10,
        top_db=80.0,
    ),
    # torchaudio MelSpectrogram + AmplitudeToDB(stype="power")
    "torchaudio": dict(
        features="logmel",
        sample_rate=16000,
        n_fft=400,
        hop_length=200,
        window="hann",
        center=True,
        pad_mode="reflect",
        n_mels=128,
        mel_scale="htk",
        norm="none",
        log="db",
        amin=1e-10,
        top_db=None,
    ),
    # Whisper's log_mel_spectrogram on librosa (Slaney) filters
    "whisper": dict(
        features="logmel",
        sample_rate=16000,
        n_fft=400,
        hop_length=160,
        window="hann",
        center=True,
        pad_mode="reflect",
        n_mels=80,
        mel_scale="slaney",
        norm="slaney",
        log="log10",
        amin=1e-10,
        top_db=None,
        post="whisper",
        drop_last_frame=True,
    ),
    # PANNs (torchlibrosa front end)
    "panns": dict(
        features="logmel",
        sample_rate=32000,
        n_fft=1024,
        hop_length=320,
        window="hann",
        center=True,
        pad_mode="reflect",
        n_mels=64,
        f_min=50.0,
        f_max=14000.0,
        mel_scale="slaney",
        norm="slaney",
        log="db",
        amin=1e-10,
        top_db=None,
    ),
    # Kaldi compute-fbank-feats defaults, on int16-scaled samples as Kaldi reads them
    "kaldi": dict(
        features="fbank",
        sample_rate=16000,
        n_mels=23,
        window="povey",
        f_min=20.0,
        f_max=0.0,
        log="ln",
        amin=KALDI_EPSILON,
        top_db=None,
        input_scale=32768.0,
    ),
    # AST: Kaldi fbank (hanning window, 128 bins) on [-1, 1] samples, 512 frames, dataset norm
    "ast": dict(
        features="fbank",
        sample_rate=16000,
        n_mels=128,
        window="hanning",
        f_min=20.0,
        f_max=0.0,
        log="ln",
        amin=KALDI_EPSILON,
        top_db=None,
        input_scale=1.0,
        post="ast",
        num_frames=512,
        norm_mean=-6.6268077,
        norm_std=5.358466,
    ),
}


def feature_config(
    preset: str = "librosa", features: str | None = None, **overrides: Any
) -> FeatureConfig:
    """A preset with overrides applied (None values are ignored)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    values = dict(PRESETS[preset])
    values["preset"] = preset
    known = {f.name for f in fields(FeatureConfig)}
    for key, value in overrides.items():
        if key not in known:
            raise ValueError(f"unknown feature option {key!r}")
        if value is not None:
            values[key] = value
    if features is not None:
        kind = PRESETS[preset]["features"]
        if features in ("logmel", "mfcc") and kind == "fbank":
            raise ValueError(
                f"preset {preset!r} is a Kaldi fbank convention; use --features fbank or waveform"
            )
        if features == "fbank" and kind != "fbank":
            raise ValueError(f"--features fbank needs --preset kaldi or ast, not {preset!r}")
        values["features"] = features
    return FeatureConfig(**values)


@functools.lru_cache(maxsize=32)
def make_window(kind: str, length: int, dtype: torch.dtype) -> torch.Tensor:
    """The analysis window (cached: callers only read it)."""
    n = np.arange(length, dtype=np.float64)
    if kind == "hann":
        w = 0.5 - 0.5 * np.cos(2 * math.pi * n / length)
    elif kind in ("hanning", "povey"):
        w = 0.5 - 0.5 * np.cos(2 * math.pi * n / max(length - 1, 1))
        if kind == "povey":
            w = w**0.85
    elif kind == "hamming":
        w = 0.54 - 0.46 * np.cos(2 * math.pi * n / max(length - 1, 1))
    elif kind == "rectangular":
        w = np.ones(length)
    else:
        raise ValueError(f"unknown window {kind!r}")
    return torch.from_numpy(w).to(dtype)


def _pad_edges(x: torch.Tensor, pad: int, mode: str) -> torch.Tensor:
    if mode == "constant" or pad == 0:
        return F.pad(x, (pad, pad))
    if x.shape[-1] > pad:
        return F.pad(x.reshape(-1, 1, x.shape[-1]), (pad, pad), mode="reflect").reshape(
            *x.shape[:-1], -1
        )
    # Shorter than the padding: numpy reflects repeatedly, as librosa does.
    arr = x.detach().cpu().numpy()
    if arr.shape[-1] == 0:
        return F.pad(x, (pad, pad))
    widths = [(0, 0)] * (arr.ndim - 1) + [(pad, pad)]
    return torch.from_numpy(np.pad(arr, widths, mode="reflect")).to(x.dtype)


def frame_signal(
    x: torch.Tensor, frame: int, hop: int, center: bool, pad_mode: str
) -> torch.Tensor:
    """``(..., time) -> (..., frames, frame)``, a strided view where possible."""
    if center:
        x = _pad_edges(x, frame // 2, pad_mode)
    if x.shape[-1] < frame:
        return x.new_zeros((*x.shape[:-1], 0, frame))
    return x.unfold(-1, frame, hop)


def power_spectrogram(x: torch.Tensor, cfg: FeatureConfig) -> torch.Tensor:
    """float32 ``(..., time) -> (..., frames, n_fft//2+1)`` float32 |STFT|^power.

    Only the FFT needs cfg.fft_dtype: its rounding error is relative to the
    whole frame's energy, so in float32 it swamps bands far below the peak.
    Framing stays in the input's float32 (exact), the window multiply promotes
    to float64, and each FFT output bin is rounded back to complex64 at once,
    an error relative to that bin alone.
    """
    win_length = cfg.win_length or cfg.n_fft
    window = make_window(cfg.window, win_length, cfg.dtype)
    if win_length < cfg.n_fft:
        left = (cfg.n_fft - win_length) // 2
        window = F.pad(window, (left, cfg.n_fft - win_length - left))
    frames = frame_signal(x, cfg.n_fft, cfg.hop_length, cfg.center, cfg.pad_mode)
    if frames.shape[-2] == 0:  # the FFT backend rejects empty batches
        return frames.new_zeros((*frames.shape[:-1], cfg.n_fft // 2 + 1), dtype=torch.float32)
    # A same-dtype cast copy then an in-place multiply: about twice as fast as
    # letting the multiply promote float32 frames to float64.
    windowed = torch.empty(frames.shape, dtype=window.dtype)
    if frames.dtype == window.dtype:
        torch.mul(frames, window, out=windowed)
    else:
        windowed.copy_(frames)
        windowed.mul_(window)
    spec = torch.fft.rfft(windowed).to(torch.complex64)
    if cfg.power == 2.0:
        power = spec.real.square()
        power.addcmul_(spec.imag, spec.imag)
    else:
        power = spec.abs().pow(cfg.power)
    return power[..., :-1, :] if cfg.drop_last_frame else power


def kaldi_frame_sizes(cfg: FeatureConfig) -> tuple[int, int, int]:
    size = int(cfg.sample_rate * cfg.frame_length_ms * 0.001)
    shift = int(cfg.sample_rate * cfg.frame_shift_ms * 0.001)
    padded = 1 << (size - 1).bit_length() if cfg.round_to_power_of_two else size
    return size, shift, padded


def kaldi_power_spectrum(x: torch.Tensor, cfg: FeatureConfig) -> torch.Tensor:
    """Kaldi framing (snip_edges), DC removal, pre-emphasis, window, |FFT|^2.

    The time-domain steps round relative to the frame too, so they run in
    cfg.fft_dtype along with the FFT.
    """
    size, shift, padded = kaldi_frame_sizes(cfg)
    x = x.to(cfg.dtype) * cfg.input_scale
    frames = frame_signal(x, size, shift, center=False, pad_mode="constant")
    if frames.shape[-2] == 0:
        return frames.new_zeros((*frames.shape[:-1], padded // 2 + 1), dtype=torch.float32)
    if cfg.remove_dc:
        frames = frames - frames.mean(dim=-1, keepdim=True)
    if cfg.preemphasis:
        previous = torch.cat([frames[..., :1], frames[..., :-1]], dim=-1)
        frames = frames - cfg.preemphasis * previous
    frames = frames * make_window(cfg.window, size, x.dtype)
    spec = torch.fft.rfft(F.pad(frames, (0, padded - size))).to(torch.complex64)
    power = spec.real.square()
    power.addcmul_(spec.imag, spec.imag)
    return power


def _log(x: torch.Tensor, cfg: FeatureConfig) -> torch.Tensor:
    if cfg.log == "none":
        return x
    clamped = x.clamp_min(cfg.amin)
    if cfg.log == "db":
        out = 10.0 * torch.log10(clamped)
    elif cfg.log == "log10":
        out = torch.log10(clamped)
    else:
        out = torch.log(clamped)
    if cfg.top_db is not None:
        out = _clip_below_clip_max(out, cfg.top_db)
    return out


def _clip_below_clip_max(x: torch.Tensor, floor: float) -> torch.Tensor:
    """max(x, max over this clip - floor), one max per leading index."""
    if x.shape[-2] * x.shape[-1] == 0:
        return x
    peak = x.amax(dim=(-2, -1), keepdim=True)
    return torch.maximum(x, peak - floor)


def _fix_frames(x: torch.Tensor, num_frames: int) -> torch.Tensor:
    have = x.shape[-2]
    if have >= num_frames:
        return x[..., :num_frames, :]
    return F.pad(x, (0, 0, 0, num_frames - have))


@functools.lru_cache(maxsize=32)
def _filterbank_tensor(cfg: FeatureConfig) -> torch.Tensor:
    if cfg.features == "fbank":
        _, _, padded = kaldi_frame_sizes(cfg)
        f_max = cfg.f_max if cfg.f_max is not None else 0.0
        fb = kaldi_filterbank(cfg.sample_rate, padded, cfg.n_mels, cfg.f_min, f_max)
    else:
        f_max = cfg.sample_rate / 2 if cfg.f_max is None else cfg.f_max
        fb = mel_filterbank(
            cfg.sample_rate, cfg.n_fft, cfg.n_mels, cfg.f_min, f_max, cfg.mel_scale, cfg.norm
        )
    return torch.tensor(fb, dtype=torch.float32)


Band = tuple[
    int, int, int, int, torch.Tensor
]  # filters [f0, f1) use bins [b0, b1): weights [b1-b0, f1-f0]


@functools.lru_cache(maxsize=32)
def _filterbank_bands(cfg: FeatureConfig, filters_per_band: int = 16) -> tuple[Band, ...]:
    """The filterbank cut into groups of adjacent filters, each with the bin range it touches.

    Triangular filters are narrow, so a dense ``[bins, n_mels]`` product is
    mostly multiplications by zero; per band only the touched bins are used.
    """
    fb = _filterbank_tensor(cfg)
    bands = []
    for f0 in range(0, fb.shape[1], filters_per_band):
        f1 = min(fb.shape[1], f0 + filters_per_band)
        rows = torch.nonzero(fb[:, f0:f1].any(dim=1)).flatten()
        b0, b1 = (int(rows[0]), int(rows[-1]) + 1) if len(rows) else (0, 0)
        bands.append((f0, f1, b0, b1, fb[b0:b1, f0:f1].contiguous()))
    return tuple(bands)


def apply_filterbank(power: torch.Tensor, bands: tuple[Band, ...]) -> torch.Tensor:
    """``(..., frames, bins) -> (..., frames, n_mels)``: the filterbank product, band by band."""
    out = power.new_zeros((*power.shape[:-1], bands[-1][1]))
    for f0, f1, b0, b1, weights in bands:
        if b1 > b0:
            out[..., f0:f1] = power[..., b0:b1] @ weights
    return out


def featurize(waveform: torch.Tensor, cfg: FeatureConfig) -> torch.Tensor:
    """``(..., time)`` at cfg.sample_rate -> float32 ``(..., frames, bins)`` (``(..., time)`` for waveform)."""
    x = waveform.to(torch.float32)
    if cfg.features == "waveform":
        return x
    power = kaldi_power_spectrum(x, cfg) if cfg.features == "fbank" else power_spectrogram(x, cfg)
    mel = apply_filterbank(power, _filterbank_bands(cfg))
    out = _log(mel, cfg)
    if cfg.post == "whisper":
        out = (_clip_below_clip_max(out, 8.0) + 4.0) / 4.0
    if cfg.features == "mfcc":
        out = out @ torch.tensor(dct_matrix(cfg.n_mels, cfg.n_mfcc), dtype=torch.float32)
    if cfg.num_frames is not None:
        out = _fix_frames(out, cfg.num_frames)
    if cfg.post == "ast":
        out = (out - cfg.norm_mean) / (2.0 * cfg.norm_std)
    return out

"""Audio featurizers as pure torch functions, and the presets that configure them.

Every function maps ``(..., time)`` to ``(..., frames, bins)`` (time-major)
and treats each leading index as its own clip: per-clip clamps (``top_db``,
Whisper's max-8) are never computed across a batch.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from . import numerics
from .decode import PCM16_SCALE
from .filterbanks import dct_matrix, kaldi_filterbank, mel_filterbank
from .kernels import native as _native  # None: torch products serve

# MKL's CPU-independent code path, asked for before anything here runs MKL (compiler.numerics)
numerics.prefer()


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
    # Precision of the window, FFT and power (and Kaldi's time-domain steps).
    # float32 is what every preset's reference computes in on decoded float32
    # audio: librosa and torchaudio keep the input's dtype, Whisper, AST and
    # PANNs run torch in float32, and Kaldi's BaseFloat is float. float64
    # moves bands 75 dB below a clip's peak by about 2e-3 dB, below what
    # float16 storage keeps, at about twice the FFT's cost. Filterbank, log
    # and clamps run in float32 either way: sums of positive powers keep
    # their relative precision.
    fft_dtype: str = "float32"

    def __post_init__(self) -> None:
        _check_types(self)
        _check_values(self)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float64 if self.fft_dtype == "float64" else torch.float32

    @property
    def bins(self) -> int:
        return self.n_mfcc if self.features == "mfcc" else self.n_mels

    def to_json(self) -> dict[str, Any]:
        """The parameters that produce this convention's features, and only those.

        Options the chosen kind never reads are left out; defaults that are
        resolved at run time (``win_length``, ``f_max``) are written resolved;
        Kaldi framing is also written in samples. ``from_json`` reads it back.
        """
        values = asdict(self)
        out = {name: values[name] for name in applicable_options(self)}
        if "win_length" in out:
            out["win_length"] = self.win_length or self.n_fft
        if "f_max" in out:
            out["f_max"] = resolved_f_max(self)
        if self.features == "fbank":
            out.update(_kaldi_facts(*kaldi_frame_sizes(self)))
            out.update(mel_scale="kaldi", power=2.0)
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> FeatureConfig:
        """A config from ``to_json``'s table (or an older one holding every field).

        The facts ``to_json`` adds (sizes in samples, Kaldi's fixed choices) are
        checked against the options they follow from, so an edited table
        cannot say one thing and run another.
        """
        if not isinstance(obj, dict):
            raise ValueError(f"features: expected a table of options, got {type(obj).__name__}")
        known = {f.name for f in fields(cls)}
        facts = set(_kaldi_facts(1, 1, 1))
        unknown = sorted(set(obj) - known - facts)
        if unknown:
            raise ValueError(
                f"features: unknown option(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}"
            )
        values = {k: v for k, v in obj.items() if k in known}
        fbank = values.get("features") == "fbank"
        if fbank:
            # Kaldi's mel scale and power spectrum are fixed, recorded as facts.
            values.pop("mel_scale", None)
            values.pop("power", None)
        cfg = cls(**values)
        given = {k: obj[k] for k in facts if k in obj}
        if given and not fbank:
            raise ValueError(
                f"features: {', '.join(sorted(given))} apply to fbank only, not {cfg.features}"
            )
        if given:
            want = _kaldi_facts(*kaldi_frame_sizes(cfg))
            for key, value in given.items():
                if value != want[key]:
                    raise ValueError(
                        f"features.{key}: recorded {value!r} but the options give {want[key]!r}; "
                        f"remove {key} or make it agree"
                    )
        return cfg

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


MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 1000, 768_000  # Hz
MAX_FFT = 1 << 16  # samples per analysis frame (n_fft, Kaldi's padded window)
MAX_FRAMES = 1 << 24  # num_frames
CHOICES: dict[str, tuple[str, ...]] = {
    "features": FEATURES,
    "window": ("hann", "hanning", "hamming", "povey", "rectangular"),
    "pad_mode": ("constant", "reflect"),
    "mel_scale": ("htk", "slaney"),
    "norm": ("slaney", "none"),
    "log": ("db", "log10", "ln", "none"),
    "post": ("none", "whisper", "ast"),
    "fft_dtype": ("float32", "float64"),
}
_KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


def _check_types(cfg: FeatureConfig) -> None:
    """Each field holds its declared type: no bool for int, no string for a number.

    Numbers become float where a float is declared, so ``80`` and ``80.0``
    record alike.
    """
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        kinds = str(f.type).split(" | ")
        if value is None and "None" in kinds:
            continue
        base = kinds[0]
        if base == "int":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif base == "float":
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if ok and not math.isfinite(value):
                raise ValueError(f"{f.name}: expected a finite number, got {value!r}")
            if ok:
                object.__setattr__(cfg, f.name, float(value))
        elif base == "bool":
            ok = isinstance(value, bool)
        else:
            ok = isinstance(value, str)
        if not ok:
            expected = _KINDS[base] + (" or none" if "None" in kinds else "")
            raise ValueError(
                f"{f.name}: expected {expected}, got {value!r} ({type(value).__name__})"
            )


def _check_values(c: FeatureConfig) -> None:
    """Ranges of every field and the relations between them (types already checked)."""

    def bad(key: str, msg: str) -> ValueError:
        return ValueError(f"{key}: {msg}")

    def within(key: str, lo: float, hi: float, unit: str = "") -> None:
        value = getattr(c, key)
        if value is not None and not lo <= value <= hi:
            raise bad(key, f"{value}{unit} is outside the allowed {lo}..{hi}{unit}")

    def positive(key: str) -> None:
        value = getattr(c, key)
        if value is not None and not value > 0:
            raise bad(key, f"{value} must be greater than 0")

    for key, allowed in CHOICES.items():
        if getattr(c, key) not in allowed:
            raise bad(key, f"{getattr(c, key)!r} is not one of {', '.join(allowed)}")
    if c.preset not in PRESETS:
        raise bad("preset", f"{c.preset!r} is not one of {', '.join(sorted(PRESETS))}")
    within("sample_rate", MIN_SAMPLE_RATE, MAX_SAMPLE_RATE, " Hz")
    within("n_fft", 2, MAX_FFT)
    within("hop_length", 1, MAX_FFT)
    within("win_length", 1, c.n_fft)
    within("n_mels", 1, math.inf)  # the upper bound depends on the FFT size (below)
    within("n_mfcc", 1, math.inf)
    within("num_frames", 1, MAX_FRAMES)
    within("preemphasis", 0.0, 1.0)
    for key in ("power", "amin", "top_db", "input_scale", "norm_std"):
        positive(key)
    for key in ("frame_length_ms", "frame_shift_ms"):
        positive(key)
    if c.features == "waveform":
        return
    nyquist = c.sample_rate / 2
    if c.features == "fbank":
        size, shift, padded = kaldi_frame_sizes(c)
        if size < 2 or padded > MAX_FFT:
            raise bad(
                "frame_length_ms",
                f"{c.frame_length_ms} ms is {size} samples at {c.sample_rate} Hz; "
                f"a frame needs 2..{MAX_FFT} samples",
            )
        if shift < 1:
            raise bad(
                "frame_shift_ms",
                f"{c.frame_shift_ms} ms is 0 samples at {c.sample_rate} Hz; give at least "
                f"{1000 / c.sample_rate:.4g} ms",
            )
        bins = padded // 2
        fft_note = f"the {bins} frequency bins of a {padded}-sample FFT"
    else:
        bins = c.n_fft // 2 + 1
        fft_note = f"the {bins} frequency bins of n_fft {c.n_fft} (n_fft // 2 + 1)"
    if c.n_mels > bins:
        raise bad(
            "n_mels", f"{c.n_mels} is more than {fft_note}; lower n_mels or raise the FFT size"
        )
    f_max = resolved_f_max(c)
    if not 0 <= c.f_min < f_max:
        raise bad("f_min", f"{c.f_min} Hz must be >= 0 and below f_max ({f_max} Hz)")
    if not f_max <= nyquist:
        raise bad("f_max", f"{f_max} Hz is above Nyquist ({nyquist} Hz at {c.sample_rate} Hz)")
    if c.features == "mfcc" and c.n_mfcc > c.n_mels:
        raise bad("n_mfcc", f"{c.n_mfcc} is more than n_mels ({c.n_mels})")


def resolved_f_max(cfg: FeatureConfig) -> float:
    """The upper filterbank edge in Hz: None is Nyquist; for fbank, <= 0 is an offset from it."""
    nyquist = cfg.sample_rate / 2
    if cfg.features == "fbank":
        f_max = cfg.f_max if cfg.f_max is not None else 0.0
        return f_max + nyquist if f_max <= 0.0 else f_max
    return nyquist if cfg.f_max is None else cfg.f_max


def applicable_options(cfg: FeatureConfig) -> list[str]:
    """The fields the featurizer reads for cfg.features, in recording order."""
    names = ["features", "preset", "sample_rate"]
    if cfg.features == "waveform":
        return names
    if cfg.features == "fbank":
        names += ["frame_length_ms", "frame_shift_ms", "round_to_power_of_two", "window"]
        names += ["remove_dc", "preemphasis", "input_scale"]
    else:
        names += ["n_fft", "hop_length", "win_length", "window", "center"]
        names += ["pad_mode"] if cfg.center else []
        names += ["power", "drop_last_frame", "mel_scale", "norm"]
    names += ["n_mels", "f_min", "f_max", "fft_dtype", "log"]
    if cfg.log != "none":
        names += ["amin", "top_db"]
    names += ["n_mfcc"] if cfg.features == "mfcc" else []
    names += ["num_frames", "post"]
    names += ["norm_mean", "norm_std"] if cfg.post == "ast" else []
    return names


def _kaldi_facts(size: int, shift: int, padded: int) -> dict[str, Any]:
    """What Kaldi framing runs, in samples (recorded beside the options it follows from)."""
    return {
        "frame_length_samples": size,
        "frame_shift_samples": shift,
        "fft_length": padded,
        "snip_edges": True,
    }


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
    if not isinstance(preset, str) or preset not in PRESETS:
        raise ValueError(f"preset: unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    values = dict(PRESETS[preset])
    values["preset"] = preset
    known = {f.name for f in fields(FeatureConfig)} - {"preset", "features"}
    given = {k: v for k, v in overrides.items() if v is not None}
    for key in given:
        if key not in known:
            raise ValueError(f"{key}: unknown feature option; valid: {', '.join(sorted(known))}")
    values.update(given)
    if features is not None:
        kind = PRESETS[preset]["features"]
        if features in ("logmel", "mfcc") and kind == "fbank":
            raise ValueError(
                f"preset {preset!r} is a Kaldi fbank convention; use --features fbank or waveform"
            )
        if features == "fbank" and kind != "fbank":
            raise ValueError(f"--features fbank needs --preset kaldi or ast, not {preset!r}")
        values["features"] = features
    cfg = FeatureConfig(**values)
    _check_applicable(cfg, given)
    return cfg


def with_options(cfg: FeatureConfig, overrides: dict[str, Any]) -> FeatureConfig:
    """cfg with some options changed (None values are ignored); each must apply to its kind."""
    known = {f.name for f in fields(FeatureConfig)} - {"preset", "features"}
    given = {k: v for k, v in overrides.items() if v is not None}
    for key in given:
        if key not in known:
            raise ValueError(f"{key}: unknown feature option; valid: {', '.join(sorted(known))}")
    out = dataclasses.replace(cfg, **given)
    _check_applicable(out, given)
    return out


def _check_applicable(cfg: FeatureConfig, given: dict[str, Any]) -> None:
    """An option the featurizer would not read is a mistake in the recipe, not a no-op."""
    applicable = applicable_options(cfg)
    for key in given:
        if key not in applicable:
            raise ValueError(
                f"{key}: does not apply to {cfg.features} features (preset {cfg.preset}); "
                f"the options that do: {', '.join(applicable[2:])}"
            )


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


def frame_segments(
    x: torch.Tensor, frame: int, hop: int, center: bool, pad_mode: str
) -> list[torch.Tensor]:
    """``(time,)`` -> frame_signal's ``(frames, frame)`` rows as pieces to be laid end to end.

    With centring, only the few frames that reach into the padding are made
    from padded copies of the clip's ends; the frames between are a view of
    the clip itself, so the clip is never copied whole to pad it.
    """
    pad = frame // 2 if center else 0
    length = x.shape[-1]
    count = 0 if length + 2 * pad < frame else 1 + (length + 2 * pad - frame) // hop
    first = -(-pad // hop)  # the first frame lying wholly inside the clip
    last = (length + pad - frame) // hop  # and the last
    if not center or count == 0 or first > last or length <= 2 * pad + 1:
        return [frame_signal(x, frame, hop, center, pad_mode)]
    # The head's padded samples 0..span depend on x[:span - pad] and, when
    # reflecting, on x[1 : pad + 1]; the tail's on x from its first frame on
    # and on x[-pad - 1 :]. Each end is padded on its own, then cut to the
    # part that matches the padded clip.
    span = (first - 1) * hop + frame
    head = _pad_edges(x[: min(length, max(span - pad, pad + 1))], pad, pad_mode)[:span]
    pieces = [
        head.unfold(-1, frame, hop),
        x[first * hop - pad :].unfold(-1, frame, hop)[: last + 1 - first],
    ]
    if count > last + 1:
        begin = (last + 1) * hop - pad  # the tail's first frame, in clip samples
        cut = max(0, min(begin, length - pad - 1))
        tail = _pad_edges(x[cut:], pad, pad_mode)[pad + begin - cut :]
        pieces.append(tail.unfold(-1, frame, hop)[: count - last - 1])
    return pieces


def _stft_frames(x: torch.Tensor, cfg: FeatureConfig) -> list[torch.Tensor]:
    """float32 ``(time,)`` -> the (centred) signal's ``(frames, n_fft)`` rows, in pieces
    (frame_segments); views where possible."""
    pieces = frame_segments(x, cfg.n_fft, cfg.hop_length, cfg.center, cfg.pad_mode)
    if cfg.drop_last_frame:
        while pieces and pieces[-1].shape[-2] == 0:
            pieces.pop()
        if pieces:
            pieces[-1] = pieces[-1][:-1]
    return pieces


@functools.lru_cache(maxsize=32)
def _stft_window(kind: str, win_length: int, n_fft: int, dtype: torch.dtype) -> torch.Tensor:
    """The window centred in n_fft samples (zeros either side when win_length is shorter)."""
    window = make_window(kind, win_length, dtype)
    left = (n_fft - win_length) // 2
    return F.pad(window, (left, n_fft - win_length - left)) if win_length < n_fft else window


def _stft_spectrum(frames: torch.Tensor, cfg: FeatureConfig) -> torch.Tensor:
    """float32 ``(rows, n_fft) -> (rows, n_fft//2+1)`` complex64 FFT of the frames.

    With fft_dtype float32 the frames arrive windowed (gather_window: the
    window multiplies them as they are gathered, one pass fewer). With
    fft_dtype float64 the window multiply and FFT run in float64 and each
    output bin is rounded back to complex64 at once, an error relative to
    that bin alone (a float32 FFT's error is relative to the whole frame).
    """
    if frames.shape[-2] == 0:  # the FFT backend rejects empty batches
        return frames.new_zeros((*frames.shape[:-1], cfg.n_fft // 2 + 1), dtype=torch.complex64)
    if cfg.dtype != torch.float32:
        # float64: a cast copy then an in-place multiply, about twice as fast as
        # letting the multiply promote float32 frames.
        window = _stft_window(cfg.window, cfg.win_length or cfg.n_fft, cfg.n_fft, cfg.dtype)
        frames = frames.to(cfg.dtype).mul_(window)
    spec = torch.fft.rfft(frames)
    del frames
    spectrum: torch.Tensor = spec if spec.dtype == torch.complex64 else spec.to(torch.complex64)
    return spectrum


def _power(spec: torch.Tensor, exponent: float) -> torch.Tensor:
    """complex64 -> float32 ``|spec| ** exponent`` (re^2 + im^2 for 2)."""
    if exponent == 2.0:
        power: torch.Tensor = spec.real.square()
        power.addcmul_(spec.imag, spec.imag)
        return power
    magnitude: torch.Tensor = spec.abs().pow(exponent)
    return magnitude


def _stft_power(frames: torch.Tensor, cfg: FeatureConfig) -> torch.Tensor:
    """float32 ``(rows, n_fft) -> (rows, n_fft//2+1)`` float32 |FFT|^power of the frames."""
    return _power(_stft_spectrum(frames, cfg), cfg.power)


def kaldi_frame_sizes(cfg: FeatureConfig) -> tuple[int, int, int]:
    size = int(cfg.sample_rate * cfg.frame_length_ms * 0.001)
    shift = int(cfg.sample_rate * cfg.frame_shift_ms * 0.001)
    padded = 1 << (size - 1).bit_length() if cfg.round_to_power_of_two else size
    return size, shift, padded


def _kaldi_frames(x: torch.Tensor, cfg: FeatureConfig) -> torch.Tensor:
    """float32 ``(time,) -> (frames, frame_length)`` view (snip_edges framing)."""
    size, shift, _ = kaldi_frame_sizes(cfg)
    return frame_signal(x, size, shift, center=False, pad_mode="constant")


def _kaldi_spectrum(frames: torch.Tensor, cfg: FeatureConfig) -> torch.Tensor:
    """float32 ``(rows, frame_length or fft_length) -> (rows, fft_length//2+1)`` complex64:
    Kaldi's scaling, DC removal, pre-emphasis, window and FFT per frame (``frames`` is
    modified).

    Frames given ``fft_length`` wide (as featurize_clips gathers them) hold the
    frame in their first ``frame_length`` samples and zeros after, the FFT's
    padding. The time-domain steps round relative to the frame too, so they
    run in cfg.fft_dtype along with the FFT.
    """
    size, _, padded = kaldi_frame_sizes(cfg)
    if frames.shape[-2] == 0:
        return frames.new_zeros((*frames.shape[:-1], padded // 2 + 1), dtype=torch.complex64)
    if frames.shape[-1] == size and padded > size:
        frames = F.pad(frames, (0, padded - size))
    frames = frames.to(cfg.dtype)
    frame = frames[..., :size]  # the samples; the rest stays zero
    if cfg.input_scale != 1.0:
        frame.mul_(cfg.input_scale)
    if cfg.remove_dc:
        # The mean as a matrix product (MKL, the same path on every CPU: compiler.numerics),
        # not torch's mean, whose summation order follows the CPU's vector width.
        ones = torch.full((size, 1), 1.0 / size, dtype=frame.dtype)
        frame.sub_(torch.matmul(frame, ones))
    if cfg.preemphasis:
        # x[i] - p * x[i - 1], and x[0] - p * x[0]: the products are taken first
        previous = frame[..., :-1] * cfg.preemphasis
        frame[..., :1].sub_(frame[..., :1] * cfg.preemphasis)
        frame[..., 1:].sub_(previous)
        del previous
    frame.mul_(make_window(cfg.window, size, frames.dtype))
    spec = torch.fft.rfft(frames)
    del frames, frame
    spectrum: torch.Tensor = spec if spec.dtype == torch.complex64 else spec.to(torch.complex64)
    return spectrum


def _kaldi_power(frames: torch.Tensor, cfg: FeatureConfig) -> torch.Tensor:
    """float32 ``(rows, frame_length or fft_length) -> (rows, fft_length//2+1)``: Kaldi's
    |FFT|^2 per frame (_kaldi_spectrum; ``frames`` is modified)."""
    return _power(_kaldi_spectrum(frames, cfg), 2.0)


def _log_(x: torch.Tensor, cfg: FeatureConfig) -> None:
    """cfg.log of x, in place (no clamps that depend on the clip)."""
    if cfg.log == "none":
        return
    x.clamp_(min=cfg.amin)
    if cfg.log == "db":
        torch.log10(x, out=x)
        x.mul_(10.0)
    elif cfg.log == "log10":
        torch.log10(x, out=x)
    else:
        torch.log(x, out=x)


def _clip_below_clip_max_(x: torch.Tensor, floor: float) -> None:
    """x = max(x, max(x) - floor) in place, x being one clip's ``(frames, bins)``."""
    if x.numel():
        torch.maximum(x, x.amax() - floor, out=x)


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


@functools.lru_cache(maxsize=8)
def _dct_tensor(n_mels: int, n_mfcc: int) -> torch.Tensor:
    return torch.tensor(dct_matrix(n_mels, n_mfcc), dtype=torch.float32)


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


ROW_BLOCK = 32  # frames per matrix product; every clip's frames start on a block boundary


def _blocked_matmul(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``(rows, k) @ (k, n)`` as products of exactly ROW_BLOCK rows each (rows padded with zeros).

    BLAS picks kernels by matrix size and may round a row differently in a
    product of another size; a batch of fixed-size products makes each row's
    result the same whatever else is computed with it.
    """
    rows = x.shape[0]
    blocks = -(-rows // ROW_BLOCK)
    if blocks * ROW_BLOCK != rows:
        x = F.pad(x, (0, 0, 0, blocks * ROW_BLOCK - rows))
    product = torch.bmm(
        x.view(blocks, ROW_BLOCK, x.shape[1]), weights.expand(blocks, *weights.shape)
    )
    return product.flatten(0, 1)[:rows]


def apply_filterbank(
    power: torch.Tensor, bands: tuple[Band, ...], out: torch.Tensor | None = None
) -> torch.Tensor:
    """``(rows, bins) -> (rows, n_mels)``: the filterbank product, band by band, in fixed
    ROW_BLOCK-row products (see _blocked_matmul), written into ``out`` when given."""
    rows = power.shape[0]
    blocks = -(-rows // ROW_BLOCK)
    if blocks * ROW_BLOCK != rows:
        power = F.pad(power, (0, 0, 0, blocks * ROW_BLOCK - rows))
    if out is None:
        out = power.new_empty((rows, bands[-1][1]))
    for f0, f1, b0, b1, weights in bands:
        if b1 == b0:
            out[:, f0:f1] = 0.0
            continue
        x = power[:, b0:b1].reshape(blocks, ROW_BLOCK, b1 - b0)
        product = torch.bmm(x, weights.expand(blocks, *weights.shape))
        out[:, f0:f1] = product.view(blocks * ROW_BLOCK, f1 - f0)[:rows]
    return out


@dataclass(frozen=True)
class _FilterTable:
    """The filterbank as the compiled kernel takes it: filter f weighs bins [lo[f], hi[f])
    by weights[start[f] : start[f] + hi[f] - lo[f]]."""

    bins: int
    lo: torch.Tensor  # int32
    hi: torch.Tensor  # int32
    start: torch.Tensor  # int64
    weights: torch.Tensor  # float32


@functools.lru_cache(maxsize=32)
def _filter_table(cfg: FeatureConfig) -> _FilterTable:
    fb = _filterbank_tensor(cfg)
    lo, hi, start, pieces, at = [], [], [], [], 0
    for f in range(fb.shape[1]):
        touched = torch.nonzero(fb[:, f]).flatten()
        b0, b1 = (int(touched[0]), int(touched[-1]) + 1) if len(touched) else (0, 0)
        lo.append(b0)
        hi.append(b1)
        start.append(at)
        pieces.append(fb[b0:b1, f])
        at += b1 - b0
    return _FilterTable(
        fb.shape[0],
        torch.tensor(lo, dtype=torch.int32),
        torch.tensor(hi, dtype=torch.int32),
        torch.tensor(start, dtype=torch.int64),
        torch.cat(pieces).contiguous() if pieces else torch.zeros(1),
    )


def _filterbank_into(
    spec: torch.Tensor, exponent: float, cfg: FeatureConfig, out: torch.Tensor
) -> None:
    """complex64 ``(rows, bins)`` -> the filterbank of ``|spec| ** exponent`` in ``out``
    ``(rows, n_mels)`` float32: by the compiled kernel when it was built (power and
    filterbank in one pass over the spectrum), else by torch products."""
    if _native is None or exponent not in (1.0, 2.0):
        apply_filterbank(_power(spec, exponent), _filterbank_bands(cfg), out=out)
        return
    table = _filter_table(cfg)
    rows, bins = spec.shape
    if (
        spec.dtype != torch.complex64
        or bins != table.bins
        or out.dtype != torch.float32
        or tuple(out.shape) != (rows, table.lo.numel())
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"filterbank of a {tuple(spec.shape)} {spec.dtype} spectrum into a "
            f"{tuple(out.shape)} {out.dtype} output: expected {table.bins} bins and a "
            f"contiguous float32 ({rows}, {table.lo.numel()}) output"
        )
    spec = spec.contiguous()
    _native.power_filterbank(
        spec.data_ptr(),
        rows,
        bins,
        out.data_ptr(),
        table.lo.numel(),
        table.lo.data_ptr(),
        table.hi.data_ptr(),
        table.start.data_ptr(),
        table.weights.data_ptr(),
        exponent == 1.0,
    )


def as_float(wave: torch.Tensor) -> torch.Tensor:
    """A waveform in float32: int16 (16-bit PCM as read) times PCM16_SCALE, which is exact."""
    if wave.dtype == torch.int16:
        return wave.to(torch.float32).mul_(float(PCM16_SCALE))
    return wave.to(torch.float32)


def takes_pcm16(cfg: FeatureConfig) -> bool:
    """Whether featurize_clips frames int16 clips as they are, the 1/32768 folded into the
    window it multiplies frames by as it gathers them (float32 STFT features): no
    float32 copy of the clip is made. Elsewhere it converts them first (as_float)."""
    return cfg.features != "waveform" and _gather_window(cfg) is not None


def _gather_window(cfg: FeatureConfig, pcm16: bool = False) -> torch.Tensor | None:
    """The window _gather_rows multiplies the frames by: float32 STFT windows only (Kaldi
    windows after its time-domain steps, float64 after the cast); for int16 frames, that
    window times PCM16_SCALE."""
    if cfg.features == "fbank" or cfg.dtype != torch.float32:
        return None
    size = cfg.win_length or cfg.n_fft
    if pcm16:
        return _pcm16_window(cfg.window, size, cfg.n_fft)
    return _stft_window(cfg.window, size, cfg.n_fft, torch.float32)


@functools.lru_cache(maxsize=32)
def _pcm16_window(kind: str, win_length: int, n_fft: int) -> torch.Tensor:
    """The float32 STFT window times 2**-15. Scaling by a power of two is exact, so
    int16 x times it rounds once to the float32 nearest x * 2**-15 * w, which is
    (x * 2**-15) times the window: the bits float32 input gives."""
    return _stft_window(kind, win_length, n_fft, torch.float32) * float(PCM16_SCALE)


def _gather_rows(
    pieces: list[torch.Tensor],
    at: list[int],
    r0: int,
    r1: int,
    window: torch.Tensor | None,
    width: int = 0,
    pcm16_window: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``r0:r1`` of the frames laid out as piece k from row at[k] (ascending), zero
    rows wherever no piece lies: a new float32 ``(r1 - r0, max(width, frame_length))``
    tensor, zero after each frame's samples, each copied row multiplied by ``window``
    when one is given (rows of int16 pieces by ``pcm16_window``)."""
    frame = pieces[0].shape[-1]
    full = torch.empty((r1 - r0, max(width, frame)), dtype=torch.float32)
    if full.shape[1] > frame:
        full[:, frame:] = 0.0
    out = full[:, :frame]
    k = bisect.bisect_right(at, r0) - 1
    pos = r0
    while pos < r1:
        if k >= 0:
            start = at[k]
            end = min(start + pieces[k].shape[-2], r1)
            if pos < end:
                src, dst = pieces[k][pos - start : end - start], out[pos - r0 : end - r0]
                if src.dtype == torch.int16:
                    if pcm16_window is None:
                        raise ValueError("int16 frames need the window scaled for 16-bit PCM")
                    _pcm16_windowed(src, pcm16_window, dst)
                elif window is None:
                    dst.copy_(src)
                else:
                    torch.mul(src, window, out=dst)
                pos = end
        k += 1
        end = min(at[k], r1) if k < len(at) else r1
        if pos < end:
            out[pos - r0 : end - r0] = 0.0
            pos = end
    return full


def _pcm16_windowed(src: torch.Tensor, window: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst = src * window``, int16 rows (16-bit PCM) by a float32 window: by the compiled
    kernel when it was built and each row is contiguous, as framing lays them out, else by
    torch (twice as slow); both round each product once, alike."""
    if (
        _native is None
        or src.dtype != torch.int16
        or src.stride(-1) != 1
        or dst.stride(-1) != 1
        or window.dtype != torch.float32
        or not window.is_contiguous()
        or window.shape != src.shape[-1:]
        or dst.shape != src.shape
        or dst.dtype != torch.float32
    ):
        torch.mul(src, window, out=dst)
        return
    rows, frame = src.shape
    _native.pcm16_rows(
        src.data_ptr(), src.stride(0), rows, frame, window.data_ptr(), dst.data_ptr(), dst.stride(0)
    )


def _row_layout(
    frames: list[list[torch.Tensor]],
) -> tuple[list[int], list[int], list[torch.Tensor], list[int]]:
    """Each clip's frame pieces laid end to end, each clip from a ROW_BLOCK boundary:
    (frames per clip, first row per clip (and the total), every piece, its first row)."""
    counts = [sum(p.shape[-2] for p in clip) for clip in frames]
    starts, pieces, at = [0], list[torch.Tensor](), list[int]()
    for clip_pieces, count in zip(frames, counts, strict=True):
        row = starts[-1]
        for piece in clip_pieces:
            pieces.append(piece)
            at.append(row)
            row += piece.shape[-2]
        starts.append(starts[-1] + -(-count // ROW_BLOCK) * ROW_BLOCK)
    return counts, starts, pieces, at


# Frame samples per featurizer step (2 MiB in float32): a step's frames,
# spectrum and power stay in a core's cache from framing to filterbank; steps
# four times larger run up to three times slower, spilling each pass to memory.
CHUNK_SAMPLES = 1 << 19


def featurize_clips(
    waves: Sequence[torch.Tensor], cfg: FeatureConfig, chunk_frames: int | None = None
) -> list[torch.Tensor]:
    """Each ``(time,)`` clip at cfg.sample_rate -> float32 ``(frames, bins)`` (``(time,)`` for waveform).

    A clip is float (float32 or wider) or int16, 16-bit PCM as read (PCM16_SCALE):
    an int16 clip's features are byte-identical to those of its float32 form.

    The clips' frames are laid end to end, each clip starting on a ROW_BLOCK
    boundary (zero rows fill the rest of its last block), and go through the
    FFT and filterbank ``chunk_frames`` rows at a time (default: about
    CHUNK_SAMPLES samples of frames; rounded up to whole ROW_BLOCKs), so
    neither many clips nor one long recording is held as a whole
    spectrogram. Every frame is transformed alone and every product has a
    fixed shape over rows of one clip, so a clip's features are byte-identical
    whichever clips are featurized with it and however the rows are chunked.
    Log runs once on all mel rows; the per-clip clamps (top_db, Whisper's
    max - 8) and everything after on each clip's own rows.
    """
    if chunk_frames is not None and chunk_frames < 1:
        raise ValueError(f"chunk_frames must be positive, got {chunk_frames}")
    framed_pcm16 = takes_pcm16(cfg)
    xs = []
    for n, wave in enumerate(waves):
        if wave.ndim != 1:
            raise ValueError(
                f"clip {n}: expected a (time,) waveform, got shape {tuple(wave.shape)}"
            )
        xs.append(wave if framed_pcm16 and wave.dtype == torch.int16 else as_float(wave))
    if cfg.features == "waveform" or not xs:
        return xs
    if cfg.features == "fbank":  # rows gathered zero-padded to Kaldi's FFT length
        frames, spectrum_of = [[_kaldi_frames(x, cfg)] for x in xs], _kaldi_spectrum
        width, exponent = kaldi_frame_sizes(cfg)[2], 2.0
    else:
        frames, spectrum_of = [_stft_frames(x, cfg) for x in xs], _stft_spectrum
        width, exponent = 0, cfg.power
    counts, starts, pieces, at = _row_layout(frames)
    del frames
    total = starts[-1]
    step = chunk_frames or CHUNK_SAMPLES // pieces[0].shape[-1]
    step = -(-step // ROW_BLOCK) * ROW_BLOCK  # whole blocks
    window, pcm16_window = _gather_window(cfg), _gather_window(cfg, pcm16=True)
    mel = torch.empty((total, cfg.n_mels), dtype=torch.float32)
    for r0 in range(0, total, step):
        r1 = min(total, r0 + step)
        rows = _gather_rows(pieces, at, r0, r1, window, width, pcm16_window)
        _filterbank_into(spectrum_of(rows, cfg), exponent, cfg, mel[r0:r1])
    del pieces, xs
    _log_(mel, cfg)
    for start, count in zip(starts, counts, strict=False):
        clip = mel[start : start + count]
        if cfg.log != "none" and cfg.top_db is not None:
            _clip_below_clip_max_(clip, cfg.top_db)
        if cfg.post == "whisper":
            _clip_below_clip_max_(clip, 8.0)
            clip.add_(4.0).div_(4.0)
    out = (
        _blocked_matmul(mel, _dct_tensor(cfg.n_mels, cfg.n_mfcc)) if cfg.features == "mfcc" else mel
    )
    clips = []
    for start, count in zip(starts, counts, strict=False):
        clip = out[start : start + count]
        if cfg.num_frames is not None:
            clip = _fix_frames(clip, cfg.num_frames)
        if cfg.post == "ast":
            clip = (clip - cfg.norm_mean) / (2.0 * cfg.norm_std)
        clips.append(clip)
    return clips


def featurize(
    waveform: torch.Tensor, cfg: FeatureConfig, chunk_frames: int | None = None
) -> torch.Tensor:
    """``(..., time)`` at cfg.sample_rate -> float32 ``(..., frames, bins)`` (``(..., time)`` for waveform).

    Each leading index is a clip of its own (featurize_clips), so the result
    is byte-identical to featurizing the clips one by one. int16 is 16-bit PCM
    (PCM16_SCALE).
    """
    if cfg.features == "waveform":
        return as_float(waveform)
    lead, length = waveform.shape[:-1], waveform.shape[-1]
    clips = featurize_clips(list(waveform.reshape(math.prod(lead), length)), cfg, chunk_frames)
    if not clips:
        return torch.zeros((*lead, cfg.num_output_frames(length), cfg.bins), dtype=torch.float32)
    return torch.stack(clips).reshape(*lead, *clips[0].shape)

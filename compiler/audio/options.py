"""What an audio featurizer computes: the options, their checks and the presets.

A ``FeatureConfig`` says which convention's features a compile writes (librosa,
torchaudio, Kaldi, Whisper, AST, ...); ``compiler.audio.features`` computes them. This
module needs no torch, so reading and checking a recipe stays light.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

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


def kaldi_frame_sizes(cfg: FeatureConfig) -> tuple[int, int, int]:
    size = int(cfg.sample_rate * cfg.frame_length_ms * 0.001)
    shift = int(cfg.sample_rate * cfg.frame_shift_ms * 0.001)
    padded = 1 << (size - 1).bit_length() if cfg.round_to_power_of_two else size
    return size, shift, padded


@dataclass(frozen=True)
class ResampleConfig:
    """The resampling kernel's parameters (``compiler.audio.resample``): sinc zero crossings,
    roll-off as a fraction of the lower Nyquist frequency, Kaiser window beta."""

    zero_crossings: int = 64
    rolloff: float = 0.9475937167399596
    beta: float = 14.769656459379492

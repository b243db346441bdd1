"""The recorded recipe says exactly what ran and rebuilds the archive; bad recipes stop before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import soundfile as sf

from dlop.compiler.audio.options import PRESETS, FeatureConfig, feature_config
from dlop.compiler.errors import CompileError
from dlop.compiler.recipe import build_recipe
from dlop.formats import ArchiveReader
from dlop.tools.compile_cli import main

from .fixtures import esc50_corpus

COMBINATIONS = [
    (preset, kind)
    for preset, values in PRESETS.items()
    for kind in (
        ("fbank", "waveform") if values["features"] == "fbank" else ("logmel", "mfcc", "waveform")
    )
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Two rates, so that one clip is resampled whatever the preset's rate.
    return esc50_corpus(
        tmp_path_factory.mktemp("recipe") / "c", [("wav", 16000, 1), ("flac", 22050, 2)], 0.6
    )


def shards(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.glob("*.dlop"))}


@pytest.mark.parametrize(("preset", "kind"), COMBINATIONS)
def test_recorded_recipe_rebuilds_the_archive_and_says_what_ran(
    corpus: Path, tmp_path: Path, preset: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    a, b = tmp_path / "a", tmp_path / "b"
    args = ["--preset", preset, "--features", kind, "--duration", "0", "--workers", "1", "-q"]
    assert main([str(corpus), "-o", str(a), *args]) == 0
    assert main(["--recipe", str(a), "-o", str(b), "--workers", "1", "-q"]) == 0
    assert shards(a) == shards(b) and len(shards(a)) == 1
    assert (a / "index.json").read_bytes() == (b / "index.json").read_bytes()

    recorded = json.loads((a / "index.json").read_text())["recipe"]["features"]
    cfg = feature_config(preset, kind)
    assert recorded == cfg.to_json()
    assert FeatureConfig.from_json(recorded) == FeatureConfig.from_json(cfg.to_json())
    rate = recorded["sample_rate"]
    stft = {"n_fft", "hop_length", "win_length", "center", "pad_mode", "power", "drop_last_frame"}
    kaldi = {"frame_length_ms", "frame_shift_ms", "preemphasis", "remove_dc", "input_scale"}
    if kind == "waveform":
        assert set(recorded) == {"features", "preset", "sample_rate"}
    elif kind == "fbank":
        assert not stft & set(recorded) - {"power"} and kaldi <= set(recorded)
        assert recorded["frame_length_samples"] == rate * 25 // 1000 == 400
        assert recorded["frame_shift_samples"] == rate * 10 // 1000 == 160
        assert recorded["fft_length"] == 512 and recorded["snip_edges"] is True
        assert recorded["mel_scale"] == "kaldi" and recorded["f_max"] == rate / 2
    else:
        assert not kaldi & set(recorded) and stft - {"pad_mode"} <= set(recorded)
        assert recorded["win_length"] == recorded["n_fft"] and recorded["f_max"] is not None
    assert ("n_mfcc" in recorded) == (kind == "mfcc")
    assert ("norm_mean" in recorded) == (preset == "ast" and kind == "fbank")

    # The frame counts the archive holds follow from the recorded framing alone.
    reader = ArchiveReader(a)
    for i in range(len(reader)):
        key = str(reader.get("key", i))
        info = sf.info(str(corpus / key))
        n = -(-info.frames * rate // info.samplerate)  # resampled length
        if kind == "waveform":
            want = n
        elif recorded.get("num_frames") is not None:
            want = recorded["num_frames"]
        elif kind == "fbank":
            size, shift = recorded["frame_length_samples"], recorded["frame_shift_samples"]
            want = 0 if n < size else 1 + (n - size) // shift
        else:
            padded = n + (recorded["n_fft"] // 2 * 2 if recorded["center"] else 0)
            want = 1 + (padded - recorded["n_fft"]) // recorded["hop_length"]
            want -= 1 if recorded["drop_last_frame"] else 0
        assert reader.get(kind, i).shape[0] == want, (key, n)


def test_kaldi_record_has_no_stft_defaults() -> None:
    """The issue's case: kaldi fbank recorded n_fft 2048 / hop 512 / center / slaney."""
    recorded = feature_config("kaldi", "fbank").to_json()
    for key in ("n_fft", "hop_length", "center", "pad_mode", "norm", "win_length"):
        assert key not in recorded
    assert recorded["mel_scale"] == "kaldi" and recorded["window"] == "povey"


def test_an_edited_record_that_contradicts_itself_is_refused(tmp_path: Path) -> None:
    recorded = feature_config("kaldi").to_json()
    with pytest.raises(CompileError, match=r"features\.frame_shift_samples"):
        build_recipe(
            {
                "source": str(tmp_path),
                "layout": "folder",
                "features": {**recorded, "frame_shift_samples": 512},
            }
        )
    with pytest.raises(CompileError, match=r"features: unknown option.*hop_lenght"):
        build_recipe(
            {"source": str(tmp_path), "layout": "folder", "features": {**recorded, "hop_lenght": 1}}
        )


BAD = [
    ("n_mels", 100000, "n_mels"),
    ("n_mels", 0, "n_mels"),
    ("n_mels", True, "n_mels"),
    ("n_fft", "abc", "n_fft"),
    ("n_fft", 2.5, "n_fft"),
    ("n_fft", True, "n_fft"),
    ("n_fft", 1 << 20, "n_fft"),
    ("hop_length", 0, "hop_length"),
    ("hop_length", -160, "hop_length"),
    ("win_length", 4096, "win_length"),
    ("sample_rate", 10, "sample_rate"),
    ("sample_rate", 10_000_000, "sample_rate"),
    ("sample_rate", "16k", "sample_rate"),
    ("f_min", -1.0, "f_min"),
    ("f_min", 20000.0, "f_min"),
    ("f_max", 30000.0, "f_max"),
    ("f_max", "nyquist", "f_max"),
    ("top_db", -5.0, "top_db"),
    ("top_db", "80", "top_db"),
    ("n_mfcc", 500, "n_mfcc"),
    ("power", 0.0, "power"),
    ("amin", 0.0, "amin"),
    ("center", "yes", "center"),
    ("window", "blackman", "window"),
    ("mel_scale", "mel", "mel_scale"),
    ("fft_dtype", "float16", "fft_dtype"),
    ("num_frames", 0, "num_frames"),
    ("preset", "htk", "preset"),
    ("preset", 3, "preset"),
    ("features", "spectrogram", "features"),
    ("dtype", "float64", "dtype"),
    ("duration", -1.0, "duration"),
    ("duration", "5", "duration"),
    ("duration", 1e9, "duration"),
    ("duration", float("nan"), "duration"),
    ("shard_bytes", 10, "shard_bytes"),
    ("shard_bytes", "12 parsecs", "shard_bytes"),
    ("shard_bytes", "2TiB", "shard_bytes"),
    ("shard_bytes", True, "shard_bytes"),
    ("downmix", "sum", "downmix"),
    ("on_error", "ignore", "on_error"),
    ("layout", "zip", "layout"),
    ("media", "text", "media"),
    ("workers", 0, "workers"),
    ("workers", "4", "workers"),
    ("codec", 3, "codec"),
    ("resampler", {"beta": "high"}, "resampler.beta"),
    ("resampler", {"taps": 3}, "resampler.taps"),
    ("resampler", {"rolloff": 2.0}, "resampler.rolloff"),
    ("masks", 5, "masks"),
    ("clip_frames", "16", "clip_frames"),
    ("consensus", "yes", "consensus"),
    ("hop_lenght", 3, "hop_lenght"),
]


@pytest.mark.parametrize(("key", "value", "named"), BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_bad_recipe_values_name_the_key(
    tmp_path: Path, key: str, value: object, named: str
) -> None:
    with pytest.raises(CompileError, match=named.replace(".", r"\.")):
        build_recipe({"source": str(tmp_path / "nowhere"), "layout": "folder", key: value})


KALDI_BAD = [
    ("n_mels", 300, "n_mels"),  # more than the 256 bins of a 512-sample FFT
    ("f_max", 9000.0, "f_max"),
    ("f_max", -8000.0, "f_min"),  # offset from Nyquist down to 0 Hz
    ("n_fft", 400, "n_fft"),  # an STFT option: Kaldi framing never reads it
    ("frame_shift_ms", 0.01, "frame_shift_ms"),  # 0 samples at 16 kHz
    ("frame_length_ms", 5000.0, "frame_length_ms"),
    ("preemphasis", 1.5, "preemphasis"),
]


@pytest.mark.parametrize(("key", "value", "named"), KALDI_BAD)
def test_bad_kaldi_values_name_the_key(tmp_path: Path, key: str, value: object, named: str) -> None:
    with pytest.raises(CompileError, match=named):
        build_recipe({"source": str(tmp_path), "layout": "folder", "preset": "kaldi", key: value})


def test_options_that_would_not_run_are_refused(tmp_path: Path) -> None:
    base = {"source": str(tmp_path), "layout": "folder"}
    with pytest.raises(CompileError, match="n_mels: does not apply to waveform"):
        build_recipe({**base, "features": "waveform", "n_mels": 64})
    with pytest.raises(CompileError, match="input_scale: does not apply to logmel"):
        build_recipe({**base, "input_scale": 2.0})
    with pytest.raises(CompileError, match="n_mfcc: does not apply"):
        build_recipe({**base, "n_mfcc": 13})


@pytest.mark.parametrize(
    ("recipe", "named"),
    [
        ("n_mels = 100000\n", "n_mels"),
        ('n_fft = "abc"\n', "n_fft"),
        ("duration = -2\n", "duration"),
        ('shard_bytes = "1KiB"\n', "shard_bytes"),
        ("[resampler]\nbeta = true\n", "resampler.beta"),
    ],
)
def test_bad_recipe_through_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], recipe: str, named: str
) -> None:
    path = tmp_path / "r.toml"
    path.write_text(f'source = "{tmp_path}"\nlayout = "folder"\n{recipe}')
    assert main(["--recipe", str(path), "-o", str(tmp_path / "out"), "-q"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_bad_flags_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "out")
    assert main([str(tmp_path), "--layout", "folder", "-o", out, "--n-mels", "100000"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "n_mels" in err and "1025" in err
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path), "-o", out, "--n-fft", "abc"])
    assert e.value.code == 2 and "--n-fft" in capsys.readouterr().err

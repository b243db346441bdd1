"""16-bit PCM kept as int16 from the file to the framing gather.

decode_audio(pcm16=True) returns 16-bit PCM that needs no mix as read, and
featurize_clips frames int16 clips with the 1/32768 folded into its window
(float32 STFT features) or converts them first (everything else). Either way
a clip's features are the bytes its float32 form gives, for every preset, both
gathers (compiled and torch) and every length; an archive compiled this way
is the archive compiled without it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from dlop.compiler.audio import decode, features
from dlop.compiler.audio.decode import PCM16_SCALE, decode_audio, downmix
from dlop.compiler.audio.features import (
    ROW_BLOCK,
    as_float,
    featurize,
    featurize_clips,
    takes_pcm16,
)
from dlop.compiler.audio.options import FeatureConfig, feature_config
from dlop.compiler.errors import InputError
from dlop.compiler.run import items
from dlop.tools.compile_cli import main

from .fixtures import esc50_row, write_audio, write_esc50_csv
from .signals import make_signal
from .test_decode_errors import encoded, flac_with_total_samples, wav_with_data_size

KINDS = [
    ("librosa", "logmel", {}, True),
    ("librosa", "mfcc", {}, True),
    ("librosa", "logmel", {"power": 1.0}, True),
    ("librosa", "logmel", {"win_length": 600, "pad_mode": "constant"}, True),
    ("librosa", "logmel", {"center": False}, True),
    ("torchaudio", "logmel", {}, True),
    ("whisper", "logmel", {}, True),
    ("panns", "logmel", {}, True),
    ("librosa", "logmel", {"fft_dtype": "float64"}, False),
    ("kaldi", "fbank", {}, False),
    ("ast", "fbank", {}, False),
    ("librosa", "waveform", {}, False),
]


def pcm16_clips(rate: int) -> list[torch.Tensor]:
    """int16 clips of many lengths (empty, shorter than the centring pad, several row
    blocks), full scale at both ends."""
    out = []
    for i, seconds in enumerate((0.37, 0.0, 0.004, 0.013, 1.21, 0.6)):
        x = make_signal(rate, seconds, seed=i) if seconds else np.zeros(0)
        q = np.clip(np.round(x * 40000), -32768, 32767).astype(np.int16)
        if len(q) > 8:
            q[:4] = (-32768, 32767, -32768, 32767)
        out.append(torch.from_numpy(q))
    return out


def as_bytes(feats: list[torch.Tensor]) -> list[bytes]:
    return [f.contiguous().numpy().tobytes() for f in feats]


def test_as_float_is_the_exact_scale() -> None:
    q = torch.tensor([-32768, -1, 0, 1, 12345, 32767], dtype=torch.int16)
    assert as_float(q).tolist() == [v / 32768 for v in q.tolist()]
    assert as_float(q).dtype == torch.float32
    x = torch.tensor([0.5, -0.25], dtype=torch.float64)
    assert as_float(x).dtype == torch.float32 and as_float(x).tolist() == [0.5, -0.25]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize(("preset", "kind", "options", "framed"), KINDS)
def test_int16_clips_give_the_bytes_of_their_float32_form(
    preset: str,
    kind: str,
    options: dict[str, object],
    framed: bool,
    compiled: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = [0]
    if not compiled:
        monkeypatch.setattr(features, "_native", None)
    elif features._native is None:
        pytest.skip("the compiled kernels were not built")
    else:
        native = features._native

        class Counted:
            power_filterbank = native.power_filterbank

            @staticmethod
            def pcm16_rows(*args: object) -> None:
                calls[0] += 1
                native.pcm16_rows(*args)

        monkeypatch.setattr(features, "_native", Counted)
    cfg = feature_config(preset, kind, **options)
    assert takes_pcm16(cfg) is framed
    ints = pcm16_clips(cfg.sample_rate)
    floats = [q.to(torch.float32) * PCM16_SCALE for q in ints]
    want = as_bytes(featurize_clips(floats, cfg))
    assert as_bytes(featurize_clips(ints, cfg)) == want
    # mixed in one group, and chunked at another row count
    mixed = [q if i % 2 else f for i, (q, f) in enumerate(zip(ints, floats, strict=True))]
    assert as_bytes(featurize_clips(mixed, cfg, chunk_frames=ROW_BLOCK)) == want
    for got in featurize_clips(ints, cfg):
        assert got.dtype == torch.float32
    # the compiled gather framed the int16 clips (the torch one did otherwise)
    assert (calls[0] > 0) is (compiled and framed)


def test_featurize_takes_int16_as_pcm() -> None:
    cfg = feature_config("librosa")
    q = torch.stack(pcm16_clips(cfg.sample_rate)[4:5] * 3)
    assert torch.equal(featurize(q, cfg), featurize(q.to(torch.float32) * PCM16_SCALE, cfg))
    wave = featurize(q, feature_config("librosa", "waveform"))
    assert wave.dtype == torch.float32 and torch.equal(wave, as_float(q))
    empty = featurize(torch.zeros((2, 0), dtype=torch.int16), cfg)
    assert empty.dtype == torch.float32 and empty.shape == (2, 1, cfg.n_mels)


def test_the_gather_refuses_int16_without_its_window() -> None:
    rows = torch.zeros((2, 8), dtype=torch.int16)
    with pytest.raises(ValueError, match="16-bit PCM"):
        features._gather_rows([rows], [0], 0, 2, torch.ones(8), 0, None)


# -- decoding -----------------------------------------------------------------------


def pcm(path: Path, channels: int = 1, rate: int = 16000, subtype: str = "PCM_16") -> Path:
    x = make_signal(rate, 0.7, seed=channels, channels=channels)
    return write_audio(path, x, rate, subtype=subtype)


@pytest.mark.parametrize("plain", [True, False], ids=["plain-reader", "libsndfile"])
@pytest.mark.parametrize("ext", ["wav", "flac"])
def test_decode_keeps_mono_pcm16_as_read(
    tmp_path: Path, ext: str, plain: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decode, "PLAIN_WAV_READER", plain)
    path = pcm(tmp_path / f"a.{ext}")
    want, rate = decode_audio(path, "a")
    got, got_rate = decode_audio(path, "a", pcm16=True)
    assert got.dtype == np.int16 and got_rate == rate and got.shape == want.shape
    assert np.array_equal(got, sf.read(path, dtype="int16", always_2d=True)[0].T)
    assert np.array_equal(got * np.float32(1 / 32768), want)
    # a span, and bytes (a tar member)
    part, _ = decode_audio(path.read_bytes(), "a", 0.1, 0.25, pcm16=True)
    assert part.dtype == np.int16
    assert np.array_equal(part, got[:, 1600 : 1600 + 4000])


@pytest.mark.parametrize("plain", [True, False], ids=["plain-reader", "libsndfile"])
def test_decode_keeps_the_first_channel_and_gives_float32_for_several(
    tmp_path: Path, plain: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """int16 comes out as one channel only: a mean, or every channel, is float32 as
    without ``pcm16`` (so downmix never meets int16 channels to mix)."""
    monkeypatch.setattr(decode, "PLAIN_WAV_READER", plain)
    path = pcm(tmp_path / "stereo.wav", channels=2)
    raw = sf.read(path, dtype="int16", always_2d=True)[0].T
    first, _ = decode_audio(path, "s", mix="first", pcm16=True)
    assert first.dtype == np.int16 and np.array_equal(first, raw[:1])
    assert np.array_equal(downmix(first, "first"), raw[0])
    for mix in ("mean", None):
        got, _ = decode_audio(path, "s", mix=mix, pcm16=True)
        assert got.dtype == np.float32
        assert np.array_equal(got, decode_audio(path, "s", mix=mix)[0])


@pytest.mark.parametrize(("channels", "mix"), [(1, None), (2, "first"), (2, None)])
def test_int16_output_grows_for_a_stream_of_unknown_length(channels: int, mix: str | None) -> None:
    """A stream that does not state its length is read block by block into an output
    that grows (past the first 262144 frames); one channel stays int16 through it,
    several become float32."""
    rng = np.random.default_rng(2)
    frames = rng.integers(-32768, 32768, size=(600_001, channels)).astype(np.int16)
    at = [0]

    def read(buf: np.ndarray) -> int:
        n = min(len(buf), len(frames) - at[0])  # fewer than asked: the stream's end
        buf[:n] = frames[at[0] : at[0] + n]
        at[0] += n
        return n

    got = decode._read_blocks(read, "s", None, np.dtype(np.int16), channels, mix, pcm16=True)
    want = frames.T if mix is None else frames.T[:1]
    if channels > 1 and mix is None:
        assert got.dtype == np.float32 and np.array_equal(got, want * PCM16_SCALE)
    else:
        assert got.dtype == np.int16 and np.array_equal(got, want)


@pytest.mark.parametrize("channels", [1, 2])
def test_a_short_read_ends_the_int16_output_where_the_stream_ended(channels: int) -> None:
    """Fewer frames than the length said (a file cut while it is read): the output is the
    frames that came, read straight into it (one channel) or through the buffer."""
    frames = np.arange(-300, 300, dtype=np.int16).reshape(-1, 1).repeat(channels, axis=1)
    at = [0]

    def read(buf: np.ndarray) -> int:
        n = min(len(buf), len(frames) - at[0])
        buf[:n] = frames[at[0] : at[0] + n]
        at[0] += n
        return n

    got = decode._read_blocks(read, "s", 1000, np.dtype(np.int16), channels, "first", True)
    assert got.dtype == np.int16 and got.shape == (1, 600)
    assert np.array_equal(got[0], frames[:, 0])


def reason(source: bytes, name: str, pcm16: bool) -> str:
    with pytest.raises(InputError) as e:
        decode_audio(source, name, pcm16=pcm16)
    assert e.value.path == name
    return e.value.reason


@pytest.mark.parametrize("plain", [True, False], ids=["plain-reader", "libsndfile"])
def test_truncated_and_misstated_16_bit_files_fail_as_they_do_in_float32(
    plain: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The int16 reads (straight into the output, or block by block) stop where the
    float32 reads stop, with the same error; a header that understates the length
    gives the same frames."""
    monkeypatch.setattr(decode, "PLAIN_WAV_READER", plain)
    wav, flac = encoded("WAV", "PCM_16"), encoded("FLAC", "PCM_16")
    bad = {
        "half.wav": wav[: len(wav) // 2],
        "odd.wav": wav[: len(wav) * 4 // 5 + 1],  # cut inside a sample
        "more.wav": wav_with_data_size(wav, 2.0),
        "half.flac": flac[: len(flac) // 2],
        "more.flac": flac_with_total_samples(flac, 96000),
        "header.wav": wav[:30],
    }
    for name, data in bad.items():
        want = reason(data, name, pcm16=False)
        assert reason(data, name, pcm16=True) == want, name
        assert "truncated" in want or "cannot decode" in want, (name, want)
    for name, data in {
        "fewer.flac": flac_with_total_samples(flac, 24000),
        "fewer.wav": wav_with_data_size(wav, 0.5),
    }.items():
        try:
            floats, _ = decode_audio(data, name)
        except InputError as e:
            assert reason(data, name, pcm16=True) == e.reason, name
            continue
        ints, _ = decode_audio(data, name, pcm16=True)
        assert ints.dtype == np.int16 and np.array_equal(ints * PCM16_SCALE, floats), name


@pytest.mark.parametrize(("ext", "subtype"), [("wav", "FLOAT"), ("wav", "PCM_24"), ("ogg", None)])
def test_decode_gives_float32_for_everything_else(tmp_path: Path, ext: str, subtype: str) -> None:
    path = pcm(tmp_path / f"b.{ext}", subtype=subtype)
    got, _ = decode_audio(path, "b", pcm16=True)
    assert got.dtype == np.float32
    assert np.array_equal(got, decode_audio(path, "b")[0])


# -- end to end ---------------------------------------------------------------------


def mixed_corpus(root: Path) -> None:
    """Mono 16-bit WAV and FLAC at the recipe's rate (kept as int16), stereo (mixed),
    another rate (resampled), float WAV, clips shorter and longer than the duration."""
    specs = [
        ("wav", 22050, 1, "PCM_16", 1.3),
        ("flac", 22050, 1, "PCM_16", 0.4),
        ("wav", 22050, 2, "PCM_16", 1.0),
        ("wav", 16000, 1, "PCM_16", 1.1),
        ("wav", 22050, 1, "FLOAT", 0.9),
        ("wav", 22050, 1, "PCM_16", 0.01),
    ]
    rows = []
    for n, (ext, rate, channels, subtype, seconds) in enumerate(specs):
        name = f"{1 + n % 5}-{1000 + n}-A-{n % 3}.{ext}"
        x = make_signal(rate, seconds, seed=n, channels=channels)
        write_audio(root / "audio" / name, x, rate, subtype=subtype)
        rows.append(esc50_row(name, n))
    write_esc50_csv(root, rows)


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.mark.parametrize("downmix", ["mean", "first"])
def test_an_archive_compiled_from_int16_is_the_float32_archive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, downmix: str
) -> None:
    mixed_corpus(tmp_path / "corpus")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    args = [str(tmp_path / "corpus"), "--preset", "librosa", "--sample-rate", "22050"]
    args += ["--duration", "1.0", "--downmix", downmix, "--workers", "1", "-q"]
    seen: list[torch.dtype] = []
    featurize_clips_ = items.featurize_clips

    def watched(waves: list[torch.Tensor], cfg: FeatureConfig) -> list[torch.Tensor]:
        seen.extend(w.dtype for w in waves)
        return featurize_clips_(waves, cfg)

    monkeypatch.setattr(items, "featurize_clips", watched)
    assert main([*args, "-o", str(tmp_path / "int16")]) == 0
    # the 16-bit mono clips at the recipe's rate (and the stereo one, by its first channel)
    assert seen.count(torch.int16) == (4 if downmix == "first" else 3), seen
    monkeypatch.setattr(items, "takes_pcm16", lambda cfg: False)
    seen.clear()
    assert main([*args, "-o", str(tmp_path / "float32")]) == 0
    assert torch.int16 not in seen and len(seen) == 6
    assert files(tmp_path / "int16") == files(tmp_path / "float32")

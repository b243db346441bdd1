"""Truncated audio and headers that misstate the length are decode errors, never shorter clips."""

from __future__ import annotations

import io
import os
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from dlop.compiler.audio.decode import LENGTH_TOLERANCE_FRAMES, decode_audio, downmix
from dlop.compiler.errors import InputError
from dlop.compiler.recipe import build_recipe
from dlop.compiler.run.pipeline import compile_corpus
from dlop.formats import ArchiveReader

from .fixtures import write_aac, write_esc50_csv
from .signals import make_signal

RATE = 16000
SECONDS = 3.0


def encoded(fmt: str, subtype: str | None = None, seconds: float = SECONDS, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, make_signal(RATE, seconds, seed=seed), RATE, format=fmt, subtype=subtype)
    return buf.getvalue()


def wav_with_data_size(data: bytes, factor: float) -> bytes:
    """A WAV whose RIFF and data sizes are scaled by ``factor`` (the samples left as they are)."""
    out = bytearray(data)
    at = out.find(b"data")
    size = struct.unpack("<I", out[at + 4 : at + 8])[0]
    new = int(size * factor) // 2 * 2
    out[at + 4 : at + 8] = struct.pack("<I", new)
    out[4:8] = struct.pack("<I", new + at + 8 - 8)
    return bytes(out)


def flac_with_total_samples(data: bytes, total: int) -> bytes:
    """A FLAC whose STREAMINFO total-samples field (36 bits) says ``total``."""
    out = bytearray(data)
    assert out[:4] == b"fLaC" and out[4] & 0x7F == 0  # STREAMINFO is the first block
    field = int.from_bytes(out[18:26], "big")  # sample rate .. total samples
    field = (field & ~((1 << 36) - 1)) | total
    out[18:26] = field.to_bytes(8, "big")
    return bytes(out)


TRUNCATED = {
    "wav": lambda: encoded("WAV", "PCM_16"),
    "flac": lambda: encoded("FLAC"),
    "ogg": lambda: encoded("OGG", "VORBIS"),
    "mp3": lambda: encoded("MP3"),
}


@pytest.mark.parametrize("kind", sorted(TRUNCATED))
@pytest.mark.parametrize("keep", [0.5, 0.8])
def test_a_truncated_file_is_a_decode_error(kind: str, keep: float, tmp_path: Path) -> None:
    whole = TRUNCATED[kind]()
    audio, rate = decode_audio(whole, f"whole.{kind}")
    assert rate == RATE and abs(audio.shape[1] - RATE * SECONDS) <= LENGTH_TOLERANCE_FRAMES
    cut = whole[: int(len(whole) * keep)]
    path = tmp_path / f"cut.{kind}"
    path.write_bytes(cut)
    for source in (cut, path):  # tar members arrive as bytes, files as paths
        with pytest.raises(InputError) as e:
            decode_audio(source, f"cut.{kind}")
        assert e.value.path == f"cut.{kind}"
        assert "truncated" in e.value.reason or "cannot decode" in e.value.reason


def test_truncation_messages_say_how_much_was_decoded() -> None:
    wav = encoded("WAV", "PCM_16")
    with pytest.raises(InputError, match=r"truncated: decoded \d+ of 48000 declared frames"):
        decode_audio(wav[: len(wav) // 2], "a.wav")
    flac = encoded("FLAC")
    with pytest.raises(InputError, match=r"cannot decode frames \d+-\d+ of 48000 declared: .*sync"):
        decode_audio(flac[: len(flac) // 2], "a.flac")
    ogg = encoded("OGG", "VORBIS")
    with pytest.raises(InputError, match="truncated: the file ends inside the Ogg page"):
        decode_audio(ogg[: len(ogg) // 2 + 7], "a.ogg")
    # cut exactly after a whole page: the last page is not the end of the stream
    page = ogg.rfind(b"OggS", 0, len(ogg) // 2)
    with pytest.raises(InputError, match="not marked end-of-stream"):
        decode_audio(ogg[:page], "a.ogg")


def test_headers_that_misstate_the_length() -> None:
    wav = encoded("WAV", "PCM_16")
    with pytest.raises(InputError, match="truncated: decoded 48000 of 96000 declared"):
        decode_audio(wav_with_data_size(wav, 2.0), "more.wav")
    with pytest.raises(InputError, match=r"declares 24000 frames but 48000 bytes .* not RIFF"):
        decode_audio(wav_with_data_size(wav, 0.5), "fewer.wav")
    flac = encoded("FLAC")
    with pytest.raises(InputError, match="of 96000 declared"):
        decode_audio(flac_with_total_samples(flac, 96000), "more.flac")
    # An understating FLAC header is trusted: the clip is what STREAMINFO declares.
    audio, _ = decode_audio(flac_with_total_samples(flac, 24000), "fewer.flac")
    assert audio.shape == (1, 24000)
    # A length of 0 means "unknown" in FLAC: the whole stream decodes.
    audio, _ = decode_audio(flac_with_total_samples(flac, 0), "unknown.flac")
    assert audio.shape == (1, 48000)


def test_valid_wav_extras_and_streamed_sizes_still_decode() -> None:
    wav = encoded("WAV", "PCM_16")
    tail = b"LIST" + struct.pack("<I", 4) + b"INFO" + b"TAG" + bytes(125)  # a chunk, an ID3v1 tag
    assert decode_audio(wav + tail, "extras.wav")[0].shape == (1, 48000)
    streamed = bytearray(wav)
    at = streamed.find(b"data")
    streamed[at + 4 : at + 8] = b"\xff\xff\xff\xff"  # "length unknown", as live recorders write
    assert decode_audio(bytes(streamed), "streamed.wav")[0].shape == (1, 48000)


def test_a_requested_span_is_checked_not_the_rest_of_the_file() -> None:
    wav = encoded("WAV", "PCM_16")
    cut = wav[: len(wav) // 2]  # about 1.5 s of a declared 3 s
    audio, _ = decode_audio(cut, "a.wav", offset=0.25, duration=1.0)
    assert audio.shape == (1, 16000)
    with pytest.raises(InputError, match="of the 16000 frames requested from frame 16000"):
        decode_audio(cut, "a.wav", offset=1.0, duration=1.0)
    # a span running past the declared end asks only for what is declared
    audio, _ = decode_audio(wav, "a.wav", offset=2.5, duration=1.0)
    assert audio.shape == (1, 8000)


def test_pyav_errors_are_raised_not_swallowed(tmp_path: Path) -> None:
    path = tmp_path / "a.m4a"
    write_aac(path, make_signal(RATE, 1.0).astype(np.float32), RATE)
    assert decode_audio(path, "a.m4a")[0].shape[1] >= RATE
    data = path.read_bytes()
    with pytest.raises(InputError, match=r"cannot decode .*PyAV"):
        decode_audio(data[: len(data) // 2], "cut.m4a")


BAD = {
    "cut.wav": lambda: encoded("WAV", "PCM_16", seed=9)[:50000],
    "cut.flac": lambda: encoded("FLAC", seed=9)[:20000],
    "cut.ogg": lambda: encoded("OGG", "VORBIS", seed=9)[:9000],
    "cut.mp3": lambda: encoded("MP3", seed=9)[:6000],
    "more.wav": lambda: wav_with_data_size(encoded("WAV", "PCM_16", seed=9), 2.0),
    "fewer.wav": lambda: wav_with_data_size(encoded("WAV", "PCM_16", seed=9), 0.5),
    "more.flac": lambda: flac_with_total_samples(encoded("FLAC", seed=9), 96000),
}


def test_bad_inputs_are_named_and_leave_the_good_samples_alone(tmp_path: Path) -> None:
    def corpus(root: Path, bad: bool) -> Path:
        rows = []
        good = {
            "good-0.wav": ("WAV", "PCM_16"),
            "good-1.flac": ("FLAC", None),
            "good-2.ogg": ("OGG", "VORBIS"),
            "good-3.mp3": ("MP3", None),
        }
        (root / "audio").mkdir(parents=True)
        for n, (name, (fmt, subtype)) in enumerate(good.items()):
            (root / "audio" / name).write_bytes(encoded(fmt, subtype, seconds=1.0, seed=n))
        names = list(good)
        if bad:
            for name, make in BAD.items():
                (root / "audio" / name).write_bytes(make())
            names += list(BAD)
        for n, name in enumerate(names):
            rows.append(
                {
                    "filename": name,
                    "fold": 1,
                    "target": n % 3,
                    "category": f"c{n % 3}",
                    "esc10": "False",
                    "src_file": n,
                    "take": "A",
                }
            )
        write_esc50_csv(root, rows)
        return root

    def run(root: Path, out: Path) -> ArchiveReader:
        recipe = build_recipe(
            {"source": str(root), "duration": 0, "dtype": "float32", "sample_rate": RATE}
        )
        compile_corpus(recipe, out, workers=1, progress=False)
        return ArchiveReader(out)

    clean = run(corpus(tmp_path / "clean", bad=False), tmp_path / "a")
    mixed = run(corpus(tmp_path / "mixed", bad=True), tmp_path / "b")
    assert len(mixed) == len(clean) == 4
    for i in range(4):
        a, b = clean.sample(i), mixed.sample(i)
        assert a["key"] == b["key"] and a["label"] == b["label"]
        np.testing.assert_array_equal(a["logmel"], b["logmel"])
    errors = {Path(e["path"]).name: e["reason"] for e in mixed.errors()}
    assert sorted(errors) == sorted(BAD) and mixed.index.skipped_count == len(BAD)
    assert all("truncated" in r or "cannot decode" in r or "RIFF" in r for r in errors.values())


def test_fail_mode_stops_on_a_truncated_file(tmp_path: Path) -> None:
    from dlop.compiler.errors import CompileError

    root = tmp_path / "c"
    (root / "audio").mkdir(parents=True)
    (root / "audio" / "cut.flac").write_bytes(BAD["cut.flac"]())
    row = {"fold": 1, "target": 0, "category": "c", "esc10": "False", "src_file": 0, "take": "A"}
    write_esc50_csv(root, [{"filename": "cut.flac", **row}])
    recipe = build_recipe({"source": str(root), "on_error": "fail"})
    with pytest.raises(CompileError, match=r"cut\.flac: cannot decode frames"):
        compile_corpus(recipe, tmp_path / "out", workers=1, progress=False)


# Containers libsndfile writes here whose frame count it shortens to the bytes present.
CONTAINERS = {
    "wavex": ("WAVEX", "PCM_16"),
    "wavex-float": ("WAVEX", "FLOAT"),
    "aiff": ("AIFF", "PCM_16"),
    "aiff-24": ("AIFF", "PCM_24"),
    "w64": ("W64", "PCM_16"),
    "rf64": ("RF64", "PCM_16"),
    "au": ("AU", "PCM_16"),
    "ima-adpcm.wav": ("WAV", "IMA_ADPCM"),
    "ms-adpcm.wav": ("WAV", "MS_ADPCM"),
}


@pytest.mark.parametrize("kind", sorted(CONTAINERS))
def test_other_containers_cut_short_are_decode_errors(kind: str, tmp_path: Path) -> None:
    fmt, subtype = CONTAINERS[kind]
    whole = encoded(fmt, subtype)
    audio, _ = decode_audio(whole, f"whole.{kind}")
    if "adpcm" in kind:  # blocks of frames: the last one is padded
        assert 48000 <= audio.shape[1] < 48000 + 2048
    else:
        assert audio.shape == (1, 48000)
        reference, _ = sf.read(io.BytesIO(whole), dtype="float32")
        np.testing.assert_array_equal(audio[0], reference)
    cut = whole[: len(whole) // 2]
    path = tmp_path / f"cut.{kind}"
    path.write_bytes(cut)
    for source in (cut, path):
        with pytest.raises(InputError, match="truncated: ") as e:
            decode_audio(source, f"cut.{kind}")
        assert e.value.path == f"cut.{kind}"
        assert "of 48000 declared frames" in e.value.reason or "bytes but the file holds" in (
            e.value.reason
        )


def test_a_span_of_a_cut_aiff_still_decodes() -> None:
    aiff = encoded("AIFF", "PCM_16")
    cut = aiff[: len(aiff) // 2]
    assert decode_audio(cut, "a.aiff", offset=0.25, duration=1.0)[0].shape == (1, 16000)
    with pytest.raises(InputError, match="of the 16000 frames requested from frame 16000"):
        decode_audio(cut, "a.aiff", offset=1.0, duration=1.0)


def mp3_frame_length(data: bytes, at: int) -> int:
    """Length of the MPEG-2 layer III frame at ``at`` (the encoder's 16 kHz output)."""
    kbps = (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160)[(data[at + 2] >> 4) - 1]
    assert data[at : at + 2] == b"\xff\xf3"  # MPEG-2, layer III, no CRC
    return 72 * kbps * 1000 // RATE + ((data[at + 2] >> 1) & 1)


def test_an_mp3_without_a_xing_header_cut_short_is_a_decode_error(tmp_path: Path) -> None:
    mp3 = encoded("MP3")
    assert b"Xing" in mp3[:200] or b"Info" in mp3[:200]
    bare = mp3[mp3_frame_length(mp3, 0) :]  # the Xing frame removed: the length is estimated
    assert b"Xing" not in bare[:200] and b"Info" not in bare[:200]
    assert abs(decode_audio(bare, "bare.mp3")[0].shape[1] - 48000) <= LENGTH_TOLERANCE_FRAMES
    cut = bare[: len(bare) // 2]
    path = tmp_path / "cut.mp3"
    path.write_bytes(cut)
    for source in (cut, path):
        with pytest.raises(InputError, match=r"truncated: the MPEG audio frame at byte \d+"):
            decode_audio(source, "cut.mp3")
    # whole frames followed by an ID3v1 tag are a whole file
    tagged = bare + b"TAG" + bytes(125)
    assert decode_audio(tagged, "tagged.mp3")[0].shape[1] > 40000


@pytest.mark.parametrize("channels", [3, 1])
def test_block_by_block_conversion_and_mixing_match_the_whole_file(
    channels: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dlop.compiler.audio import decode

    monkeypatch.setattr(decode, "_BLOCK_FRAMES", 1 << 16)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((150_000, channels)) * 0.2).clip(-1, 1).astype(np.float32)  # 3 blocks
    for subtype in ("PCM_16", "FLOAT", "PCM_24"):
        buf = io.BytesIO()
        sf.write(buf, x, RATE, format="WAV", subtype=subtype)
        data = buf.getvalue()
        if subtype == "PCM_16":
            ints, _ = sf.read(io.BytesIO(data), dtype="int16", always_2d=True)
            reference = (ints * np.float32(1 / 32768)).astype(np.float32).T
        else:
            reference = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)[0].T
        audio, _ = decode_audio(data, "a.wav")
        assert audio.flags.c_contiguous
        np.testing.assert_array_equal(audio, reference)
        for policy in ("mean", "first"):
            mixed, _ = decode_audio(data, "a.wav", mix=policy)
            np.testing.assert_array_equal(mixed[0], downmix(audio, policy))
        span, _ = decode_audio(data, "a.wav", offset=1.5, duration=4.0, mix="mean")
        np.testing.assert_array_equal(span[0], downmix(audio[:, 24000:88000], "mean"))


def test_pyav_keeps_only_the_span_and_mixes_the_same(tmp_path: Path) -> None:
    import av

    path = tmp_path / "a.mka"
    t = np.arange(3 * RATE) / RATE
    stereo = np.stack([np.sin(2 * np.pi * 440 * t), 0.5 * np.cos(2 * np.pi * 220 * t)])
    with av.open(str(path), "w") as c:
        s = c.add_stream("pcm_s16le", rate=RATE, layout="stereo")
        for k in range(0, stereo.shape[1], 1000):
            block = (stereo[:, k : k + 1000] * 20000).astype(np.int16)
            frame = av.AudioFrame.from_ndarray(
                block.T.reshape(1, -1), format="s16", layout="stereo"
            )
            frame.sample_rate, frame.pts = RATE, k
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    full, rate = decode_audio(path, "a.mka")
    assert rate == RATE and full.shape == (2, 3 * RATE)
    span, _ = decode_audio(path, "a.mka", offset=0.5, duration=1.25)
    np.testing.assert_array_equal(span, full[:, 8000:28000])
    mixed, _ = decode_audio(path, "a.mka", offset=0.5, duration=1.25, mix="mean")
    np.testing.assert_array_equal(mixed[0], downmix(full[:, 8000:28000], "mean"))


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.wav"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def decode() -> None:
        try:
            decode_audio(fifo, "pipe.wav")
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=decode, daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():  # blocked opening the FIFO: let it go before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        pytest.fail("decoding a FIFO waited for a writer")
    assert isinstance(outcome[0], InputError)
    assert "pipe.wav: empty file (0 bytes)" in str(outcome[0])

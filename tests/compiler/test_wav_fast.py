"""The plain-WAV reader gives libsndfile's arrays, rates and errors, bit for bit.

Every case decodes twice: with ``decode.PLAIN_WAV_READER`` on (plain 16-bit PCM
and 32-bit float WAVs are read without libsndfile) and off (libsndfile reads
everything). The two outcomes must be identical: the same float32 bits and
rate, or the same InputError message.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from dlop.compiler.audio import decode
from dlop.compiler.audio.decode import DOWNMIX_POLICIES, decode_audio
from dlop.compiler.audio.wav import HeadFirst
from dlop.compiler.errors import InputError

RATE = 8000
SPANS = [(0.0, None), (0.01, 0.05), (0.0, 10.0), (0.1, None), (5.0, 1.0), (0.124, 0.01)]


def wav(
    frames: int, channels: int, subtype: str, fmt: str = "WAV", seed: int = 0, **kw: Any
) -> bytes:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((frames, channels)) * 0.3).clip(-1, 1).astype(np.float32)
    buf = io.BytesIO()
    with sf.SoundFile(buf, "w", RATE, channels, subtype, format=fmt) as f:
        for key, value in kw.items():  # title= etc.: a LIST chunk before or after the data
            setattr(f, key, value)
        f.write(x)
    return buf.getvalue()


def riff_sized(data: bytes | bytearray) -> bytes:
    out = bytearray(data)
    out[4:8] = struct.pack("<I", len(out) - 8)
    return bytes(out)


def data_at(data: bytes) -> int:
    at = 12
    while data[at : at + 4] != b"data":
        at += 8 + struct.unpack("<I", data[at + 4 : at + 8])[0]
    return at


def before_data(data: bytes, chunk: bytes) -> bytes:
    at = data_at(data)
    return riff_sized(data[:at] + chunk + data[at:])


def chunk(cid: bytes, body: bytes, size: int | None = None) -> bytes:
    n = len(body) if size is None else size
    return cid + struct.pack("<I", n) + body + b"\0" * (len(body) & 1)


def info_list(text: bytes = b"a title") -> bytes:
    text += b"\0" * (len(text) & 1)
    return chunk(b"LIST", b"INFO" + chunk(b"INAM", text))


def set_u32(data: bytes, at: int, value: int, riff: bool = True) -> bytes:
    out = bytearray(data)
    out[at : at + 4] = struct.pack("<I", value)
    return riff_sized(out) if riff else bytes(out)


def set_u16(data: bytes, at: int, value: int) -> bytes:
    out = bytearray(data)
    out[at : at + 2] = struct.pack("<H", value)
    return bytes(out)


def outcome(source: bytes | Path, **kw: Any) -> tuple[Any, ...]:
    try:
        audio, rate = decode_audio(source, "x.wav", **kw)
    except InputError as e:
        return ("error", str(e))
    assert audio.dtype == np.float32 and audio.flags.c_contiguous
    return ("ok", audio.shape, audio.view(np.uint32).tobytes(), rate)


def both(
    monkeypatch: pytest.MonkeyPatch, source: bytes | Path, **kw: Any
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    monkeypatch.setattr(decode, "PLAIN_WAV_READER", True)
    fast = outcome(source, **kw)
    monkeypatch.setattr(decode, "PLAIN_WAV_READER", False)
    slow = outcome(source, **kw)
    monkeypatch.setattr(decode, "PLAIN_WAV_READER", True)
    return fast, slow


@pytest.fixture
def libsndfile_opens(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts soundfile.SoundFile opens (the plain reader opens none)."""
    opened: list[int] = []
    real = sf.SoundFile

    def counting(*args: Any, **kwargs: Any) -> Any:
        opened.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(sf, "SoundFile", counting)
    return opened


def check_same(
    monkeypatch: pytest.MonkeyPatch,
    data: bytes,
    tmp_path: Path,
    spans: list[tuple[float, float | None]] = SPANS,
    mixes: tuple[str | None, ...] = (None, *DOWNMIX_POLICIES),
) -> set[str]:
    """Asserts both readers agree on ``data`` (as bytes and as a file); the outcomes seen."""
    path = tmp_path / "x.wav"
    path.write_bytes(data)
    kinds = set()
    for (offset, duration), mix, source in itertools.product(spans, mixes, (data, path)):
        fast, slow = both(monkeypatch, source, offset=offset, duration=duration, mix=mix)
        assert fast == slow, (offset, duration, mix, type(source), fast[:2], slow[:2])
        kinds.add(fast[0] if fast[0] == "ok" else fast[1])
    return kinds


def plain_wavs() -> Iterator[tuple[str, bytes]]:
    for fmt, subtype, channels, frames in itertools.product(
        ("WAV", "WAVEX"), ("PCM_16", "FLOAT"), (1, 2, 3), (1001, 777, 1)
    ):
        yield f"{fmt}-{subtype}-{channels}ch-{frames}", wav(frames, channels, subtype, fmt)


@pytest.mark.parametrize(
    "name,data", list(plain_wavs()), ids=lambda v: v if isinstance(v, str) else ""
)
def test_plain_wavs_decode_the_same_and_without_libsndfile(
    name: str,
    data: bytes,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    libsndfile_opens: list[int],
) -> None:
    check_same(monkeypatch, data, tmp_path)
    opened = len(libsndfile_opens)
    decode_audio(data, "x.wav")
    with contextlib.suppress(InputError):  # a 1-frame clip has no audio at 0.05 s
        decode_audio(data, "x.wav", offset=0.05, duration=0.01, mix="mean")
    assert len(libsndfile_opens) == opened, f"{name}: the plain reader fell back to libsndfile"


def test_the_common_clip_is_read_without_libsndfile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "clip.wav"
    path.write_bytes(wav(RATE * 2, 1, "PCM_16"))

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("libsndfile opened a plain 16-bit WAV")

    monkeypatch.setattr(sf, "SoundFile", refused)
    audio, rate = decode_audio(path, "clip.wav", mix="mean")
    assert audio.shape == (1, RATE * 2) and rate == RATE


EXTRAS: dict[str, Callable[[bytes], bytes]] = {
    "list-before": lambda d: before_data(d, info_list()),
    "list-after": lambda d: riff_sized(d + info_list(b"after")),
    "junk-before": lambda d: before_data(d, chunk(b"JUNK", bytes(28))),
    "odd-chunk-before": lambda d: before_data(d, chunk(b"abcd", bytes(5))),
    "unknown-before": lambda d: before_data(d, chunk(b"abcd", bytes(6))),
    "list-holding-data": lambda d: before_data(d, chunk(b"LIST", b"INFO" + b"data" + bytes(8))),
    "list-with-short-size": lambda d: before_data(d, chunk(b"LIST", b"INFO" + bytes(12), 8)),
    "list-with-a-4-byte-tail": lambda d: before_data(d, chunk(b"LIST", info_list()[8:] + b"abcd")),
    "second-fmt": lambda d: before_data(d, d[12 : 12 + 8 + 16]),
    "peak-before-fmt": lambda d: riff_sized(d[:12] + chunk(b"PEAK", bytes(16)) + d[12:]),
    "bad-peak": lambda d: before_data(d, chunk(b"PEAK", bytes(40))),
    "odd-data-size": lambda d: set_u32(d, data_at(d) + 4, len(d) - data_at(d) - 9),
    "data-0xffffffff": lambda d: set_u32(d, data_at(d) + 4, 0xFFFFFFFF, riff=False),
    "data-size-0": lambda d: set_u32(d, data_at(d) + 4, 0, riff=False),
    "absurd-data-size": lambda d: set_u32(d, data_at(d) + 4, 0x7FFFFFF0, riff=False),
    "understated-a-little": lambda d: set_u32(d, data_at(d) + 4, len(d) - data_at(d) - 8 - 60),
    "understated-a-lot": lambda d: set_u32(d, data_at(d) + 4, 24),
    "trailing-junk": lambda d: d + b"\x01\x02junk" * 3,
    "trailing-3-bytes": lambda d: d + b"\0\0\0",
    "trailing-id3": lambda d: d + b"TAG" + bytes(125),
    "wvpk-data": lambda d: d[: data_at(d) + 8] + b"wvpk" + d[data_at(d) + 12 :],
    "zero-channels": lambda d: set_u16(d, 22, 0),
    "block-align-0": lambda d: set_u16(d, 32, 0),
    "rate-0": lambda d: set_u32(d, 24, 0, riff=False),
    "riff-size-wrong": lambda d: set_u32(d, 4, 12, riff=False),
    "huge-list-before": lambda d: before_data(d, chunk(b"LIST", b"INFO", 0xFFFFFFF0)),
    "huge-junk-after": lambda d: riff_sized(d + chunk(b"JUNK", bytes(8), 0x7FFFFFF0)),
}


@pytest.mark.parametrize("extra", sorted(EXTRAS))
@pytest.mark.parametrize("subtype,channels", [("PCM_16", 1), ("PCM_16", 2), ("FLOAT", 3)])
def test_extra_chunks_and_odd_headers(
    extra: str, subtype: str, channels: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = EXTRAS[extra](wav(1001, channels, subtype))
    check_same(monkeypatch, data, tmp_path, spans=SPANS[:4], mixes=(None, "mean"))


@pytest.mark.parametrize("fmt", ["WAV", "WAVEX"])
@pytest.mark.parametrize("subtype,channels", [("PCM_16", 1), ("PCM_16", 2), ("FLOAT", 3)])
def test_cut_files(
    fmt: str, subtype: str, channels: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = wav(1001, channels, subtype, fmt)
    at = data_at(data)
    cuts = {
        0,
        10,
        12,
        20,
        30,
        at,
        at + 4,
        at + 8,
        at + 9,
        at + 10,
        at + 11,
        at + 101,
        len(data) - 1,
    }
    cuts |= {len(data) - 2, len(data) // 2, len(data) // 2 + 1, len(data) - 12}
    seen: set[str] = set()
    for cut in sorted(c for c in cuts if 0 < c < len(data)):
        seen |= check_same(monkeypatch, data[:cut], tmp_path, spans=SPANS[:4], mixes=(None, "mean"))
    assert any(k.startswith("x.wav: truncated") for k in seen)


@pytest.mark.parametrize("fmt", ["WAV", "WAVEX"])
def test_non_finite_float_samples(
    fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = bytearray(wav(1001, 2, "FLOAT", fmt))
    at = data_at(bytes(data)) + 8
    for k, bad in enumerate((np.nan, np.inf, -np.inf)):
        data[at + 40 * k : at + 40 * k + 4] = np.float32(bad).tobytes()
    kinds = check_same(monkeypatch, bytes(data), tmp_path, spans=SPANS[:4])
    assert any("non-finite samples (NaN or Inf): 3 of 2002" in k for k in kinds)


def test_metadata_written_by_soundfile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for subtype, channels in (("PCM_16", 1), ("FLOAT", 2)):
        data = wav(999, channels, subtype, title="a clip", artist="someone", comment="x" * 301)
        assert b"LIST" in data
        check_same(monkeypatch, data, tmp_path, spans=SPANS[:3])


def test_block_by_block_reading_matches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode, "_BLOCK_FRAMES", 1 << 8)
    for subtype, channels in (("PCM_16", 1), ("PCM_16", 2), ("FLOAT", 3)):
        data = wav(1001, channels, subtype)
        check_same(monkeypatch, data, tmp_path)


def test_other_wavs_still_go_to_libsndfile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, libsndfile_opens: list[int]
) -> None:
    for subtype in ("PCM_24", "PCM_U8", "PCM_32", "DOUBLE", "ULAW"):
        data = wav(1001, 2, subtype)
        opened = len(libsndfile_opens)
        decode_audio(data, "x.wav")
        assert len(libsndfile_opens) == opened + 1
        check_same(monkeypatch, data, tmp_path, spans=SPANS[:2], mixes=(None,))


def test_a_header_that_understates_the_length(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = wav(20_000, 1, "PCM_16")
    data = set_u32(data, data_at(data) + 4, 2000)
    kinds = check_same(monkeypatch, data, tmp_path, spans=SPANS[:2], mixes=(None,))
    assert any("the header understates the length" in k for k in kinds)


@pytest.mark.parametrize("head_len", [0, 3, 40, 4096])
def test_head_first_reads_as_the_file_does(head_len: int) -> None:
    """Seeks and reads inside the head, across its end and past the file's end give the
    file's own bytes and positions; only reads past the head reach the file, never for
    more than it holds, and a negative position is refused as a file refuses it."""
    data = np.random.default_rng(head_len).integers(0, 256, 300, dtype=np.uint8).tobytes()
    plain = io.BytesIO(data)
    asked: list[tuple[int, int]] = []

    def pread(n: int, at: int) -> bytes:
        asked.append((n, at))
        return data[at : at + n]

    r = HeadFirst(pread, data[:head_len], len(data))
    rng = np.random.default_rng(7)
    for _ in range(400):
        step = int(rng.integers(0, 4))
        if step == 0:
            pos = int(rng.integers(0, 320))
            assert r.seek(pos) == plain.seek(pos)
        elif step == 1:
            pos = -int(rng.integers(0, 300))
            assert r.seek(pos, 2) == plain.seek(pos, 2)
        elif step == 2:
            pos = int(rng.integers(-plain.tell(), 40))
            assert r.seek(pos, 1) == plain.seek(pos, 1)
        else:
            n = int(rng.integers(-1, 60))
            assert r.read(n) == plain.read(n)
    assert all(n > 0 and head_len < at + n <= len(data) for n, at in asked), asked
    assert bool(asked) == (head_len < len(data))
    with pytest.raises(OSError):
        r.seek(-1, 0)
    with pytest.raises(OSError):
        r.seek(-(len(data) + 1), 2)

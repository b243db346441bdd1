"""Audio decoding: soundfile for the formats it knows (WAV, FLAC, OGG, MP3), PyAV for the rest.

Returns float32 ``[channels, samples]`` in [-1, 1] and the file's sample rate.

A file soundfile recognizes is decoded by soundfile only: any error while
reading it is the file's error, not a reason to try another decoder that
might return a valid prefix. The decoded length is checked against the length
the file declares (see ``LENGTH_TOLERANCE_FRAMES``), so a truncated file is a
decode error instead of a shorter clip carrying the full clip's label.
"""

from __future__ import annotations

import io
import os
import struct
from pathlib import Path
from typing import IO, Any

import numpy as np

from .errors import InputError

Source = str | os.PathLike[str] | bytes

LENGTH_TOLERANCE_FRAMES = 4096
"""How many frames a lossy stream (MP3, Vorbis, Opus, AAC, anything PyAV decodes)
may decode short of its declared length: encoder priming and end padding are
up to a few thousand samples. Lossless PCM (WAV, FLAC, AIFF) must decode every
declared frame."""

# libsndfile open errors that mean "not a file for soundfile": format not
# recognised (1), or a known container holding an encoding it lacks (4,
# "unimplemented format"). Every other open error on a recognised file is the
# file's own (malformed, truncated header).
_NOT_FOR_SOUNDFILE = {1, 4, 18}
_LOSSLESS_SUBTYPES = ("PCM_", "FLOAT", "DOUBLE", "ULAW", "ALAW")
_UNKNOWN_FRAMES = 1 << 62  # libsndfile reports SF_COUNT_MAX when a stream's length is unknown
_BLOCK_FRAMES = 1 << 16  # read unit: an error is placed within one block
# Containers whose headers state the stream length the muxer wrote (not an
# estimate from the bit rate, as for raw ADTS AAC or MP3 without a Xing header).
_PYAV_EXACT_LENGTH = {"mov", "mp4", "matroska", "webm", "flac", "wav", "aiff"}


def check_file(source: Source, name: str) -> None:
    """InputError for a missing, unreadable or empty input (bytes from a tar, or a path)."""
    if isinstance(source, bytes):
        if not source:
            raise InputError(name, "empty file (0 bytes)")
        return
    try:
        size = Path(source).stat().st_size
    except FileNotFoundError:
        raise InputError(name, "file not found") from None
    except OSError as e:
        raise InputError(name, f"cannot read: {e.strerror or e}") from None
    if size == 0:
        raise InputError(name, "empty file (0 bytes)")


def decode_audio(
    source: Source, name: str, offset: float = 0.0, duration: float | None = None
) -> tuple[np.ndarray, int]:
    """Decodes ``[offset, offset + duration)`` seconds; raises InputError naming ``name``.

    Raises when the file (or the requested span of it) decodes to fewer frames
    than it declares, beyond ``LENGTH_TOLERANCE_FRAMES`` for lossy codecs.
    """
    check_file(source, name)
    decoded = _soundfile(source, name, offset, duration)
    if decoded is None:
        decoded = _pyav(source, name, offset, duration)
    audio, rate = decoded
    if audio.shape[1] == 0:
        raise InputError(name, "no audio samples" + (f" at offset {offset} s" if offset else ""))
    if not np.isfinite(audio).all():
        raise InputError(
            name,
            f"non-finite samples (NaN or Inf): {int((~np.isfinite(audio)).sum())} of {audio.size}",
        )
    return audio, rate


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:200]


def _sf_reason(e: BaseException) -> str:
    # soundfile prefixes "Error opening <object ...>: "; the file is named by InputError already.
    text = _short(e)
    return text.split(": ", 1)[1] if text.startswith("Error opening") and ": " in text else text


def _check_length(
    name: str, decoded: int, declared: int | None, start: int, wanted: int | None, tolerance: int
) -> None:
    """Raises when fewer frames than declared (or than the requested span) were decoded."""
    if declared is None:
        return
    stop = declared if wanted is None else min(declared, start + wanted)
    expected = max(0, stop - start)
    if expected - decoded <= tolerance:
        return
    if wanted is None and start == 0:
        what = f"decoded {decoded} of {declared} declared frames"
    else:
        what = f"decoded {decoded} of the {expected} frames requested from frame {start} ({declared} declared)"
    raise InputError(
        name, f"truncated: {what}; the file is cut short or its header overstates its length"
    )


def _soundfile(
    source: Source, name: str, offset: float, duration: float | None
) -> tuple[np.ndarray, int] | None:
    """Decoded audio, or None when soundfile does not recognize the file."""
    import soundfile as sf

    # soundfile encodes a str path strictly; the bytes of the path also open a file whose
    # name is not UTF-8 (os.fsdecode's surrogates)
    handle = io.BytesIO(source) if isinstance(source, bytes) else os.fsencode(source)
    try:
        f = sf.SoundFile(handle)
    except sf.LibsndfileError as e:
        if e.code in _NOT_FOR_SOUNDFILE:
            return None
        raise InputError(name, f"cannot decode: {_sf_reason(e)}") from None
    with f:
        rate, channels, subtype = f.samplerate, f.channels, f.subtype
        lossless = subtype.startswith(_LOSSLESS_SUBTYPES)
        declared = f.frames if f.frames < _UNKNOWN_FRAMES else None
        if f.format == "WAV" and lossless:
            # libsndfile shortens a WAV's length to the bytes present; the header says what was meant.
            declared = _wav_declared_frames(source, name, declared)
        elif f.format == "OGG":
            _check_ogg_end(source, name)
        start = round(offset * rate)
        wanted = None if duration is None else round(duration * rate)
        if start:
            try:
                f.seek(start if declared is None else min(start, f.frames))
            except (sf.LibsndfileError, RuntimeError) as e:
                raise InputError(name, f"cannot seek to frame {start}: {_sf_reason(e)}") from None
        count = wanted
        if declared is not None:
            left = max(0, f.frames - f.tell())
            count = left if count is None else min(count, left)
        # int16 then scale: the same float32 values as libsndfile's own
        # conversion (x / 32768 is exact), in a third of the time.
        dtype = "int16" if subtype == "PCM_16" else "float32"
        try:
            data = _read_blocks(f, name, count, channels, dtype, start, declared)
        except InputError:
            if declared is not None:
                raise
            # A stream that does not state its length (FLAC with 0 total samples)
            # can make libsndfile fail at its end; PyAV reads such streams, strictly.
            return None
    _check_length(
        name, data.shape[0], declared, start, wanted, 0 if lossless else LENGTH_TOLERANCE_FRAMES
    )
    if dtype == "int16":
        data = np.multiply(data, np.float32(1 / 32768), dtype=np.float32)
    return np.ascontiguousarray(data.T), rate


def _read_blocks(
    f: Any,
    name: str,
    count: int | None,
    channels: int,
    dtype: str,
    start: int,
    declared: int | None,
) -> np.ndarray:
    """Up to ``count`` frames (all that follow when None) as ``[frames, channels]``, block by block."""
    import soundfile as sf

    def fail(at: int, e: BaseException) -> InputError:
        stop = at + _BLOCK_FRAMES if count is None else min(at + _BLOCK_FRAMES, start + count)
        of = f" of {declared} declared" if declared is not None else ""
        return InputError(name, f"cannot decode frames {at}-{stop}{of}: {_sf_reason(e)}")

    if count is not None:
        out = np.empty((count, channels), dtype)
        pos = 0
        while pos < count:
            try:
                got = f.read(out=out[pos : pos + _BLOCK_FRAMES]).shape[0]
            except (sf.LibsndfileError, RuntimeError) as e:
                raise fail(start + pos, e) from None
            pos += got
            if got < min(_BLOCK_FRAMES, count - (pos - got)):
                break
        return out[:pos]
    blocks = []
    pos = 0
    while True:
        try:
            block = f.read(_BLOCK_FRAMES, dtype=dtype, always_2d=True)
        except (sf.LibsndfileError, RuntimeError) as e:
            raise fail(start + pos, e) from None
        blocks.append(block)
        pos += block.shape[0]
        if block.shape[0] < _BLOCK_FRAMES:
            break
    return np.concatenate(blocks) if len(blocks) > 1 else blocks[0]


def _reader(source: Source) -> IO[bytes]:
    return io.BytesIO(source) if isinstance(source, bytes) else open(source, "rb")


def _wav_declared_frames(source: Source, name: str, fallback: int | None) -> int | None:
    """The frames a RIFF WAV's data chunk declares (None when it says "unknown").

    Raises when the data chunk is followed by more than ``LENGTH_TOLERANCE_FRAMES``
    frames' worth of bytes that are not RIFF chunks: a header that understates the length.
    """
    with _reader(source) as r:
        head = r.read(12)
        if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
            return fallback  # RIFX, RF64, W64: libsndfile's count stands
        pos, block_align = 12, 0
        while True:
            r.seek(pos)
            chunk = r.read(8)
            if len(chunk) < 8:
                return fallback
            cid, size = chunk[:4], int(struct.unpack("<I", chunk[4:])[0])
            if cid == b"fmt ":
                fmt = r.read(min(size, 16))
                block_align = struct.unpack("<H", fmt[12:14])[0] if len(fmt) >= 14 else 0
            elif cid == b"data":
                break
            pos += 8 + size + (size & 1)
        if size in (0, 0xFFFFFFFF) or not block_align:
            return None  # streamed WAVs leave the length unset: no declared length to hold it to
        declared = size // block_align
        end = r.seek(0, io.SEEK_END)
        pos += 8 + size + (size & 1)
        while pos + 8 <= end:
            r.seek(pos)
            chunk = r.read(8)
            if not all(0x20 <= c <= 0x7E for c in chunk[:4]):
                junk = end - pos
                if junk > LENGTH_TOLERANCE_FRAMES * block_align:
                    raise InputError(
                        name,
                        f"the WAV data chunk declares {declared} frames but {junk} bytes that are "
                        f"not RIFF chunks follow it at byte {pos} (about {junk // block_align} more "
                        "frames): the header understates the length; rewrite the file",
                    )
                break
            size = int(struct.unpack("<I", chunk[4:])[0])
            pos += 8 + size + (size & 1)
    return declared


def _check_ogg_end(source: Source, name: str) -> None:
    """Raises unless the file ends with a whole Ogg page carrying the end-of-stream flag.

    Ogg declares no total length; a cut file ends inside a page or on a page
    that is not the stream's last.
    """
    with _reader(source) as r:
        end = r.seek(0, io.SEEK_END)
        at = max(0, end - (27 + 255 + 255 * 255))  # one page at most
        r.seek(at)
        tail = r.read()
    i = len(tail)
    while (i := tail.rfind(b"OggS", 0, i)) >= 0:
        if len(tail) - i < 27 or tail[i + 4] != 0:
            continue
        segments = tail[i + 26]
        lacing = tail[i + 27 : i + 27 + segments]
        page_end = i + 27 + segments + sum(lacing)
        if len(lacing) < segments or page_end > len(tail):
            raise InputError(
                name,
                f"truncated: the file ends inside the Ogg page that starts at byte {at + i}",
            )
        if page_end == len(tail):
            if not tail[i + 5] & 0x04:
                raise InputError(
                    name,
                    "truncated: the last Ogg page (at byte "
                    f"{at + i}) is not marked end-of-stream; the file is cut short",
                )
            return
    raise InputError(name, "truncated: no whole Ogg page ends the file")


_SCALE = {
    "s16": 1 / 32768,
    "s16p": 1 / 32768,
    "s32": 1 / 2**31,
    "s32p": 1 / 2**31,
    "u8": 1 / 128,
    "u8p": 1 / 128,
}


def _pyav(
    source: Source, name: str, offset: float, duration: float | None
) -> tuple[np.ndarray, int]:
    import av

    handle = io.BytesIO(source) if isinstance(source, bytes) else str(source)
    chunks: list[np.ndarray] = []
    decoded = 0
    rate = 0
    try:
        with av.open(handle, "r", metadata_errors="ignore") as container:
            streams = container.streams.audio
            if not streams:
                raise InputError(name, "no audio stream")
            stream = streams[0]
            stream.codec_context.thread_type = "AUTO"
            rate = stream.rate
            declared = _pyav_declared_frames(container, stream)
            for frame in container.decode(stream):
                rate = frame.sample_rate
                arr = frame.to_ndarray()
                fmt = frame.format.name
                channels = len(frame.layout.channels)
                if not frame.format.is_planar:
                    arr = arr.reshape(-1, channels).T
                arr = arr.astype(np.float32)
                if fmt.startswith("u8"):
                    arr -= 128
                arr *= _SCALE.get(fmt, 1.0)
                chunks.append(arr)
                decoded += arr.shape[1]
    except InputError:
        raise
    except (av.FFmpegError, ValueError, OSError) as e:
        where = f"after {decoded} frames ({decoded / rate:.3f} s)" if chunks and rate else ""
        raise InputError(
            name,
            "cannot decode (not a format soundfile knows; PyAV: "
            f"{_short(e)}{'; ' + where if where else ''})",
        ) from None
    if not chunks:
        raise InputError(name, "no audio frames decoded")
    audio = np.concatenate(chunks, axis=1)
    start = round(offset * rate)
    wanted = None if duration is None else round(duration * rate)
    stop = None if wanted is None else start + wanted
    out = np.ascontiguousarray(audio[:, start:stop])
    _check_length(name, out.shape[1], declared, start, wanted, LENGTH_TOLERANCE_FRAMES)
    return out, rate


def _pyav_declared_frames(container: Any, stream: Any) -> int | None:
    """The audio stream's length in frames as its container's header states it, when trustworthy."""
    if not set(container.format.name.split(",")) & _PYAV_EXACT_LENGTH or not stream.rate:
        return None
    if stream.duration and stream.time_base:
        seconds = float(stream.duration * stream.time_base)
    elif container.duration and len(container.streams) == 1:
        seconds = container.duration / 1_000_000
    else:
        return None
    return round(seconds * float(stream.rate))


DOWNMIX_POLICIES = ("mean", "first")


def downmix(audio: np.ndarray, policy: str) -> np.ndarray:
    """``[channels, samples] -> [samples]``: ``mean`` of channels, or the ``first``."""
    if policy == "mean":
        mean: np.ndarray = audio.mean(axis=0, dtype=np.float32) if audio.shape[0] > 1 else audio[0]
        return mean
    if policy == "first":
        first: np.ndarray = audio[0]
        return first
    raise ValueError(f"downmix {policy!r} must be mean or first")

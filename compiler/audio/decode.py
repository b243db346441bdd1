"""Audio decoding: soundfile for the formats it knows (WAV, FLAC, OGG, MP3), PyAV for the rest.

Returns float32 ``[channels, samples]`` in [-1, 1] and the file's sample rate; with
``pcm16``, one channel of 16-bit PCM comes back as read, in int16 (see
``decode_audio``).

A file soundfile recognizes is decoded by soundfile only: any error while
reading it is the file's error, not a reason to try another decoder that
might return a valid prefix. The decoded length is checked against the length
the file declares (see ``LENGTH_TOLERANCE_FRAMES``), so a truncated file is a
decode error instead of a shorter clip carrying the full clip's label.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import stat
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from dlop.formats.extras import needs_extra

from ..errors import InputError
from . import wav

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
_BLOCK_FRAMES = (
    1 << 18
)  # read unit (a 6 s clip at 44.1 kHz in one read): an error is placed within one block
# Containers whose headers state the stream length the muxer wrote (not an
# estimate from the bit rate, as for raw ADTS AAC or MP3 without a Xing header).
_PYAV_EXACT_LENGTH = {"mov", "mp4", "matroska", "webm", "flac", "wav", "aiff"}

PCM16_SCALE = np.float32(1 / 32768)
"""What one step of 16-bit PCM stands for (exact in float32): libsndfile's scale, and the
meaning of the int16 samples decode_audio's ``pcm16`` returns."""


@dataclass(frozen=True)
class _Span:
    """What decode_audio was asked for, as every decoder takes it: the seconds
    ``[offset, offset + duration)``, the channel mix, and whether 16-bit PCM may stay int16."""

    offset: float
    duration: float | None
    mix: str | None
    pcm16: bool = False

    def frames(self, rate: int) -> tuple[int, int | None]:
        """The span at ``rate``: its first frame and its frame count (None: to the end)."""
        wanted = None if self.duration is None else round(self.duration * rate)
        return round(self.offset * rate), wanted


PLAIN_WAV_READER = True
"""Read plain 16-bit PCM and 32-bit float WAVs (``wav.sample_format``, ``wav.WavLayout.plain``)
without libsndfile: the same arrays, rate and errors, in a fraction of the time. Every other
file, and every WAV this reader is unsure of, goes through libsndfile."""


def check_file(source: Source, name: str) -> None:
    """InputError for a missing, unreadable or empty input (bytes from a tar, or a path)."""
    if isinstance(source, bytes):
        if not source:
            raise InputError(name, "empty file (0 bytes)")
        return
    try:
        size = os.stat(source).st_size
    except FileNotFoundError:
        raise InputError(name, "file not found") from None
    except OSError as e:
        raise InputError(name, f"cannot read: {e.strerror or e}") from None
    if size == 0:
        raise InputError(name, "empty file (0 bytes)")


def decode_audio(
    source: Source,
    name: str,
    offset: float = 0.0,
    duration: float | None = None,
    *,
    mix: str | None = None,
    pcm16: bool = False,
) -> tuple[np.ndarray, int]:
    """Decodes ``[offset, offset + duration)`` seconds; raises InputError naming ``name``.

    Raises when the file (or the requested span of it) decodes to fewer frames
    than it declares, beyond ``LENGTH_TOLERANCE_FRAMES`` for lossy codecs.
    ``mix`` (a ``DOWNMIX_POLICIES`` word) mixes the channels block by block as
    they are decoded: ``[1, samples]``, equal to ``downmix`` of the full
    decode, without ever holding every channel of a long recording.

    With ``pcm16``, 16-bit PCM read through libsndfile or the plain WAV reader
    (``PLAIN_WAV_READER``) that comes out as one channel as read (a mono file, or
    ``mix="first"``) is returned in int16: half the bytes, each value x standing
    for x / 32768, so that ``result * PCM16_SCALE`` is exactly the float32 result.
    Everything else is float32 as without it.
    """
    if mix is not None and mix not in DOWNMIX_POLICIES:
        raise ValueError(f"downmix {mix!r} must be one of {', '.join(DOWNMIX_POLICIES)}")
    span = _Span(offset, duration, mix, pcm16)
    decoded = _plain_wav(source, name, span) if PLAIN_WAV_READER else None
    if decoded is None:
        check_file(source, name)  # a file the plain reader took exists and is not empty
        decoded = _soundfile(source, name, span)
    if decoded is None:
        decoded = _pyav(source, name, span)
    audio, rate = decoded
    if audio.shape[1] == 0:
        raise InputError(name, "no audio samples" + (f" at offset {offset} s" if offset else ""))
    return audio, rate


PROBE_BYTES = 64 << 10  # what probe_rate reads of an input: its headers, not its audio


def probe_rate(source: Source) -> int | None:
    """The sample rate an audio input's header declares, from at most its first
    PROBE_BYTES; None when that does not tell it. Only a regular file is read, opened
    without blocking (a FIFO or a device named as an input is passed over: its decode
    reports it), so a probe never waits and never reads more than a header."""
    if isinstance(source, bytes):
        head = source[:PROBE_BYTES]
    else:
        try:
            fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            head = os.pread(fd, PROBE_BYTES, 0)
        except OSError:
            return None
        finally:
            os.close(fd)
    if not head:
        return None
    if head[:3] == b"ID3" or _mpeg_frame(head, 0) is not None:
        # an MP3, told by its frames: libsndfile would warn on stderr about a cut one
        found = _first_mpeg_frame(head[_mpeg_audio_start(head[:10]) :][: 1 << 14])
        if found is not None:
            return found[1][0][2]
    with needs_extra("compile", "decoding audio"):
        import soundfile as sf

    try:
        return int(sf.info(io.BytesIO(head)).samplerate)
    except Exception:  # not a header libsndfile reads: ask PyAV's container header
        pass
    with needs_extra("compile", "decoding audio"):  # outside the try, which passes over errors
        import av
    try:
        with av.open(io.BytesIO(head), "r", metadata_errors="ignore") as container:
            streams = container.streams.audio
            return int(streams[0].rate) if streams and streams[0].rate else None
    except Exception:
        return None


def _plain_wav(source: Source, name: str, span: _Span) -> tuple[np.ndarray, int] | None:
    """``_soundfile``'s result for a plain 16-bit PCM or 32-bit float WAV, or None for any other file.

    The samples are read straight from the data chunk: the frames present are
    the data chunk's (at most the bytes the file holds, as libsndfile counts
    them), and the declared length is ``_wav_declared_frames``'s. Reads are
    positioned: the header comes from one read of the first 4 KiB
    (wav.HeadFirst), the samples from one read into their array.
    """
    try:
        if isinstance(source, bytes):
            held = memoryview(source)

            def bytes_into(buf: memoryview, at: int) -> int:
                part = held[at : at + len(buf)]
                buf[: len(part)] = part
                return len(part)

            head = wav.HeadFirst(lambda n, at: source[at : at + n], source, len(source))
            return _plain_samples(head, bytes_into, name, span)
        # not blocking: opening a FIFO with no writer would wait for one forever
        # (check_file then reports it as an empty file)
        fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # libsndfile reads it again and reports its own error
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            return None
        head = wav.HeadFirst(
            lambda n, at: os.pread(fd, n, at), os.pread(fd, wav.HEAD_BYTES, 0), status.st_size
        )
        return _plain_samples(head, lambda buf, at: os.preadv(fd, [buf], at), name, span)
    except OSError:
        return None  # libsndfile reads it again and reports its own error
    finally:
        os.close(fd)


def _plain_samples(
    r: wav.HeadFirst,
    read_at: Callable[[memoryview, int], int],
    name: str,
    span: _Span,
) -> tuple[np.ndarray, int] | None:
    """_plain_wav's work on an opened file: ``r`` serves the header, ``read_at(buf, at)``
    fills ``buf`` from byte ``at`` and returns how many bytes it read."""
    layout = wav.read_layout(r)
    if layout is None or not layout.plain or layout.data_bytes in (0, 0xFFFFFFFF):
        return None
    form = wav.sample_format(layout.fmt)
    if form is None or layout.data_bytes % 2 or not wav.plain_tail(r, layout):
        return None
    dtype, channels, rate = form
    r.seek(layout.data_offset)
    if r.read(4) in (b"wvpk", b"OggS"):  # libsndfile refuses these data chunks
        return None
    start, wanted = span.frames(rate)
    if start < 0 or (wanted is not None and wanted < 0):
        return None
    width = dtype.itemsize * channels
    present = min(layout.data_bytes, layout.file_bytes - layout.data_offset) // width
    count = present - min(start, present)
    count = count if wanted is None else min(wanted, count)
    at = layout.data_offset + min(start, present) * width

    def read(buf: np.ndarray) -> int:
        nonlocal at
        got = read_at(buf.data.cast("B"), at)
        at += got
        return got // width

    data = _read_blocks(read, name, count, dtype, channels, span.mix, span.pcm16)
    if data.shape[1] != count:
        return None  # the file ended early (it changed): libsndfile reads it again
    _check_length(name, data.shape[1], layout.data_bytes // width, start, wanted, 0)
    return data, rate


def _mixed(block: np.ndarray, mix: str | None) -> np.ndarray:
    """``[channels, n]`` C-contiguous float32 -> what one block contributes to the output.

    The mean of a C-contiguous block adds its rows in order, as ``downmix`` of
    the whole recording does, so block-by-block mixing gives the same bits.
    """
    if mix is None or block.shape[0] == 1:
        return block
    return block[:1] if mix == "first" else block.mean(axis=0, dtype=np.float32)[None]


def _convert(raw: np.ndarray, dest: np.ndarray, mix: str | None) -> None:
    """One block as read, ``[frames, channels]`` int16 (PCM_16, times 1/32768 in float32)
    or float32, into ``dest`` (``[1 or channels, frames]`` float32), mixed when asked;
    an int16 ``dest`` (``[1, frames]``) takes the first channel as read."""
    if dest.dtype == np.int16:
        np.copyto(dest, raw.T[:1])
        return
    if dest.shape[0] == raw.shape[1]:  # nothing to mix: converted straight into the output
        _scale_into(raw, dest)
        return
    block = np.empty(raw.shape[::-1], np.float32)  # C order: rows add as downmix's do
    _scale_into(raw, block)
    dest[:] = _mixed(block, mix)


def _scale_into(raw: np.ndarray, dest: np.ndarray) -> None:
    # A cast, then a multiply in place, is faster than one mixed-type multiply; both are
    # exact (x / 32768 is a float32 for every int16 x), so the bits are the same.
    np.copyto(dest, raw.T, casting="unsafe")
    if raw.dtype == np.int16:
        np.multiply(dest, PCM16_SCALE, out=dest)


class _NonFinite:
    """Counts NaN and Inf samples block by block (a whole-recording mask would be 1 byte per sample)."""

    def __init__(self) -> None:
        self.bad = self.total = 0

    def add(self, block: np.ndarray) -> None:
        self.total += block.size
        finite = np.isfinite(block)
        if not finite.all():
            self.bad += block.size - int(np.count_nonzero(finite))

    def check(self, name: str) -> None:
        if self.bad:
            raise InputError(name, f"non-finite samples (NaN or Inf): {self.bad} of {self.total}")


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


def _soundfile(source: Source, name: str, span: _Span) -> tuple[np.ndarray, int] | None:
    """Decoded audio, or None when soundfile does not recognize the file."""
    with needs_extra("compile", "decoding audio"):
        import soundfile as sf

    # soundfile encodes a str path strictly; the bytes of the path also open a file whose
    # name is not UTF-8 (os.fsdecode's surrogates)
    handle: Any = io.BytesIO(source) if isinstance(source, bytes) else os.fsencode(source)
    with contextlib.ExitStack() as stack:
        try:
            f = sf.SoundFile(handle)
        except sf.LibsndfileError as e:
            if e.code in _NOT_FOR_SOUNDFILE:
                return None
            if not isinstance(source, bytes):
                raise InputError(name, f"cannot decode: {_sf_reason(e)}") from None
            # libsndfile opens some streams (MP3) only from a file, not from memory:
            # a tar member gets the same decoder a file on disk does.
            spill = stack.enter_context(tempfile.NamedTemporaryFile(suffix=".audio"))
            spill.write(source)
            spill.flush()
            try:
                f = sf.SoundFile(spill.name)
            except sf.LibsndfileError as e2:
                if e2.code in _NOT_FOR_SOUNDFILE:
                    return None
                raise InputError(name, f"cannot decode: {_sf_reason(e2)}") from None
        with f:
            return _soundfile_read(f, source, name, span)


_SAMPLE_BYTES = {
    "PCM_S8": 1,
    "PCM_U8": 1,
    "PCM_16": 2,
    "PCM_24": 3,
    "PCM_32": 4,
    "FLOAT": 4,
    "DOUBLE": 8,
    "ULAW": 1,
    "ALAW": 1,
}
# libsndfile's header log notes a data size larger than the bytes present as
# "data : 96000 (should be 47960)": the data chunk (WAV, WAVEX), SSND (AIFF),
# "Data Size" (AU), BODY (8SVX), and W64's lower-case riff size (its data
# chunk is not noted). RF64 notes a frame count short of its ds64 chunk's.
_SIZE_NOTE = re.compile(
    r"^\s*(data|SSND|Data Size|BODY|riff)\s*:\s*(\d+)\s*\(should be (-?\d+)\)", re.M
)
_DS64_NOTE = re.compile(
    r"Calculated frame count (\d+) does not match value from 'ds64' chunk of (\d+)"
)
_UNSET_SIZES = (0, 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF)  # streamed: "length unknown"


def _header_declared_frames(f: Any, name: str) -> int | None:
    """The frames the header declares when libsndfile noted that the file holds fewer, else None.

    libsndfile shortens its frame count to the bytes present; its header log
    keeps what the header said. Raises when the missing bytes cannot be
    counted in frames (ADPCM, GSM: blocks of frames).
    """
    info = f.extra_info
    if m := _DS64_NOTE.search(info):
        calculated, declared = int(m[1]), int(m[2])
        return declared if declared > calculated else None
    for label, said, present in _SIZE_NOTE.findall(info):
        said_bytes, present_bytes = int(said), int(present)
        if said_bytes in _UNSET_SIZES or said_bytes <= present_bytes:
            continue
        missing = said_bytes - present_bytes
        width = _SAMPLE_BYTES.get(f.subtype)
        if width is None:
            raise InputError(
                name,
                f"truncated: the {f.format} header's {label.strip()} size is {said_bytes} bytes "
                f"but the file holds {present_bytes} ({missing} bytes of {f.subtype} audio "
                "missing); the file is cut short or its header overstates its length",
            )
        # a cut inside a frame leaves part of it: the missing bytes round up to frames
        return int(f.frames) - (-missing // (width * int(f.channels)))
    return None


def _soundfile_read(
    f: Any, source: Source, name: str, span: _Span
) -> tuple[np.ndarray, int] | None:
    import soundfile as sf

    rate, channels, subtype = f.samplerate, f.channels, f.subtype
    lossless = subtype.startswith(_LOSSLESS_SUBTYPES)
    declared = f.frames if f.frames < _UNKNOWN_FRAMES else None
    if declared is not None:
        declared = _header_declared_frames(f, name) or declared
    if f.format in ("WAV", "WAVEX") and lossless:
        # libsndfile shortens a WAV's length to the bytes present; the header says what was meant.
        declared = _wav_declared_frames(source, name, declared)
    elif f.format == "OGG":
        _check_ogg_end(source, name)
    elif f.format == "MP3":
        _check_mpeg_end(source, name)
        if not _mpeg_states_length(source):
            # libsndfile estimates the length from the first frame's bit rate and
            # stops reading there (a variable-rate file would lose its end); PyAV
            # decodes every frame, and the end check above holds it to whole frames.
            return None
    start, wanted = span.frames(rate)
    if start:
        try:
            f.seek(start if declared is None else min(start, f.frames))
        except (sf.LibsndfileError, RuntimeError) as e:
            raise InputError(name, f"cannot seek to frame {start}: {_sf_reason(e)}") from None
    count = wanted
    if declared is not None:
        left = max(0, f.frames - f.tell())
        count = left if count is None else min(count, left)
    done = 0

    def read(buf: np.ndarray) -> int:
        nonlocal done
        try:
            got = int(f.read(out=buf).shape[0])
        except (sf.LibsndfileError, RuntimeError) as e:
            stop = start + done + len(buf)
            of = f" of {declared} declared" if declared is not None else ""
            raise InputError(
                name, f"cannot decode frames {start + done}-{stop}{of}: {_sf_reason(e)}"
            ) from None
        done += got
        return got

    dtype = np.dtype(np.int16 if subtype == "PCM_16" else np.float32)
    try:
        data = _read_blocks(read, name, count, dtype, channels, span.mix, span.pcm16)
    except InputError:
        if declared is not None:
            raise
        # A stream that does not state its length (FLAC with 0 total samples)
        # can make libsndfile fail at its end; PyAV reads such streams, strictly.
        return None
    _check_length(
        name, data.shape[1], declared, start, wanted, 0 if lossless else LENGTH_TOLERANCE_FRAMES
    )
    return data, rate


def _read_blocks(
    read: Callable[[np.ndarray], int],
    name: str,
    count: int | None,
    dtype: np.dtype[Any],
    channels: int,
    mix: str | None,
    pcm16: bool = False,
) -> np.ndarray:
    """Up to ``count`` frames (all that follow when None) as float32 ``[channels, frames]``.

    ``read(buf)`` fills the leading frames of ``buf`` (``[frames, channels]`` of ``dtype``:
    int16 for PCM_16, else float32) and returns how many; fewer than asked ends the
    stream. Read block by block into one reused buffer and converted into the output
    as they come: the file's samples are never held whole in a second form. int16 is
    scaled by 1/32768 in float32, the same values as libsndfile's own conversion
    (x / 32768 is exact) in a third of the time; float samples are checked finite.
    With ``pcm16``, int16 that comes out as one channel as read stays int16
    (decode_audio), read straight into the output when the file has one channel and
    the length is known.
    """
    keep = pcm16 and dtype == np.int16 and (channels == 1 or mix == "first")
    out_dtype = np.int16 if keep else np.float32
    block = _BLOCK_FRAMES if count is None else max(1, min(count, _BLOCK_FRAMES))
    out_channels = 1 if mix is not None else channels
    out = np.empty((out_channels, count if count is not None else _BLOCK_FRAMES), out_dtype)
    direct = keep and channels == 1 and count is not None  # no buffer: the output is one
    buf = np.empty((0 if direct else block, channels), dtype)
    finite = _NonFinite()
    parts: list[np.ndarray] = []  # full outputs, when the length is not known ahead
    pos = filled = 0
    while count is None or pos < count:
        n = block if count is None else min(block, count - pos)
        if direct:
            got = read(out[0, filled : filled + n].reshape(n, 1))
            filled += got
        elif got := read(buf[:n]):
            raw = buf[:got]
            if count is None and filled + got > out.shape[1]:
                parts.append(out[:, :filled])
                out = np.empty((out_channels, max(out.shape[1] * 2, got)), out_dtype)
                filled = 0
            if dtype.kind == "f":
                finite.add(raw)
            _convert(raw, out[:, filled : filled + got], mix)
            filled += got
        pos += got
        if got < n:
            break
    finite.check(name)
    if parts:
        return np.concatenate([*parts, out[:, :filled]], axis=1)
    return out if filled == out.shape[1] else np.ascontiguousarray(out[:, :filled])


def _reader(source: Source) -> io.BufferedReader | io.BytesIO:
    return io.BytesIO(source) if isinstance(source, bytes) else open(source, "rb")


def _wav_declared_frames(source: Source, name: str, fallback: int | None) -> int | None:
    """The frames a RIFF WAV's data chunk declares (None when it says "unknown").

    Raises when the data chunk is followed by more than ``LENGTH_TOLERANCE_FRAMES``
    frames' worth of bytes that are not RIFF chunks: a header that understates the length.
    """
    with _reader(source) as r:
        layout = wav.read_layout(r)
        if layout is None:
            return fallback  # RIFX, RF64, W64, no data chunk: libsndfile's count stands
        size, block_align = layout.data_bytes, layout.block_align
        if size in (0, 0xFFFFFFFF) or not block_align:
            return None  # streamed WAVs leave the length unset: no declared length to hold it to
        declared = size // block_align
        for cid, pos, _ in wav.chunks(r, layout.data_end):
            if not all(0x20 <= c <= 0x7E for c in cid):
                junk = layout.file_bytes - pos
                if junk > LENGTH_TOLERANCE_FRAMES * block_align:
                    raise InputError(
                        name,
                        f"the WAV data chunk declares {declared} frames but {junk} bytes that are "
                        f"not RIFF chunks follow it at byte {pos} (about {junk // block_align} more "
                        "frames): the header understates the length; rewrite the file",
                    )
                break
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


# MPEG audio frame header tables (ISO 11172-3, 13818-3): kbit/s by [version][layer]
# for bitrate indices 1-14, where version 3 is MPEG-1 and 2 / 0 are MPEG-2 / 2.5.
_MPEG_KBPS = {
    (3, 3): (32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),
    (3, 2): (32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),
    (3, 1): (32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    (2, 3): (32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
    (2, 2): (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
    (2, 1): (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
_MPEG_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}
_MPEG_MAX_FRAME = 2881  # bytes: layer II, MPEG-2.5, 160 kbit/s, 8 kHz


def _mpeg_frame(b: bytes, i: int) -> tuple[tuple[int, int, int], int] | None:
    """((version, layer, rate), length in bytes) of the frame header at ``b[i:]``, or None."""
    if i + 4 > len(b) or b[i] != 0xFF or b[i + 1] & 0xE0 != 0xE0:
        return None
    version, layer = (b[i + 1] >> 3) & 3, (b[i + 1] >> 1) & 3
    bitrate, rate_index, padding = b[i + 2] >> 4, (b[i + 2] >> 2) & 3, (b[i + 2] >> 1) & 1
    if version == 1 or layer == 0 or bitrate in (0, 15) or rate_index == 3:
        return None  # reserved, or free format (no length in the header)
    kbps = _MPEG_KBPS[(3 if version == 3 else 2, layer)][bitrate - 1] * 1000
    rate = _MPEG_RATES[version][rate_index]
    if layer == 3:  # layer I: 4-byte slots
        length = (12 * kbps // rate + padding) * 4
    elif layer == 1 and version != 3:  # layer III, MPEG-2/2.5: 576 samples a frame
        length = 72 * kbps // rate + padding
    else:
        length = 144 * kbps // rate + padding
    return (version, layer, rate), length


def _mpeg_audio_end(r: IO[bytes], end: int) -> int:
    """Where the MPEG frames end: before a trailing ID3v1 tag and APEv2 tag."""
    for _ in range(2):
        if end >= 128:
            r.seek(end - 128)
            if r.read(3) == b"TAG":
                end -= 128
                continue
        if end >= 32:
            r.seek(end - 32)
            footer = r.read(32)
            if footer[:8] == b"APETAGEX":
                size, flags = struct.unpack("<II", footer[12:20])
                end -= size + (32 if flags & 0x80000000 else 0)
                continue
        break
    return end


def _mpeg_audio_start(head: bytes) -> int:
    """Where an MP3's frames start: after an ID3v2 tag (``head``: its first 10 bytes)."""
    if head[:3] == b"ID3" and len(head) >= 10:  # ID3v2: a syncsafe size, maybe a footer
        size = (head[6] << 21) | (head[7] << 14) | (head[8] << 7) | head[9]
        return 10 + size + (10 if head[5] & 0x10 else 0)
    return 0


def _first_mpeg_frame(data: bytes) -> tuple[int, tuple[tuple[int, int, int], int]] | None:
    """(offset, _mpeg_frame's answer) of the first frame in ``data`` that the next frame
    header follows where its length says, with one version, layer and rate."""
    for i in range(len(data)):
        frame = _mpeg_frame(data, i)
        if frame is None:
            continue
        nxt = _mpeg_frame(data, i + frame[1])
        if nxt is None or nxt[0] != frame[0]:
            continue  # not a run of frames: a chance 0xFF byte
        return i, frame
    return None


def _mpeg_states_length(source: Source) -> bool:
    """Whether an MP3's first frame is a Xing/Info or VBRI header (which states the length)."""
    with _reader(source) as r:
        r.seek(_mpeg_audio_start(r.read(10)))
        data = r.read(1 << 16)
    found = _first_mpeg_frame(data)
    if found is None:
        return False
    body = data[found[0] : found[0] + found[1][1]]
    return b"Xing" in body or b"Info" in body or body[36:40] == b"VBRI"


def _check_mpeg_end(source: Source, name: str) -> None:
    """Raises when an MP3 file ends inside an MPEG audio frame.

    Without a Xing/Info or VBRI header libsndfile estimates an MP3's length
    from its size, so a cut file would decode as a shorter clip. The last
    frames are found in the file's tail (a run of three headers, each where
    the previous frame's length says, with one version, layer and rate) and
    followed to the end: a frame whose header promises more bytes than
    remain is a cut. A cut that falls exactly between two frames, or a tail
    with no such run (bytes that are not MPEG audio), cannot be told apart
    from a whole file here.
    """
    with _reader(source) as r:
        end = _mpeg_audio_end(r, r.seek(0, io.SEEK_END))
        at = max(0, end - 8 * _MPEG_MAX_FRAME)
        r.seek(at)
        tail = r.read(end - at)
    for i in range(len(tail)):
        first = _mpeg_frame(tail, i)
        if first is None:
            continue
        j, run, cut = i, 0, 0
        while (frame := _mpeg_frame(tail, j)) is not None and frame[0] == first[0]:
            if j + frame[1] > len(tail):
                cut = frame[1]
                break
            run += 1
            j += frame[1]
        if run < 3:
            continue  # a chance 0xFF byte, or too few frames to judge
        left = len(tail) - j
        if cut or (0 < left < 4 and tail[j] == 0xFF):
            size = f"is {cut} bytes" if cut else "starts"
            raise InputError(
                name,
                f"truncated: the MPEG audio frame at byte {at + j} {size} but the file ends "
                f"{left} bytes after it starts; the file is cut short",
            )
        return  # the frames run to the end, or to bytes that are not a frame header


_SCALE = {
    "s16": 1 / 32768,
    "s16p": 1 / 32768,
    "s32": 1 / 2**31,
    "s32p": 1 / 2**31,
    "u8": 1 / 128,
    "u8p": 1 / 128,
}


class _Collector:
    """Keeps the decoded samples of ``[start, stop)`` only, in float32 ``[channels, n]``.

    Preallocated to the expected length when the container states one; grows
    in doubling steps otherwise (or past it), so that no list of frames, no
    concatenation of them and no sliced copy are alive together.
    """

    def __init__(self, start: int, stop: int | None, expected: int | None) -> None:
        self.start, self.stop = start, stop
        self.expected = expected
        self.seen = 0  # samples decoded, kept or not
        self.out: np.ndarray | None = None
        self.filled = 0
        self.parts: list[np.ndarray] = []

    def add(self, arr: np.ndarray) -> None:
        n = arr.shape[1]
        lo = max(0, self.start - self.seen)
        hi = n if self.stop is None else min(n, self.stop - self.seen)
        self.seen += n
        if hi <= lo:
            return
        arr = arr[:, lo:hi]
        got = arr.shape[1]
        if self.out is None:
            first = max(got, self.expected or 0, 1 << 16)
            self.out = np.empty((arr.shape[0], first), np.float32)
        elif arr.shape[0] != self.out.shape[0]:
            raise ValueError(f"channel count changed from {self.out.shape[0]} to {arr.shape[0]}")
        if self.filled + got > self.out.shape[1]:
            self.parts.append(self.out[:, : self.filled])
            self.out = np.empty((arr.shape[0], max(self.out.shape[1], got)), np.float32)
            self.filled = 0
        self.out[:, self.filled : self.filled + got] = arr
        self.filled += got

    def result(self) -> np.ndarray:
        if self.out is None:
            return np.zeros((1, 0), np.float32)
        last = self.out[:, : self.filled]
        if self.parts:
            return np.concatenate([*self.parts, last], axis=1)
        return self.out if self.filled == self.out.shape[1] else np.ascontiguousarray(last)


def _pyav(source: Source, name: str, span: _Span) -> tuple[np.ndarray, int]:
    with needs_extra("compile", "decoding audio"):
        import av

    handle = io.BytesIO(source) if isinstance(source, bytes) else str(source)
    decoded = 0
    rate = 0
    finite = _NonFinite()
    kept: _Collector | None = None
    declared: int | None = None
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
                if kept is None:
                    rate = frame.sample_rate or rate
                    start, wanted = span.frames(rate)
                    stop = None if wanted is None else start + wanted
                    left = None if declared is None else max(0, declared - start)
                    if left is not None and stop is not None:
                        left = min(left, stop - start)
                    expected = None if left is None else left + LENGTH_TOLERANCE_FRAMES
                    kept = _Collector(start, stop, expected)
                arr = frame.to_ndarray()
                fmt = frame.format.name
                channels = len(frame.layout.channels)
                if not frame.format.is_planar:
                    arr = arr.reshape(-1, channels).T
                arr = np.array(arr, dtype=np.float32, order="C")
                if fmt.startswith("u8"):
                    arr -= 128
                arr *= _SCALE.get(fmt, 1.0)
                finite.add(arr)
                kept.add(_mixed(arr, span.mix))
                decoded += arr.shape[1]
                if kept.stop is not None and kept.seen >= kept.stop:
                    break  # the requested span is decoded: the rest of the file is not needed
    except InputError:
        raise
    except (av.FFmpegError, ValueError, OSError) as e:
        where = f"after {decoded} frames ({decoded / rate:.3f} s)" if decoded and rate else ""
        raise InputError(
            name,
            "cannot decode (not a format soundfile knows; PyAV: "
            f"{_short(e)}{'; ' + where if where else ''})",
        ) from None
    if kept is None:
        raise InputError(name, "no audio frames decoded")
    finite.check(name)
    out = kept.result()
    start, wanted = span.frames(rate)
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

"""RIFF/WAVE chunk layout: where a WAV's fmt and data chunks are, and whether the
file is plain enough to read without libsndfile.

"Plain" is narrow on purpose. libsndfile steps over most chunks by their size
but parses some (LIST, PEAK, fact, a second fmt) its own way, ignores a pad
byte after odd-sized ones, and resynchronises on bytes that are not chunks; a
file holding anything whose reading could differ is left to libsndfile, so
that the fast reader and libsndfile always agree on where the samples are.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

RIFF_HEADER_BYTES = 12  # "RIFF", size, "WAVE"
MAX_CHANNELS = 256  # libsndfile's limit is higher; more channels go to it
_GUID_TAIL = b"\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"  # KSDATAFORMAT_SUBTYPE_*
_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE
# Chunks libsndfile skips by their size, as the walker does (no pad byte: sizes must be even).
_SKIPPED = {b"JUNK", b"junk", b"PAD "}
# LIST sub-chunks that libsndfile reads as size-prefixed strings (its text buffer is larger).
_LIST_TEXT = {b"ISFT", b"ICOP", b"IARL", b"IART", b"ICMT", b"ICRD", b"IENG", b"INAM", b"IPRD"}
_LIST_TEXT |= {b"ISBJ", b"ISRC"}
_LIST_TEXT_MAX = 1024


HEAD_BYTES = 4096  # what one read takes from a WAV's start: every header of a common file


class Readable(Protocol):
    def seek(self, pos: int, whence: int = 0, /) -> int: ...
    def read(self, n: int = -1, /) -> bytes: ...


class HeadFirst:
    """A file's first ``len(head)`` bytes, read in one call, behind the seek and read the
    chunk walker uses: a plain WAV's header is parsed without a system call per chunk.
    A read reaching past them goes to the file: ``pread(n, at)``, n bytes from byte at."""

    def __init__(self, pread: Callable[[int, int], bytes], head: bytes, size: int) -> None:
        self._pread, self._head, self._pos, self._size = pread, head, 0, size

    def seek(self, pos: int, whence: int = 0, /) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        if base + pos < 0:
            raise OSError(f"seek to a negative position ({base + pos})")
        self._pos = base + pos
        return self._pos

    def read(self, n: int = -1, /) -> bytes:
        left = max(0, self._size - self._pos)  # a chunk's declared size may be far beyond it
        n = left if n < 0 else min(n, left)
        end = self._pos + n
        if n == 0 or end <= len(self._head):
            data = self._head[self._pos : end]
        else:
            data = self._pread(n, self._pos)
        self._pos += len(data)
        return data


def chunks(r: Readable, pos: int) -> Iterator[tuple[bytes, int, int]]:
    """``(id, header offset, declared size)`` of each RIFF chunk from byte ``pos`` on.

    Each chunk starts after the previous one's size and pad byte; the walk
    stops where fewer than 8 bytes are left. The caller may read inside a
    chunk between steps.
    """
    while True:
        r.seek(pos)
        head = r.read(8)
        if len(head) < 8:
            return
        size = int.from_bytes(head[4:], "little")
        yield head[:4], pos, size
        pos += 8 + size + (size & 1)


@dataclass(frozen=True)
class WavLayout:
    """A RIFF/WAVE file's chunks up to its first data chunk."""

    fmt: bytes  # the first 40 bytes of the last fmt chunk before the data (b"" when none)
    data_at: int  # byte offset of the data chunk's header
    data_bytes: int  # the size the data chunk declares
    file_bytes: int
    plain: bool  # one fmt chunk, then only chunks libsndfile steps over as the walker does

    @property
    def data_offset(self) -> int:
        return self.data_at + 8

    @property
    def data_end(self) -> int:
        """Where the chunk after the data chunk starts (past the file's end when it is cut)."""
        return self.data_offset + self.data_bytes + (self.data_bytes & 1)

    @property
    def block_align(self) -> int:
        return int(struct.unpack("<H", self.fmt[12:14])[0]) if len(self.fmt) >= 14 else 0


def read_layout(r: Readable) -> WavLayout | None:
    """The layout of a little-endian RIFF/WAVE file, or None (RIFX, RF64, W64, no data chunk)."""
    file_bytes = r.seek(0, 2)
    r.seek(0)
    head = r.read(RIFF_HEADER_BYTES)
    if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    fmt, fmts, plain = b"", 0, True
    for cid, pos, size in chunks(r, RIFF_HEADER_BYTES):
        if cid == b"data":
            return WavLayout(fmt, pos, size, file_bytes, plain and fmts == 1)
        if cid == b"fmt ":
            fmt, fmts = r.read(min(size, 40)), fmts + 1
            plain = plain and size % 2 == 0
        else:
            plain = plain and _steps_over(r, cid, pos, size, fmt)
    return None


def plain_tail(r: Readable, layout: WavLayout) -> bool:
    """Whether only chunks libsndfile steps over follow the data chunk, ending at the file's end."""
    if layout.data_end >= layout.file_bytes:
        return True
    end = layout.data_end
    for cid, pos, size in chunks(r, layout.data_end):
        if not _steps_over(r, cid, pos, size, layout.fmt):
            return False
        end = pos + 8 + size
    return end == layout.file_bytes


def sample_format(fmt: bytes) -> tuple[np.dtype[np.generic], int, int] | None:
    """``(dtype, channels, sample_rate)`` for 16-bit PCM or 32-bit float, else None.

    Accepts format tag 1 or 3, or WAVE_FORMAT_EXTENSIBLE with the PCM or IEEE
    float sub-format GUID and every container bit valid, with a block align
    that matches the channels (libsndfile reads by its own frame width).
    """
    if len(fmt) < 16:
        return None
    tag, channels, rate, _, block_align, bits = struct.unpack_from("<HHIIHH", fmt)
    if tag == _EXTENSIBLE:
        if len(fmt) < 40 or fmt[28:40] != _GUID_TAIL or fmt[18:20] != fmt[14:16]:
            return None  # no sub-format, an unknown one, or valid bits short of the container
        tag = int(struct.unpack_from("<I", fmt, 24)[0])
    if not (1 <= channels <= MAX_CHANNELS and 1 <= rate < 1 << 31):
        return None
    if tag == _PCM and bits == 16 and block_align == 2 * channels:
        return np.dtype("<i2"), channels, rate
    if tag == _FLOAT and bits == 32 and block_align == 4 * channels:
        return np.dtype("<f4"), channels, rate
    return None


def _steps_over(r: Readable, cid: bytes, pos: int, size: int, fmt: bytes) -> bool:
    """Whether libsndfile's header parser leaves this chunk exactly at its end, without error."""
    if size % 2:
        return False  # libsndfile does not skip the pad byte after most chunks
    if cid in _SKIPPED:
        return True
    if cid == b"fact":
        return size >= 4
    if cid == b"PEAK":  # must follow fmt and fit its channel count, or libsndfile fails
        return len(fmt) >= 4 and size == 8 + 8 * int(struct.unpack("<H", fmt[2:4])[0])
    if cid == b"LIST":
        r.seek(pos + 8)
        return _list_steps_over(r.read(size), size)
    return False


def _list_steps_over(body: bytes, size: int) -> bool:
    """Whether libsndfile's LIST parser (which counts the size field among the bytes it
    reads, stops at the first step past the size, and backs out at a "data" marker)
    ends exactly where the chunk does."""
    if size <= 8 or len(body) < size:
        return False
    done, at = 4, 0  # libsndfile's byte count starts with the size field
    while done < size:
        marker = body[at : at + 4]
        at, done = at + 4, done + 4
        if marker in (b"INFO", b"adtl"):
            continue
        if marker == b"data" or marker == b"exif" or at + 4 > len(body):
            return False
        length = int.from_bytes(body[at : at + 4], "little")
        at, done = at + 4, done + 4
        if marker == b"labl":
            text = length - 4 + ((length - 4) & 1)
            if not 1 <= text <= _LIST_TEXT_MAX:
                return False
            at, done = at + 4 + text, done + 4 + text
            continue
        length += length & 1
        if length > (_LIST_TEXT_MAX if marker in _LIST_TEXT else size):
            return False
        at, done = at + length, done + length
    return done == size + 4

"""Streaming shard writer (SPEC.md §2-§5).

Each field's values are spooled to a temporary file beside the shard while
samples arrive (a block-coded field keeps only its current block in memory); closing
lays out header and regions into a temporary file and renames it into place,
so a shard file either is complete or does not exist.

With ``in_place`` (ArchiveWriter asks for it for shards of IN_PLACE_SHARD_BYTES
or more), the values of the largest field stored as one plain region (a
fixed-shape raw field: the bulk of most archives) go straight into that
temporary shard file at their final offset, the file's first region, just past
room reserved for the largest header the schema can have. They are never copied at close, and the kernel is asked to
start writing them back as they arrive, so the final fsync waits only for the
last few megabytes.
"""

from __future__ import annotations

import ctypes
import os
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from .codecs import BlockCoder
from .constants import (
    BLOCK_COLUMNS,
    BLOCK_ROW,
    CRC_DTYPE,
    CRC_PIECE_BYTES,
    MAX_BLOCK_RAW_BYTES,
    MAX_DIM,
    MAX_FIELD_BYTES,
    MAX_SAMPLE_BYTES,
    MAX_SHARD_SAMPLES,
    OFFSET_DTYPE,
    PREAMBLE,
    SHAPE_DTYPE,
)
from .crc import crc32, crc32_combine
from .errors import SchemaError
from .header import (
    FieldLayout,
    Region,
    align,
    encode_header,
    has_pieces,
    header_end_for,
    required_regions,
)
from .heap import libc
from .schema import Field, check_schema, footprint_bytes
from .units import is_count

_COPY_CHUNK = 8 << 20
SPOOL_BUFFER = 64 << 10  # bytes a spool gathers before a write (larger values go straight)
# Bytes written into the shard file between requests to start their writeback.
WRITEBACK_BYTES = 16 << 20
# Shards an ArchiveWriter rotates at this size or more write their largest plain
# field in place (smaller ones spool every field and stay as compact as can be).
IN_PLACE_SHARD_BYTES = 16 << 20
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback of the range, do not wait


def _sync_file_range() -> Any:
    """libc's sync_file_range (Linux), or None."""
    fn = getattr(libc(), "sync_file_range", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_start_writeback = _sync_file_range()
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass(frozen=True)
class ShardInfo:
    """What the archive index records of a finished shard (SPEC.md §6)."""

    file: str
    num_samples: int
    bytes: int
    crc32: int
    # The CRC-32 of the shard's header (its preamble's, SPEC.md §2): ties the header, and
    # through it every region's and piece's CRC, to the index before the file is whole.
    # None in indexes written before it.
    header_crc32: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "file": self.file,
            "num_samples": self.num_samples,
            "bytes": self.bytes,
            "crc32": self.crc32,
        }
        if self.header_crc32 is not None:
            out["header_crc32"] = self.header_crc32
        return out

    @classmethod
    def from_json(cls, file: str, entry: Mapping[str, Any]) -> ShardInfo:
        """The entry of shard ``file`` as to_json wrote it; ValueError saying what is
        wrong with its numbers (SPEC.md §6)."""
        num_samples, size, crc = nums = [entry.get(k) for k in ("num_samples", "bytes", "crc32")]
        if not (
            is_count(num_samples, MAX_SHARD_SAMPLES)
            and is_count(size, (1 << 64) - 1)
            and is_count(crc, 0xFFFFFFFF)
        ):
            raise ValueError(
                f"num_samples, bytes and crc32 must be non-negative integers of at most "
                f"{MAX_SHARD_SAMPLES}, 2^64-1 and 2^32-1; got {nums}"
            )
        header = entry.get("header_crc32")
        if header is not None and not is_count(header, 0xFFFFFFFF):
            raise ValueError(f"header_crc32 must be an integer 0 ... 2^32-1; got {header!r:.40}")
        return cls(file, num_samples, size, crc, header)


class _Spool:
    """One region's bytes in a temporary file, with a running CRC-32.

    With ``base`` the file is the shard's own temporary file and the bytes are
    written from that offset on, where the region will stay; writeback of
    each WRITEBACK_BYTES is started as they are written. With ``piece`` the CRC
    is kept per piece of that many bytes too (SPEC.md §4 ``crcs``), the region's
    composed from theirs: the bytes are read once either way.
    """

    def __init__(self, path: Path, base: int | None = None, piece: int | None = None) -> None:
        self.path = path
        # a buffer large enough that small values (a few KiB each) reach the file in
        # few system calls, not one each
        self.file: IO[bytes] = open(path, "w+b", buffering=SPOOL_BUFFER)  # noqa: SIM115
        self.base = base
        self.piece = piece
        self.pieces = array("I")  # the CRC of each whole piece so far
        self._whole = 0  # CRC of every byte (no pieces) or of the whole pieces
        self._tail = self._tail_len = 0  # CRC and length of the piece being filled
        self.length = 0
        self._unsynced = 0
        if base is not None:
            self.file.seek(base)

    @property
    def crc(self) -> int:
        return crc32_combine(self._whole, self._tail, self._tail_len)

    def piece_crcs(self) -> bytes | None:
        """The ``crcs`` region: one CRC-32 a piece, when the values fill more than one."""
        if self.piece is None or self.length <= self.piece:
            return None
        tail = [self._tail] if self._tail_len else []
        return np.array([*self.pieces, *tail], dtype=CRC_DTYPE).tobytes()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.file.write(data)
        n = len(data) if isinstance(data, (bytes, bytearray)) else data.nbytes
        if self.piece is None:
            self._whole = crc32(data, self._whole)
        elif self._tail_len + n < self.piece:
            self._tail = crc32(data, self._tail)
            self._tail_len += n
        else:
            self._cut(memoryview(data).cast("B"))
        self.length += n
        if self.base is not None:
            self._unsynced += n
            if self._unsynced >= WRITEBACK_BYTES:
                self._writeback()

    def _cut(self, view: memoryview) -> None:
        """Folds ``view`` into the pieces, closing each one it fills."""
        assert self.piece is not None
        pos = 0
        while len(view) - pos >= self.piece - self._tail_len:
            take = self.piece - self._tail_len
            done = crc32(view[pos : pos + take], self._tail)
            self.pieces.append(done)
            self._whole = crc32_combine(self._whole, done, self.piece)
            self._tail = self._tail_len = 0
            pos += take
        if pos < len(view):
            self._tail = crc32(view[pos:])
            self._tail_len = len(view) - pos

    def _writeback(self) -> None:
        """Asks the kernel to start writing the bytes written since the last request."""
        if _start_writeback is None or self.base is None:
            return
        self.file.flush()
        end = self.base + self.length
        _start_writeback(
            self.file.fileno(), end - self._unsynced, self._unsynced, _SYNC_FILE_RANGE_WRITE
        )
        self._unsynced = 0

    def close(self) -> None:
        self.file.close()
        if self.base is None:  # the shard's own file is renamed or removed by the writer
            self.path.unlink(missing_ok=True)


class _PlainSink:
    """Values stored as they are: every payload goes straight to the data spool."""

    def __init__(self, data: _Spool) -> None:
        self.data = data

    @property
    def pending_bytes(self) -> int:
        return 0

    @property
    def num_blocks(self) -> int | None:
        return None

    def add(self, payload: bytes | memoryview, index: int) -> None:
        self.data.write(payload)

    def flush(self) -> None:
        pass

    def small_regions(self) -> dict[str, bytes]:
        crcs = self.data.piece_crcs()
        return {} if crcs is None else {"crcs": crcs}


class _BlockSink:
    """Values in blocks of whole samples, each block stored as one frame and listed
    in the block table (SPEC.md §4); only the current block is held in memory."""

    def __init__(self, field: Field, data: _Spool, coder: BlockCoder) -> None:
        self.field = field
        self.data = data
        self.block_bytes = coder.block_bytes
        self.encode = coder.encoder(field.itemsize)
        self.block = bytearray()
        self.block_first = 0
        self.block_samples = 0
        self.rows: list[tuple[int, ...]] = []

    @property
    def pending_bytes(self) -> int:
        return len(self.block)

    @property
    def num_blocks(self) -> int | None:
        return len(self.rows)

    def add(self, payload: bytes | memoryview, index: int) -> None:
        if len(payload) > MAX_BLOCK_RAW_BYTES:
            raise SchemaError(
                f"sample {index} field {self.field.name!r}: {len(payload)} bytes exceed the "
                f"{MAX_BLOCK_RAW_BYTES}-byte block limit of codec "
                f"{self.field.codec.describe()}; store such samples with codec raw"
            )
        if len(self.block) + len(payload) > MAX_BLOCK_RAW_BYTES:
            self.flush()  # a block never decodes to more than the limit
        if self.block_samples == 0:
            self.block_first = index
            if len(payload) >= self.block_bytes:  # a block of its own: encoded as it is,
                self._emit(payload)  # never copied (a large sample is not held twice more)
                return
        self.block += payload
        self.block_samples += 1
        if len(self.block) >= self.block_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.block_samples:
            return
        self._emit(self.block)
        self.block.clear()
        self.block_samples = 0

    def _emit(self, raw: bytes | bytearray | memoryview) -> None:
        """Stores ``raw`` (the samples from ``block_first`` on) as one frame."""
        frame = self.encode(raw)
        row = {
            "comp_offset": self.data.length,
            "comp_length": len(frame),
            "first_sample": self.block_first,
            "raw_length": len(raw),
            "crc32": crc32(frame),
        }
        self.rows.append(tuple(row[c] for c in BLOCK_COLUMNS))
        self.data.write(frame)

    def small_regions(self) -> dict[str, bytes]:
        return {"blocks": np.array(self.rows, dtype=BLOCK_ROW).tobytes()}


class _FieldSink:
    def __init__(self, field: Field, spool: Path, base: int | None = None) -> None:
        self.field = field
        self.name = field.name
        self.data = _Spool(spool, base, CRC_PIECE_BYTES if has_pieces(field) else None)
        self.want = field.np_dtype
        # A fixed-shape array field whose shape passes the per-sample bounds takes arrays of
        # exactly its dtype and shape as they are (encode); anything else goes through
        # encode_value, which converts or names what is wrong.
        self.fixed_shape: tuple[int, ...] | None = None
        if field.kind == "array" and not field.ragged:
            shape = tuple(int(d) for d in field.shape if d is not None)
            try:
                _check_sample_shape("", shape, field.itemsize)
                # memoryview cannot cast an empty array's view to bytes
                self.fixed_shape = None if 0 in shape else shape
            except SchemaError:
                pass
        self.text = field.kind == "str"
        self.max_text = min(MAX_DIM, MAX_SAMPLE_BYTES)
        self.int64 = self.fixed_shape == () and self.want == np.dtype("<i8")
        self.offsets = array("q", [0]) if field.ragged else None
        self.shapes = array("q") if field.ragged else None
        # The one place the writer looks at the codec: how it stores values.
        coder = field.codec.block_coder()
        self.values: _PlainSink | _BlockSink = (
            _PlainSink(self.data) if coder is None else _BlockSink(field, self.data, coder)
        )

    def encode(self, value: Any, index: int) -> tuple[bytes | memoryview, tuple[int, ...]]:
        """``encode_value`` for this field; a C-contiguous array of the field's dtype and
        shape is passed on as a view of its memory, not copied."""
        shape = self.fixed_shape
        if (
            shape is not None
            and type(value) is np.ndarray
            and value.shape == shape
            and value.dtype == self.want
            and value.flags.c_contiguous
        ):
            return value.data.cast("B"), shape
        if self.text and type(value) is str:
            data = value.encode("utf-8")
            if len(data) <= self.max_text:
                return data, (len(data),)
        if self.int64 and type(value) is int and _I64_MIN <= value <= _I64_MAX:
            return value.to_bytes(8, "little", signed=True), ()
        return encode_value(self.field, value, index)

    def add(self, payload: bytes | memoryview, shape: tuple[int, ...], index: int) -> None:
        if self.offsets is not None and self.shapes is not None:
            self.offsets.append(self.offsets[-1] + len(payload) // self.field.itemsize)
            self.shapes.extend(shape)
        self.values.add(payload, index)

    def small_regions(self) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        if self.offsets is not None and self.shapes is not None:
            out["shapes"] = np.asarray(self.shapes, dtype=SHAPE_DTYPE).tobytes()
            out["offsets"] = np.asarray(self.offsets, dtype=OFFSET_DTYPE).tobytes()
        out.update(self.values.small_regions())
        return out


class ShardWriter:
    """Writes one shard, one sample at a time.

    ``write(sample)`` takes a mapping with exactly the schema's field names:
    numpy arrays (or scalars) for ``array`` fields, ``bytes`` for ``bytes``
    fields, ``str`` for ``str`` fields. ``bf16`` fields take ``uint16`` bit
    patterns. Use as a context manager, or call ``close()`` (keeps the shard)
    or ``abort()`` (leaves nothing behind).
    """

    def __init__(
        self, path: str | os.PathLike[str], fields: Sequence[Field], in_place: bool = False
    ) -> None:
        self.path = Path(path)
        self.fields = check_schema(fields)
        self.num_samples = 0
        self._tmp = self.path.with_name(f".{self.path.name}.tmp")
        fields_ = list(self.fields.values())
        # in_place: the values of the largest field stored as one plain region go
        # straight into the shard file, past room for the largest header: the file's
        # first region (worth its few KiB of room in large shards).
        plain = [i for i, f in enumerate(fields_) if in_place and required_regions(f) == ("data",)]
        self._in_place = max(plain, key=lambda i: fields_[i].footprint_bytes, default=None)
        self._base = reserved_header_end(fields_) if self._in_place is not None else None
        self._sinks = [
            _FieldSink(f, self._tmp, self._base)
            if i == self._in_place
            else _FieldSink(f, self.path.with_name(f".{self.path.name}.f{i}.spool"))
            for i, f in enumerate(fields_)
        ]
        self._closed = False
        # Samples a shard can take before some fixed field passes MAX_FIELD_BYTES.
        self._field_room = min(
            (MAX_FIELD_BYTES // f.footprint_bytes for f in self.fields.values() if not f.ragged),
            default=MAX_SHARD_SAMPLES,
        )

    @property
    def bytes_written(self) -> int:
        """Uncompressed-or-compressed bytes spooled so far (for shard rotation)."""
        return sum(s.data.length + s.values.pending_bytes for s in self._sinks)

    def write(self, sample: Mapping[str, Any]) -> None:
        if self._closed:
            raise SchemaError(f"{self.path}: write after close")
        if sample.keys() != self.fields.keys():
            missing = sorted(set(self.fields) - set(sample))
            extra = sorted(set(sample) - set(self.fields))
            raise SchemaError(
                f"{self.path}: sample {self.num_samples} does not match the schema "
                f"(missing {missing}, unexpected {extra})"
            )
        n = self.num_samples + 1
        if n > MAX_SHARD_SAMPLES:
            raise SchemaError(f"{self.path}: a shard holds at most {MAX_SHARD_SAMPLES} samples")
        if n > self._field_room:
            self._check_field_room(n)
        encoded = [s.encode(sample[s.name], self.num_samples) for s in self._sinks]
        for sink, (payload, shape) in zip(self._sinks, encoded, strict=True):
            sink.add(payload, shape, self.num_samples)
        self.num_samples += 1

    def _check_field_room(self, n: int) -> None:
        for f in self.fields.values():
            if not f.ragged and n * f.footprint_bytes > MAX_FIELD_BYTES:
                raise SchemaError(
                    f"{self.path}: field {f.name!r} of shape {list(f.shape)} would exceed the "
                    f"{MAX_FIELD_BYTES}-byte field limit at sample {n - 1}; start a new shard"
                )

    def write_many(self, samples: Iterable[Mapping[str, Any]]) -> None:
        for s in samples:
            self.write(s)

    def close(self) -> ShardInfo:
        """Lays out the shard and renames it into place."""
        if self._closed:
            raise SchemaError(f"{self.path}: closed twice")
        try:
            info = self._assemble()
        except BaseException:
            self.abort()
            raise
        self._closed = True
        return info

    def abort(self) -> None:
        """Removes every temporary file; the shard is not written."""
        self._closed = True
        for s in self._sinks:
            s.data.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            if not self._closed:
                self.close()
        else:
            self.abort()

    def _file_order(self) -> list[int]:
        """The fields in the order their regions lie in the file: the one written in
        place first, then the others in schema order."""
        order = list(range(len(self._sinks)))
        if self._in_place is not None:
            order.remove(self._in_place)
            order.insert(0, self._in_place)
        return order

    def _layout(
        self, header_end: int, smalls: list[dict[str, bytes]]
    ) -> tuple[list[FieldLayout], int]:
        """Every field's regions (schema order) laid out from header_end, or from the
        reserved end when one field's values are already in place; the file's size."""
        cursor = header_end if self._base is None else self._base
        regions: dict[int, dict[str, Region]] = {}
        for i in self._file_order():
            sink, small = self._sinks[i], smalls[i]
            regions[i] = {}
            names = required_regions(sink.field)
            for rname in (*names, *(k for k in small if k not in names)):
                if rname == "data":
                    length, crc = sink.data.length, sink.data.crc
                else:
                    length, crc = len(small[rname]), crc32(small[rname])
                cursor = align(cursor)
                regions[i][rname] = Region(cursor, length, crc)
                cursor += length
        layouts = [
            FieldLayout(
                sink.field,
                regions[i],
                sink.offsets[-1] if sink.offsets is not None else None,
                sink.values.num_blocks,
                sink.data.piece if "crcs" in regions[i] else None,
            )
            for i, sink in enumerate(self._sinks)
        ]
        return layouts, align(cursor)

    def _assemble(self) -> ShardInfo:
        for s in self._sinks:
            s.values.flush()
        smalls = [s.small_regions() for s in self._sinks]
        # The header's length and the region offsets depend on each other: iterate
        # until the aligned header end stops moving (two rounds in practice).
        header_end = header_end_for(0)
        while True:
            layouts, file_bytes = self._layout(header_end, smalls)
            head = encode_header(self.num_samples, file_bytes, layouts)
            if header_end_for(len(head) - PREAMBLE.size) == header_end:
                break
            header_end = header_end_for(len(head) - PREAMBLE.size)
        if self._base is not None and header_end > self._base:
            raise SchemaError(  # reserved_header_end bounds every header; never expected
                f"{self.path}: the header ends at byte {header_end}, past the {self._base} "
                "bytes reserved for it"
            )
        crc = self._write_file(head, layouts, smalls, file_bytes)
        for s in self._sinks:
            s.data.close()
        os.replace(self._tmp, self.path)
        header_crc = PREAMBLE.unpack_from(head)[2]
        return ShardInfo(self.path.name, self.num_samples, file_bytes, crc, header_crc)

    def _write_file(
        self,
        head: bytes,
        layouts: list[FieldLayout],
        smalls: list[dict[str, bytes]],
        file_bytes: int,
    ) -> int:
        """Writes the temporary shard file in file order, fsyncs it; returns its CRC-32.

        Small pieces are written and checksummed directly; data spools are copied
        by the kernel, and the file's CRC is composed from theirs. Values already
        in place are passed over.
        """
        crc = pos = 0
        in_place = self._sinks[self._in_place].data if self._in_place is not None else None
        if in_place is not None:
            in_place.file.flush()
        with open(self._tmp, "r+b" if in_place is not None else "wb") as out:

            def put(data: bytes) -> None:
                nonlocal crc, pos
                out.write(data)
                crc = crc32(data, crc)
                pos += len(data)

            def pad_to(target: int) -> None:
                if target > pos:
                    put(bytes(target - pos))

            put(head)
            for i in self._file_order():
                sink = self._sinks[i]
                for rname, region in layouts[i].regions.items():
                    pad_to(region.offset)
                    if rname != "data":
                        put(smalls[i][rname])
                        continue
                    if sink.data is not in_place:
                        out.flush()
                        sink.data.file.flush()
                        _copy_file(sink.data.file.fileno(), out.fileno(), sink.data.length, pos)
                    out.seek(pos + sink.data.length)
                    crc = crc32_combine(crc, sink.data.crc, sink.data.length)
                    pos += sink.data.length
            pad_to(file_bytes)
            out.truncate(file_bytes)
            out.flush()
            os.fsync(out.fileno())
        return crc


def reserved_header_end(fields: Sequence[Field]) -> int:
    """An aligned header end that no shard of these fields passes: the end of the header
    with every count, offset, length and checksum at its largest."""
    big = (1 << 63) - 1
    layouts = []
    for f in fields:
        names = required_regions(f) + (("crcs",) if has_pieces(f) else ())
        layouts.append(
            FieldLayout(
                f,
                {name: Region(big, big, 0xFFFFFFFF) for name in names},
                big if f.ragged else None,
                big if "blocks" in names else None,
                big if has_pieces(f) else None,
            )
        )
    head = encode_header(MAX_SHARD_SAMPLES, big, layouts)
    return header_end_for(len(head) - PREAMBLE.size)


def _copy_file(src: int, dst: int, length: int, dst_offset: int) -> None:
    """Copies ``length`` bytes from the start of fd ``src`` to ``dst_offset`` of fd ``dst``."""
    done = 0
    try:
        while done < length:
            n = os.copy_file_range(src, dst, length - done, done, dst_offset + done)
            if n == 0:
                raise OSError("copy_file_range made no progress")
            done += n
        return
    except (AttributeError, OSError):
        pass  # not Linux, or a file system that cannot: copy through user space
    while done < length:
        chunk = os.pread(src, min(_COPY_CHUNK, length - done), done)
        if not chunk:
            raise OSError(f"spool ended {length - done} bytes early")
        done += os.pwrite(dst, chunk, dst_offset + done)


def encode_value(f: Field, value: Any, index: int) -> tuple[bytes | memoryview, tuple[int, ...]]:
    """One sample's value as bytes plus its shape; raises SchemaError naming the field."""
    where = f"sample {index} field {f.name!r}"
    if f.kind == "str":
        if not isinstance(value, str):
            raise SchemaError(f"{where}: expected str, got {type(value).__name__}")
        data = value.encode("utf-8")
        _check_sample_shape(where, (len(data),), 1)
        return data, (len(data),)
    if f.kind == "bytes":
        if isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 1:
            value = np.ascontiguousarray(value).data  # a view: a large value is not copied
        if not isinstance(value, bytes | bytearray | memoryview):
            raise SchemaError(f"{where}: expected bytes, got {type(value).__name__}")
        if isinstance(value, memoryview) and not value.c_contiguous:
            value = value.tobytes()  # a strided view: its bytes in order
        view = value if isinstance(value, bytes) else memoryview(value).cast("B")
        _check_sample_shape(where, (len(view),), 1)
        return view, (len(view),)
    arr = np.asarray(value)
    want = f.np_dtype
    if f.dtype == "bf16":
        if arr.dtype not in (np.dtype(np.uint16), np.dtype(np.int16)):
            raise SchemaError(f"{where}: bf16 fields take uint16 bit patterns, got {arr.dtype}")
        arr = arr.view(np.uint16)
    elif arr.dtype != want:
        if not np.can_cast(arr.dtype, want, casting="same_kind"):
            raise SchemaError(f"{where}: cannot store {arr.dtype} values as {f.dtype}")
        arr = arr.astype(want)
    if arr.ndim != f.ndim or any(
        d is not None and d != s for d, s in zip(f.shape, arr.shape, strict=True)
    ):
        raise SchemaError(f"{where}: shape {list(arr.shape)} does not fit {list(f.shape)}")
    shape = tuple(int(s) for s in arr.shape)
    _check_sample_shape(where, shape, f.itemsize)
    arr = np.ascontiguousarray(arr, dtype=want)
    if not arr.size:
        return b"", shape
    # a view of the array's memory, not a copy: a large value is never held twice
    return arr.reshape(-1).view(np.uint8).data, shape


def _check_sample_shape(where: str, shape: tuple[int, ...], itemsize: int) -> None:
    """The per-sample bounds of SPEC.md §8, checked before any copy of the value."""
    if any(d > MAX_DIM for d in shape):
        raise SchemaError(f"{where}: shape {list(shape)} has a dimension above {MAX_DIM}")
    if footprint_bytes(shape, itemsize) > MAX_SAMPLE_BYTES:
        raise SchemaError(
            f"{where}: shape {list(shape)} holds more than {MAX_SAMPLE_BYTES} bytes "
            "(zero dimensions count as 1)"
        )

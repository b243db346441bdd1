"""Memory-mapped shard reader (SPEC.md §2-§5).

Opening a shard checks the preamble, the header CRC and JSON, every region's
bounds, alignment and overlap, and the CRC and consistency of the small
metadata regions (shapes, offsets, block tables) before any value is touched.
Raw fields are then handed out as zero-copy views of the mapping; data-region
checksums are checked by ``verify()``.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .codecs import BlockCoder, FrameError
from .constants import (
    BLOCK_COLUMNS,
    BLOCK_DTYPE,
    BLOCK_ROW,
    CRC_DTYPE,
    MAX_BLOCK_RAW_BYTES,
    MAX_DIM,
    MAX_SAMPLE_BYTES,
    OFFSET_DTYPE,
    PREAMBLE,
    SHAPE_DTYPE,
    ZSTD_MAX_RATIO,
)
from .crc import crc32
from .errors import ChecksumError, FormatError, SchemaError
from .files import open_regular
from .header import FieldLayout, Region, parse_header, read_preamble
from .limits import too_many_maps, with_room
from .schema import Field

_CRC_CHUNK = 64 << 20

Value = np.ndarray | bytes | str
# Mapped bytes (uint8) to the bytes to read instead: a copy made where a fault on a file
# that shrank is an error, not SIGBUS (ShardReader.decode_block, copied_tables).
MappedCopy = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Problem:
    """One verification failure: where, and what."""

    path: str
    field: str | None
    block: int | None
    message: str

    def __str__(self) -> str:
        where = self.path
        if self.field is not None:
            where += f" field {self.field!r}"
        if self.block is not None:
            where += f" block {self.block}"
        return f"{where}: {self.message}"


class _FieldState:
    __slots__ = (
        "coder",
        "field",
        "first_samples",
        "layout",
        "offsets",
        "shapes",
        "store",
        "table",
    )

    def __init__(self, layout: FieldLayout) -> None:
        self.layout = layout
        self.field = layout.field
        self.offsets: np.ndarray | None = None
        self.shapes: np.ndarray | None = None
        self.table: np.ndarray | None = None  # BLOCK_ROW records of a block-coded field
        self.first_samples: np.ndarray | None = None
        # The one place the reader looks at the codec: how the values are stored.
        self.coder: BlockCoder | None = layout.field.codec.block_coder()
        self.store: _Store = _MAPPED if self.coder is None else _BLOCKS


class BlockCache:
    """Decoded zstd blocks, least recently used out first, bounded in bytes; thread-safe.

    An ArchiveReader shares one among its shards, so random access over a
    whole archive decodes each block once while it stays in the budget.
    """

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._blocks: OrderedDict[tuple[int, str, int], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[int, str, int]) -> np.ndarray | None:
        with self._lock:
            hit = self._blocks.get(key)
            if hit is not None:
                self._blocks.move_to_end(key)
            return hit

    def put(self, key: tuple[int, str, int], values: np.ndarray) -> None:
        with self._lock:
            if key in self._blocks:
                return
            self._blocks[key] = values
            self.bytes += values.nbytes
            while self.bytes > self.max_bytes and len(self._blocks) > 1:
                _, old = self._blocks.popitem(last=False)
                self.bytes -= old.nbytes


_READER_TOKENS = itertools.count()


# Every shard mapped in this process, for naming the file a faulting address lies in.
_LIVE_MAPS: weakref.WeakSet[ShardReader] = weakref.WeakSet()


def mapped_at(address: int) -> ShardReader | None:
    """The open shard whose mapping holds ``address`` (a read fault's), or None."""
    while True:
        try:  # another thread may map or drop a shard meanwhile
            readers = list(_LIVE_MAPS)
            break
        except RuntimeError:
            continue
    for reader in readers:
        start, length = reader.mapped_span()
        if start <= address < start + length:
            return reader
    return None


class ShardReader:
    """Reads one shard file; ``verify=True`` also checks every data checksum on open.

    Decoded zstd blocks go to ``block_cache`` (a private 64 MiB one if None).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        verify: bool = False,
        block_cache: BlockCache | None = None,
        archive_dir: str | os.PathLike[str] | None = None,
        expected_bytes: int | None = None,
    ) -> None:
        self.path = Path(path)
        self._token = next(_READER_TOKENS)  # cache key: unlike id(), never reused
        # Only a regular file is mapped; inside an archive, links must stay in it (SPEC.md §8).
        try:
            fd = open_regular(self.path, root=None if archive_dir is None else Path(archive_dir))
        except FileNotFoundError:
            missing = "listed in index.json is missing" if archive_dir is not None else "is missing"
            raise FormatError(self.path, f"shard {missing}") from None
        try:
            size = os.fstat(fd).st_size
            if expected_bytes is not None and size != expected_bytes:
                raise FormatError(
                    self.path, f"index.json says {expected_bytes} bytes, the file has {size}"
                )
            if size < PREAMBLE.size:
                raise FormatError(
                    self.path,
                    f"truncated: {size} bytes is shorter than the {PREAMBLE.size}-byte preamble",
                )
            # a map keeps a descriptor of its own
            self._mm = with_room(lambda: mmap.mmap(fd, size, access=mmap.ACCESS_READ), self.path)
        except OSError as e:
            if e.errno == errno.ENOMEM and (capped := too_many_maps(self.path)) is not None:
                raise capped from None
            raise FormatError(self.path, f"cannot map: {e.strerror or e}") from None
        finally:
            os.close(fd)
        self._u8 = np.frombuffer(self._mm, dtype=np.uint8)
        _LIVE_MAPS.add(self)
        self._derived: dict[Hashable, Any] = {}
        self._cache = block_cache if block_cache is not None else BlockCache()
        try:
            hlen, crc = read_preamble(self.path, bytes(self._u8[: PREAMBLE.size]), size)
            body = bytes(self._u8[PREAMBLE.size : PREAMBLE.size + hlen])
            self.layout = parse_header(self.path, body, crc, size)
            self.header_crc32 = crc  # checked: the header's bytes have this CRC
            self.num_samples = self.layout.num_samples
            self._state = {fl.field.name: _FieldState(fl) for fl in self.layout.fields}
            for st in self._state.values():
                self._load_metadata(st)
            if verify:
                problems = self.verify()
                if problems:
                    raise ChecksumError(self.path, str(problems[0]).removeprefix(f"{self.path}: "))
        except BaseException:
            self.close()
            raise
        self.fields: dict[str, Field] = {name: st.field for name, st in self._state.items()}

    # -- metadata -----------------------------------------------------------------

    def _region(self, st: _FieldState, rname: str, dtype: np.dtype[Any]) -> np.ndarray:
        r = st.layout.regions[rname]
        return self._u8[r.offset : r.end].view(dtype)

    def _load_metadata(self, st: _FieldState) -> None:
        f, n = st.field, self.num_samples
        for rname in ("shapes", "offsets", "blocks", "crcs"):
            if rname in st.layout.regions:
                self._check_crc(st, rname, st.layout.regions[rname])
        if f.ragged:
            shapes = self._region(st, "shapes", SHAPE_DTYPE).reshape(n, f.ndim)
            offsets = self._region(st, "offsets", OFFSET_DTYPE)
            self._check_ragged(st, shapes, offsets)
            st.shapes, st.offsets = shapes, offsets
        st.store.load(self, st)

    def _check_crc(self, st: _FieldState, rname: str, r: Region) -> None:
        if _crc(self._u8[r.offset : r.end]) != r.crc32:
            raise ChecksumError(
                self.path,
                f"field {st.field.name!r} region {rname!r} (bytes {r.offset}..{r.end}): CRC-32 mismatch",
            )

    def _fail(self, st: _FieldState, problem: str) -> FormatError:
        return FormatError(self.path, f"field {st.field.name!r}: {problem}")

    def _check_ragged(self, st: _FieldState, shapes: np.ndarray, offsets: np.ndarray) -> None:
        f, value_count = st.field, st.layout.value_count or 0
        if offsets[0] != 0 or int(offsets[-1]) != value_count:
            raise self._fail(
                st, f"offsets run {int(offsets[0])}..{int(offsets[-1])}, expected 0..{value_count}"
            )
        if len(offsets) > 1 and not np.all(offsets[1:] >= offsets[:-1]):
            bad = int(np.argmax(offsets[1:] < offsets[:-1]))
            raise self._fail(st, f"offsets decrease at sample {bad}")
        if shapes.size and (shapes.min() < 0 or shapes.max() > MAX_DIM):
            bad = int(np.argmax(np.any((shapes < 0) | (shapes > MAX_DIM), axis=1)))
            raise self._fail(
                st,
                f"sample {bad}: stored shape {shapes[bad].tolist()} has a dimension outside 0..{MAX_DIM}",
            )
        footprint = np.prod(np.maximum(shapes, 1).astype(np.float64), axis=1) * f.itemsize
        if footprint.size and footprint.max() > MAX_SAMPLE_BYTES:
            bad = int(np.argmax(footprint > MAX_SAMPLE_BYTES))
            raise self._fail(
                st,
                f"sample {bad}: stored shape {shapes[bad].tolist()} holds more than "
                f"{MAX_SAMPLE_BYTES} bytes (zero dimensions count as 1)",
            )
        for axis, dim in enumerate(f.shape):
            if dim is not None and shapes.size and not np.all(shapes[:, axis] == dim):
                bad = int(np.argmax(shapes[:, axis] != dim))
                raise self._fail(
                    st,
                    f"sample {bad} has dimension {axis} = {int(shapes[bad, axis])}, schema says {dim}",
                )
        counts = np.diff(offsets).astype(np.int64)
        if np.any(np.prod(shapes.astype(np.float64), axis=1) >= 2.0**62) or not np.array_equal(
            np.prod(shapes, axis=1), counts
        ):
            bad = int(np.argmax(np.prod(shapes, axis=1) != counts)) if len(counts) else 0
            raise self._fail(st, f"sample {bad}: stored shape does not match its offsets")

    def _check_blocks(self, st: _FieldState, table: np.ndarray) -> None:
        n, data = self.num_samples, st.layout.regions["data"]
        if not len(table):
            if data.length:
                raise self._fail(st, "no blocks, but the data region is not empty")
            return
        comp_off, comp_len = table["comp_offset"], table["comp_length"]
        first, raw_len = table["first_sample"], table["raw_length"]
        ends = comp_off + comp_len
        if comp_off[0] != 0 or np.any(comp_off[1:] != ends[:-1]) or int(ends[-1]) != data.length:
            raise self._fail(st, "block table does not cover the data region exactly and in order")
        if first[0] != 0 or np.any(first[1:] <= first[:-1]) or int(first[-1]) >= n:
            raise self._fail(st, "block first-sample column must start at 0 and strictly increase")
        if np.any(table["crc32"] > 0xFFFFFFFF):
            raise self._fail(st, "block CRC-32 column holds a value wider than 32 bits")
        # Bound what a block may decode to before anything trusts it (SPEC.md §8): the
        # spec's cap, and what a Zstandard frame of that size can possibly hold.
        cap = np.minimum(comp_len * np.uint64(ZSTD_MAX_RATIO), np.uint64(MAX_BLOCK_RAW_BYTES))
        if np.any(raw_len > cap):
            bad = int(np.argmax(raw_len > cap))
            raise self._fail(
                st,
                f"block {bad}: uncompressed length {int(raw_len[bad])} exceeds "
                f"{int(cap[bad])} (at most {MAX_BLOCK_RAW_BYTES} bytes, and {ZSTD_MAX_RATIO} "
                f"times its {int(comp_len[bad])} compressed bytes)",
            )
        bounds = np.append(first, n).astype(np.int64)
        if st.field.ragged:
            assert st.offsets is not None  # loaded just before, for ragged fields
            want = (st.offsets[bounds[1:]] - st.offsets[bounds[:-1]]) * st.field.itemsize
        else:
            want = (bounds[1:] - bounds[:-1]) * st.field.sample_bytes
        if not np.array_equal(raw_len.astype(np.int64), want.astype(np.int64)):
            bad = int(np.argmax(raw_len.astype(np.int64) != want.astype(np.int64)))
            raise self._fail(
                st,
                f"block {bad}: uncompressed length {int(raw_len[bad])}, its samples hold {int(want[bad])}",
            )

    # -- access -------------------------------------------------------------------

    def __len__(self) -> int:
        return self.num_samples

    def _st(self, name: str) -> _FieldState:
        try:
            return self._state[name]
        except KeyError:
            raise SchemaError(
                f"{self.path}: no field {name!r} (fields: {sorted(self._state)})"
            ) from None

    def layout_of(self, name: str) -> FieldLayout:
        return self._st(name).layout

    def field_path(self, name: str) -> Path:
        """The file holding field ``name``'s bytes (this shard's; a field group's own
        shard for a joined reader), which errors about its values name."""
        self._st(name)
        return self.path

    def derived(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """What ``make()`` builds from this shard (views of its mapping a reader reuses
        batch after batch), built once per key and kept until ``close``, which lets go of
        it so the mapping and its descriptor can go at once."""
        got = self._derived.get(key)
        if got is None:
            got = self._derived[key] = make()
        return got

    def array(self, name: str) -> np.ndarray:
        """A fixed raw field as one zero-copy ``[num_samples, *shape]`` view."""
        st = self._st(name)
        f = st.field
        values = st.store.view(self, st)
        if f.ragged or values is None:
            raise SchemaError(
                f"{self.path}: field {name!r} is not a fixed field stored as it is "
                f"(it is {'ragged' if f.ragged else f.codec.describe()}); use read_range() or get()"
            )
        return values.reshape(self.num_samples, *(d for d in f.shape if d is not None))

    def read_range(
        self, name: str, start: int, stop: int, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Copies samples ``start:stop`` of a fixed field into ``out`` (allocated if None),
        on the calling thread: the format layer starts no threads (the runtime's copy
        engine is where batch copies run in parallel)."""
        st = self._st(name)
        f = st.field
        if f.ragged:
            raise SchemaError(f"{self.path}: field {name!r} is ragged; read samples with get()")
        if not 0 <= start <= stop <= self.num_samples:
            raise IndexError(f"{self.path}: range {start}:{stop} outside 0:{self.num_samples}")
        shape = (stop - start, *(d for d in f.shape if d is not None))
        if out is None:
            out = np.empty(shape, f.np_dtype)
        elif out.shape != shape or out.dtype != f.np_dtype:
            raise SchemaError(
                f"{self.path}: out is {out.dtype}{list(out.shape)}, need {f.np_dtype}{list(shape)}"
            )
        st.store.copy_range(self, st, start, stop, out)
        return out

    def values(self, name: str) -> np.ndarray:
        """A raw ragged field's concatenated values, as a zero-copy 1-D view."""
        st = self._st(name)
        values = st.store.view(self, st)
        if not st.field.ragged or values is None:
            raise SchemaError(
                f"{self.path}: field {name!r} is not a ragged field stored as it is "
                f"(it is {'fixed' if not st.field.ragged else st.field.codec.describe()}); "
                "read samples with get()"
            )
        return values

    def offsets(self, name: str) -> np.ndarray:
        """u64 ``[num_samples + 1]`` element offsets of a ragged field."""
        st = self._st(name)
        if st.offsets is None:
            raise SchemaError(f"{self.path}: field {name!r} is not ragged")
        return st.offsets

    def shapes(self, name: str) -> np.ndarray:
        """i64 ``[num_samples, ndim]`` per-sample shapes of a ragged field."""
        st = self._st(name)
        if st.shapes is None:
            raise SchemaError(f"{self.path}: field {name!r} is not ragged")
        return st.shapes

    def copied_tables(self, name: str, copy: MappedCopy) -> tuple[np.ndarray, np.ndarray]:
        """A ragged field's ``offsets`` and ``shapes`` (as those methods give them) read
        through ``copy`` (given each table's mapped bytes as ``uint8``; as
        ``decode_block``'s), each copy's CRC-32 compared with the one the header
        records: a table changed in place since the shard opened (where it was checked
        whole) is ChecksumError here. A reader of the copies still bounds each sample's
        span by the values it lies in (CRC-32 catches accidents, not forgery)."""
        st = self._st(name)
        if st.offsets is None or st.shapes is None:
            raise SchemaError(f"{self.path}: field {name!r} is not ragged")
        tables = []
        for rname, table in (("offsets", st.offsets), ("shapes", st.shapes)):
            got = copy(table.reshape(-1).view(np.uint8))
            region = st.layout.regions[rname]
            if _crc(got) != region.crc32:
                raise ChecksumError(
                    self.path,
                    f"field {name!r} region {rname!r} (bytes {region.offset}..{region.end}): "
                    "CRC-32 mismatch: changed in place since the shard was opened",
                )
            tables.append(got.view(table.dtype).reshape(table.shape))
        return tables[0], tables[1]

    def value_bytes(self, name: str) -> int:
        """Bytes the field's values take uncompressed (its data region when stored as they are)."""
        st = self._st(name)
        return st.store.value_bytes(self, st)

    def region_crc(self, name: str, region: str) -> int:
        """The CRC-32 of one of a field's regions as it is in the file now."""
        st = self._st(name)
        r = st.layout.regions[region]
        return _crc(self._u8[r.offset : r.end])

    def piece_crcs(self, name: str) -> tuple[int, np.ndarray] | None:
        """A raw field's CRC pieces (SPEC.md §4 ``crcs``): the piece size and one CRC-32
        per piece of its data region, checked on open; None when the shard has none."""
        st = self._st(name)
        piece = st.layout.crc_piece_bytes
        return None if piece is None else (piece, self._region(st, "crcs", CRC_DTYPE))

    def block_table(self, name: str) -> np.ndarray:
        """The block table of a block-coded field as ``[num_blocks]`` BLOCK_ROW records,
        columns by name: ``table["raw_length"]`` (SPEC.md §4)."""
        st = self._st(name)
        if st.table is None:
            raise SchemaError(
                f"{self.path}: field {name!r} has no block table (codec {st.field.codec.describe()})"
            )
        return st.table

    def blocks(self, name: str) -> np.ndarray:
        """u64 ``[num_blocks, 5]`` block table of a block-coded field, columns in the order
        of BLOCK_COLUMNS (SPEC.md §4); block_table() names them."""
        return self.block_table(name).view(BLOCK_DTYPE).reshape(-1, len(BLOCK_COLUMNS))

    def block_of(self, name: str, index: int) -> int:
        st = self._st(name)
        if st.first_samples is None:
            raise SchemaError(
                f"{self.path}: field {name!r} has no block table (codec {st.field.codec.describe()})"
            )
        return int(np.searchsorted(st.first_samples, index, side="right")) - 1

    def compressed_block(self, name: str, block: int) -> memoryview:
        """The stored frame bytes of one block, zero-copy."""
        st = self._st(name)
        row = self.block_table(name)[block]
        start = st.layout.regions["data"].offset + int(row["comp_offset"])
        return memoryview(self._mm)[start : start + int(row["comp_length"])]

    def decode_block(
        self, name: str, block: int, *, cached: bool = True, copy: MappedCopy | None = None
    ) -> np.ndarray:
        """One block's values, decompressed and unshuffled: 1-D array of the field's dtype.

        With ``cached`` the result comes from (and goes to) the reader's block
        cache; treat it as read-only. ``copy`` is given the frame's mapped bytes
        (``uint8``) and returns the bytes to decode: a reader that must not touch a
        mapping in place (a file may shrink under it) copies the frame out first.
        """
        st = self._st(name)
        if not cached:
            return self._decode_block(st, block, copy)
        key = (self._token, name, block)
        values = self._cache.get(key)
        if values is None:
            values = self._decode_block(st, block, copy)
            self._cache.put(key, values)
        return values

    def _decode_block(self, st: _FieldState, block: int, copy: MappedCopy | None) -> np.ndarray:
        name, coder, table = st.field.name, st.coder, self.block_table(st.field.name)
        if coder is None:  # a field with a block table always has a block coder
            raise SchemaError(f"{self.path}: field {name!r} has no block coder")
        raw_len = int(table["raw_length"][block])
        frame = self.compressed_block(name, block)
        if copy is not None:
            frame = memoryview(copy(np.frombuffer(frame, np.uint8)).data)
        try:
            u8 = coder.decode(frame, raw_len, st.field.itemsize)
        except FrameError as e:
            raise FormatError(self.path, f"field {name!r} block {block}: {e}") from None
        if u8.nbytes != raw_len:
            raise FormatError(
                self.path,
                f"field {name!r} block {block}: decoded {u8.nbytes} bytes, expected {raw_len}",
            )
        return u8.view(st.field.np_dtype)

    def get(self, name: str, index: int) -> Value:
        """One sample's value: ndarray (a view for raw fields), bytes, or str."""
        st = self._st(name)
        f = st.field
        if not 0 <= index < self.num_samples:
            raise IndexError(f"{self.path}: sample {index} out of range 0..{self.num_samples - 1}")
        if f.ragged:
            assert st.offsets is not None and st.shapes is not None
            lo, hi = int(st.offsets[index]), int(st.offsets[index + 1])
            shape = tuple(int(s) for s in st.shapes[index])
        else:
            count = f.sample_bytes // f.itemsize
            lo, hi = index * count, (index + 1) * count
            shape = tuple(d for d in f.shape if d is not None)
        arr = st.store.span(self, st, index, lo, hi)
        if f.kind == "bytes":
            return arr.tobytes()
        if f.kind == "str":
            try:
                return arr.tobytes().decode("utf-8")
            except UnicodeDecodeError as e:
                raise FormatError(
                    self.path, f"field {name!r} sample {index}: not UTF-8 ({e.reason})"
                ) from None
        return arr.reshape(shape)

    def sample(self, index: int) -> dict[str, Value]:
        return {name: self.get(name, index) for name in self._state}

    # -- verification ---------------------------------------------------------------

    def verify(self) -> list[Problem]:
        """Checks every data region and block checksum and decodes every block."""
        problems: list[Problem] = []
        p = str(self.path)
        for name, st in self._state.items():
            data = st.layout.regions["data"]
            found = st.store.verify(self, st)
            if _crc(self._u8[data.offset : data.end]) != data.crc32:
                found += self._bad_pieces(name) if not found else []
                if not found:
                    found.append(
                        Problem(
                            p,
                            name,
                            None,
                            f"data region (bytes {data.offset}..{data.end}) CRC-32 mismatch",
                        )
                    )
            elif st.field.dtype == "bool" and st.store.bool_bad(self, st):
                found.append(Problem(p, name, None, "bool field holds bytes other than 0 and 1"))
            problems += found
        return problems

    def _bad_pieces(self, name: str) -> list[Problem]:
        """The CRC pieces of a raw field's data that fail their checksum, each named."""
        pieces = self.piece_crcs(name)
        if pieces is None:
            return []
        size, crcs = pieces
        data = self._st(name).layout.regions["data"]
        bad = []
        for i, want in enumerate(crcs.tolist()):
            lo = data.offset + i * size
            hi = min(lo + size, data.end)
            if _crc(self._u8[lo:hi]) != want:
                bad.append(
                    Problem(
                        str(self.path),
                        name,
                        None,
                        f"data bytes {lo}..{hi} (CRC piece {i}): CRC-32 mismatch",
                    )
                )
        return bad

    def part(self, name: str) -> ShardReader:
        """The reader of field ``name`` (a joined shard's: its group's shard, opened)."""
        return self

    def parts(self) -> list[ShardReader]:
        """The mapped files this reader reads (a joined shard's: its groups' too, those
        opened so far), each to be checked for having shrunk under its mapping."""
        return [self]

    def mapped_size(self) -> int:
        """The current size of the mapped file itself (an fstat of the mapping's own
        descriptor): smaller than it was when mapped if the file was truncated in
        place, whatever its path now names."""
        return int(self._mm.size())

    def mapped_span(self) -> tuple[int, int]:
        """(address, bytes) of the mapping; (0, 0) once closed."""
        return (self._u8.ctypes.data, len(self._u8)) if len(self._u8) else (0, 0)

    def file_crc32(self) -> int:
        """CRC-32 of the whole file, as recorded in the archive index."""
        return _crc(self._u8)

    def close(self) -> None:
        """Unmaps the file unless views of it are still alive (they keep it mapped)."""
        mm = getattr(self, "_mm", None)
        if mm is None:
            return
        self._u8 = np.empty(0, np.uint8)
        self._derived = {}
        for st in getattr(self, "_state", {}).values():
            st.offsets = st.shapes = st.table = st.first_samples = None
        # A caller may still hold a view; the mapping then goes when it does.
        with contextlib.suppress(BufferError):
            mm.close()

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Store(Protocol):
    """How a field's values are stored (SPEC.md §4), chosen once per field from its codec."""

    def load(self, r: ShardReader, st: _FieldState) -> None:
        """Loads and checks the storage's own metadata when the shard opens."""

    def view(self, r: ShardReader, st: _FieldState) -> np.ndarray | None:
        """All values as one zero-copy 1-D view, or None when they are not stored as they are."""

    def span(self, r: ShardReader, st: _FieldState, index: int, lo: int, hi: int) -> np.ndarray:
        """Elements ``lo:hi`` of the values: those of sample ``index``, 1-D."""

    def copy_range(
        self, r: ShardReader, st: _FieldState, start: int, stop: int, out: np.ndarray
    ) -> None:
        """Copies samples ``start:stop`` of a fixed field into ``out``."""

    def value_bytes(self, r: ShardReader, st: _FieldState) -> int:
        """Bytes of the values, uncompressed."""

    def verify(self, r: ShardReader, st: _FieldState) -> list[Problem]:
        """Problems with the storage's own checksums and frames."""

    def bool_bad(self, r: ShardReader, st: _FieldState) -> bool:
        """Whether a bool field holds bytes other than 0 and 1 (checked where it is cheap)."""


class _Mapped:
    """Values stored as they are: every read is a slice of the mapping, zero-copy."""

    def load(self, r: ShardReader, st: _FieldState) -> None:
        pass

    def view(self, r: ShardReader, st: _FieldState) -> np.ndarray:
        return r._region(st, "data", st.field.np_dtype)

    def span(self, r: ShardReader, st: _FieldState, index: int, lo: int, hi: int) -> np.ndarray:
        return self.view(r, st)[lo:hi]

    def copy_range(
        self, r: ShardReader, st: _FieldState, start: int, stop: int, out: np.ndarray
    ) -> None:
        values = self.view(r, st).reshape(r.num_samples, *out.shape[1:])
        np.copyto(out, values[start:stop])

    def value_bytes(self, r: ShardReader, st: _FieldState) -> int:
        return st.layout.regions["data"].length

    def verify(self, r: ShardReader, st: _FieldState) -> list[Problem]:
        return []

    def bool_bad(self, r: ShardReader, st: _FieldState) -> bool:
        data = st.layout.regions["data"]
        return bool(np.any(r._u8[data.offset : data.end] > 1))


class _Blocks:
    """Values in blocks of whole samples, one frame each, found through the block table;
    decoded blocks go through the reader's block cache."""

    def load(self, r: ShardReader, st: _FieldState) -> None:
        # copied out of the mapping (it is small): reading a block's place in it never
        # touches the file, whatever happens to the file later
        table = r._region(st, "blocks", BLOCK_DTYPE).view(BLOCK_ROW).copy()
        r._check_blocks(st, table)
        st.table = table
        st.first_samples = table["first_sample"].astype(np.int64)

    def view(self, r: ShardReader, st: _FieldState) -> None:
        return None

    def span(self, r: ShardReader, st: _FieldState, index: int, lo: int, hi: int) -> np.ndarray:
        f, firsts = st.field, st.first_samples
        if firsts is None:
            raise SchemaError(f"{r.path}: the reader is closed; reopen it to read field {f.name!r}")
        k = int(np.searchsorted(firsts, index, side="right")) - 1
        first = int(firsts[k])
        base = (
            int(st.offsets[first])
            if st.offsets is not None
            else first * (f.sample_bytes // f.itemsize)
        )
        return r.decode_block(f.name, k)[lo - base : hi - base]

    def copy_range(
        self, r: ShardReader, st: _FieldState, start: int, stop: int, out: np.ndarray
    ) -> None:
        # Whole blocks, each decoded once, sliced to their overlap with start:stop.
        name = st.field.name
        firsts = r.block_table(name)["first_sample"]
        k = r.block_of(name, start) if stop > start else len(firsts)
        while k < len(firsts) and int(firsts[k]) < stop:
            first = int(firsts[k])
            last = int(firsts[k + 1]) if k + 1 < len(firsts) else r.num_samples
            a, b = max(start, first), min(stop, last)
            block = r.decode_block(name, k).reshape(-1, *out.shape[1:])
            out[a - start : b - start] = block[a - first : b - first]
            k += 1

    def value_bytes(self, r: ShardReader, st: _FieldState) -> int:
        return int(r.block_table(st.field.name)["raw_length"].sum())

    def verify(self, r: ShardReader, st: _FieldState) -> list[Problem]:
        p, name, problems = str(r.path), st.field.name, []
        for k, crc in enumerate(r.block_table(name)["crc32"].tolist()):
            if _crc(r.compressed_block(name, k)) != crc:
                problems.append(Problem(p, name, k, "block CRC-32 mismatch"))
                continue
            try:
                r._decode_block(st, k, None)
            except FormatError as e:
                problems.append(Problem(p, name, k, e.problem))
        return problems

    def bool_bad(self, r: ShardReader, st: _FieldState) -> bool:
        return False  # values are checked as blocks decode, not all at once here


_MAPPED = _Mapped()
_BLOCKS = _Blocks()


def _crc(buf: np.ndarray | memoryview) -> int:
    """CRC-32 of a buffer, in chunks (each without the GIL)."""
    mv = (
        memoryview(buf).cast("B") if isinstance(buf, memoryview) else np.ascontiguousarray(buf).data
    )
    crc = 0
    for start in range(0, len(mv), _CRC_CHUNK):
        crc = crc32(mv[start : start + _CRC_CHUNK], crc)
    return crc

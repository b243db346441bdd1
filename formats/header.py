"""Shard preamble and JSON header: encoding, and validation before any data is read.

Everything here works on the header alone (SPEC.md §2-§4); nothing touches a
data region.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .constants import (
    ALIGNMENT,
    BLOCK_ROW_BYTES,
    CHECKSUM_NAME,
    CRC_DTYPE,
    FORMAT_VERSION,
    MAGIC,
    MAX_CRC_PIECE_BYTES,
    MAX_FIELD_BYTES,
    MAX_HEADER_BYTES,
    MAX_SHARD_SAMPLES,
    MIN_CRC_PIECE_BYTES,
    PREAMBLE,
    SHARD_FORMAT,
    SUPPORTED_VERSIONS,
    unsupported_version,
)
from .errors import ChecksumError, FormatError, SchemaError
from .files import loads_bounded
from .schema import Field


@dataclass(frozen=True)
class Region:
    offset: int
    length: int
    crc32: int

    @property
    def end(self) -> int:
        return self.offset + self.length

    def to_json(self) -> dict[str, int]:
        return {"offset": self.offset, "length": self.length, "crc32": self.crc32}


@dataclass(frozen=True)
class FieldLayout:
    field: Field
    regions: dict[str, Region]
    value_count: int | None = None  # ragged fields
    num_blocks: int | None = None  # block-coded fields
    crc_piece_bytes: int | None = None  # raw fields with a ``crcs`` region

    def to_json(self) -> dict[str, Any]:
        out = self.field.to_json()
        out["regions"] = {k: r.to_json() for k, r in self.regions.items()}
        if self.value_count is not None:
            out["value_count"] = self.value_count
        if self.num_blocks is not None:
            out["num_blocks"] = self.num_blocks
        if self.crc_piece_bytes is not None:
            out["crc_piece_bytes"] = self.crc_piece_bytes
        return out

    def pieces(self) -> int:
        """How many CRC pieces the data region is cut into (0 without a ``crcs`` region)."""
        if self.crc_piece_bytes is None:
            return 0
        return -(-self.regions["data"].length // self.crc_piece_bytes)


@dataclass(frozen=True)
class ShardLayout:
    num_samples: int
    file_bytes: int
    header_end: int
    fields: tuple[FieldLayout, ...]


def align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def required_regions(f: Field) -> tuple[str, ...]:
    """Region names of a field, in file order (SPEC.md §4)."""
    names: list[str] = []
    if f.ragged:
        names += ["shapes", "offsets"]
    names += f.codec.regions
    return tuple(names)


def has_pieces(f: Field) -> bool:
    """Whether a field's data may carry a CRC per piece (SPEC.md §4: values stored as
    they are)."""
    return f.codec.regions == ("data",)


def encode_header(num_samples: int, file_bytes: int, fields: Sequence[FieldLayout]) -> bytes:
    """Preamble plus JSON, unpadded."""
    body = json.dumps(
        {
            "format": SHARD_FORMAT,
            "version": FORMAT_VERSION,
            "num_samples": num_samples,
            "file_bytes": file_bytes,
            "checksum": CHECKSUM_NAME,
            "fields": [fl.to_json() for fl in fields],
        },
        separators=(",", ":"),
        ensure_ascii=True,
    ).encode()
    return PREAMBLE.pack(MAGIC, FORMAT_VERSION, zlib.crc32(body), len(body)) + body


def header_end_for(body_len: int) -> int:
    return align(PREAMBLE.size + body_len)


def read_preamble(path: object, head: bytes, file_size: int) -> tuple[int, int]:
    """Returns (header length, header CRC) after checking magic, version and bounds."""
    if len(head) < PREAMBLE.size:
        raise FormatError(
            path, f"truncated: {file_size} bytes is shorter than the {PREAMBLE.size}-byte preamble"
        )
    magic, version, crc, hlen = PREAMBLE.unpack_from(head)
    if magic != MAGIC:
        raise FormatError(path, f"not a dlop shard: magic {magic!r} at byte 0, expected {MAGIC!r}")
    if version not in SUPPORTED_VERSIONS:
        raise FormatError(path, unsupported_version(version, "format") + " (byte 8)")
    if hlen > MAX_HEADER_BYTES:
        raise FormatError(
            path, f"header length {hlen} at byte 16 exceeds the {MAX_HEADER_BYTES}-byte cap"
        )
    if PREAMBLE.size + hlen > file_size:
        raise FormatError(
            path,
            f"truncated: header of {hlen} bytes runs past the end of the {file_size}-byte file",
        )
    return int(hlen), int(crc)


def parse_header(path: object, body: bytes, crc: int, file_size: int) -> ShardLayout:
    """Validates the JSON header against SPEC.md §3-§4 and the real file size."""
    if zlib.crc32(body) != crc:
        raise ChecksumError(path, "header CRC-32 mismatch (bytes 24..): the header is corrupt")
    obj = loads_bounded(path, body, "header")
    if not isinstance(obj, dict):
        raise FormatError(path, "header JSON is not an object")
    _expect(path, obj, "format", SHARD_FORMAT)
    _expect(path, obj, "version", FORMAT_VERSION)
    _expect(path, obj, "checksum", CHECKSUM_NAME)
    n = _int(path, obj, "num_samples", "header")
    if n > MAX_SHARD_SAMPLES:
        raise FormatError(
            path, f"header num_samples {n} exceeds the {MAX_SHARD_SAMPLES}-sample shard limit"
        )
    file_bytes = _int(path, obj, "file_bytes", "header")
    if file_bytes != file_size:
        raise FormatError(
            path,
            f"truncated or padded: header says {file_bytes} bytes, the file has {file_size}",
        )
    raw_fields = obj.get("fields")
    if not isinstance(raw_fields, list):
        raise FormatError(path, "header key 'fields' should be a list")
    header_end = header_end_for(len(body))
    layouts: list[FieldLayout] = []
    names: set[str] = set()
    spans: list[tuple[int, int, str]] = []
    for i, fobj in enumerate(raw_fields):
        try:
            fdef = Field.from_json(fobj, f"field #{i}")
        except SchemaError as e:
            raise FormatError(path, str(e)) from None
        if not fdef.ragged and n * fdef.footprint_bytes > MAX_FIELD_BYTES:
            raise FormatError(
                path,
                f"field {fdef.name!r}: {n} samples of shape {list(fdef.shape)} exceed the "
                f"{MAX_FIELD_BYTES}-byte field limit (zero dimensions count as 1)",
            )
        if fdef.name in names:
            raise FormatError(path, f"field name {fdef.name!r} appears twice")
        names.add(fdef.name)
        fl = _field_layout(path, fdef, fobj, n, file_size)
        layouts.append(fl)
        spans += [(r.offset, r.end, f"{fdef.name}.{k}") for k, r in fl.regions.items() if r.length]
    spans.sort()
    prev_end, prev_name = header_end, "header"
    for start, end, name in spans:
        if start < prev_end:
            raise FormatError(
                path, f"region {name} at byte {start} overlaps {prev_name} (ends at {prev_end})"
            )
        prev_end, prev_name = end, name
    return ShardLayout(n, file_bytes, header_end, tuple(layouts))


def _field_layout(
    path: object, f: Field, obj: dict[str, Any], n: int, file_size: int
) -> FieldLayout:
    where = f"field {f.name!r}"
    robj = obj.get("regions")
    if not isinstance(robj, dict):
        raise FormatError(path, f"{where}: 'regions' should be an object")
    regions: dict[str, Region] = {}
    for rname in required_regions(f):
        r = robj.get(rname)
        if not isinstance(r, dict):
            raise FormatError(path, f"{where}: region {rname!r} is missing")
        regions[rname] = _region(path, f"{where} region {rname!r}", r, file_size)
    piece = None
    if has_pieces(f) and ("crcs" in robj or "crc_piece_bytes" in obj):
        r = robj.get("crcs")
        if not isinstance(r, dict) or "crc_piece_bytes" not in obj:
            raise FormatError(
                path, f"{where}: region 'crcs' and key 'crc_piece_bytes' come together"
            )
        piece = _int(path, obj, "crc_piece_bytes", where)
        if not MIN_CRC_PIECE_BYTES <= piece <= MAX_CRC_PIECE_BYTES:
            raise FormatError(
                path,
                f"{where}: crc_piece_bytes {piece} is outside "
                f"{MIN_CRC_PIECE_BYTES}..{MAX_CRC_PIECE_BYTES}",
            )
        regions["crcs"] = _region(path, f"{where} region 'crcs'", r, file_size)
    value_count = num_blocks = None
    if f.ragged:
        value_count = _int(path, obj, "value_count", where)
        _expect_len(path, where, "shapes", regions["shapes"], n * f.ndim * 8)
        _expect_len(path, where, "offsets", regions["offsets"], (n + 1) * 8)
    if "blocks" in regions:
        num_blocks = _int(path, obj, "num_blocks", where)
        if (num_blocks == 0) != (n == 0) or num_blocks > n:
            raise FormatError(path, f"{where}: {num_blocks} blocks for {n} samples")
        _expect_len(path, where, "blocks", regions["blocks"], num_blocks * BLOCK_ROW_BYTES)
    else:
        total = (
            value_count if value_count is not None else n * f.sample_bytes // f.itemsize
        ) * f.itemsize
        _expect_len(path, where, "data", regions["data"], total)
    layout = FieldLayout(f, regions, value_count, num_blocks, piece)
    if piece is not None:
        _expect_len(path, where, "crcs", regions["crcs"], layout.pieces() * CRC_DTYPE.itemsize)
    return layout


def _region(path: object, rw: str, r: dict[str, Any], file_size: int) -> Region:
    """A region entry checked against the file: aligned, inside it, a 32-bit CRC."""
    region = Region(
        _int(path, r, "offset", rw), _int(path, r, "length", rw), _int(path, r, "crc32", rw)
    )
    if region.offset % ALIGNMENT:
        raise FormatError(path, f"{rw}: offset {region.offset} is not a multiple of {ALIGNMENT}")
    if region.end > file_size:
        raise FormatError(
            path,
            f"{rw}: bytes {region.offset}..{region.end} run past the end of the {file_size}-byte file",
        )
    if region.crc32 > 0xFFFFFFFF:
        raise FormatError(path, f"{rw}: crc32 {region.crc32} does not fit 32 bits")
    return region


def _expect_len(path: object, where: str, rname: str, region: Region, want: int) -> None:
    if region.length != want:
        raise FormatError(
            path, f"{where} region {rname!r}: length {region.length}, expected {want}"
        )


def _expect(path: object, obj: dict[str, Any], key: str, want: object) -> None:
    got = obj.get(key)
    if got != want or isinstance(got, bool):
        if key == "version":
            raise FormatError(
                path, f"header version {got!r} is not supported (reads {SUPPORTED_VERSIONS})"
            )
        raise FormatError(path, f"header {key!r} is {got!r}, expected {want!r}")


def _int(path: object, obj: dict[str, Any], key: str, where: str) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v >= 1 << 64:
        raise FormatError(
            path, f"{where}: {key!r} should be a non-negative 64-bit integer, got {v!r}"
        )
    return v

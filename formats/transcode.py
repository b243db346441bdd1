"""Block-coded shards rewritten with every field raw (SPEC.md §4), so that a copy kept
in a local cache is memory-mapped and read zero-copy instead of decoding a block
per sample. Pure: reads one shard file, writes another, starts no threads.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .codecs import Raw
from .constants import CRC_DTYPE, CRC_PIECE_BYTES, PREAMBLE
from .errors import FormatError
from .header import align, header_end_for, parse_header, read_preamble, required_regions
from .reader import BlockCache, ShardReader
from .schema import Field
from .writer import ShardInfo, ShardWriter


def raw_fields(fields: Sequence[Field]) -> tuple[Field, ...]:
    """``fields`` with every codec replaced by raw (names, kinds, shapes kept)."""
    return tuple(f if f.codec.mappable else dataclasses.replace(f, codec=Raw()) for f in fields)


def needs_transcode(fields: Sequence[Field]) -> bool:
    """Whether any field is block-coded (its values are not stored as they are)."""
    return any(not f.codec.mappable for f in fields)


def transcode_raw(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> ShardInfo:
    """Writes shard ``src`` to ``dst`` with every field raw; same samples, same order.

    Each block is decoded once (blocks are read in order through a cache of a
    few blocks). ``dst`` is written through ShardWriter (a temporary name, then
    renamed into place).
    """
    with ShardReader(src, block_cache=BlockCache(8 << 20)) as reader:
        fields = raw_fields(tuple(reader.fields.values()))
        with ShardWriter(Path(dst), fields) as writer:
            for i in range(reader.num_samples):
                writer.write(reader.sample(i))
            info = writer.close()
    return info


def transcode_bytes(data: bytes, name: str = "shard") -> bytes:
    """``transcode_raw`` of the shard file ``data``, through two scratch files (named
    after ``name``) in the temporary folder (``TMPDIR``), removed after."""
    with tempfile.TemporaryDirectory(prefix=f"dlop-{name}-") as scratch:
        src, dst = Path(scratch) / "coded", Path(scratch) / "raw"
        src.write_bytes(data)
        transcode_raw(src, dst)
        return dst.read_bytes()


# A number in a header is at most 20 digits: the raw header, with the same fields, may
# outgrow the block-coded one by this much per region entry (offset, length, crc32).
HEADER_GROWTH_PER_REGION = 64


def header_span(head: bytes, path: object, file_size: int) -> int:
    """Bytes from the start of a shard of ``file_size`` bytes through its JSON header,
    read from its first bytes ``head`` (at least the preamble)."""
    hlen, _ = read_preamble(path, head, file_size)
    return PREAMBLE.size + hlen


def raw_size_bound(head: bytes, path: object, file_size: int) -> int:
    """At least the bytes ``transcode_raw`` writes for the shard whose first bytes are
    ``head`` (preamble and whole header, ``header_span`` bytes), from the header's
    declared sizes (SPEC.md §4): a fixed field's data is ``num_samples * prod(shape) *
    itemsize`` raw, a ragged one's ``value_count * itemsize``, with a ``crcs`` region
    when longer than one CRC piece; each region and the header start on a 4096-byte
    boundary."""
    hlen, crc = read_preamble(path, head, file_size)
    if len(head) < PREAMBLE.size + hlen:
        raise FormatError(
            path, f"need the first {PREAMBLE.size + hlen} bytes for the header, got {len(head)}"
        )
    layout = parse_header(path, head[PREAMBLE.size : PREAMBLE.size + hlen], crc, file_size)
    body = regions = 0
    for fl in layout.fields:
        f = fl.field
        for name in required_regions(raw_fields((f,))[0]):
            if name != "data":
                length = fl.regions[name].length
            elif f.ragged:
                length = (fl.value_count or 0) * f.itemsize
            else:
                length = layout.num_samples * f.sample_bytes
            body += align(length)
            regions += 1
            if name == "data" and length > CRC_PIECE_BYTES:  # its crcs region and key
                body += align(-(-length // CRC_PIECE_BYTES) * CRC_DTYPE.itemsize)
                regions += 2
    return header_end_for(hlen + HEADER_GROWTH_PER_REGION * (regions + 1)) + body

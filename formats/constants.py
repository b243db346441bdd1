"""Every on-disk constant of format v1 (SPEC.md §2-§6), in one place."""

import struct

import numpy as np

MAGIC = b"DLOPSHRD"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)


def unsupported_version(version: object, what: str) -> str:
    """Why a ``what`` of format ``version`` is not read, and what to do about it."""
    newer = isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION
    advice = (
        "it was written by a newer dlop: upgrade dlop (pip install -U dlop) to read it"
        if newer
        else "it is damaged or not a dlop archive's"
    )
    return (
        f"{what} version {version!r} is not supported (this dlop reads {SUPPORTED_VERSIONS}); "
        + advice
    )


# magic, version, header CRC-32, header length (SPEC.md §2)
PREAMBLE = struct.Struct("<8sIIQ")
ALIGNMENT = 4096

# Bounds every reader enforces and every writer respects (SPEC.md §8).
MAX_HEADER_BYTES = 64 << 20
# An archive holds at most MAX_SHARDS shards. A shard entry as the writer writes it
# (shard-NNNNNN.dlop, the largest counts and header_crc32) takes at most 164 bytes: 21 MiB
# for all entries, leaving 11 MiB of the index for schema, recipe, provenance and metadata.
MAX_SHARDS = 1 << 17
# Work units an index lists (SPEC.md §6.1): two counts each, at most 16 bytes and 2 values.
MAX_UNITS = 1 << 17
MAX_INDEX_BYTES = 32 << 20
# JSON text of the header, index.json and one errors.jsonl record: nesting depth,
# values and keys (a shard entry is 11), characters of one number token. The value
# bound covers MAX_SHARDS entries with room to spare and caps a parse to a few hundred MB.
MAX_JSON_DEPTH = 64
MAX_JSON_VALUES = 1 << 21
MAX_JSON_NUMBER_CHARS = 32
# errors.jsonl: one flat JSON object per line (string keys, scalar values), no more
# lines than the index's skipped count.
MAX_ERRORS_BYTES = 256 << 20
MAX_ERRORS_RECORDS = 1 << 20
MAX_ERROR_RECORD_BYTES = 64 << 10
MAX_ERROR_RECORD_KEYS = 16
MAX_SHARD_SAMPLES = 1 << 40
MAX_ARCHIVE_SAMPLES = 1 << 48
MAX_NDIM = 32
MAX_DIM = (1 << 31) - 1
MAX_SAMPLE_BYTES = 1 << 40
# num_samples x a fixed field's footprint (zero dimensions counted as 1) x itemsize:
# what numpy must be able to describe as one array.
MAX_FIELD_BYTES = 1 << 62
MAX_BLOCK_RAW_BYTES = 1 << 31
# Raw data regions longer than a piece carry a CRC-32 per piece (SPEC.md §4, region
# ``crcs``), so a reader can trust part of a region before all of it has arrived.
CRC_PIECE_BYTES = 1 << 20
MIN_CRC_PIECE_BYTES = 4096
MAX_CRC_PIECE_BYTES = 1 << 31
CRC_DTYPE = np.dtype("<u4")
# A Zstandard block regenerates at most 128 KiB and takes at least 4 bytes (an RLE
# block: 3-byte header, 1 byte), so no frame decodes to more than this many times its size.
ZSTD_MAX_RATIO = 32768

SHARD_FORMAT = "dlop-shard"
ARCHIVE_FORMAT = "dlop-archive"
CHECKSUM_NAME = "crc32"

INDEX_NAME = "index.json"
ERRORS_NAME = "errors.jsonl"
# What a compile in progress keeps in OUT: its journal, and a lock held for the whole compile
# (holding "pid N on HOST"); an OUT with the journal and no index.json is still compiling
# or was interrupted.
JOURNAL_NAME = ".dlop-progress.json"
LOCK_NAME = ".dlop-lock"
SHARD_SUFFIX = ".dlop"

# Dtype codes (SPEC.md §3.1). bf16 is carried as its uint16 bit pattern.
DTYPES: dict[str, np.dtype] = {
    "u8": np.dtype("<u1"),
    "u16": np.dtype("<u2"),
    "u32": np.dtype("<u4"),
    "u64": np.dtype("<u8"),
    "i8": np.dtype("<i1"),
    "i16": np.dtype("<i2"),
    "i32": np.dtype("<i4"),
    "i64": np.dtype("<i8"),
    "f16": np.dtype("<f2"),
    "bf16": np.dtype("<u2"),
    "f32": np.dtype("<f4"),
    "f64": np.dtype("<f8"),
    "bool": np.dtype("?"),
}

KINDS = ("array", "bytes", "str")

# Block table (SPEC.md §4): one row of these u64 columns per block of a block-coded
# field: compressed offset within `data`, compressed length, first sample,
# uncompressed length, CRC-32 of the compressed bytes. Code names a column through
# BLOCK_ROW (``table["raw_length"]``), never by its position.
BLOCK_COLUMNS = ("comp_offset", "comp_length", "first_sample", "raw_length", "crc32")
BLOCK_DTYPE = np.dtype("<u8")
BLOCK_ROW = np.dtype([(column, BLOCK_DTYPE) for column in BLOCK_COLUMNS])
BLOCK_ROW_BYTES = BLOCK_ROW.itemsize
OFFSET_DTYPE = np.dtype("<u8")
SHAPE_DTYPE = np.dtype("<i8")

DEFAULT_BLOCK_BYTES = 256 << 10
DEFAULT_ZSTD_LEVEL = 3
MAX_NAME_CHARS = 128

"""The dlop tensor-archive format (SPEC.md): fields, codecs, shard and archive I/O.

Standard library, numpy and zstandard only.
"""

from .archive import (
    ArchiveReader,
    ArchiveWriter,
    Index,
    encode_index,
    parse_index,
    read_index,
    read_index_data,
    shard_name,
    write_index,
)
from .codecs import Codec, Raw, Zstd, codec_from_json, parse_codec
from .constants import ALIGNMENT, ERRORS_NAME, FORMAT_VERSION, INDEX_NAME
from .errors import ChecksumError, DlopError, FormatError, SchemaError, StorageError
from .reader import BlockCache, Problem, ShardReader
from .schema import Field
from .units import UnitTable, num_units, unit_shard_name
from .writer import ShardInfo, ShardWriter

__all__ = [
    "ALIGNMENT",
    "ERRORS_NAME",
    "FORMAT_VERSION",
    "INDEX_NAME",
    "ArchiveReader",
    "ArchiveWriter",
    "BlockCache",
    "ChecksumError",
    "Codec",
    "DlopError",
    "Field",
    "FormatError",
    "Index",
    "Problem",
    "Raw",
    "SchemaError",
    "ShardInfo",
    "ShardReader",
    "ShardWriter",
    "StorageError",
    "UnitTable",
    "Zstd",
    "codec_from_json",
    "encode_index",
    "num_units",
    "parse_codec",
    "parse_index",
    "read_index",
    "read_index_data",
    "shard_name",
    "unit_shard_name",
    "write_index",
]

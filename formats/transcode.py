"""Block-coded shards rewritten with every field raw (SPEC.md §4), so that a copy kept
in a local cache is memory-mapped and read zero-copy instead of decoding a block
per sample. Pure: reads one shard file, writes another, starts no threads.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from .codecs import Raw
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

"""One archive shard read with its field groups' shards as one (SPEC.md §6.3).

``JoinedShard`` answers for every field of the shard and of its groups, each field from
the file that holds it. A group's shard file is opened (and checked against the index)
the first time one of its fields is read, so reading the archive's own fields never
opens a group's files.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .errors import SchemaError
from .header import FieldLayout
from .reader import MappedCopy, Problem, ShardReader, Value


class JoinedShard(ShardReader):
    """Shard ``base`` with the fields of its groups: ``owners`` maps each group field to
    its group's name, and ``open_part(name)`` opens that group's shard aligned with this
    one. Whole-file answers (path, size, mapping, CRC) are the base shard's."""

    def __init__(
        self,
        base: ShardReader,
        group_fields: Mapping[str, Any],
        owners: Mapping[str, str],
        open_part: Callable[[str], ShardReader],
    ) -> None:
        # not ShardReader.__init__: this reader maps no file of its own
        self.base = base
        self.path = base.path
        self.layout = base.layout
        self.header_crc32 = base.header_crc32
        self.num_samples = base.num_samples
        self.fields = {**base.fields, **group_fields}
        self._owners = dict(owners)
        self._open_part = open_part
        self._parts: dict[str, ShardReader] = {}
        self._lock = threading.Lock()
        self._derived = {}

    def part(self, name: str) -> ShardReader:
        """The reader of field ``name``: the base shard, or its group's shard."""
        group = self._owners.get(name)
        if group is None:
            if name not in self.base.fields:
                raise SchemaError(f"{self.path}: no field {name!r} (fields: {sorted(self.fields)})")
            return self.base
        part = self._parts.get(group)
        if part is None:
            with self._lock:
                part = self._parts.get(group)
                if part is None:
                    part = self._parts[group] = self._open_part(group)
        return part

    def field_path(self, name: str) -> Path:
        return self.part(name).path

    def parts(self) -> list[ShardReader]:
        with self._lock:
            return [self.base, *self._parts.values()]

    def layout_of(self, name: str) -> FieldLayout:
        return self.part(name).layout_of(name)

    def array(self, name: str) -> np.ndarray:
        return self.part(name).array(name)

    def read_range(
        self, name: str, start: int, stop: int, out: np.ndarray | None = None
    ) -> np.ndarray:
        return self.part(name).read_range(name, start, stop, out)

    def values(self, name: str) -> np.ndarray:
        return self.part(name).values(name)

    def offsets(self, name: str) -> np.ndarray:
        return self.part(name).offsets(name)

    def shapes(self, name: str) -> np.ndarray:
        return self.part(name).shapes(name)

    def value_bytes(self, name: str) -> int:
        return self.part(name).value_bytes(name)

    def region_crc(self, name: str, region: str) -> int:
        return self.part(name).region_crc(name, region)

    def piece_crcs(self, name: str) -> tuple[int, np.ndarray] | None:
        return self.part(name).piece_crcs(name)

    def block_table(self, name: str) -> np.ndarray:
        return self.part(name).block_table(name)

    def block_of(self, name: str, index: int) -> int:
        return self.part(name).block_of(name, index)

    def compressed_block(self, name: str, block: int) -> memoryview:
        return self.part(name).compressed_block(name, block)

    def copied_tables(self, name: str, copy: MappedCopy) -> tuple[np.ndarray, np.ndarray]:
        return self.part(name).copied_tables(name, copy)

    def decode_block(
        self, name: str, block: int, *, cached: bool = True, copy: MappedCopy | None = None
    ) -> np.ndarray:
        return self.part(name).decode_block(name, block, cached=cached, copy=copy)

    def get(self, name: str, index: int) -> Value:
        return self.part(name).get(name, index)

    def sample(self, index: int) -> dict[str, Value]:
        return {name: self.get(name, index) for name in self.fields}

    def verify(self) -> list[Problem]:
        return [p for part in self.parts() for p in part.verify()]

    def mapped_size(self) -> int:
        return self.base.mapped_size()

    def mapped_span(self) -> tuple[int, int]:
        return self.base.mapped_span()

    def file_crc32(self) -> int:
        return self.base.file_crc32()

    def close(self) -> None:
        self._derived = {}
        for part in self.parts():
            part.close()
        with self._lock:
            self._parts.clear()

"""Field groups of an archive (SPEC.md §6.3): fields added after its compile.

A field group holds fields computed from an archive's samples, in shard files of its
own aligned one to one with the archive's shards: group shard k holds, for each sample
of shard k in order, the group's fields. Its index entry records every group shard
(size, CRC-32, header CRC-32) and the whole-file CRC-32 of the shard it was computed
from, so a group shard is only ever read beside the shard it belongs to. The archive's
own shards are never rewritten: adding, compiling again or dropping a group publishes a
new index.json, and readers that predate field groups ignore them.

A group covers the archive's first ``len(group.shards)`` shards; after an append it
covers the earlier generations only, and its fields are read once it is compiled again
to cover the new shards.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import FormatError, SchemaError
from .schema import Field, check_schema
from .units import is_count
from .writer import ShardInfo

MAX_FIELD_GROUPS = 64
MAX_REVISION = (1 << 31) - 1
GROUP_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


def group_file(name: str, revision: int, shard: int) -> str:
    """The file of group ``name``'s shard aligned with the archive's shard ``shard``, as
    compiled the ``revision``-th time (a group compiled again writes new files, so a reader
    of the earlier index reads the earlier ones to its end)."""
    return f"group-{name}-r{revision}-{shard:06d}.dlop"


def check_group_name(name: object) -> str:
    """``name`` when it can name a field group, else SchemaError saying what it may be."""
    if not isinstance(name, str) or not GROUP_NAME.fullmatch(name):
        raise SchemaError(
            f"field group name {name!r:.60}: 1 to 32 characters, lowercase letters, digits "
            "and _, starting with a letter"
        )
    return name


@dataclass(frozen=True)
class GroupShard:
    """One group shard: the file's index entry and the whole-file CRC-32 of the archive
    shard it was computed from (``base_crc32``)."""

    info: ShardInfo
    base_crc32: int

    def to_json(self) -> dict[str, Any]:
        return {**self.info.to_json(), "base_crc32": self.base_crc32}


@dataclass(frozen=True)
class FieldGroup:
    """One entry of the index's ``field_groups``."""

    name: str
    revision: int
    fields: tuple[Field, ...]
    shards: tuple[GroupShard, ...]  # aligned with the archive's first len(shards) shards
    recipe: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def covers(self) -> int:
        """How many of the archive's shards (its first ones) this group covers."""
        return len(self.shards)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "revision": self.revision,
            "schema": [f.to_json() for f in self.fields],
            "shards": [s.to_json() for s in self.shards],
            "recipe": self.recipe,
            "provenance": self.provenance,
        }


def parse_field_groups(
    path: object,
    obj: object,
    fields: Sequence[Field],
    shards: Sequence[ShardInfo],
) -> tuple[FieldGroup, ...]:
    """An index's ``field_groups`` checked against its schema (every field name distinct
    across the archive and its groups) and its shard list (each group shard aligned with
    the archive shard of its position: its sample count, and the CRC-32 of that shard)."""

    def bad(problem: str) -> FormatError:
        return FormatError(path, f"'field_groups' {problem} (SPEC.md §6.3)")

    if not isinstance(obj, list) or len(obj) > MAX_FIELD_GROUPS:
        got = f"{len(obj)} entries" if isinstance(obj, list) else type(obj).__name__
        raise bad(f"is {got}; expected a list of at most {MAX_FIELD_GROUPS} groups")
    out: list[FieldGroup] = []
    names: set[str] = set()
    files = {s.file for s in shards}
    every = list(fields)
    for g, entry in enumerate(obj):
        where = f"entry #{g}"
        if not isinstance(entry, dict):
            raise bad(f"{where} is not an object")
        name = entry.get("name")
        try:
            check_group_name(name)
        except SchemaError as e:
            raise bad(f"{where}: {e}") from None
        assert isinstance(name, str)
        where = f"group {name!r}"
        if name in names:
            raise bad(f"{where} is listed twice")
        names.add(name)
        revision = entry.get("revision")
        if not is_count(revision, MAX_REVISION):
            raise bad(f"{where}: 'revision' is {revision!r:.40}, expected 0 ... {MAX_REVISION}")
        schema, listed = entry.get("schema"), entry.get("shards")
        if not isinstance(schema, list) or not schema or not isinstance(listed, list):
            raise bad(f"{where}: 'schema' must be a list of fields and 'shards' a list")
        try:
            own = tuple(
                Field.from_json(f, f"{where} schema entry #{i}") for i, f in enumerate(schema)
            )
            check_schema(own)
            check_schema(every + list(own))
        except SchemaError as e:
            raise bad(f"{where}: {e}") from None
        every += own
        if len(listed) > len(shards):
            raise bad(f"{where} lists {len(listed)} shards; the archive has {len(shards)}")
        mine = []
        for k, s in enumerate(listed):
            file = s.get("file") if isinstance(s, dict) else None
            if not isinstance(s, dict) or file != group_file(name, revision, k):
                raise bad(
                    f"{where} shard #{k}: expected an entry for file "
                    f"{group_file(name, revision, k)!r}, got {s!r:.120}"
                )
            try:
                info = ShardInfo.from_json(file, s)
            except ValueError as e:
                raise bad(f"{where} shard #{k} ({file}): {e}") from None
            base = s.get("base_crc32")
            if info.header_crc32 is None or not is_count(base, 0xFFFFFFFF):
                raise bad(f"{where} shard #{k} ({file}): needs 'header_crc32' and 'base_crc32'")
            if info.num_samples != shards[k].num_samples or base != shards[k].crc32:
                raise bad(
                    f"{where} shard #{k} ({file}) is not aligned with the archive's shard "
                    f"{shards[k].file}: it holds {info.num_samples} samples computed from a "
                    f"shard of CRC-32 {base:#010x}; {shards[k].file} holds "
                    f"{shards[k].num_samples} samples, CRC-32 {shards[k].crc32:#010x}"
                )
            if file in files:
                raise bad(f"{where} shard #{k}: file {file} is listed twice")
            files.add(file)
            mine.append(GroupShard(info, base))
        dicts = [entry.get(k, {}) for k in ("recipe", "provenance")]
        if not all(isinstance(d, dict) for d in dicts):
            raise bad(f"{where}: 'recipe' and 'provenance' must be objects")
        out.append(FieldGroup(name, revision, own, tuple(mine), dicts[0], dicts[1]))
    return tuple(out)


def field_owner(groups: Sequence[FieldGroup], name: str) -> FieldGroup | None:
    """The group holding field ``name``, or None."""
    for group in groups:
        if any(f.name == name for f in group.fields):
            return group
    return None

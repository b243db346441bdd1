"""Field groups: fields computed from an archive's samples and stored beside its shards
(``add_fields``), compiled again or dropped (``drop_fields``) without touching the
archive's own files. ``shard`` is one unit's work, ``adding`` drives the compile."""

from .adding import add_fields, drop_fields

__all__ = ["add_fields", "drop_fields"]

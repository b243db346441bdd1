"""A work unit's commit record: what the unit wrote (its shards, its skipped inputs, who
ran it), published into OUT after its shards as ``.dlop-unit-000003.json``. A unit counts
as done only when its record exists, parses as this compile's record of that unit
(parse_record), and every shard it names is in OUT under that name (shards_in_place:
with the recorded size, and locally the recorded CRC-32); a unit without one is compiled
again. The client merges the records in unit order into the index (merge.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlop.formats import FormatError, ShardInfo, unit_shard_name
from dlop.formats.crc import crc32
from dlop.formats.files import loads_bounded
from dlop.formats.skipped import encode_record
from dlop.formats.units import is_count

from .store import LocalStore, Store

COMMIT_PREFIX = ".dlop-unit-"


def commit_name(unit: int) -> str:
    return f"{COMMIT_PREFIX}{unit:06d}.json"


@dataclass(frozen=True)
class UnitRecord:
    """What a committed unit wrote: its shards and skipped inputs (and who ran it)."""

    unit: int
    first_input: int
    num_inputs: int
    shards: tuple[ShardInfo, ...] = ()
    skipped: tuple[dict[str, Any], ...] = ()
    failure: str | None = None  # the bad input that stopped an --on-error fail compile
    # with a failure: the (field, axis) an input showed to vary, which the compile's schema
    # held fixed (a compile of one's own Dataset starts again with that axis ragged)
    widen: tuple[str, int] | None = None
    worker: str = ""
    peak_rss: int = 0  # bytes: the worker process's peak resident set so far
    # sha256 of the inputs' sizes as the unit started (input_sizes), when the corpus's
    # fingerprint leaves them out (Corpus.unit_sizes); "" otherwise
    input_sizes: str = ""
    # (input, sample_digest of what it wrote) for a few inputs spread over the unit: a
    # resume of a user's code computes some again and compares (compiler.custom)
    witnesses: tuple[tuple[int, str], ...] = ()

    def to_json(self, digest: str) -> dict[str, Any]:
        return {
            "recipe_digest": digest,
            "unit": self.unit,
            "first_input": self.first_input,
            "num_inputs": self.num_inputs,
            "shards": [s.to_json() for s in self.shards],
            "skipped": list(self.skipped),
            "worker": self.worker,
            "peak_rss": self.peak_rss,
            **({"input_sizes": self.input_sizes} if self.input_sizes else {}),
            "witnesses": [list(w) for w in self.witnesses],
        }


def parse_record(data: bytes, unit: int, inputs: range, digest: str) -> UnitRecord | None:
    """A commit record's contents when it is the record of ``unit`` of this compile; else None
    (such a unit is not committed, and is compiled again)."""
    try:
        obj = loads_bounded(commit_name(unit), data, "commit record")
    except FormatError:
        return None
    if not isinstance(obj, dict) or obj.get("recipe_digest") != digest:
        return None
    head = [obj.get(k) for k in ("unit", "first_input", "num_inputs")]
    shards, skipped = obj.get("shards"), obj.get("skipped")
    if head != [unit, inputs.start, len(inputs)] or not isinstance(shards, list):
        return None
    if not isinstance(skipped, list) or len(skipped) > len(inputs):
        return None
    infos = []
    for j, s in enumerate(shards):
        if not isinstance(s, dict) or s.get("file") != unit_shard_name(unit, j):
            return None
        try:
            infos.append(ShardInfo.from_json(s["file"], s))
        except ValueError:
            return None
    try:
        for k, r in enumerate(skipped):
            encode_record(r, k)
    except (FormatError, ValueError, TypeError):
        return None
    worker, rss, sizes = obj.get("worker"), obj.get("peak_rss"), obj.get("input_sizes", "")
    witnesses = obj.get("witnesses", [])
    if (
        not isinstance(witnesses, list)
        or len(witnesses) > WITNESSES
        or not all(
            isinstance(w, list)
            and len(w) == 2
            and is_count(w[0], inputs.stop - 1)
            and w[0] in inputs
            and isinstance(w[1], str)
            and len(w[1]) == 64
            for w in witnesses
        )
    ):
        return None
    return UnitRecord(
        unit,
        inputs.start,
        len(inputs),
        tuple(infos),
        tuple(skipped),
        worker=worker if isinstance(worker, str) else "",
        peak_rss=rss if is_count(rss, 1 << 62) else 0,
        input_sizes=sizes if isinstance(sizes, str) else "",
        witnesses=tuple((int(w[0]), str(w[1])) for w in witnesses),
    )


WITNESSES = 4  # inputs a unit records the digest of: its first, a quarter, half, 3/4 in


def shards_in_place(store: Store, record: UnitRecord, listed: Mapping[str, int]) -> bool:
    """Whether every shard the record names is in OUT with the recorded size, by the
    listing ``listed`` (Store.sizes: a store publishes whole files only); for a local
    OUT with the recorded CRC-32 too."""
    for s in record.shards:
        if listed.get(s.file) != s.bytes:
            return False
        if isinstance(store, LocalStore) and _file_crc32(store.root / s.file) != s.crc32:
            return False
    return True


def _file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            crc = crc32(chunk, crc)
    return crc

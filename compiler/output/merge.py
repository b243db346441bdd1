"""index.json and errors.jsonl of a compile: merged from its units' commit records in unit
order (the index last), held to the archive's bounds as each record arrives (Totals),
and found again in OUT when a compile stopped after writing them (finished_index,
intact_index)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NoReturn

from dlop.formats import (
    ERRORS_NAME,
    INDEX_NAME,
    Field,
    FormatError,
    Index,
    UnitTable,
    encode_index,
    num_units,
    parse_index,
)
from dlop.formats.archive import now_utc
from dlop.formats.constants import MAX_ERRORS_BYTES, MAX_ERRORS_RECORDS, MAX_SHARDS
from dlop.formats.files import loads_bounded
from dlop.formats.redact import redact
from dlop.formats.skipped import encode_record

from ..audio import numerics
from ..corpus.records import Corpus
from ..errors import CompileError
from ..faults import fault_at
from ..recipe import Recipe
from .commit import UnitRecord
from .store import Store


@dataclass(frozen=True)
class IndexPlan:
    """What a compile's index holds besides its units' commit records: the recipe, the
    corpus it listed, the fields, and the unit size the inputs are cut by."""

    recipe: Recipe
    corpus: Corpus
    fields: tuple[Field, ...]
    unit_inputs: int

    @property
    def num_units(self) -> int:
        return num_units(len(self.corpus.items), self.unit_inputs)


@dataclass
class Totals:
    """The archive-wide counts of the records merged so far, held to the bounds of SPEC.md §8
    as each record arrives: a compile stops at the first unit past one, not after its last."""

    shards: int = 0
    skipped: int = 0
    errors_bytes: int = 0  # errors.jsonl

    def add(self, record: UnitRecord) -> None:
        self.shards += len(record.shards)
        self.skipped += len(record.skipped)
        self.errors_bytes += sum(len(encode_record(s, 0)) for s in record.skipped)
        where = f"{self.shards} shards after unit {record.unit}"
        if self.shards > MAX_SHARDS:
            self._stop(f"{where}; an archive holds at most {MAX_SHARDS}", "a larger --shard-bytes")
        if self.skipped > MAX_ERRORS_RECORDS:
            self._stop(
                f"{self.skipped} skipped inputs after unit {record.unit}; errors.jsonl holds at "
                f"most {MAX_ERRORS_RECORDS}",
                "the corpus and the decoders checked",
            )
        if self.errors_bytes > MAX_ERRORS_BYTES:
            self._stop(
                f"errors.jsonl would be {self.errors_bytes} bytes after unit {record.unit}; it "
                f"holds at most {MAX_ERRORS_BYTES}",
                "the corpus and the decoders checked",
            )

    @staticmethod
    def _stop(problem: str, remedy: str) -> NoReturn:
        raise CompileError(
            f"{problem} (SPEC.md §8), so no index could list them; stopped here. Compile again "
            f"with {remedy} (--overwrite)"
        )


def intact_index(plan: IndexPlan, store: Store, committed: dict[int, UnitRecord]) -> Index | None:
    """The index in OUT when it reads cleanly as this compile's archive (same recipe, corpus
    and units), agrees with the commit records left, and every shard it lists, and
    errors.jsonl when it counts skipped inputs, is in OUT at its size: a compile stopped
    while the tidying up (guard.tidy) deleted the commit records."""
    data = store.read(INDEX_NAME)
    if data is None:
        return None
    try:
        index = parse_index(f"{store.url}/{INDEX_NAME}", data)  # the format's bounds and checks
    except FormatError:
        return None
    source = index.provenance.get("source")
    units = index.units
    if (
        index.recipe != plan.recipe.to_json()
        or not isinstance(source, dict)
        or source.get("fingerprint") != plan.corpus.fingerprint
        or units is None
        or (units.unit_inputs, units.num_inputs) != (plan.unit_inputs, len(plan.corpus.items))
    ):
        return None
    first = list(itertools.accumulate(units.shards, initial=0))
    for u, r in committed.items():
        if index.shards[first[u] : first[u + 1]] != r.shards or units.skipped[u] != len(r.skipped):
            return None
    listed = store.sizes()  # one listing: no request per shard for a URL OUT
    if index.skipped_count and ERRORS_NAME not in listed:
        return None
    if any(listed.get(s.file) != s.bytes for s in index.shards):
        return None
    return index


def finished_index(plan: IndexPlan, store: Store, committed: dict[int, UnitRecord]) -> Index | None:
    """The index in OUT when it is, byte for byte, the one these records make (with its
    own creation time), with the errors.jsonl they make beside it; else None."""
    data = store.read(INDEX_NAME) if len(committed) == plan.num_units else None
    if data is None:
        return None
    try:
        provenance = loads_bounded(INDEX_NAME, data, "index").get("provenance")
        created = provenance.get("created")
    except (FormatError, AttributeError):
        return None
    if not isinstance(created, str):
        return None
    index, errors = merged(plan, committed, created)
    if encode_index(index, INDEX_NAME) != data or store.read(ERRORS_NAME) != errors:
        return None
    return index


def write_archive(plan: IndexPlan, store: Store, committed: dict[int, UnitRecord]) -> Index:
    """errors.jsonl, then index.json last, both merged from the records in unit order."""
    index, errors = merged(plan, committed, now_utc())
    if errors is not None:
        store.write(ERRORS_NAME, errors)
    fault_at("index")
    store.write(INDEX_NAME, encode_index(index, f"{store.url}/{INDEX_NAME}"))
    return index


def merged(
    plan: IndexPlan, committed: dict[int, UnitRecord], created: str
) -> tuple[Index, bytes | None]:
    """The index and the errors.jsonl bytes (None when nothing was skipped) that the
    records make, merged in unit order."""
    records = [committed[u] for u in range(plan.num_units)]
    shards = tuple(s for r in records for s in r.shards)
    skipped = [s for r in records for s in r.skipped]
    errors = b"".join(encode_record(s, k) for k, s in enumerate(skipped)) if skipped else None
    from dlop import __version__

    corpus = plan.corpus
    source = {
        "layout": corpus.layout,
        "path": redact(corpus.root),  # never a URL's credentials
        "num_inputs": len(corpus.items),
        "fingerprint": corpus.fingerprint,
    }
    index = Index(
        plan.fields,
        shards,
        sum(s.num_samples for s in shards),
        plan.recipe.to_json(),
        {
            "dlop_version": __version__,
            "created": created,
            "source": source,
            "numerics": numerics.target(),
        },
        len(skipped),
        {**corpus.metadata, "feature_field": plan.recipe.feature_name},
        UnitTable(
            plan.unit_inputs,
            len(corpus.items),
            tuple(len(r.shards) for r in records),
            tuple(len(r.skipped) for r in records),
        ),
    )
    return index, errors

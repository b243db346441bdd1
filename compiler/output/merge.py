"""index.json and errors.jsonl of a compile: merged from its units' commit records in unit
order (the index last), held to the archive's bounds as each record arrives (Totals),
and found again in OUT when a compile stopped after writing them (finished_index,
intact_index)."""

from __future__ import annotations

import functools
import itertools
import os
from dataclasses import dataclass
from typing import Any, NoReturn

from dlop.formats import (
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
from dlop.formats.generations import (
    Generation,
    encode_identities,
    errors_name,
    inputs_name,
)
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
    corpus it listed, the fields, and the unit size the inputs are cut by; for an append,
    the index it appends to and the number of its first unit (after the base's)."""

    recipe: Recipe
    corpus: Corpus
    fields: tuple[Field, ...]
    unit_inputs: int
    base: Index | None = None
    first_unit: int = 0

    @property
    def num_units(self) -> int:
        return num_units(len(self.corpus.items), self.unit_inputs)

    @property
    def units(self) -> range:
        return range(self.first_unit, self.first_unit + self.num_units)

    @property
    def generation(self) -> int:
        return 0 if self.base is None else len(self.base.generations)

    @functools.cached_property
    def identities(self) -> tuple[bytes, int]:
        """The inputs file of this compile's generation, and its CRC-32."""
        return encode_identities(self.corpus.identities())


def source_path(corpus: Corpus) -> str:
    """Where the corpus was read from, as the index records it: a local folder resolved
    (an append checks it reads the same one, however SOURCE is spelt), a URL without its
    credentials; "" for a user's Dataset or list of inputs."""
    from dlop.formats.urls import is_url

    if not corpus.root or is_url(corpus.root):
        return redact(corpus.root)
    return os.path.realpath(corpus.root)


def plan_metadata(recipe: Recipe, corpus: Corpus) -> dict[str, Any]:
    """The index's ``metadata``: the corpus's facts and the feature field's name."""
    return {**corpus.metadata, "feature_field": recipe.feature_name}


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
    g = plan.generation
    gen = index.generations[g] if len(index.generations) == g + 1 else None
    units = None if gen is None else gen.units
    recipe = plan.recipe.to_json() if plan.base is None else plan.base.recipe
    if (
        index.recipe != recipe
        or not isinstance(source, dict)
        or source.get("fingerprint") != plan.corpus.fingerprint
        or units is None
        or (units.unit_inputs, units.num_inputs) != (plan.unit_inputs, len(plan.corpus.items))
        or (plan.base is not None and index.shards[: len(plan.base.shards)] != plan.base.shards)
    ):
        return None
    before = 0 if plan.base is None else len(plan.base.shards)
    first = list(itertools.accumulate(units.shards, initial=before))
    for u, r in committed.items():
        k = u - plan.first_unit
        if index.shards[first[k] : first[k + 1]] != r.shards or units.skipped[k] != len(r.skipped):
            return None
    listed = store.sizes()  # one listing: no request per shard for a URL OUT
    if gen is not None and gen.skipped and errors_name(g) not in listed:
        return None
    if listed.get(inputs_name(g)) != len(plan.identities[0]):
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
    g = plan.generation
    if encode_index(index, INDEX_NAME) != data or store.read(errors_name(g)) != errors:
        return None
    if store.read(inputs_name(g)) != plan.identities[0]:
        return None
    return index


def write_archive(plan: IndexPlan, store: Store, committed: dict[int, UnitRecord]) -> Index:
    """The generation's errors file and inputs file, then index.json last, merged from the
    records in unit order."""
    index, errors = merged(plan, committed, now_utc())
    if errors is not None:
        store.write(errors_name(plan.generation), errors)
    store.write(inputs_name(plan.generation), plan.identities[0])
    fault_at("index")
    store.write(INDEX_NAME, encode_index(index, f"{store.url}/{INDEX_NAME}"))
    return index


def merged(
    plan: IndexPlan, committed: dict[int, UnitRecord], created: str
) -> tuple[Index, bytes | None]:
    """The index and the errors file's bytes (None when nothing was skipped) that the
    records make, merged in unit order; for an append, after the base's."""
    records = [committed[u] for u in plan.units]
    shards = tuple(s for r in records for s in r.shards)
    skipped = [s for r in records for s in r.skipped]
    errors = b"".join(encode_record(s, k) for k, s in enumerate(skipped)) if skipped else None
    from dlop import __version__

    corpus = plan.corpus
    source = {
        "layout": corpus.layout,
        "path": source_path(corpus),
        "num_inputs": len(corpus.items),
        "fingerprint": corpus.fingerprint,
    }
    provenance = {
        "dlop_version": __version__,
        "created": created,
        "source": source,
        "numerics": numerics.target(),
    }
    units = UnitTable(
        plan.unit_inputs,
        len(corpus.items),
        tuple(len(r.shards) for r in records),
        tuple(len(r.skipped) for r in records),
    )
    samples = sum(s.num_samples for s in shards)
    generation = Generation(
        len(shards),
        samples,
        len(skipped),
        len(corpus.items),
        plan.identities[1],
        units,
        created,
        corpus.listed,
    )
    base = plan.base
    if base is None:
        index = Index(
            plan.fields,
            shards,
            samples,
            plan.recipe.to_json(),
            provenance,
            len(skipped),
            plan_metadata(plan.recipe, corpus),
            units,
            (generation,),
        )
    else:  # the base's shards and recipe, then these; the corpus facts (append checked that
        # they keep the base's: class names may grow at their end)
        index = Index(
            base.fields,
            base.shards + shards,
            base.num_samples + samples,
            base.recipe,
            provenance,
            base.skipped_count + len(skipped),
            plan_metadata(plan.recipe, corpus),
            None,
            (*base.generations, generation),
            base.field_groups,  # each now covers the earlier generations only
        )
    return index, errors

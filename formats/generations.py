"""Generations of an archive (SPEC.md §6.2): what each compile into it added.

A first compile writes generation 0; each append (``dlop-compile --append``) adds
one: its shards follow the earlier ones in the index's shard list, its work units
are numbered after theirs, its skipped inputs go to an errors file of its own, and
the identities of the inputs it read go to ``inputs-GGGG.bin`` (16 bytes each),
which the next append reads to know which inputs the archive holds already. Files
of earlier generations are never rewritten, so a reader that opened an earlier
index reads it to its end while an append runs.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .constants import ERRORS_NAME, MAX_ARCHIVE_SAMPLES, MAX_ERRORS_RECORDS, MAX_UNITS
from .crc import crc32
from .errors import FormatError
from .units import UnitTable, is_count, num_units
from .writer import ShardInfo

MAX_GENERATIONS = 1 << 12
MAX_GENERATION_INPUTS = 1 << 24  # an inputs file of at most 256 MiB
IDENTITY_BYTES = 16  # BLAKE2b digest of one input's identity
IDENTITY_DTYPE = np.dtype(f"S{IDENTITY_BYTES}")


def errors_name(generation: int) -> str:
    """The errors file of a generation's skipped inputs: errors.jsonl for the first (what
    readers that predate generations read), errors-GGGG.jsonl for each append."""
    return ERRORS_NAME if generation == 0 else f"errors-{generation:04d}.jsonl"


def inputs_name(generation: int) -> str:
    """The file of a generation's input identities."""
    return f"inputs-{generation:04d}.bin"


def input_identity(text: str) -> bytes:
    """The 16-byte identity of an input named by ``text`` (a preset's input key, a
    function's input as JSON, a Dataset's index in decimal)."""
    data = text.encode("utf-8", "surrogatepass")  # a file name's undecodable bytes too
    return hashlib.blake2b(data, digest_size=IDENTITY_BYTES).digest()


def identities(texts: Sequence[str]) -> np.ndarray:
    """input_identity of each text, as one (writable) array of IDENTITY_DTYPE."""
    digests = bytearray().join(map(input_identity, texts))  # no numpy call per input
    return np.frombuffer(digests, IDENTITY_DTYPE) if digests else np.empty(0, IDENTITY_DTYPE)


def listing_identities(texts: Sequence[str], repeats: list[int] | None = None) -> np.ndarray:
    """The identities of a listing's inputs, in order (SPEC.md §6.2): each text's, but a
    text's k-th repeat (k >= 1) is named by the text, a NUL and k in decimal, so that an
    input listed twice is two inputs an append tells apart (the first, and the repeat).
    ``repeats``: given a list, the places of the repeats are added to it, ascending."""
    out = identities(texts)
    order = np.argsort(out, kind="stable")  # a text's places in listing order
    ranked = out[order]
    same = np.flatnonzero(ranked[1:] == ranked[:-1]) + 1  # a repeat of the one before
    if not len(same):
        return out
    run_start = np.ones(len(out), bool)
    run_start[same] = False
    first = np.maximum.accumulate(np.where(run_start, np.arange(len(out)), 0))
    for r in same.tolist():
        n = int(order[r])
        out[n] = input_identity(f"{texts[n]}\0{r - first[r]}")
    if repeats is not None:
        repeats.extend(sorted(int(order[r]) for r in same))
    return out


@dataclass(frozen=True)
class Listed:
    """The listing file a compile read its inputs from, where its layout lists from one
    whose appended lines add inputs after the others (ESC-50's CSV, a manifest): its
    length, its SHA-256 and how many inputs it named. An append whose listing file starts
    with those bytes lists the lines after them only (SPEC.md §6.2)."""

    size: int
    sha256: str
    inputs: int

    def head_of(self, raw: bytes) -> bytes | None:
        """The bytes this listing file held, when ``raw`` (the file now) begins with them;
        else None (it was rewritten, not grown)."""
        head = raw[: self.size]
        if len(head) != self.size or hashlib.sha256(head).hexdigest() != self.sha256:
            return None
        return head

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.size, "sha256": self.sha256, "inputs": self.inputs}


MAX_LISTING_BYTES = 1 << 48  # a listing file's length as a generation may record it


def listed_file(raw: bytes, inputs: int) -> Listed | None:
    """The Listed record of a listing file's bytes that named ``inputs`` inputs; None when
    its last line has no end (a line appended to it would lengthen that one)."""
    if not raw.endswith(b"\n"):
        return None
    return Listed(len(raw), hashlib.sha256(raw).hexdigest(), inputs)


@dataclass(frozen=True)
class Generation:
    """One entry of the index's ``generations``: the shards a compile added (the next
    ``shards`` of the shard list), the samples in them, the inputs it skipped (in
    errors_name(number)), how many inputs it read (their identities in inputs_name(number),
    with that file's CRC-32), its work units (numbered after the earlier ones'), and the
    listing file it listed them from (Listed), where its layout has one."""

    shards: int
    num_samples: int
    skipped: int
    inputs: int
    inputs_crc32: int
    units: UnitTable | None = None
    created: str = ""
    listed: Listed | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "shards": self.shards,
            "num_samples": self.num_samples,
            "skipped": self.skipped,
            "inputs": {"count": self.inputs, "crc32": self.inputs_crc32},
            **({} if self.units is None else {"units": self.units.to_json()}),
            "created": self.created,
            **({} if self.listed is None else {"listing": self.listed.to_json()}),
        }


def units_cut(generations: Sequence[Generation]) -> int:
    """How many work units the generations cut in all: an append's are numbered after them."""
    return sum(
        num_units(g.units.num_inputs, g.units.unit_inputs)
        for g in generations
        if g.units is not None
    )


def parse_generations(
    path: object, obj: object, shards: Sequence[ShardInfo], num_samples: int, top_skipped: int
) -> tuple[Generation, ...]:
    """An index's ``generations`` checked against its shard list (each generation's shards
    the next ones, its samples theirs, its units named after the earlier generations'),
    its sample count and its top-level skipped count (the first generation's)."""

    def bad(problem: str) -> FormatError:
        return FormatError(path, f"'generations' {problem} (SPEC.md §6.2)")

    if not isinstance(obj, list) or not 1 <= len(obj) <= MAX_GENERATIONS:
        got = f"{len(obj)} entries" if isinstance(obj, list) else type(obj).__name__
        raise bad(f"is {got}; expected a list of 1 ... {MAX_GENERATIONS} generations")
    out: list[Generation] = []
    start = unit = held = 0
    for g, entry in enumerate(obj):
        where = f"entry #{g}"
        if not isinstance(entry, dict):
            raise bad(f"{where} is not an object")
        count, samples, skipped = (entry.get(k) for k in ("shards", "num_samples", "skipped"))
        if not is_count(count, len(shards) - start):
            raise bad(
                f"{where}: 'shards' is {count!r:.40}; {len(shards) - start} shards are left "
                "of the index's list"
            )
        mine = shards[start : start + count]
        if not is_count(samples, MAX_ARCHIVE_SAMPLES) or samples != sum(
            s.num_samples for s in mine
        ):
            raise bad(
                f"{where}: 'num_samples' is {samples!r:.40}; its shards hold "
                f"{sum(s.num_samples for s in mine)}"
            )
        if not is_count(skipped, MAX_ERRORS_RECORDS):
            raise bad(f"{where}: 'skipped' is {skipped!r:.40}, expected 0 ... {MAX_ERRORS_RECORDS}")
        inputs = entry.get("inputs")
        n = inputs.get("count") if isinstance(inputs, dict) else None
        crc = inputs.get("crc32") if isinstance(inputs, dict) else None
        if not is_count(n, MAX_GENERATION_INPUTS) or n < skipped or not is_count(crc, 0xFFFFFFFF):
            raise bad(
                f"{where}: 'inputs' is {inputs!r:.80}; expected {{'count': {skipped} ... "
                f"{MAX_GENERATION_INPUTS}, 'crc32': 0 ... 2^32-1}}"
            )
        units = entry.get("units")
        table = None
        if units is not None:
            table = UnitTable.from_json(
                f"{path} generation {g}", units, [s.file for s in mine], skipped, first_unit=unit
            )
            unit += num_units(table.num_inputs, table.unit_inputs)
            if unit > MAX_UNITS:
                raise bad(f"{where}: its units end at unit {unit}; an archive lists {MAX_UNITS}")
            if table.num_inputs != n:
                raise bad(f"{where}: its units cut {table.num_inputs} inputs, 'inputs' counts {n}")
        created = entry.get("created", "")
        if not isinstance(created, str) or len(created) > 64:
            raise bad(f"{where}: 'created' is {created!r:.40}, expected a short string")
        held += n  # what the generations so far read (a listing names no more)
        listed = _listed(entry.get("listing"), held, bad, where)
        out.append(Generation(count, samples, skipped, n, crc, table, created, listed))
        start += count
    if start != len(shards):
        raise bad(f"counts {start} shards in all, the index lists {len(shards)}")
    if sum(g.num_samples for g in out) != num_samples:
        raise bad(f"counts {sum(g.num_samples for g in out)} samples, the index {num_samples}")
    if out[0].skipped != top_skipped:
        raise bad(
            f"entry #0 counts {out[0].skipped} skipped inputs; 'skipped.count' (the first "
            f"generation's, in {ERRORS_NAME}) is {top_skipped}"
        )
    return tuple(out)


def _listed(obj: object, held: int, bad: Callable[[str], FormatError], where: str) -> Listed | None:
    """A generation's ``listing``, checked: no more inputs than the generations so far
    hold (every input a listing named is held once its compile ends)."""
    if obj is None:
        return None
    size, digest, inputs = (
        (obj.get(k) for k in ("bytes", "sha256", "inputs"))
        if isinstance(obj, dict)
        else (None,) * 3
    )
    if (
        not is_count(size, MAX_LISTING_BYTES)
        or not isinstance(digest, str)
        or not _SHA256.fullmatch(digest)
        or not is_count(inputs, held)
    ):
        raise bad(
            f"{where}: 'listing' is {obj!r:.120}; expected {{'bytes': 0 ... 2^48, 'sha256': 64 "
            f"lowercase hex digits, 'inputs': 0 ... {held} (the inputs held so far)}}"
        )
    return Listed(size, digest, inputs)


_SHA256 = re.compile("[0-9a-f]{64}")


def encode_identities(ids: np.ndarray) -> tuple[bytes, int]:
    """An inputs file's bytes and their CRC-32."""
    data = np.ascontiguousarray(ids, IDENTITY_DTYPE).tobytes()
    return data, crc32(data)


def parse_identities(path: str | Path, data: bytes, generation: Generation) -> np.ndarray:
    """An inputs file's identities, checked against its generation's count and CRC-32."""
    want = generation.inputs * IDENTITY_BYTES
    if len(data) != want:
        raise FormatError(
            path, f"is {len(data)} bytes; {generation.inputs} input identities take {want}"
        )
    if crc32(data) != generation.inputs_crc32:
        raise FormatError(path, "CRC-32 differs from index.json's")
    return np.frombuffer(data, IDENTITY_DTYPE)

"""Work units of an archive (SPEC.md §6.1): consecutive inputs compiled together.

A compile cuts its inputs, in corpus order, into units of ``unit_inputs`` inputs
(the last may be shorter); each unit writes its own shards, named by unit and
shard number, and the index lists units in order with how many shards and
skipped inputs each has. Archives written before units had no ``units`` entry.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from .constants import MAX_ERRORS_RECORDS, MAX_UNITS, SHARD_SUFFIX
from .errors import FormatError

MAX_COUNT = (1 << 64) - 1  # SPEC.md §8: counts are 0 ... 2^64-1
UNIT_SHARD = re.compile(rf"unit-(\d{{6,}})-(\d{{4,}}){re.escape(SHARD_SUFFIX)}")


def unit_shard_name(unit: int, number: int) -> str:
    """The file of shard ``number`` (counted within its unit) of unit ``unit``."""
    return f"unit-{unit:06d}-{number:04d}{SHARD_SUFFIX}"


def num_units(num_inputs: int, unit_inputs: int) -> int:
    return -(-num_inputs // unit_inputs)


@dataclass(frozen=True)
class UnitTable:
    """The index's ``units`` entry: unit k holds inputs [k * unit_inputs, (k + 1) * unit_inputs)
    of ``num_inputs``, wrote ``shards[k]`` shards and skipped ``skipped[k]`` inputs."""

    unit_inputs: int
    num_inputs: int
    shards: tuple[int, ...]
    skipped: tuple[int, ...]

    def inputs_of(self, unit: int) -> range:
        start = unit * self.unit_inputs
        return range(start, min(start + self.unit_inputs, self.num_inputs))

    def count_of(self, unit: int) -> int:
        """How many inputs unit ``unit`` holds (len(inputs_of) fails past sys.maxsize)."""
        return max(0, min(self.unit_inputs, self.num_inputs - unit * self.unit_inputs))

    def to_json(self) -> dict[str, Any]:
        return {
            "unit_inputs": self.unit_inputs,
            "num_inputs": self.num_inputs,
            "shards": list(self.shards),
            "skipped": list(self.skipped),
        }

    @classmethod
    def from_json(
        cls,
        path: object,
        obj: object,
        shard_files: Sequence[str],
        skipped: int,
        first_unit: int = 0,
    ) -> UnitTable:
        """Parses and checks an index's ``units`` against its shard list (each unit's shards
        named by unit and number, in order) and its skipped count. Unit k is named
        ``first_unit + k``: an appended generation's units follow the earlier ones'."""

        def bad(problem: str) -> FormatError:
            return FormatError(path, f"'units' {problem} (SPEC.md §6.1)")

        if not isinstance(obj, dict):
            raise bad(f"is {type(obj).__name__}, expected an object")
        size, total = obj.get("unit_inputs"), obj.get("num_inputs")
        if not is_count(size, MAX_COUNT) or size == 0:
            raise bad(f"'unit_inputs' is {size!r:.40}, expected an integer 1 ... 2^64-1")
        most = min(MAX_UNITS * size, MAX_COUNT)
        if not is_count(total, most):
            raise bad(
                f"'num_inputs' is {total!r:.40}, expected an integer 0 ... {most} (at most "
                f"{MAX_UNITS} units of {size} inputs)"
            )
        expected = num_units(total, size)
        lists = {k: obj.get(k) for k in ("shards", "skipped")}
        for key, value in lists.items():
            if not isinstance(value, list) or len(value) != expected:
                got = len(value) if isinstance(value, list) else type(value).__name__
                raise bad(f"'{key}' is {got}, expected a list of {expected} counts, one per unit")
        table = cls(size, total, tuple(lists["shards"]), tuple(lists["skipped"]))  # type: ignore[arg-type]
        for k in range(expected):
            inputs = table.count_of(k)
            if not is_count(table.shards[k], inputs):
                raise bad(f"'shards[{k}]' is {table.shards[k]!r:.40}, expected 0 ... {inputs}")
            most = min(inputs, MAX_ERRORS_RECORDS)
            if not is_count(table.skipped[k], most):
                raise bad(f"'skipped[{k}]' is {table.skipped[k]!r:.40}, expected 0 ... {most}")
        if sum(table.shards) != len(shard_files):
            raise bad(
                f"'shards' counts {sum(table.shards)} shards in all, the index lists "
                f"{len(shard_files)}"
            )
        names = ((first_unit + k, j) for k, n in enumerate(table.shards) for j in range(n))
        for i, (name, (k, j)) in enumerate(zip(shard_files, names, strict=True)):
            if name != unit_shard_name(k, j):
                raise bad(
                    f"'shards' makes shard entry #{i} shard {j} of unit {k}, named "
                    f"{unit_shard_name(k, j)!r}; the index names it {name!r}"
                )
        if sum(table.skipped) != skipped:
            raise bad(
                f"'skipped' counts {sum(table.skipped)} skipped inputs in all, 'skipped.count' "
                f"is {skipped}"
            )
        return table


def is_count(value: object, most: int) -> TypeGuard[int]:
    """Whether a parsed JSON value is an integer 0 ... ``most`` (a bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= most

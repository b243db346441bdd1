"""One unit of a field group's compile: the group's shard aligned with one archive shard.

A unit reads archive shard k (its whole-file CRC-32 checked against the index first,
so the group is computed from the bytes the index names), calls the user's function on
each of its samples in order, and writes the group shard under its final name (the
shard writer's temporary file, renamed once complete). It runs in a worker process of
the local pool, or as a Dask task; everything it takes is picklable and everything it
returns is small.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dlop.formats import ArchiveReader, FormatError, ShardReader
from dlop.formats.groups import group_file
from dlop.formats.writer import ShardInfo, ShardWriter

from ..custom.samples import Mismatch, SampleError, Spec, conform, flatten
from ..custom.work import reason, seed_item
from ..errors import AxisVaries, CompileError
from ..run.processes import time_limit


class ItemFailed(CompileError):
    """The function failed on one sample: a field group needs a value for every sample, so
    the compile stops (``sample`` names it)."""


@dataclass(frozen=True)
class GroupTask:
    """What every unit of one group's compile shares."""

    archive: str  # the archive's folder
    name: str
    revision: int
    specs: dict[str, Spec]
    codec: str
    seed: int
    code: bytes  # the function, pickled by value (compiler.run.units.by_value)
    timeout: float | None

    def fields(self) -> tuple[Any, ...]:
        return tuple(s.field(self.codec) for s in self.specs.values())


_FUNCTIONS: dict[bytes, Any] = {}  # a worker's unpickled function, by its pickle


def function_of(code: bytes) -> Any:
    fn = _FUNCTIONS.get(code)
    if fn is None:
        fn = _FUNCTIONS[code] = pickle.loads(
            code
        )  # the user's own function, never an archive's bytes
    return fn


def sample_of(shard: ShardReader, i: int) -> dict[str, Any]:
    """Sample ``i`` of an archive shard as the function gets it: arrays as tensors (copies
    the function may change), str and bytes as they are."""
    out: dict[str, Any] = {}
    for name in shard.fields:
        value = shard.get(name, i)
        out[name] = value if isinstance(value, str | bytes) else torch.from_numpy(np.array(value))
    return out


def leaves_of(
    fn: Any, sample: dict[str, Any], seed: int, index: int, where: str, timeout: float | None
) -> dict[str, Any]:
    """The leaves of ``fn(sample)``: a dict of new fields, each a value compile_map takes."""
    seed_item(seed, index)
    try:
        with time_limit(timeout):
            got = fn(sample)
    except (Exception, SystemExit) as e:  # the user's code: any failure is this sample's
        raise ItemFailed(f"{where}: the function failed: {reason(e)}") from None
    if not isinstance(got, dict):
        raise ItemFailed(
            f"{where}: the function gave a {type(got).__name__}; it gives a dict of the new "
            "fields, {'name': value}"
        )
    try:
        _, leaves = flatten(got, where)
    except SampleError as e:
        raise ItemFailed(str(e)) from None
    nested = [n for n in leaves if "." in n]
    if nested:
        raise ItemFailed(
            f"{where}: field {nested[0]!r} is nested; a field group's fields are one level, "
            "{'name': value}"
        )
    return leaves


def run_group_unit(task: GroupTask, k: int) -> dict[str, Any]:
    """Computes and writes group shard ``k``; returns its index entry (GroupShard JSON)."""
    fn = function_of(task.code)
    archive = ArchiveReader(task.archive, field_groups=False)
    try:
        info = archive.index.shards[k]
        base = archive.shard(k)
        if base.file_crc32() != info.crc32:
            raise FormatError(base.path, "whole-file CRC-32 differs from index.json")
        first = int(archive.shard_starts[k])
        path = Path(task.archive) / group_file(task.name, task.revision, k)
        writer = ShardWriter(path, task.fields())
        try:
            for i in range(base.num_samples):
                where = f"sample {first + i} ({info.file} #{i})"
                leaves = leaves_of(
                    fn, sample_of(base, i), task.seed, first + i, where, task.timeout
                )
                try:
                    writer.write(conform(leaves, task.specs, where))
                except Mismatch as e:
                    if e.widen is not None:
                        raise AxisVaries(e.message, *e.widen) from None
                    raise ItemFailed(e.message) from None
            written: ShardInfo = writer.close()
        except BaseException:
            writer.abort()
            raise
        return {**written.to_json(), "base_crc32": info.crc32}
    finally:
        archive.close()


def probe(
    code: bytes, archive: str, indices: list[int], seed: int, timeout: float | None
) -> list[tuple[str, dict[str, Any]]]:
    """The leaves the function gives for the archive's samples ``indices`` (their names
    for messages): what the driver infers the group's schema from, computed in a worker."""
    fn = function_of(code)
    reader = ArchiveReader(archive, field_groups=False)
    try:
        out = []
        for index in indices:
            k, i = reader.locate(index)
            where = f"sample {index} ({reader.index.shards[k].file} #{i})"
            out.append(
                (where, leaves_of(fn, sample_of(reader.shard(k), i), seed, index, where, timeout))
            )
        return out
    finally:
        reader.close()


def worker_start() -> None:
    """A pool worker's start: it dies with the driver, and an item's time limit may end it."""
    from ..output.guard import close_inherited_locks
    from ..run.processes import arm_item_limits, die_with_driver

    close_inherited_locks()  # the archive's lock is the driver's: it ends with the driver
    die_with_driver()
    arm_item_limits()

"""One unit of a field group's compile: the group's shard aligned with one archive shard.

A unit reads archive shard k (in place in a local archive, downloaded from one in object
storage; its whole-file CRC-32 checked against the index first, so the group is computed
from the bytes the index names), calls the user's function on each of its samples in
order, writes the group shard in the store's staging folder and publishes it whole
under its final name (compiler.output.store). It runs in a worker process of the local
pool, or as a Dask task; everything it takes is picklable and everything it returns is
small.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dlop.formats import Field, FormatError, Index, ShardReader, parse_index
from dlop.formats.constants import INDEX_NAME
from dlop.formats.groups import group_file
from dlop.formats.writer import ShardInfo, ShardWriter

from ..custom.samples import Mismatch, SampleError, Spec, conform, flatten
from ..custom.work import reason, seed_item
from ..errors import AxisVaries, CompileError
from ..output.store import LocalStore, Store, open_store
from ..run.processes import time_limit


class ItemFailed(CompileError):
    """The function failed on one sample: a field group needs a value for every sample, so
    the compile stops (``sample`` names it)."""


@dataclass(frozen=True)
class GroupTask:
    """What every unit of one group's compile shares."""

    archive: str  # the archive's folder or URL
    name: str
    revision: int
    specs: dict[str, Spec]
    codec: str
    seed: int
    code: bytes  # the function, pickled by value (compiler.run.units.by_value)
    timeout: float | None
    storage_options: dict[str, Any] | None = None

    def store(self) -> Store:
        return open_store(self.archive, self.storage_options)

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


def index_of(store: Store) -> Index:
    """The archive's index as the store holds it now."""
    data = store.read(INDEX_NAME)
    if data is None:
        raise CompileError(f"{store.url}: holds no archive (no {INDEX_NAME}); compile one first")
    return parse_index(f"{store.url}/{INDEX_NAME}", data)


@contextlib.contextmanager
def shard_file(store: Store, info: ShardInfo, fields: Any = None) -> Iterator[ShardReader]:
    """The shard ``info`` names, mapped: in place in a local archive, else downloaded into
    the staging folder first (removed after); its size and sample count checked against
    ``info``, and its schema against ``fields`` when given."""
    local = store.root if isinstance(store, LocalStore) else None
    if local is not None:
        path = local / info.file
    else:
        path = store.staging() / f".{info.file}.{os.getpid()}.base"
        store.download(info.file, path, info.bytes + 1)
    try:
        reader = ShardReader(path, archive_dir=local, expected_bytes=info.bytes)
        try:
            if reader.num_samples != info.num_samples:
                raise FormatError(
                    path, f"holds {reader.num_samples} samples, index.json says {info.num_samples}"
                )
            if fields is not None and tuple(reader.fields.values()) != tuple(fields):
                raise FormatError(path, "shard schema differs from the index schema")
            yield reader
        finally:
            reader.close()
    finally:
        if local is None:
            path.unlink(missing_ok=True)


def run_group_unit(
    task: GroupTask, k: int, info: ShardInfo, fields: tuple[Field, ...], first: int
) -> dict[str, Any]:
    """Computes and publishes group shard ``k`` beside the archive's shard ``info`` (whose
    schema is ``fields``, whose first sample is number ``first`` of the archive); returns
    its index entry (GroupShard JSON). The driver read the index once for every unit."""
    fn = function_of(task.code)
    store = task.store()
    with shard_file(store, info, fields) as base:
        if base.file_crc32() != info.crc32:
            raise FormatError(base.path, "whole-file CRC-32 differs from index.json")
        name = group_file(task.name, task.revision, k)
        path = store.staging() / name
        writer = ShardWriter(path, task.fields())
        try:
            for i in range(base.num_samples):
                where = f"sample {first + i} ({info.file} #{i})"
                sample = sample_of(base, i)
                leaves = leaves_of(fn, sample, task.seed, first + i, where, task.timeout)
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
    try:
        store.put(path, name)
    finally:
        path.unlink(missing_ok=True)
    return {**written.to_json(), "base_crc32": info.crc32}


def probe(task: GroupTask, count: int) -> list[tuple[str, dict[str, Any]]]:
    """The leaves the function gives for the archive's first ``count`` samples (their
    names for messages): what the driver infers the group's schema from, computed in a
    worker."""
    fn = function_of(task.code)
    store = task.store()
    index = index_of(store)
    out: list[tuple[str, dict[str, Any]]] = []
    first = 0
    for info in index.shards:
        if len(out) >= count:
            break
        with shard_file(store, info, index.fields) as shard:
            for i in range(min(shard.num_samples, count - len(out))):
                where = f"sample {first + i} ({info.file} #{i})"
                sample = sample_of(shard, i)
                out.append(
                    (where, leaves_of(fn, sample, task.seed, first + i, where, task.timeout))
                )
        first += info.num_samples
    return out


def worker_start(driver: int, environ: dict[str, str]) -> None:
    """A pool worker's start: the compile's environment (a fork server keeps the one it
    started with: credentials, endpoints), one torch thread (the pool is the parallelism),
    death with the driver, and an item's time limit may end it."""
    from ..output.guard import close_inherited_locks
    from ..run.processes import arm_item_limits, die_with_driver

    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)
    close_inherited_locks()  # the archive's lock is the driver's: it ends with the driver
    die_with_driver(driver)
    arm_item_limits()

"""``add_fields`` and ``drop_fields``: a field group computed from an archive's samples,
added beside its shards, compiled again or dropped, the archive's own files untouched.

The driver takes the archive's lock (no compile, append or other group change runs
meanwhile; an archive in object storage has no lock, as for a compile into it), infers the group's schema from the function's first samples (computed in a
worker, like every call of the user's code), records what it compiles in a journal of
its own (``.dlop-group-NAME.json``), and runs one unit per archive shard on a local
pool of worker processes or on Dask (compiler.groups.shard), reading and publishing
through the archive's store (compiler.output.store): a local folder or a URL. Once every group shard is
written it publishes the new index.json atomically; until then a reader sees the
archive as it was. A sample on which the function fails stops the compile (a group
holds a value for every sample); what was written stays for ``resume=True``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import importlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from dlop.formats import FormatError, Index, parse_index
from dlop.formats.archive import encode_index, now_utc
from dlop.formats.constants import INDEX_NAME, JOURNAL_NAME
from dlop.formats.errors import SchemaError
from dlop.formats.files import loads_bounded
from dlop.formats.groups import FieldGroup, GroupShard, check_group_name, group_file
from dlop.formats.writer import ShardInfo

from ..custom.code import changes
from ..custom.compiling import check_options, described
from ..custom.samples import Spec, given_schema, infer, merge, widened
from ..errors import AxisVaries, CompileError
from ..faults import fault_at
from ..output.guard import OutputLock
from ..output.store import LocalStore, Store, open_store
from ..recipe import DTYPES
from ..run.processes import local_workers, worker_context
from ..run.units import by_value
from .shard import (
    GroupTask,
    ItemFailed,
    probe,
    run_group_unit,
    shard_file,
    worker_start,
)

PROBE_SAMPLES = 8  # the archive's first samples, from which the group's schema is inferred
PROGRESS_SECONDS = 30.0
MAX_JOURNAL_BYTES = 1 << 20


def journal_name(name: str) -> str:
    return f".dlop-group-{name}.json"


def add_fields(
    archive: str | os.PathLike[str],
    fn: Callable[[dict[str, Any]], dict[str, Any]],
    name: str,
    *,
    workers: int | None = None,
    dask: str | None = None,
    resume: bool = False,
    overwrite: bool = False,
    compression: str = "raw",
    schema: Mapping[str, Any] | None = None,
    dtype: str | None = None,
    seed: int = 0,
    item_timeout: float | None = None,
    arguments: Any = None,
    progress: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> Index:
    """Adds field group ``name`` to the archive at ``archive``: ``fn(sample)`` (a dict of
    the sample's fields, arrays as tensors) gives a dict of new fields for every sample,
    stored in shard files aligned with the archive's (docs/compile.md, "Growing an
    archive"). Returns the new index.

    The group is compiled once: run again, it computes only the shards an append added
    since (same function, options and arguments) or says there is nothing to add.
    ``overwrite=True`` compiles it again from the start; ``resume=True`` finishes one that
    was interrupted. ``workers``, ``dask``, ``compression``, ``schema``, ``dtype``,
    ``seed``, ``item_timeout``, ``arguments`` and ``storage_options`` (for an archive at a URL) mean
    what they do for compile_map."""
    check_group_name_or_refuse(name)
    check_options(
        {
            "workers": workers,
            "item_timeout": item_timeout,
            "seed": seed,
            "dtype": dtype,
            "compression": compression,
        }
    )
    options = {
        "workers": workers,
        "dask": dask,
        "codec": str(compression),
        "dtype": dtype,
        "seed": seed,
        "timeout": item_timeout,
        "storage_options": storage_options,
    }
    given = given_schema(schema)
    code = described(fn, False, arguments)
    recipe = {
        "compile": "fields",
        "code": code,
        "seed": seed,
        "schema": {
            k: {"dtype": d, "shape": None if s is None else list(s)} for k, (d, s) in given.items()
        }
        or None,
        "dtype": dtype,
        "codec": compression,
    }
    pickled = by_value(fn)
    with _locked(archive, storage_options) as (store, index, data):
        return _add(
            store, index, data, name, recipe, pickled, given, options, resume, overwrite, progress
        )


def drop_fields(
    archive: str | os.PathLike[str], name: str, storage_options: dict[str, Any] | None = None
) -> Index:
    """Drops field group ``name`` from the archive: a new index.json without it. Its files
    stay until the group changes again (a reader of the earlier index reads them to its
    end), or go with a later add_fields or drop_fields of that name: drop_fields of a name
    the index no longer lists deletes what is left of it (a dropped group's files, an
    interrupted compile's). Returns the new index."""
    check_group_name_or_refuse(name)
    with _locked(archive, storage_options) as (store, index, _):
        group = next((g for g in index.field_groups if g.name == name), None)
        if group is None:
            there = journal_name(name) in store.list(journal_name(name))
            if not there and not _files_of(store, name):
                names = [g.name for g in index.field_groups]
                raise CompileError(
                    f"{store.url}: no field group {name!r} to drop; its groups are "
                    f"{names or 'none'}"
                )
            _tidy(store, name, index, None)  # an interrupted compile's files and journal
            return index
        index = replace(index, field_groups=tuple(g for g in index.field_groups if g.name != name))
        _publish(store, index)
        _tidy(store, name, index, group.revision)
        return index


def check_group_name_or_refuse(name: object) -> None:
    try:
        check_group_name(name)
    except SchemaError as e:
        raise CompileError(str(e)) from None


@contextlib.contextmanager
def _locked(
    archive: str | os.PathLike[str], storage_options: dict[str, Any] | None
) -> Iterator[tuple[Store, Index, bytes]]:
    """The archive's store, its lock held when it is a local folder (an object store has
    none, as for a compile into it); refused unless it holds a finished archive."""
    store = open_store(archive, storage_options)
    root = store.root if isinstance(store, LocalStore) else None
    if root is not None and not (root / INDEX_NAME).is_file():
        raise CompileError(f"{store.url}: holds no archive (no {INDEX_NAME}); compile one first")
    lock = None if root is None else OutputLock(root)
    try:
        if JOURNAL_NAME in store.list(JOURNAL_NAME):
            raise CompileError(
                f"{store.url}: holds an interrupted compile or append; finish it first with "
                "--resume"
            )
        try:
            data = store.read(INDEX_NAME)
            if data is None:
                raise CompileError(
                    f"{store.url}: holds no archive (no {INDEX_NAME}); compile one first"
                )
            index = parse_index(f"{store.url}/{INDEX_NAME}", data)
        except FormatError as e:
            raise CompileError(str(e)) from None
        yield store, index, data
    finally:
        if lock is not None:
            lock.release()


def _add(
    store: Store,
    index: Index,
    data: bytes,
    name: str,
    recipe: dict[str, Any],
    pickled: bytes,
    given: dict[str, Any],
    options: dict[str, Any],
    resume: bool,
    overwrite: bool,
    progress: bool,
) -> Index:
    out = store.url
    at_start = hashlib.sha256(data).hexdigest()  # the index is the same throughout (locked)
    digest = _digest(recipe)
    existing = next((g for g in index.field_groups if g.name == name), None)
    journal = _read_journal(store, name, overwrite)
    if (
        journal is not None
        and existing is not None
        and existing.revision == journal["revision"]
        and existing.covers == len(index.shards)
        and journal["digest"] == _digest(existing.recipe)
    ):  # published before the compile stopped: only the tidying was left
        _tidy(store, name, index, journal.get("keep"))
        if not overwrite:
            return index
        journal = None
    specs: dict[str, Spec] | None = None
    if journal is not None and not (resume or overwrite):
        raise CompileError(
            f"{out}: field group {name!r} was being added when its compile stopped; pass "
            "resume=True to finish it, or overwrite=True to compile it again"
        )
    if resume and journal is None:
        raise CompileError(f"{out}: no interrupted compile of field group {name!r} to resume")
    if resume and journal is not None:
        if journal["digest"] != digest:
            why = changes(journal["recipe"]["code"], recipe["code"]) or [
                f"{k} differs" for k in recipe if recipe[k] != journal["recipe"].get(k)
            ]
            raise CompileError(
                f"{out}: resume=True continues field group {name!r} with the function and "
                f"options it began with, and {'; '.join(why) or 'they differ'}; pass "
                "overwrite=True to compile it again"
            )
        if journal["index"] != at_start:
            raise CompileError(
                f"{out}: the archive changed since field group {name!r} began; pass "
                "overwrite=True to compile it again"
            )
        revision, start = journal["revision"], journal["start"]
        specs = {s["name"]: Spec.from_json(s) for s in journal["specs"]}
    elif existing is not None and not overwrite:
        if _digest(existing.recipe) != digest:
            why = changes(existing.recipe.get("code", {}), recipe["code"]) or [
                f"{k} differs" for k in recipe if recipe[k] != existing.recipe.get(k)
            ]
            raise CompileError(
                f"{out}: already holds field group {name!r}, compiled from another function "
                f"or options ({'; '.join(why)}); pass overwrite=True to compile it again, "
                "or choose another name"
            )
        if existing.covers == len(index.shards):
            _say(progress, f"field group {name!r} covers every shard; nothing to add")
            return index
        revision, start = existing.revision, existing.covers  # an append added shards
        specs = {s["name"]: Spec.from_json(s) for s in existing.recipe["fields"]}
    else:  # a new revision: past every revision any file of the group was written under
        revision, start = _next_revision(store, name, existing, journal), 0

    engine = _Engine(options, out, progress)
    try:
        if specs is None:
            specs = _probe(engine, out, pickled, given, options, index, name)
        while True:
            _check_names(out, name, specs, index)
            journal = {
                "recipe": recipe,
                "digest": digest,
                "revision": revision,
                # the revision the current index lists, kept for its readers when this one
                # is published (and by a tidying left to a later call)
                "keep": None
                if existing is None or existing.revision == revision
                else existing.revision,
                "start": start,
                "specs": [s.to_json() for s in specs.values()],
                "index": at_start,
            }
            store.write(journal_name(name), json.dumps(journal).encode())
            task = _task(out, name, revision, specs, pickled, options)
            try:
                made = _run_units(
                    engine, task, index, range(start, len(index.shards)), resume, progress
                )
                break
            except AxisVaries as e:
                specs = widened(specs, e.field, e.axis)
                _say(
                    True,
                    f"{e}; compiling field group {name!r} again, whole, with that axis ragged "
                    "(pass schema= to declare it)",
                )
                # the shards written so far, and any the group held (their schema is the
                # old one), are left behind: a new revision, from the first shard
                after = max(_next_revision(store, name, existing, None), revision + 1)
                revision, start, resume = after, 0, False
    finally:
        engine.close()
    fields = task.fields()
    kept = existing.shards[:start] if existing is not None and start else ()
    # the revision a reader of the current index reads, kept through this change
    earlier = existing.revision if existing is not None and existing.revision != revision else None
    group = FieldGroup(
        name,
        revision,
        fields,
        (*kept, *made),
        {**recipe, "fields": [s.to_json() for s in specs.values()]},
        {"created": now_utc()},
    )
    others = [g for g in index.field_groups if g.name != name]
    at = next((i for i, g in enumerate(index.field_groups) if g.name == name), len(others))
    index = replace(index, field_groups=(*others[:at], group, *others[at:]))
    _publish(store, index)
    fault_at("group published")
    _tidy(store, name, index, earlier)
    return index


def _files_of(store: Store, name: str) -> dict[str, int]:
    """Group ``name``'s shard files in the store, each with its revision."""
    out = {}
    for file in store.list(f"group-{name}-r"):
        m = re.fullmatch(rf"group-{name}-r(\d+)-\d{{6,}}\.dlop", file)
        if m:
            out[file] = int(m.group(1))
    return out


def _next_revision(
    store: Store, name: str, existing: FieldGroup | None, journal: dict[str, Any] | None
) -> int:
    """A revision no file of group ``name`` was written under: its files never replace a
    file a reader of an earlier index maps."""
    used = list(_files_of(store, name).values())
    if existing is not None:
        used.append(existing.revision)
    if journal is not None:
        used.append(int(journal["revision"]))
    return max(used, default=-1) + 1


def _task(
    out: str,
    name: str,
    revision: int,
    specs: dict[str, Spec],
    pickled: bytes,
    options: dict[str, Any],
) -> GroupTask:
    return GroupTask(
        out,
        name,
        revision,
        specs,
        options["codec"],
        options["seed"],
        pickled,
        options["timeout"],
        options["storage_options"],
    )


def _digest(recipe: Mapping[str, Any]) -> str:
    mine = {k: v for k, v in recipe.items() if k != "fields"}
    return hashlib.sha256(json.dumps(mine, sort_keys=True).encode()).hexdigest()


def _read_journal(store: Store, name: str, overwrite: bool = False) -> dict[str, Any] | None:
    """Group ``name``'s journal, None when there is none (or, with ``overwrite``, when it
    cannot be read: the group is compiled again from the start, past its files)."""
    data = store.read(journal_name(name))
    if data is None:
        return None
    path = f"{store.url}/{journal_name(name)}"
    try:
        if len(data) > MAX_JOURNAL_BYTES:
            raise FormatError(path, f"larger than a journal's {MAX_JOURNAL_BYTES} bytes")
        obj = loads_bounded(path, data, "journal")
        if not isinstance(obj, dict) or not {
            "recipe",
            "digest",
            "revision",
            "start",
            "specs",
            "index",
        } <= set(obj):
            raise FormatError(path, "not a field group journal")
        return obj
    except FormatError as e:
        if overwrite:
            return None
        raise CompileError(f"{e}; pass overwrite=True to compile the group again") from None


def _check_names(out: str, name: str, specs: Mapping[str, Spec], index: Index) -> None:
    """Refuses new fields named as one the archive or another group holds, or as the
    ``<field>_lengths`` a batch holds for a ragged field of either."""
    others = [*index.fields, *(f for g in index.field_groups if g.name != name for f in g.fields)]
    taken = {f.name for f in others}
    clash = sorted(set(specs) & taken)
    if clash:
        raise CompileError(
            f"{out}: the function gives field(s) {clash}, which the archive (or another of "
            "its field groups) holds already; name the new fields apart"
        )
    ragged = {f.name for f in others if f.ragged}
    ragged |= {s.name for s in specs.values() if s.kind == "array" and None in s.shape}
    names = taken | set(specs)
    for field in sorted(ragged):
        lengths = f"{field}_lengths"
        if lengths in names and (field in specs or lengths in specs):
            raise CompileError(
                f"{out}: field {field!r} varies in length, and a batch holds its lengths as "
                f"{lengths!r}, which names a field too; rename the new one"
            )


def _probe(
    engine: _Engine,
    out: str,
    pickled: bytes,
    given: dict[str, Any],
    options: dict[str, Any],
    index: Index,
    name: str,
) -> dict[str, Spec]:
    if not index.num_samples:
        raise CompileError(f"{out}: the archive holds no samples; no field to add")
    got = engine.call(probe, _task(out, name, 0, {}, pickled, options), PROBE_SAMPLES)
    dtype = options["dtype"]
    specs = infer(got[0][1], got[0][0], given, None if dtype is None else DTYPES[dtype])
    for where, leaves in got[1:]:
        specs = merge(specs, leaves, where)
    return specs


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"dlop add_fields: {message}", file=sys.stderr, flush=True)


class _Engine:
    """Where the user's function runs: a local pool of worker processes, or Dask."""

    def __init__(self, options: dict[str, Any], out: str, progress: bool) -> None:
        self.out = out
        self.progress = progress
        self.dask = options["dask"]
        self.workers = local_workers(options["workers"])
        self.stack = contextlib.ExitStack()
        self.client: Any = None
        self.pool: concurrent.futures.ProcessPoolExecutor | None = None

    def start(self) -> None:
        if self.dask is not None:
            if self.client is None:
                from ..run.dask_engine import dask_client

                self.client = self.stack.enter_context(dask_client(self.dask, self.progress))
        elif self.pool is None:
            self.pool = concurrent.futures.ProcessPoolExecutor(
                self.workers,
                mp_context=worker_context(),
                initializer=worker_start,
                initargs=(os.getpid(), dict(os.environ)),
            )

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        self.start()
        if self.client is not None:
            return self.client.submit(fn, *args, pure=False)
        assert self.pool is not None
        return self.pool.submit(fn, *args)

    def done(self, futures: list[Any]) -> Iterator[Any]:
        if self.client is not None:
            distributed: Any = importlib.import_module("distributed")  # annotations are partial
            yield from distributed.as_completed(futures)
        else:
            yield from concurrent.futures.as_completed(futures)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        future = self.submit(fn, *args)
        return self.result(future, "the first samples")

    def result(self, future: Any, what: str) -> Any:
        try:
            return future.result()
        except CompileError:
            raise
        except FormatError as e:  # the archive's shard is not what its index says
            raise CompileError(
                f"{e}; computing {what} read it, so nothing was published: verify the "
                "archive (dlop-inspect verify)"
            ) from None
        except concurrent.futures.process.BrokenProcessPool:
            self.pool = None
            raise CompileError(
                f"{self.out}: a worker process ended while computing {what}: the function "
                "exited, was killed, or ran past item_timeout; nothing was published"
            ) from None
        except Exception as e:
            if type(e).__name__ == "KilledWorker":
                raise CompileError(
                    f"{self.out}: the Dask workers computing {what} died (the function exited, "
                    "crashed or ran past item_timeout); nothing was published"
                ) from None
            raise

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        self.stack.close()


def _run_units(
    engine: _Engine, task: GroupTask, index: Index, shards: range, resume: bool, progress: bool
) -> list[GroupShard]:
    """Every pending unit's group shard (a resume keeps those already written whole)."""
    made: dict[int, GroupShard] = {}
    store = task.store()
    present = set(store.list(f"group-{task.name}-r{task.revision}-")) if resume else set()
    todo = []
    for k in shards:
        done = _written(store, task, index, k) if _named(task, k) in present else None
        if done is not None:
            made[k] = done
        else:
            todo.append(k)
    starts = np.cumsum([0, *(s.num_samples for s in index.shards)]).tolist()
    futures = {
        engine.submit(run_group_unit, task, k, index.shards[k], index.fields, starts[k]): k
        for k in todo
    }
    last = time.monotonic()
    try:
        for future in engine.done(list(futures)):
            k = futures[future]
            entry = engine.result(
                future, f"field group {task.name!r} of shard {index.shards[k].file}"
            )
            made[k] = GroupShard(
                ShardInfo.from_json(entry["file"], entry), int(entry["base_crc32"])
            )
            if progress and time.monotonic() - last >= PROGRESS_SECONDS:
                last = time.monotonic()
                _say(True, f"field group {task.name!r}: {len(made)} of {len(shards)} shards")
    except ItemFailed as e:
        raise CompileError(
            f"{task.archive}: field group {task.name!r}: {e}; a field group holds a value for "
            "every sample, so nothing was published (the archive reads as before). Fix the "
            "function and run again with overwrite=True"
        ) from None
    finally:
        for future in futures:
            future.cancel()
    return [made[k] for k in shards]


def _named(task: GroupTask, k: int) -> str:
    return group_file(task.name, task.revision, k)


def _written(store: Store, task: GroupTask, index: Index, k: int) -> GroupShard | None:
    """Group shard ``k`` as an interrupted compile published it (whole: a shard is
    published under its name only once complete), or None when it is not this group's."""
    name = _named(task, k)
    size = store.sizes(name).get(name)
    if size is None:
        return None
    info = ShardInfo(name, index.shards[k].num_samples, size, 0)
    try:
        with shard_file(store, info, task.fields()) as reader:
            if reader.verify():
                return None
            crc = reader.file_crc32()
            done = ShardInfo(name, reader.num_samples, size, crc, reader.header_crc32)
    except (FormatError, OSError):
        return None
    return GroupShard(done, index.shards[k].crc32)


def _publish(store: Store, index: Index) -> None:
    try:
        data = encode_index(index, f"{store.url}/{INDEX_NAME}")
    except SchemaError as e:
        raise CompileError(f"{store.url}: {e}") from None
    store.write(INDEX_NAME, data)


def _tidy(store: Store, name: str, index: Index, keep: int | None) -> None:
    """Deletes group ``name``'s files the index does not list (earlier revisions', an
    interrupted compile's) but revision ``keep``'s, the one the earlier index listed: a
    reader of that index (a running job, a node cache fetching as it reads) reads it to
    its end; the next change of the group deletes it. Then the group's journal."""
    listed = {s.info.file for g in index.field_groups for s in g.shards}
    for file, revision in _files_of(store, name).items():
        if file not in listed and revision != keep:
            store.delete(file)
    store.delete(journal_name(name))
    if isinstance(store, LocalStore):  # what killed units left half written (under the lock)
        store.clear_staging()

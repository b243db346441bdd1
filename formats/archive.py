"""Archive = directory of shards + index.json (SPEC.md §1, §6)."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import re
import stat
import threading
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from .constants import (
    ARCHIVE_FORMAT,
    ERRORS_NAME,
    FORMAT_VERSION,
    INDEX_NAME,
    JOURNAL_NAME,
    LOCK_NAME,
    MAX_ARCHIVE_SAMPLES,
    MAX_ERRORS_RECORDS,
    MAX_INDEX_BYTES,
    MAX_NAME_CHARS,
    MAX_SHARDS,
    SHARD_SUFFIX,
    SUPPORTED_VERSIONS,
    unsupported_version,
)
from .errors import DlopError, FormatError, SchemaError
from .files import atomic_write, check_scan, loads_bounded, read_capped, scan_json
from .generations import (
    IDENTITY_BYTES,
    Generation,
    errors_name,
    inputs_name,
    parse_generations,
    parse_identities,
)
from .groups import FieldGroup, parse_field_groups
from .joined import JoinedShard
from .limits import room_for_files
from .reader import BlockCache, Problem, ShardReader, Value
from .redact import redact
from .schema import Field, check_schema
from .skipped import encode_record, read_skipped
from .units import UnitTable
from .writer import IN_PLACE_SHARD_BYTES, ShardInfo, ShardWriter

# How ArchiveReader.verify runs its per-shard check: ``map`` or a pool's ``map``.
ShardMap = Callable[[Callable[[int], list[Problem]], Iterable[int]], Iterable[list[Problem]]]

_SHARD_NAME = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]*")


@dataclass(frozen=True)
class Index:
    """A parsed, validated index.json."""

    fields: tuple[Field, ...]
    shards: tuple[ShardInfo, ...]
    num_samples: int
    recipe: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    skipped_count: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    units: UnitTable | None = None  # absent from archives written before work units
    # what each compile into the archive added (SPEC.md §6.2); () for an index without them.
    # With generations, ``skipped_count`` counts every generation's skipped inputs, and
    # ``units`` is the first generation's while it is the only one (None after an append).
    generations: tuple[Generation, ...] = ()
    # fields added after the compile, in shard files aligned with the archive's (§6.3)
    field_groups: tuple[FieldGroup, ...] = ()

    def to_json(self) -> dict[str, Any]:
        units = {} if self.units is None else {"units": self.units.to_json()}
        skipped = self.generations[0].skipped if self.generations else self.skipped_count
        generations = (
            {"generations": [g.to_json() for g in self.generations]} if self.generations else {}
        )
        groups = (
            {"field_groups": [g.to_json() for g in self.field_groups]} if self.field_groups else {}
        )
        return {
            "format": ARCHIVE_FORMAT,
            "version": FORMAT_VERSION,
            "num_samples": self.num_samples,
            "schema": [f.to_json() for f in self.fields],
            "shards": [s.to_json() for s in self.shards],
            "recipe": self.recipe,
            "provenance": self.provenance,
            "skipped": {"count": skipped, "file": ERRORS_NAME},
            **units,
            **generations,
            **groups,
            "metadata": self.metadata,
        }

    def errors_files(self) -> list[tuple[str, int]]:
        """Each errors file with the skipped inputs it holds, in generation order."""
        if not self.generations:
            return [(ERRORS_NAME, self.skipped_count)]
        return [(errors_name(g), gen.skipped) for g, gen in enumerate(self.generations)]

    def complete_groups(self) -> tuple[FieldGroup, ...]:
        """The field groups that cover every shard: those whose fields are read."""
        return tuple(g for g in self.field_groups if g.covers == len(self.shards))


def shard_name(number: int) -> str:
    return f"shard-{number:05d}{SHARD_SUFFIX}"


def write_index(directory: str | os.PathLike[str], index: Index) -> Path:
    """Writes index.json last and atomically; the archive is complete once it exists."""
    path = Path(directory) / INDEX_NAME
    atomic_write(path, encode_index(index, path))
    return path


def encode_index(index: Index, path: object = INDEX_NAME) -> bytes:
    """index.json's bytes; refuses an index a reader would refuse (SPEC.md §6, §8)."""
    if index.num_samples != sum(s.num_samples for s in index.shards):
        raise SchemaError(
            f"index num_samples {index.num_samples} != sum over shards {sum(s.num_samples for s in index.shards)}"
        )
    if len(index.shards) > MAX_SHARDS:
        raise SchemaError(
            f"{len(index.shards)} shards; an archive holds at most {MAX_SHARDS} (SPEC.md §8): "
            "raise shard_bytes"
        )
    data = json.dumps(index.to_json(), indent=1, sort_keys=False).encode() + b"\n"
    # The bounds a reader enforces (SPEC.md §8), checked on the bytes it would read.
    if len(data) > MAX_INDEX_BYTES:
        raise SchemaError(
            f"index.json would be {len(data)} bytes, above its {MAX_INDEX_BYTES}-byte cap: "
            "recipe, provenance or metadata too large"
        )
    try:
        check_scan(path, scan_json(data), "index")
    except FormatError as e:
        raise SchemaError(f"{e.problem}: not written, a reader would refuse it") from None
    return data


def now_utc() -> str:
    """The creation time written into indexes: now, or SOURCE_DATE_EPOCH (seconds) when set,
    so that rebuilding an archive can reproduce its index byte for byte."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "")
    when = datetime.fromtimestamp(int(epoch), UTC) if epoch.isdigit() else datetime.now(UTC)
    return when.replace(microsecond=0).isoformat().replace("+00:00", "Z")


def read_index(directory: str | os.PathLike[str]) -> Index:
    """Reads and validates ``index.json`` against SPEC.md §6 and the bounds of §8.

    Unknown top-level keys are ignored (§7); what they cost to parse is bounded
    with the rest of the text (bytes, nesting, values, number length) before
    anything is parsed.
    """
    return parse_index(Path(directory) / INDEX_NAME, read_index_data(directory))


def read_index_data(directory: str | os.PathLike[str]) -> bytes:
    """``index.json``'s bytes as ``read_index`` reads them (within MAX_INDEX_BYTES), not
    yet validated: what pins a reader to the index it opened (parse_index checks them)."""
    path = Path(directory) / INDEX_NAME
    try:
        return read_capped(path, MAX_INDEX_BYTES, root=Path(directory), what="index")
    except FileNotFoundError:
        raise FormatError(path, f"no index.json: {_why_no_index(Path(directory))}") from None


def _why_no_index(folder: Path) -> str:
    """What a folder without index.json is: missing, a compile running (its lock is held:
    by whom), an interrupted compile, or not an archive."""
    if not folder.is_dir():
        return "no such folder" if not folder.exists() else "not a folder"
    if not (folder / JOURNAL_NAME).is_file():
        return "not a dlop archive"
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO never blocks
    try:
        fd = os.open(folder / LOCK_NAME, flags)
    except OSError:
        fd = -1
    if fd >= 0:
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:  # held: a compile is writing it now
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "pid unknown"
            return f"it is being compiled now ({holder}); read it once that compile ends"
        finally:
            os.close(fd)
    return (
        "its compile did not finish (interrupted); run the same dlop-compile again with "
        "--resume to finish it"
    )


def parse_index(path: str | os.PathLike[str], data: bytes) -> Index:
    """``index.json``'s bytes validated as read_index does (``path`` names them in errors);
    for an index held in memory, e.g. one fetched from object storage."""
    if len(data) > MAX_INDEX_BYTES:
        raise FormatError(path, f"index is {len(data)} bytes, above its {MAX_INDEX_BYTES}-byte cap")
    obj = loads_bounded(path, data, "index")
    if not isinstance(obj, dict):
        raise FormatError(path, "index is not a JSON object")
    if obj.get("format") != ARCHIVE_FORMAT:
        raise FormatError(path, f"'format' is {obj.get('format')!r}, expected {ARCHIVE_FORMAT!r}")
    version = obj.get("version")
    if isinstance(version, bool) or version not in SUPPORTED_VERSIONS:
        raise FormatError(path, unsupported_version(version, "archive"))
    schema = obj.get("schema")
    shards = obj.get("shards")
    if not isinstance(schema, list) or not isinstance(shards, list):
        raise FormatError(path, "'schema' and 'shards' must be lists")
    if len(shards) > MAX_SHARDS:
        raise FormatError(
            path, f"lists {len(shards)} shards; an archive holds at most {MAX_SHARDS} (SPEC.md §8)"
        )
    try:
        fields = tuple(Field.from_json(f, f"schema entry #{i}") for i, f in enumerate(schema))
        check_schema(fields)
    except SchemaError as e:
        raise FormatError(path, str(e)) from None
    infos = []
    for i, s in enumerate(shards):
        if not isinstance(s, dict):
            raise FormatError(path, f"shard entry #{i} is not an object")
        name = s.get("file")
        if (
            not isinstance(name, str)
            or len(name) > MAX_NAME_CHARS
            or not _SHARD_NAME.fullmatch(name)
            or name == INDEX_NAME
        ):
            raise FormatError(
                path,
                f"shard entry #{i}: file {name!r:.{MAX_NAME_CHARS + 8}} is not a plain file name "
                f"of at most {MAX_NAME_CHARS} characters in the archive",
            )
        try:
            infos.append(ShardInfo.from_json(name, s))
        except ValueError as e:
            raise FormatError(path, f"shard entry #{i} ({name}): {e}") from None
    if len({s.file for s in infos}) != len(infos):
        raise FormatError(path, "a shard file is listed twice")
    total = obj.get("num_samples")
    if isinstance(total, int) and total > MAX_ARCHIVE_SAMPLES:
        raise FormatError(
            path, f"num_samples {total} exceeds the {MAX_ARCHIVE_SAMPLES}-sample archive limit"
        )
    if total != sum(s.num_samples for s in infos) or isinstance(total, bool):
        raise FormatError(
            path, f"num_samples {total!r} != {sum(s.num_samples for s in infos)} summed over shards"
        )
    skipped = obj.get("skipped", {})
    count = skipped.get("count", 0) if isinstance(skipped, dict) else None
    if (
        isinstance(count, bool)
        or not isinstance(count, int)
        or not 0 <= count <= MAX_ERRORS_RECORDS
    ):
        raise FormatError(
            path,
            f"'skipped' is {skipped!r:.200}; expected an object whose 'count' is an integer "
            f"0 ... {MAX_ERRORS_RECORDS}",
        )
    dicts = {k: obj.get(k, {}) for k in ("recipe", "provenance", "metadata")}
    for k, v in dicts.items():
        if not isinstance(v, dict):
            raise FormatError(path, f"{k!r} should be an object")
    units, listed = obj.get("units"), obj.get("generations")
    generations: tuple[Generation, ...] = ()
    if listed is not None:
        generations = parse_generations(path, listed, infos, total, count)
        if units is not None and (len(generations) > 1 or generations[0].units is None):
            raise FormatError(
                path, "'units' beside more than one generation (SPEC.md §6.2): each holds its own"
            )
        count = sum(g.skipped for g in generations)
    table = None
    if units is not None:
        table = UnitTable.from_json(path, units, [s.file for s in infos], count)
        if generations and table != generations[0].units:
            raise FormatError(path, "'units' differs from its generation's (SPEC.md §6.2)")
    listed_groups = obj.get("field_groups")
    groups = () if listed_groups is None else parse_field_groups(path, listed_groups, fields, infos)
    return Index(
        fields,
        tuple(infos),
        total,
        dicts["recipe"],
        dicts["provenance"],
        count,
        dicts["metadata"],
        table,
        generations,
        groups,
    )


class ArchiveWriter:
    """Writes samples into shards of about ``shard_bytes`` each, then the index.

    A shard closes once it holds ``shard_bytes`` or more, and only between
    groups (``write_group``): the samples one input yields (clips, segments,
    tiles) always share a shard, so a group larger than ``shard_bytes`` makes
    one shard larger than ``shard_bytes``. ``write(sample)`` is a group of one.

    On ``abort()`` (or an exception inside ``with``) every file this writer made
    is removed and no index is written. To continue an interrupted write, pass
    the shards already completed (and inputs already skipped); ``on_shard`` is
    called after each shard is closed, for progress records. ``name_shard`` names
    the shard numbered from 0 among this writer's (``shard-NNNNN.dlop`` by default);
    a writer of one work unit's shards names them by unit (units.unit_shard_name) and
    ends with ``finish_shards`` instead of writing an index.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        fields: Sequence[Field],
        *,
        shard_bytes: int = 256 << 20,
        recipe: Mapping[str, Any] | None = None,
        provenance: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        shards: Sequence[ShardInfo] = (),
        skipped: Sequence[Mapping[str, Any]] = (),
        on_shard: Callable[[ShardInfo], None] | None = None,
        name_shard: Callable[[int], str] = shard_name,
    ) -> None:
        self.directory = Path(directory)
        self.name_shard = name_shard
        self.fields = tuple(check_schema(fields).values())
        if shard_bytes < 1:
            raise SchemaError(f"shard_bytes must be positive, got {shard_bytes}")
        self.shard_bytes = shard_bytes
        self.recipe = dict(recipe or {})
        self.provenance = dict(provenance or {})
        self.metadata = dict(metadata or {})
        self.directory.mkdir(parents=True, exist_ok=True)
        index = self.directory / INDEX_NAME
        if index.exists():
            if not overwrite:
                raise DlopError(
                    f"{self.directory} already holds an archive; choose another path or overwrite it"
                )
            index.unlink()
        self.shards: list[ShardInfo] = list(shards)
        self.skipped: list[dict[str, Any]] = [dict(s) for s in skipped]
        self.on_shard = on_shard
        self._current: ShardWriter | None = None

    def write(self, sample: Mapping[str, Any]) -> None:
        self.write_group((sample,))

    def write_group(self, samples: Iterable[Mapping[str, Any]]) -> None:
        """Writes samples that belong together into one shard; the shard may close after them.

        ``on_shard`` therefore only ever sees shards that end on a group boundary,
        which lets a caller count whole inputs as done when a shard completes.
        """
        for sample in samples:
            if self._current is None:
                if len(self.shards) >= MAX_SHARDS:
                    raise SchemaError(
                        f"{self.directory}: an archive holds at most {MAX_SHARDS} shards "
                        f"(SPEC.md §8); raise shard_bytes (now {self.shard_bytes})"
                    )
                self._current = ShardWriter(
                    self.directory / self.name_shard(len(self.shards)),
                    self.fields,
                    in_place=self.shard_bytes >= IN_PLACE_SHARD_BYTES,
                )
            self._current.write(sample)
        if self._current is not None and self._current.bytes_written >= self.shard_bytes:
            self._finish_shard(self._current)

    def _finish_shard(self, writer: ShardWriter) -> None:
        self._current = None
        self.shards.append(writer.close())
        if self.on_shard is not None:
            self.on_shard(self.shards[-1])

    def skip(self, path: str, reason: str, **extra: Any) -> None:
        """Records an input that was not compiled (written to errors.jsonl).

        ``extra`` values are strings, numbers, booleans or None (SPEC.md §8)."""
        record = {"path": redact(path), "reason": redact(reason), **extra}
        encode_record(record, len(self.skipped))  # refused now rather than at close
        self.skipped.append(record)

    def finish_shards(self) -> list[ShardInfo]:
        """Closes the last shard; returns every completed one. Writes no index."""
        if self._current is not None:
            self._finish_shard(self._current)
        return self.shards

    def close(self, before_index: Callable[[], None] | None = None) -> Index:
        """Closes the last shard, writes errors.jsonl, calls ``before_index``, writes the index."""
        self.finish_shards()
        if self.skipped:
            lines = b"".join(encode_record(s, i) for i, s in enumerate(self.skipped))
            atomic_write(self.directory / ERRORS_NAME, lines)
        if before_index is not None:
            before_index()
        provenance = {"dlop_version": _dlop_version(), "created": now_utc(), **self.provenance}
        index = Index(
            self.fields,
            tuple(self.shards),
            sum(s.num_samples for s in self.shards),
            self.recipe,
            provenance,
            len(self.skipped),
            self.metadata,
        )
        write_index(self.directory, index)
        return index

    def abort(self, keep_completed: bool = False) -> None:
        """Drops the shard in progress and, unless ``keep_completed``, every completed one."""
        if self._current is not None:
            self._current.abort()
            self._current = None
        if keep_completed:
            return
        for s in self.shards:
            (self.directory / s.file).unlink(missing_ok=True)
        self.shards.clear()

    def __enter__(self) -> ArchiveWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class ArchiveReader:
    """Reads an archive directory; shards are opened (and validated) on first use.

    With ``field_groups`` (the default) the fields of every field group that covers the
    whole archive are read beside the archive's own, each shard as one (JoinedShard);
    without, the archive reads as its compile wrote it."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        block_cache_bytes: int = 256 << 20,
        *,
        field_groups: bool = True,
        index: Index | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.block_cache = BlockCache(block_cache_bytes)  # decoded zstd blocks, for all shards
        # ``index``: one validated already (parse_index), for a folder whose own index.json
        # is another version of it (a node cache's, kept without field groups)
        self.index = read_index(self.directory) if index is None else index
        self.groups = {g.name: g for g in self.index.complete_groups()} if field_groups else {}
        self.owners = {f.name: g.name for g in self.groups.values() for f in g.fields}
        self.fields: dict[str, Field] = {f.name: f for f in self.index.fields}
        self.fields.update((f.name, f) for g in self.groups.values() for f in g.fields)
        self.num_samples = self.index.num_samples
        # shard_starts[k] is the global index of shard k's first sample.
        self.shard_starts = np.cumsum(
            [0] + [s.num_samples for s in self.index.shards], dtype=np.int64
        )
        self._readers: list[ShardReader | None] = [None] * len(self.index.shards)
        self._lock = threading.Lock()
        # each shard it maps keeps a descriptor, its field groups' files too
        room_for_files(len(self.index.shards) * (1 + len(self.groups)))

    def __len__(self) -> int:
        return self.num_samples

    @property
    def num_shards(self) -> int:
        return len(self.index.shards)

    def shard(self, k: int) -> ShardReader:
        reader = self._readers[k]
        if reader is not None:
            return reader
        with self._lock:
            if self._readers[k] is None:
                self._readers[k] = self._open(k)
        return self._readers[k]  # type: ignore[return-value]

    def _open(self, k: int) -> ShardReader:
        reader = self._open_file(self.index.shards[k], self.index.fields)
        if not self.groups:
            return reader
        own = {n: f for n, f in self.fields.items() if n in self.owners}
        return JoinedShard(reader, own, self.owners, lambda name: self.open_group(name, k))

    def _open_file(self, info: ShardInfo, fields: tuple[Field, ...], tied: str = "") -> ShardReader:
        """The shard file ``info`` lists, checked against it: its size, its sample count,
        its schema (``fields``) and, when ``tied`` says whose shard it must be, its header
        CRC-32 (which ties every region's CRC to the index)."""
        path = self.directory / info.file
        reader = ShardReader(
            path,
            block_cache=self.block_cache,
            archive_dir=self.directory,
            expected_bytes=info.bytes,
        )
        problem = None
        if tied and reader.header_crc32 != info.header_crc32:
            problem = (
                f"header CRC-32 {reader.header_crc32:#010x} differs from index.json's "
                f"{info.header_crc32:#010x}: not {tied}"
            )
        elif info.header_crc32 not in (None, reader.header_crc32):
            # the header's CRC-32 ties every region's CRC to the index: another file of
            # the same size and count (an archive compiled again in place) is refused
            problem = (
                f"header CRC-32 {reader.header_crc32:#010x} differs from index.json's "
                f"header_crc32 {info.header_crc32:#010x}: not the shard the index lists (the "
                "archive compiled again since the index was read?)"
            )
        elif reader.num_samples != info.num_samples:
            problem = f"holds {reader.num_samples} samples, index.json says {info.num_samples}"
        elif tuple(reader.fields.values()) != fields:
            problem = "shard schema differs from the index schema"
        if problem is not None:
            reader.close()
            raise FormatError(path, problem)
        return reader

    def open_group(self, name: str, k: int) -> ShardReader:
        """Group ``name``'s shard aligned with shard ``k``, checked against its entry."""
        group = next(g for g in self.index.field_groups if g.name == name)
        tied = f"field group {name!r}'s shard for {self.index.shards[k].file}"
        return self._open_file(group.shards[k].info, group.fields, tied)

    def locate(self, index: int) -> tuple[int, int]:
        """Global sample index -> (shard number, index within the shard)."""
        if not 0 <= index < self.num_samples:
            raise IndexError(
                f"{self.directory}: sample {index} out of range 0..{self.num_samples - 1}"
            )
        k = int(np.searchsorted(self.shard_starts, index, side="right")) - 1
        return k, index - int(self.shard_starts[k])

    def get(self, name: str, index: int) -> Value:
        k, i = self.locate(index)
        return self.shard(k).get(name, i)

    def sample(self, index: int) -> dict[str, Value]:
        k, i = self.locate(index)
        return self.shard(k).sample(i)

    def errors(self, limit: int | None = None) -> list[dict[str, Any]]:
        """The skipped inputs recorded in errors.jsonl, in order: the first ``limit`` when given.

        Only the chunks holding the lines returned are read, and only those
        lines parsed; reading them all also checks that the file holds exactly
        the index's skipped count.
        """
        with contextlib.closing(self.iter_errors()) as records:
            return list(itertools.islice(records, limit))

    def iter_errors(self) -> Generator[dict[str, Any], None, None]:
        """The skipped inputs' records one at a time, every generation's errors file in
        turn (see ``dlop.formats.skipped``)."""
        for name, count in self.index.errors_files():
            yield from read_skipped(self.directory, count, name)

    def verify(
        self,
        progress: Callable[[int], None] | None = None,
        map_shards: ShardMap = map,
    ) -> list[Problem]:
        """Checks every shard's whole-file CRC, structure, regions and blocks, and errors.jsonl.

        Shards are checked through ``map_shards(check, shard_numbers)``, in order by
        default; a caller that wants them checked in parallel passes its own pool's
        ``map`` (the format layer starts no threads).
        """

        def one(k: int) -> list[Problem]:
            info = self.index.shards[k]
            path = self.directory / info.file
            try:
                reader = self._open(k)
            except FormatError as e:
                return [Problem(str(path), None, None, e.problem)]
            try:
                problems = reader.verify()
                crc = reader.file_crc32()
                if crc != info.crc32 and not problems:
                    problems.append(
                        Problem(str(path), None, None, "whole-file CRC-32 differs from index.json")
                    )
                if info.header_crc32 not in (None, reader.header_crc32):
                    problems.append(
                        Problem(
                            str(path),
                            None,
                            None,
                            f"header CRC-32 {reader.header_crc32:#010x} differs from index.json's "
                            f"header_crc32 {info.header_crc32:#010x}",
                        )
                    )
                return problems
            finally:
                reader.close()

        def with_groups(k: int) -> list[Problem]:
            found = one(k)
            for group in self.index.field_groups:
                if k < group.covers:
                    found += self.verify_group_shard(group.name, k)
            return found

        problems: list[Problem] = []
        for k, found in enumerate(map_shards(with_groups, range(len(self.index.shards)))):
            problems += found
            if progress:
                progress(k + 1)
        try:  # every record, one at a time: the count and each record's shape
            for _ in self.iter_errors():
                pass
        except FormatError as e:
            problems.append(Problem(e.path, None, None, e.problem))
        for g in range(len(self.index.generations)):
            try:
                self.input_identities(g)
            except FormatError as e:
                problems.append(Problem(e.path, None, None, e.problem))
        return problems

    def verify_group_shard(self, name: str, k: int) -> list[Problem]:
        """What is wrong with group ``name``'s shard aligned with shard ``k``: its index
        entry, every checksum in it, and its whole-file CRC-32."""
        group = next(g for g in self.index.field_groups if g.name == name)
        info = group.shards[k].info
        try:
            reader = self.open_group(name, k)
        except FormatError as e:
            return [Problem(e.path, None, None, e.problem)]
        try:
            problems = reader.verify()
            if not problems and reader.file_crc32() != info.crc32:
                problems.append(
                    Problem(
                        str(reader.path), None, None, "whole-file CRC-32 differs from index.json"
                    )
                )
            return problems
        finally:
            reader.close()

    def input_identities(self, generation: int) -> np.ndarray:
        """The identities of the inputs ``generation`` read (SPEC.md §6.2), checked."""
        gen = self.index.generations[generation]
        path = self.directory / inputs_name(generation)
        cap = gen.inputs * IDENTITY_BYTES
        try:
            data = read_capped(path, cap, root=self.directory, what="inputs file")
        except FileNotFoundError:
            raise FormatError(path, "is missing; index.json lists it") from None
        return parse_identities(path, data, gen)

    def close(self) -> None:
        for r in self._readers:
            if r is not None:
                r.close()
        self._readers = [None] * len(self._readers)

    def __enter__(self) -> ArchiveReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _dlop_version() -> str:
    from dlop import __version__  # the top-level package only: no torch, compiler or runtime

    return __version__

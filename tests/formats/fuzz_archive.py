"""Child process for test_fuzz.py: structural mutations of an archive, read back.

Hypothesis mutates index.json and shard headers (types, counts, shapes, nesting),
the contents of a shard's regions (offsets, shapes, block-table rows, data; with
the region CRC fixed up or not), the lines of errors.jsonl, and the archive's
files (kinds, links, truncation). Each mutant is opened and read through
dlop.formats, dlop-inspect's summary and the runtime's open_archive (samples
and a batch through ``__getitems__``). The only outcomes allowed are success and
a DlopError. Runs under a capped address space; the number of examples comes
from DLOP_FUZZ_EXAMPLES.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import struct
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for tests.formats.helpers

from dlop.formats import ArchiveReader, ArchiveWriter, DlopError, Field, Zstd
from dlop.runtime import open_archive
from dlop.tools.inspect_cli import archive_summary
from tests.formats.helpers import read_header, rewrite_header

ADDRESS_SPACE_BYTES = 4 << 30  # the runtime maps shards and loads torch
EXAMPLES = int(os.environ.get("DLOP_FUZZ_EXAMPLES", "300"))

FIELDS = [
    Field("label", "i64", ()),
    Field("feat", "f16", (2, 3)),
    Field("rag", "f32", (None, 2)),
    Field("zfix", "i16", (4,), codec=Zstd(block_bytes=24)),
    Field.bytes_("z", codec=Zstd(block_bytes=16, shuffle=True)),
    Field.str_("text"),
]


def make_base(path: Path) -> Path:
    with ArchiveWriter(path, FIELDS, shard_bytes=300, metadata={"classes": ["a", "b"]}) as w:
        for i in range(8):
            w.write(
                {
                    "label": i,
                    "feat": np.full((2, 3), i, np.float16),
                    "rag": np.full((i % 3, 2), i, np.float32),
                    "zfix": np.arange(4, dtype=np.int16) * i,
                    "z": bytes(range(i)),
                    "text": f"t{i}",
                }
            )
        w.skip("bad.wav", "zero-byte file")
    return path


HUGE_INTS = st.sampled_from(
    [-1, 0, 1, 2, 3, 4095, 4096, 1 << 31, 1 << 32, 1 << 40, 1 << 62, 1 << 63, 1 << 64, 1 << 70]
)
SCALARS = st.one_of(
    HUGE_INTS,
    st.integers(-(1 << 66), 1 << 66),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.sampled_from(["raw", "zstd", "u8", "f32", "bytes", "str", "array", "dlop-shard"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
DEEP = st.integers(1, 5000).map(lambda d: json.loads("[" * min(d, 900) + "]" * min(d, 900)))


def paths_of(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += paths_of(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += paths_of(v, (*prefix, i))
    return out


def set_path(obj: Any, path: tuple[Any, ...], value: Any, how: str) -> None:
    parent = obj
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    if how == "delete":
        del parent[key]
    elif how == "wrap":
        parent[key] = [parent[key]]
    else:
        parent[key] = value


EDIT = st.tuples(
    st.integers(0, 10_000),
    st.sampled_from(["set", "set", "set", "delete", "wrap"]),
    st.one_of(VALUES, DEEP),
)
# A u64 written into a region: (shard, field, region, element, value, fix the region CRC).
REGION_EDIT = st.tuples(
    st.integers(0, 7),
    st.integers(0, 15),
    st.integers(0, 7),
    st.integers(0, 1 << 12),
    st.one_of(HUGE_INTS, st.integers(0, 64), st.integers(-(1 << 63), (1 << 64) - 1)),
    st.booleans(),
)
ERROR_LINES = st.lists(
    st.one_of(
        VALUES.map(json.dumps),
        st.dictionaries(st.sampled_from(["path", "reason", "key", "x"]), SCALARS).map(json.dumps),
        st.sampled_from(["", "{", "[]" * 1000, '{"path": "a", "reason": "' + "r" * 70_000 + '"}']),
    ),
    max_size=5,
)
FILE_KINDS = st.sampled_from(
    ["fifo", "dir", "dev_zero", "link_out", "link_in", "empty", "truncate", "deep_text"]
)


@st.composite
def mutations(draw: st.DrawFn) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for _ in range(draw(st.integers(1, 3))):
        target = draw(
            st.sampled_from(["index", "header", "header", "region", "region", "errors", "file"])
        )
        if target == "region":
            out.append((target, draw(REGION_EDIT)))
        elif target == "errors":
            out.append((target, draw(ERROR_LINES)))
        elif target == "file":
            which = draw(st.sampled_from(["index.json", "errors.jsonl", "shard-00000.dlop"]))
            out.append(("file", (which, draw(FILE_KINDS), draw(st.integers(0, 1 << 16)))))
        else:
            out.append((target, draw(EDIT)))
    return out


def edit_region(archive: Path, edit: tuple[int, int, int, int, int, bool]) -> None:
    """Writes one little-endian u64 into a region of a shard, fixing its CRC when asked."""
    k, fi, ri, elem, value, fix_crc = edit
    shards = sorted(archive.glob("shard-*.dlop"))
    if not shards:
        return
    shard = shards[k % len(shards)]
    if not shard.is_file() or shard.is_symlink():
        return
    try:
        header, _ = read_header(shard)
        field = header["fields"][fi % len(header["fields"])]
        names = sorted(field["regions"])
        region = field["regions"][names[ri % len(names)]]
        offset, length = int(region["offset"]), int(region["length"])
    except (
        ValueError,
        RecursionError,
        struct.error,
        LookupError,
        TypeError,
        AttributeError,
        ZeroDivisionError,  # no fields, or a field with no regions
    ):
        return  # an earlier mutation broke the header already
    raw = bytearray(shard.read_bytes())
    if length < 8 or not 0 <= offset <= len(raw) - length:
        return
    struct.pack_into("<Q", raw, offset + (elem % (length // 8)) * 8, value % (1 << 64))
    shard.write_bytes(bytes(raw))
    if fix_crc:
        region["crc32"] = zlib.crc32(raw[offset : offset + length])
        with contextlib.suppress(AssertionError):  # AssertionError: no longer fits
            rewrite_header(shard, header)


def apply(archive: Path, outside: Path, muts: list[tuple[str, Any]]) -> None:
    for target, m in muts:
        if target == "region":
            edit_region(archive, m)
        elif target == "errors":
            errors = archive / "errors.jsonl"
            if errors.is_symlink() or errors.is_dir():
                continue
            errors.write_text("".join(line + "\n" for line in m))
        elif target == "index":
            index = archive / "index.json"
            if not index.is_file() or index.is_symlink():
                continue
            try:
                obj = json.loads(index.read_text())
            except (ValueError, RecursionError):  # an earlier mutation broke it already
                continue
            paths = paths_of(obj)
            if not paths:
                continue
            n, how, value = m
            set_path(obj, paths[n % len(paths)], value, how)
            index.write_text(json.dumps(obj))
        elif target == "header":
            shard = archive / "shard-00000.dlop"
            if not shard.is_file() or shard.is_symlink():
                continue
            try:
                header, _ = read_header(shard)
            except (ValueError, RecursionError, struct.error):  # broken already
                continue
            paths = paths_of(header)
            if not paths:
                continue
            n, how, value = m
            set_path(header, paths[n % len(paths)], value, how)
            try:
                rewrite_header(shard, header)
            except AssertionError:  # no longer fits before the first region
                continue
        else:
            name, kind, cut = m
            path = archive / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                if kind == "truncate" and path.is_file() and not path.is_symlink():
                    data = path.read_bytes()
                    path.write_bytes(data[: cut % (len(data) + 1)])
                    continue
                path.unlink()
            if kind == "fifo":
                os.mkfifo(path)
            elif kind == "dir":
                path.mkdir()
            elif kind == "dev_zero":
                path.symlink_to("/dev/zero")
            elif kind == "link_out":
                path.symlink_to(outside)
            elif kind == "link_in":
                path.symlink_to("shard-00001.dlop")
            elif kind == "deep_text":
                path.write_text("[" * 100_000 + "]" * 100_000)
            else:
                path.write_bytes(b"")


def read_everything(archive: Path, counts: dict[str, int]) -> None:
    with ArchiveReader(archive) as reader:
        for i in range(min(len(reader), 8)):
            reader.sample(i)
        reader.errors()
        reader.verify()
        archive_summary(reader)
    ds = open_archive(archive)
    n = len(ds)
    for i in range(min(n, 8)):
        ds[i]
    if n:
        ds.__getitems__(list(range(n - 1, -1, -1)))  # every sample, across shards, reordered
        ds.__getitems__([0])
    counts["runtime_batches"] += 1


def main() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))
    work = Path(tempfile.mkdtemp(prefix="dlop-fuzz-"))
    base = make_base(work / "base")
    outside = work / "outside.dlop"
    shutil.copy(base / "shard-00000.dlop", outside)
    counts = {"ok": 0, "dlop": 0, "runtime_batches": 0, "region_edits": 0, "errors_edits": 0}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        # make test replays the same examples every run; make fuzz explores afresh
        derandomize="DLOP_FUZZ_RANDOM" not in os.environ,
        suppress_health_check=list(HealthCheck),
    )
    @given(mutations())
    def check(muts: list[tuple[str, Any]]) -> None:
        archive = work / "a"
        if archive.exists():
            shutil.rmtree(archive)
        shutil.copytree(base, archive, symlinks=True)
        apply(archive, outside, muts)
        for target in ("region", "errors"):
            counts[f"{target}_edits"] += any(t == target for t, _ in muts)
        try:
            read_everything(archive, counts)
            counts["ok"] += 1
        except DlopError:
            counts["dlop"] += 1

    try:
        check()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"FUZZ {json.dumps(counts)}", flush=True)


if __name__ == "__main__":
    main()

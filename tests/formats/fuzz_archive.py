"""Child process for test_fuzz.py: structural mutations of an archive, read back.

Hypothesis mutates index.json and shard headers (types, counts, shapes, nesting)
and the archive's files (kinds, links, truncation); each mutant is opened and
read through dlop.formats and dlop-inspect's summary. The only outcomes allowed
are success and a DlopError. Runs under a capped address space; the number of
examples comes from DLOP_FUZZ_EXAMPLES.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for tests.formats.helpers

from dlop.formats import ArchiveReader, ArchiveWriter, DlopError, Field, Zstd
from dlop.tools.inspect_cli import archive_summary
from tests.formats.helpers import read_header, rewrite_header

ADDRESS_SPACE_BYTES = 3 << 30
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
FILE_KINDS = st.sampled_from(
    ["fifo", "dir", "dev_zero", "link_out", "link_in", "empty", "truncate", "deep_text"]
)


@st.composite
def mutations(draw: st.DrawFn) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for _ in range(draw(st.integers(1, 3))):
        target = draw(st.sampled_from(["index", "header", "header", "file"]))
        if target == "file":
            which = draw(st.sampled_from(["index.json", "errors.jsonl", "shard-00000.dlop"]))
            out.append(("file", (which, draw(FILE_KINDS), draw(st.integers(0, 1 << 16)))))
        else:
            out.append((target, draw(EDIT)))
    return out


def apply(archive: Path, outside: Path, muts: list[tuple[str, Any]]) -> None:
    for target, m in muts:
        if target == "index":
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


def read_everything(archive: Path) -> None:
    with ArchiveReader(archive) as reader:
        for i in range(min(len(reader), 8)):
            reader.sample(i)
        reader.errors()
        reader.verify(threads=1)
        archive_summary(reader)


def main() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))
    work = Path(tempfile.mkdtemp(prefix="dlop-fuzz-"))
    base = make_base(work / "base")
    outside = work / "outside.dlop"
    shutil.copy(base / "shard-00000.dlop", outside)
    counts = {"ok": 0, "dlop": 0}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(mutations())
    def check(muts: list[tuple[str, Any]]) -> None:
        archive = work / "a"
        if archive.exists():
            shutil.rmtree(archive)
        shutil.copytree(base, archive, symlinks=True)
        apply(archive, outside, muts)
        try:
            read_everything(archive)
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

"""Archives from anywhere: hostile files, links, sizes, nesting and counts (SPEC.md §8).

Every case is opened through each entry point (the formats reader, the runtime's
open_archive and Loader, and dlop-inspect info/verify/show) in one child process
with a watchdog and a capped address space (entry_runner.py), so a hang or a
runaway allocation fails the test instead of stalling or exhausting the machine.
Each entry must succeed or raise a dlop error that names the file.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlop.formats import (
    ArchiveReader,
    ArchiveWriter,
    Field,
    FormatError,
    SchemaError,
    ShardWriter,
    Zstd,
    read_index,
)
from dlop.formats.constants import PREAMBLE
from dlop.formats.header import parse_header

from .helpers import read_header, rewrite_header

RUNNER = Path(__file__).with_name("entry_runner.py")
ENTRIES = ("formats", "open_archive", "loader", "info", "verify", "show")
FIELDS = [
    Field("label", "i64", ()),
    Field("rag", "f32", (None, 2)),
    Field.bytes_("z", codec=Zstd(block_bytes=64)),
    Field.str_("text"),
]


def make_archive(path: Path, n: int = 6) -> Path:
    with ArchiveWriter(path, FIELDS, shard_bytes=200) as w:
        for i in range(n):
            w.write(
                {
                    "label": i,
                    "rag": np.full((i % 3, 2), i, np.float32),
                    "z": bytes(range(i + 1)),
                    "text": f"t{i}",
                }
            )
        w.skip("bad.wav", "zero-byte file")
    return path


def edit_index(archive: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    obj = json.loads((archive / "index.json").read_text())
    edit(obj)
    (archive / "index.json").write_text(json.dumps(obj))


def put_region(shard: Path, header: dict[str, Any], field: int, region: str, data: bytes) -> None:
    """Writes ``data`` as a field's region in place (it must fit before the next region)."""
    r = header["fields"][field]["regions"][region]
    raw = bytearray(shard.read_bytes())
    raw[r["offset"] : r["offset"] + len(data)] = data
    shard.write_bytes(bytes(raw))
    r.update(length=len(data), crc32=zlib.crc32(data))


def zstd_frame_claiming(content_size: int) -> bytes:
    """A Zstandard frame whose header declares ``content_size`` bytes, holding one RLE block."""
    descriptor = 0xE0  # 8-byte content size, single segment, no checksum, no dictionary
    block = struct.pack("<I", 1 | (1 << 1) | (1024 << 3))[:3] + b"\x00"  # last, RLE, 1 KiB
    return struct.pack("<IB", 0xFD2FB528, descriptor) + struct.pack("<Q", content_size) + block


# -- cases -------------------------------------------------------------------------------------


def case_fifo_index(a: Path) -> None:
    (a / "index.json").unlink()
    os.mkfifo(a / "index.json")


def case_fifo_errors(a: Path) -> None:
    (a / "errors.jsonl").unlink()
    os.mkfifo(a / "errors.jsonl")


def case_fifo_shard(a: Path) -> None:
    (a / "shard-00000.dlop").unlink()
    os.mkfifo(a / "shard-00000.dlop")


def case_dir_shard(a: Path) -> None:
    (a / "shard-00000.dlop").unlink()
    (a / "shard-00000.dlop").mkdir()


def case_zero_index(a: Path) -> None:
    (a / "index.json").unlink()
    (a / "index.json").symlink_to("/dev/zero")


def case_zero_errors(a: Path) -> None:
    (a / "errors.jsonl").unlink()
    (a / "errors.jsonl").symlink_to("/dev/zero")


def case_shard_links_out(a: Path) -> None:
    outside = a.parent / f"{a.name}-elsewhere.dlop"
    (a / "shard-00000.dlop").rename(outside)
    (a / "shard-00000.dlop").symlink_to(outside)


def case_shard_links_etc(a: Path) -> None:
    (a / "shard-00000.dlop").unlink()
    (a / "shard-00000.dlop").symlink_to("/etc/passwd")


def case_index_links_out(a: Path) -> None:
    outside = a.parent / f"{a.name}-index.json"
    (a / "index.json").rename(outside)
    (a / "index.json").symlink_to(outside)


def case_shard_links_inside(a: Path) -> None:
    (a / "store").mkdir()
    (a / "shard-00000.dlop").rename(a / "store" / "first.dlop")
    (a / "shard-00000.dlop").symlink_to(Path("store") / "first.dlop")


def case_zstd_claims_2_40(a: Path) -> None:
    """One block of field z claims 2**40 bytes; table, offsets, shapes and frame all agree."""
    shard = a / "shard-00000.dlop"
    header, _ = read_header(shard)
    k = next(i for i, f in enumerate(header["fields"]) if f["name"] == "z")
    n = header["num_samples"]
    huge = 1 << 40
    shapes = np.array([[huge]] + [[0]] * (n - 1), "<i8")
    offsets = np.array([0] + [huge] * n, "<u8")
    frame = zstd_frame_claiming(huge)
    blocks = np.array([[0, len(frame), 0, huge, zlib.crc32(frame)]], "<u8")
    put_region(shard, header, k, "shapes", shapes.tobytes())
    put_region(shard, header, k, "offsets", offsets.tobytes())
    put_region(shard, header, k, "blocks", blocks.tobytes())
    put_region(shard, header, k, "data", frame)
    header["fields"][k].update(value_count=huge, num_blocks=1)
    rewrite_header(shard, header)


def case_zstd_no_blocks(a: Path) -> None:
    """Field z of a shard with samples has no blocks: every sample empty, its data region
    empty, tables and CRCs consistent. A reader must not go looking for some other
    shard's block (SPEC.md §4: a shard with samples has at least one block)."""
    shard = a / "shard-00000.dlop"
    header, _ = read_header(shard)
    k = next(i for i, f in enumerate(header["fields"]) if f["name"] == "z")
    n = header["num_samples"]
    put_region(shard, header, k, "shapes", np.zeros((n, 1), "<i8").tobytes())
    put_region(shard, header, k, "offsets", np.zeros(n + 1, "<u8").tobytes())
    put_region(shard, header, k, "blocks", b"")
    put_region(shard, header, k, "data", b"")
    header["fields"][k].update(value_count=0, num_blocks=0)
    rewrite_header(shard, header)


def case_deep_index(a: Path) -> None:
    (a / "index.json").write_text("[" * 200_000 + "]" * 200_000)


def case_deep_metadata(a: Path) -> None:
    text = (a / "index.json").read_text()
    deep = "[" * 200_000 + "]" * 200_000
    (a / "index.json").write_text(text.replace('"metadata": {}', f'"metadata": {{"x": {deep}}}'))


def case_deep_errors(a: Path) -> None:
    (a / "errors.jsonl").write_text(
        '{"path": "a", "reason": ' + "[" * 200_000 + "]" * 200_000 + "}\n"
    )


def case_flood_errors(a: Path) -> None:
    """8 MB of `[]` lines where the index counts one skipped input."""
    (a / "errors.jsonl").write_bytes(b"[]\n" * ((8 << 20) // 3))


def case_wide_index(a: Path) -> None:
    """Millions of empty arrays under a top-level key the reader does not know."""
    text = (a / "index.json").read_text().rstrip().rstrip("}")
    (a / "index.json").write_text(text + ', "future": [' + ",".join(["[]"] * 3_000_000) + "]}")


def case_long_int_index(a: Path) -> None:
    text = (a / "index.json").read_text()
    (a / "index.json").write_text(text.replace('"version": 1', '"version": 1' + "0" * 200_000))


def case_samples_2_70(a: Path) -> None:
    def edit(obj: dict[str, Any]) -> None:
        obj["shards"][0]["num_samples"] = 1 << 70
        obj["num_samples"] = sum(s["num_samples"] for s in obj["shards"])

    edit_index(a, edit)


def case_samples_2_63(a: Path) -> None:
    def edit(obj: dict[str, Any]) -> None:
        obj["shards"] = obj["shards"][:1]
        obj["shards"][0]["num_samples"] = 1 << 63
        obj["num_samples"] = 1 << 63

    edit_index(a, edit)


def case_header_samples_2_70(a: Path) -> None:
    shard = a / "shard-00000.dlop"
    header, _ = read_header(shard)
    header["num_samples"] = 1 << 70
    rewrite_header(shard, header)


def case_fixed_shape_0_2_62(a: Path) -> None:
    for p in a.glob("*"):
        p.unlink()
    fields = [Field("label", "i64", ()), Field("z", "f32", (0, 4))]
    with ArchiveWriter(a, fields, overwrite=True) as w:
        for i in range(3):
            w.write({"label": i, "z": np.zeros((0, 4), np.float32)})
    shard = a / "shard-00000.dlop"
    header, _ = read_header(shard)
    header["fields"][1]["shape"] = [0, 1 << 62]
    rewrite_header(shard, header)
    edit_index(a, lambda obj: obj["schema"][1].update(shape=[0, 1 << 62]))


# case -> entries that must raise a dlop error (the others may also succeed)
CASES: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "fifo_index": (case_fifo_index, ENTRIES),
    "fifo_errors": (case_fifo_errors, ("formats", "info")),
    "fifo_shard": (case_fifo_shard, ENTRIES),
    "dir_shard": (case_dir_shard, ENTRIES),
    "zero_index": (case_zero_index, ENTRIES),
    "zero_errors": (case_zero_errors, ("formats", "info")),
    "shard_links_out": (case_shard_links_out, ENTRIES),
    "shard_links_etc": (case_shard_links_etc, ENTRIES),
    "index_links_out": (case_index_links_out, ENTRIES),
    "shard_links_inside": (case_shard_links_inside, ()),
    "zstd_claims_2_40": (case_zstd_claims_2_40, ENTRIES),
    "zstd_no_blocks": (case_zstd_no_blocks, ENTRIES),
    "deep_index": (case_deep_index, ENTRIES),
    "deep_metadata": (case_deep_metadata, ENTRIES),
    "deep_errors": (case_deep_errors, ("formats", "info")),
    "flood_errors": (case_flood_errors, ("formats", "info")),
    "wide_index": (case_wide_index, ENTRIES),
    "long_int_index": (case_long_int_index, ENTRIES),
    "samples_2_70": (case_samples_2_70, ENTRIES),
    "samples_2_63": (case_samples_2_63, ENTRIES),
    "header_samples_2_70": (case_header_samples_2_70, ENTRIES),
    "fixed_shape_0_2_62": (case_fixed_shape_0_2_62, ENTRIES),
}
# The file each case's error must name.
NAMES = {
    "zstd_no_blocks": "0 blocks for 6 samples",
    "fifo_errors": "errors.jsonl",
    "zero_errors": "errors.jsonl",
    "deep_errors": "errors.jsonl",
    "flood_errors": "errors.jsonl",
    "wide_index": "index.json",
    "long_int_index": "index.json",
    "fifo_index": "index.json",
    "zero_index": "index.json",
    "index_links_out": "index.json",
    "deep_index": "index.json",
    "deep_metadata": "index.json",
    "samples_2_70": "index.json",
    "samples_2_63": "index.json",
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict[str, Any]]:
    """Runs every (case, entry) in child processes; a hung entry is recorded and skipped."""
    root = tmp_path_factory.mktemp("hostile")
    todo = []
    for case, (make, _) in CASES.items():
        archive = make_archive(root / case)
        make(archive)
        todo += [(case, str(archive), entry) for entry in ENTRIES]
    out: dict[tuple[str, str], dict[str, Any]] = {}
    while todo:
        cases_file = root / "cases.json"
        cases_file.write_text(json.dumps(todo))
        proc = subprocess.run(
            [sys.executable, str(RUNNER), str(cases_file)],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
            # Without the interpreter's integer-digit limit: the bounds must hold on their own.
            env={**os.environ, "PYTHONINTMAXSTRDIGITS": "0"},
        )
        started = None
        for line in proc.stdout.splitlines():
            if line.startswith("START "):
                started = tuple(line.split()[1:3])
            elif line.startswith("RESULT "):
                got = json.loads(line[len("RESULT ") :])
                out[(got["case"], got["entry"])] = got
                started = None
        done = {(c, e) for c, _, e in todo if (c, e) in out}
        if started is not None:  # killed by the watchdog (a hang) or by the memory cap
            out[started] = {"outcome": "hung or killed", "message": proc.stderr[-3000:]}
            done.add(started)
        elif len(done) < len(todo) and proc.returncode != 0:
            raise AssertionError(f"runner failed: {proc.stderr[-3000:]}")
        todo = [t for t in todo if (t[0], t[2]) not in done]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_every_entry_point_fails_cleanly(
    case: str, results: dict[tuple[str, str], dict[str, Any]]
) -> None:
    must_fail = CASES[case][1]
    for entry in ENTRIES:
        got = results[(case, entry)]
        assert got["outcome"] in ("ok", "dlop"), (entry, got)
        if entry in must_fail:
            assert got["outcome"] == "dlop", (entry, got)
            assert NAMES.get(case, case) in got["message"], (entry, got["message"])


def test_links_inside_the_archive_are_followed(
    results: dict[tuple[str, str], dict[str, Any]],
) -> None:
    for entry in ENTRIES:
        assert results[("shard_links_inside", entry)]["outcome"] == "ok", entry


def test_links_leaving_the_archive_name_the_link_not_the_target(
    results: dict[tuple[str, str], dict[str, Any]],
) -> None:
    passwd = Path("/etc/passwd").read_bytes()
    for entry in ENTRIES:
        message = results[("shard_links_etc", entry)]["message"]
        assert "shard-00000.dlop" in message and "leaves the archive" in message, message
        assert "passwd" not in message and str(len(passwd)) not in message, message
        assert passwd[:8].decode(errors="replace") not in message, message
        assert "leaves the archive" in results[("shard_links_out", entry)]["message"]


# -- direct checks of the format functions --------------------------------------------------


def test_parse_header_rejects_deep_nesting(tmp_path: Path) -> None:
    for body in (
        b"[" * 200_000 + b"]" * 200_000,
        b'{"format": "dlop-shard", "x": ' + b"{" * 100 + b"}" * 100 + b"}",
    ):
        with pytest.raises(FormatError, match="nest"):
            parse_header(tmp_path / "s.dlop", body, zlib.crc32(body), 1 << 20)


def test_parse_header_rejects_huge_integers(tmp_path: Path) -> None:
    body = b'{"format": "dlop-shard", "num_samples": ' + b"9" * 5000 + b"}"
    with pytest.raises(FormatError, match=r"s\.dlop"):
        parse_header(tmp_path / "s.dlop", body, zlib.crc32(body), 1 << 20)


@pytest.mark.parametrize(
    ("shape", "match"),
    [
        ((0, 1 << 62), "dimension"),
        ((1 << 31,), "dimension"),
        ((1 << 20, 1 << 20, 0, 8), "bytes"),
        ((1,) * 33, "dimensions"),
    ],
)
def test_schema_bounds_on_write(tmp_path: Path, shape: tuple[int, ...], match: str) -> None:
    with pytest.raises(SchemaError, match=match):
        Field("x", "f32", shape)
    with pytest.raises(SchemaError, match=match):
        ArchiveWriter(tmp_path / "a", [Field("ok", "u8", ()), Field("x", "f32", shape)])


def test_zstd_block_size_bound_on_write(tmp_path: Path) -> None:
    with pytest.raises(SchemaError, match="block_bytes"):
        Zstd(block_bytes=1 << 40)


def test_ragged_sample_bounds_on_write(tmp_path: Path) -> None:
    big = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), (0, 1 << 31), (0, 0))
    with (
        ShardWriter(tmp_path / "r.dlop", [Field("r", "u8", (None, None))]) as w,
        pytest.raises(SchemaError, match="dimension"),
    ):
        w.write({"r": big})


def test_preamble_header_cap_is_stated() -> None:
    spec = (Path(__file__).parents[2] / "formats" / "SPEC.md").read_text()
    from dlop.formats import constants as c

    for name in (
        "MAX_HEADER_BYTES",
        "MAX_INDEX_BYTES",
        "MAX_ERRORS_BYTES",
        "MAX_JSON_DEPTH",
        "MAX_SHARD_SAMPLES",
        "MAX_ARCHIVE_SAMPLES",
        "MAX_NDIM",
        "MAX_DIM",
        "MAX_SAMPLE_BYTES",
        "MAX_BLOCK_RAW_BYTES",
        "ZSTD_MAX_RATIO",
    ):
        assert hasattr(c, name), name
    for phrase in ("regular file", "symbolic link", "nesting depth", "2^40", "2^31"):
        assert phrase in spec, phrase
    assert PREAMBLE.size == 24


def test_a_shard_swapped_for_another_of_its_size_and_count_is_refused(tmp_path: Path) -> None:
    """A shard file replaced by another archive's of the same size and sample count (an
    archive compiled again in place, a copy gone wrong) was read as the index's: its
    regions match the CRCs in its own header, and nothing tied that header to index.json
    but for a field group's shards. The index's header_crc32 now ties every shard."""
    fields = [Field("x", "i32", (4,))]
    for name, base in (("a", 0), ("b", 100)):
        with ArchiveWriter(tmp_path / name, fields) as w:
            for i in range(6):
                w.write({"x": np.full(4, base + i, np.int32)})
    shard = read_index(tmp_path / "a").shards[0].file
    shutil.copyfile(tmp_path / "b" / shard, tmp_path / "a" / shard)
    with ArchiveReader(tmp_path / "a") as r, pytest.raises(FormatError, match="header CRC-32"):
        r.sample(0)

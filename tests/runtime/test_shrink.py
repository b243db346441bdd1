"""A shard truncated while mapped: reads are refused with an error naming it, never SIGBUS.

Each case runs in a subprocess, so a regression kills that process, not pytest.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from dlop.formats import ArchiveWriter, Field
from dlop.formats.codecs import parse_codec


def ran(script: str, expected: str) -> subprocess.CompletedProcess[str]:
    """``script`` run in a fresh interpreter, which must end cleanly and print ``expected``
    first."""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(expected), done.stdout + done.stderr[-2000:]
    return done


@pytest.fixture
def rows(tmp_path: Path) -> Path:
    """16 KiB rows (the compiled row copier's path), a ragged field and labels, 4 shards."""
    path = tmp_path / "a"
    fields = [
        Field("x", "f32", (64, 64)),
        Field("label", "i64", ()),
        Field("speech", "f16", (None, 80)),
    ]
    with ArchiveWriter(path, fields, shard_bytes=120_000) as w:
        for i in range(24):
            w.write(
                {
                    "x": np.full((64, 64), i, np.float32),
                    "label": i,
                    "speech": np.full((5 + i, 80), i, np.float16),
                }
            )
    return path


CASES = {
    "getitem": "ds[0]",
    "getitems": "ds.__getitems__([0, 1, 20])",
    "loader": "list(Loader(ds, 4, seed=0))",
    "loader-sync": "list(Loader(ds, 4, seed=0, prefetch=0))",
    # batches are made ahead (a ring slot packs several): two a slot, made when asked for
    "loader-midway": "packing.GROUP_BATCHES = 2; it = iter(Loader(ds, 4, shuffle=False, "
    "prefetch=0)); next(it); shrink(); list(it)",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_shrunk_shard_is_named_not_fatal(rows: Path, case: str) -> None:
    script = textwrap.dedent(
        f"""
        import os
        from dlop.runtime import Loader, LoaderError, open_archive
        from dlop.runtime.errors import ShardChangedError
        from dlop.runtime.pipeline import packing
        ds = open_archive({str(rows)!r})
        shard = ds.shards[-1 if {case!r} == "loader-midway" else 0].path
        def shrink():
            os.truncate(shard, os.path.getsize(shard) // 2)
        if {case!r} != "loader-midway":
            shrink()
        try:
            {CASES[case]}
        except (ShardChangedError, LoaderError) as e:
            print(type(e).__name__, str(e).splitlines()[0])
        """
    )
    expected = "ShardChangedError" if case.startswith("getitem") else "LoaderError"
    done = ran(script, expected)
    shards = sorted(p.name for p in rows.glob("shard-*"))
    name = shards[-1] if case == "loader-midway" else shards[0]
    assert name in done.stdout and "shrank from" in done.stdout, done.stdout


def test_a_replaced_shard_keeps_being_read_as_opened(rows: Path) -> None:
    from dlop.runtime import open_archive

    ds = open_archive(rows)
    before = ds.__getitems__(list(range(24)))["label"].tolist()
    shard = ds.shards[0].path
    data = shard.read_bytes()
    shard.unlink()
    shard.write_bytes(data[: len(data) // 2])  # a new file under the old name
    assert ds.__getitems__(list(range(24)))["label"].tolist() == before


def test_a_shard_moved_away_then_truncated_is_still_caught(rows: Path) -> None:
    """The check looks at the mapped file itself, not at whatever its old path names."""
    script = textwrap.dedent(
        f"""
        import os
        from dlop.runtime import open_archive
        from dlop.runtime.errors import ShardChangedError
        ds = open_archive({str(rows)!r})
        shard = ds.shards[0].path
        moved = str(shard) + ".old"
        os.rename(shard, moved)
        os.truncate(moved, os.path.getsize(moved) // 2)
        try:
            ds[0]
        except ShardChangedError as e:
            print(type(e).__name__, str(e).splitlines()[0])
        """
    )
    ran(script, "ShardChangedError")


@pytest.fixture
def kinds(tmp_path: Path) -> Path:
    """Every kind of field whose plan reads per-sample tables, text or zstd frames, beside
    labels, in several shards: raw and zstd text, raw bytes, a zstd array and an array
    with two varying dimensions."""
    path = tmp_path / "t"
    zstd = parse_codec("zstd")
    fields = [
        Field.str_("text"),
        Field("ztext", "u8", (None,), kind="str", codec=zstd),
        Field.bytes_("blob"),
        Field("zx", "f16", (4, 8), codec=zstd),
        Field("grid", "i16", (None, None)),
        Field("label", "i64", ()),
    ]
    with ArchiveWriter(path, fields, shard_bytes=3_000) as w:
        for i in range(40):
            w.write(
                {
                    "text": f"utterance {i} " * 8,
                    "ztext": f"utterance {i} " * 8,
                    "blob": bytes([i]) * 50,
                    "zx": np.full((4, 8), i, np.float16),
                    "grid": np.full((1 + i % 3, 1 + i % 4), i, np.int16),
                    "label": i,
                }
            )
    return path


# each field's samples as their labels (every sample's values hold its number)
AS_LABELS = {
    "text": "[int(t.split()[1]) for t in batch['text']]",
    "ztext": "[int(t.split()[1]) for t in batch['ztext']]",
    "blob": "[b[0] for b in batch['blob']]",
    "zx": "batch['zx'][:, 0, 0].int().tolist()",
    "grid": "batch['grid'][:, 0, 0].int().tolist()",
}


@pytest.mark.parametrize("name", sorted(AS_LABELS))
def test_a_shard_shrunk_mid_epoch_is_named_not_fatal(kinds: Path, name: str) -> None:
    """No field is read with a check of its shards per batch: text, tables and zstd
    frames are copied out by the compiled copier when a batch first reads them, values
    copied by it, and either names a truncated shard."""
    script = textwrap.dedent(
        f"""
        import os
        from dlop.runtime import Loader, LoaderError, open_archive
        from dlop.runtime.pipeline import packing
        packing.GROUP_BATCHES = 2  # batches made ahead of the truncation: two at a time
        ds = open_archive({str(kinds)!r}, fields=[{name!r}, "label"])
        assert not ds.planner.checks_batches()  # no stat per batch: the copies catch it
        shard = ds.shards[-1].path
        it = iter(Loader(ds, 4, shuffle=False, prefetch=0))
        batch = next(it)
        assert {AS_LABELS[name]} == batch["label"].tolist()
        os.truncate(shard, os.path.getsize(shard) // 4)
        try:
            for batch in it:
                assert {AS_LABELS[name]} == batch["label"].tolist()
        except LoaderError as e:
            print(type(e).__name__, str(e).splitlines()[0])
        """
    )
    done = ran(script, "LoaderError")
    last = sorted(p.name for p in kinds.glob("shard-*"))[-1]
    assert last in done.stdout and "shrank from" in done.stdout, done.stdout


@pytest.mark.parametrize("fields", [["label", "speech"], ["key", "text", "label"]])
def test_a_cached_shard_shrunk_before_its_entries_are_taken_is_named(
    tmp_path: Path, fields: list[str]
) -> None:
    """Without the compiled copier, a node cache's shard mapped (asked for ahead) and
    then truncated is refused by the check before its entries are copied in
    (runtime.archive.planning.Slots), never read to SIGBUS."""
    from tests.runtime.helpers import make_archive

    path = make_archive(tmp_path / "a", zstd=True)
    script = textwrap.dedent(
        f"""
        import os
        os.environ["DLOP_NATIVE_COPY"] = "0"
        import torch
        from dlop.runtime import open_archive
        from dlop.runtime.errors import ShardChangedError
        ds = open_archive({str(path)!r}, fields={fields!r}, cache_dir={str(tmp_path / "c")!r},
                          cache_bytes=300000)
        assert ds.planner.checks_batches() and ds.planner.slotted
        ds.supply.ask([3])
        shard = ds.supply.shard(3).path  # mapped whole, its entries not taken yet
        os.truncate(shard, 4096)
        try:
            ds.gather(torch.tensor([12, 13]))
        except ShardChangedError as e:
            print(type(e).__name__, str(e).splitlines()[0])
        """
    )
    done = ran(script, "ShardChangedError")
    assert "shard-00003.dlop" in done.stdout and "shrank from" in done.stdout, done.stdout

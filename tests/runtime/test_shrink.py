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
    "loader-midway": "it = iter(Loader(ds, 4, shuffle=False)); next(it); shrink(); list(it)",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_shrunk_shard_is_named_not_fatal(rows: Path, case: str) -> None:
    script = textwrap.dedent(
        f"""
        import os
        from dlop.runtime import Loader, LoaderError, open_archive
        from dlop.runtime.errors import ShardChangedError
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
def texts(tmp_path: Path) -> Path:
    """Text and bytes beside labels in 4 shards: read from copies the copier makes."""
    path = tmp_path / "t"
    fields = [Field.str_("text"), Field.bytes_("blob"), Field("label", "i64", ())]
    with ArchiveWriter(path, fields, shard_bytes=3_000) as w:
        for i in range(40):
            w.write({"text": f"utterance {i} " * 8, "blob": bytes([i]) * 50, "label": i})
    return path


def test_a_shrunk_shard_of_text_is_named_not_fatal(texts: Path) -> None:
    """Raw text is read without a check per batch: the copy of a shard's text, made by the
    compiled copier when a batch first reads it, names a truncated shard."""
    script = textwrap.dedent(
        f"""
        import os
        from dlop.runtime import Loader, LoaderError, open_archive
        ds = open_archive({str(texts)!r})
        assert not ds.planner.checks_batches()  # no stat per batch: the copies catch it
        shard = ds.shards[-1].path
        def shrink():
            os.truncate(shard, os.path.getsize(shard) // 2)
        it = iter(Loader(ds, 4, shuffle=False))
        next(it)
        shrink()
        try:
            for batch in it:
                assert [int(t.split()[1]) for t in batch["text"]] == batch["label"].tolist()
        except LoaderError as e:
            print(type(e).__name__, str(e).splitlines()[0])
        """
    )
    done = ran(script, "LoaderError")
    last = sorted(p.name for p in texts.glob("shard-*"))[-1]
    assert last in done.stdout and "shrank from" in done.stdout, done.stdout

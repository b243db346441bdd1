"""dlop-bench's remote section: without moto it measures the local zstd rows and says
the s3 rows did not run, instead of failing."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from dlop.tools.bench import cli, remote_bench


@pytest.mark.slow
def test_without_moto_only_the_local_zstd_rows_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "moto.server", None)  # import fails as if not installed
    args = argparse.Namespace(clips=8, repeats=1)
    rows = remote_bench.run(tmp_path, args)
    assert "moto is not installed" in capsys.readouterr().err
    assert [r.pipeline.split(" (")[0].split(", cache_dir")[0] for r in rows] == [
        "dlop Loader, local zstd archive"
    ] * 3
    assert all(r.workload.startswith("local zstd:") and r.samples_per_s for r in rows)
    assert [r.vs_baseline is not None for r in rows] == [False, True, True]
    assert "cache_dir warm" in rows[1].pipeline and "cold" in rows[2].pipeline
    assert list((tmp_path / "cache-local-zstd").rglob("shard-*.dlop"))  # decoded into it
    assert not (tmp_path / "raw").exists()  # the raw archive is for the s3 rows only
    assert "remote" in cli.SECTIONS and "remote" in cli.DEFAULT_SECTIONS

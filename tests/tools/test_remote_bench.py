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


@pytest.mark.slow
def test_each_node_downloads_its_share_once(tmp_path: Path) -> None:
    with remote_bench.moto_s3() as endpoint:
        if endpoint is None:
            pytest.skip("moto is not installed")
        raw = remote_bench.write(tmp_path / remote_bench.RAW_NAME, 64, zstd=False)
        url = remote_bench.upload(raw)
        rows = remote_bench.node_download_rows(url, raw, tmp_path, 64)
    firsts = [r.extra["first_epoch_of_archive"] for r in rows]
    assert [r.pipeline.split(" ")[0] for r in rows] == ["1", "2", "4"]
    # the header and index make a shard a little more than its share of samples
    assert firsts[0] == pytest.approx(1.0, abs=0.02)
    assert firsts[1] == pytest.approx(0.5, abs=0.1) and firsts[2] == pytest.approx(0.25, abs=0.1)
    assert [r.extra["second_epoch_of_archive"] for r in rows] == [0, 0, 0]

"""The compile-scaling bench section at toy sizes, untimed: every row measured and well formed."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from dlop.tools.bench import scaling_bench


@pytest.mark.slow
def test_scaling_rows(tmp_path: Path) -> None:
    pytest.importorskip("distributed")
    # 64 clips (clips // 4): the two workers' compile must outlast the sampler's looks
    # (every 0.1 s); 16 clips took 0.12 s on a fast machine and were seen in half the runs
    args = argparse.Namespace(clips=256, repeats=1, listing_lines=[10_000])
    rows = scaling_bench.run(tmp_path, args)
    assert [r.pipeline for r in rows] == [*scaling_bench.ENGINES, "open_corpus manifest"]
    for r in rows[:3]:
        assert r.samples_per_s and r.samples_per_s > 0
        assert r.extra["driver_peak_rss_mib"] > 0
    assert rows[1].baseline == "1 worker" and rows[1].vs_baseline
    assert len(rows[1].extra["worker_peak_rss_mib"]) >= 2  # the pool's two processes
    assert len(rows[2].extra["worker_peak_rss_mib"]) >= 2  # Dask's two workers
    listing = rows[3]
    assert "10000-line" in listing.workload and listing.samples_per_s
    # at toy sizes the listing may stay under the peak its imports reached: growth 0
    assert listing.extra["bytes_per_input"] >= 0 and listing.extra["peak_rss_mib"] > 0
    assert not (tmp_path / "listing" / "manifest.jsonl").exists()

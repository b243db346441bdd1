"""Benchmarks run in CI untimed, at toy sizes: every row is measured and well formed."""

from __future__ import annotations

from pathlib import Path

from dlop.tools.bench import vision_bench


def test_vision_bench_rows(tmp_path: Path) -> None:
    rows = vision_bench.run(tmp_path, videos=2, images=2, workers=1, repeats=1, loader_mib=4)
    names = [(r.workload.split(":")[0], r.pipeline.split(" (")[0]) for r in rows]
    for media in ("video", "images"):
        assert (media, "dlop-compile") in names
        assert (media, "dlop Loader") in names
        assert (media, "np.copyto of the same fields' bytes") in names
    for r in rows:
        assert r.samples_per_s and r.samples_per_s > 0
    loaders = [r for r in rows if r.pipeline.startswith("dlop Loader")]
    assert all(r.baseline == "memcpy" and r.extra["vs_naive"] > 0 for r in loaders)

"""make gpu-proof: its dry run on the CPU exercises every section, so the script cannot rot."""

from __future__ import annotations

import json
from pathlib import Path

from dlop.tools.gpu_proof import main


def test_dry_run_writes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(["--dry-run", "--out", str(out), "--workdir", str(tmp_path)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["dry_run"] is True
    assert {"environment", "augmentations", "bandwidth", "timeline", "train"} <= set(report)
    assert all(r["ok"] for r in report["augmentations"])
    names = [r["name"] for r in report["bandwidth"]["rows"]]
    assert names[0] == "bare pinned copy_" and any(n.startswith("Loader to cpu") for n in names)
    assert all(r["gb_per_s"] > 0 for r in report["bandwidth"]["rows"])
    assert "skipped" in report["timeline"]  # no copy stream without CUDA
    rows = report["train"]["rows"]
    assert [r["pipeline"].split(" ")[0] for r in rows] == ["naive", "dlop", "dlop"]
    assert all(r["samples_per_s"] > 0 and 0 <= r["extra"]["data_wait_share"] <= 1 for r in rows)
    md = (out / "report.md").read_text()
    assert "DRY RUN" in md and "## Training" in md

"""make demo's program, on a small corpus: it compiles, reads back and reports measured rates."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dlop.tools.demo import main


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(tmp_path / "d"), "--clips-per-class", "3"]) == 0
    out = capsys.readouterr().out
    assert "verify: OK; 15 samples" in out
    rates = [float(x.replace(",", "")) for x in re.findall(r"([\d,.]+) samples/s", out)]
    assert len(rates) == 3 and all(r > 0 for r in rates)
    assert re.search(r"speed-up over the naive pipeline: Loader [\d,]+x", out)
    assert (tmp_path / "d" / "archive" / "index.json").exists()

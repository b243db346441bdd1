"""What dlop-compile writes while it runs, when stderr is a log file and not a terminal:
whole progress lines (no carriage returns), and after Ctrl-C the stop message last."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dlop.compiler.faults import KILL_AT as TEST_KILL_AT
from dlop.compiler.faults import SIGNAL as TEST_SIGNAL
from tests.compiler.fixtures import esc50_corpus


def compile_logged(corpus: Path, out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    args = [str(corpus), "-o", str(out), "--workers", "1", "--unit-inputs", "4"]
    cmd = [sys.executable, "-m", "dlop.tools.compile_cli", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **env}
    )


def test_progress_in_a_log_is_whole_lines(tmp_path: Path) -> None:
    corpus = esc50_corpus(tmp_path / "esc", [("wav", 16000, 1)] * 8, seconds=0.25)
    done = compile_logged(corpus, tmp_path / "a")
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr
    assert "compiling: 8/8 inputs (100%), units 2/2" in done.stderr


def test_the_stop_message_comes_last_after_ctrl_c(tmp_path: Path) -> None:
    corpus = esc50_corpus(tmp_path / "esc", [("wav", 16000, 1)] * 8, seconds=0.25)
    stopped = compile_logged(corpus, tmp_path / "a", **{TEST_KILL_AT: "unit:1", TEST_SIGNAL: "INT"})
    assert stopped.returncode == 130
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith("dlop-compile: stopped; run again with --resume"), stopped.stderr

"""Start-up: how long the command-line tools take before they do any work.

``dlop-compile --help`` and ``dlop-inspect info ARCHIVE`` are what a user runs
first and most often; they should answer at once (goal: under 0.5 s), which
means torch and the media libraries load only when a command needs them. Each
command runs in a fresh interpreter, in rounds that take every command in turn,
beside a bare ``python -c pass`` measured in the same rounds, with bytecode
cached as an installed package has it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from dlop.formats import ArchiveWriter, Field

from .common import Row

GOAL_S = 0.5
ROUNDS = 5


def _archive(path: Path) -> Path:
    fields = [Field("logmel", "f16", (64, 40)), Field("label", "i64", ())]
    with ArchiveWriter(path, fields, overwrite=True) as w:
        for i in range(32):
            w.write({"logmel": np.full((64, 40), i, np.float16), "label": i % 4})
    return path


def _wall(argv: list[str]) -> float:
    # As installed: bytecode cached (the warm-up run writes it), whatever this shell says.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - t0


def run(work: Path, args: argparse.Namespace) -> list[Row]:
    archive = _archive(work / "archive")
    py = sys.executable
    commands = {
        "python -c pass": [py, "-c", "pass"],
        "dlop-compile --help": [py, "-m", "dlop.tools.compile_cli", "--help"],
        "dlop-inspect info": [py, "-m", "dlop.tools.inspect_cli", "info", str(archive)],
    }
    for argv in commands.values():  # first run: bytecode compiled, files in the page cache
        _wall(argv)
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(max(ROUNDS, args.repeats)):
        for name, argv in commands.items():
            times[name].append(_wall(argv))
    bare = statistics.median(times["python -c pass"])
    rows = []
    for name, took in times.items():
        median = statistics.median(took)
        extra: dict[str, object] = {
            "median_s": round(median, 3),
            "range_s": f"{min(took):.3f}-{max(took):.3f}",
            "runs": len(took),
        }
        if name != "python -c pass":
            extra["goal_s"] = GOAL_S
            extra["met"] = median < GOAL_S
            extra["over_bare_python_s"] = round(median - bare, 3)
        rows.append(Row("start-up: wall seconds, fresh interpreter, median", name, extra=extra))
    return rows

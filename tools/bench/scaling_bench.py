"""Compile scaling: inputs/s of the same compile on 1 and 2 local workers and on Dask
(``--dask local:2``), in interleaved rounds of one run, with the peak RSS of every
process of each compile; and the listing of generated JSON-lines manifests of 1 and 10
million lines: its time and peak RSS, and the time to make one unit's Items from it.

Each compile runs in a fresh process and is timed from after its imports; the Dask
row's time includes starting and stopping its LocalCluster. Peak RSS is each
process's own high-water mark (VmHWM in /proc), read while it runs. The listing runs
alone in a child process, which reports its own VmHWM before and after.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from .common import Row, rate_row
from .corpus import esc50_wavs
from .procmem import PeakSampler, descendants, status_kib

LISTING_LINES = (1_000_000, 10_000_000)  # --listing-lines, when given, replaces them
ENGINES = {"1 worker": ("1", ""), "2 workers": ("2", ""), "dask local:2": ("2", "local:2")}

_COMPILE = """
import sys, time
from dlop.compiler.demo import DEMO_RECIPE
from dlop.compiler.run.pipeline import compile_corpus
from dlop.compiler.recipe import build_recipe
corpus, out, workers, dask, unit = sys.argv[1:6]
recipe = build_recipe({**DEMO_RECIPE, "source": corpus})
t0 = time.perf_counter()
compile_corpus(recipe, out, workers=int(workers), progress=False, overwrite=True,
               dask=dask or None, unit_inputs=int(unit))
print(time.perf_counter() - t0)
"""

_LIST = """
import json, sys, time
from dlop.compiler.corpus.layouts import open_corpus
from dlop.tools.bench.procmem import status_kib

# VmHWM: this process's own peak (ru_maxrss would also count the peak of the process
# that started it, folded in at exec)
base = status_kib("VmHWM")
t0 = time.perf_counter()
corpus = open_corpus(sys.argv[1], "manifest", "audio")
took = time.perf_counter() - t0
peak = status_kib("VmHWM")
t0 = time.perf_counter()
mid = len(corpus.items) // 2
unit = corpus.items[mid : mid + 8192]  # a unit's Items, made from the listing
unit_s = time.perf_counter() - t0
print(json.dumps({"seconds": took, "inputs": len(corpus.items), "base_kib": base,
                  "peak_kib": peak, "unit_seconds": unit_s, "unit_inputs": len(unit)}))
"""


def run(work: Path, args: argparse.Namespace) -> list[Row]:
    sizes = args.listing_lines or LISTING_LINES
    listing = [_listing_row(work / "listing", lines) for lines in sizes]
    return [*_compile_rows(work / "compile", args), *listing]


# -- compile on 1 and 2 workers and on Dask ---------------------------------------------


def _timed_compile(
    corpus: Path, out: Path, workers: str, dask: str, unit: int
) -> tuple[float, int, list[int]]:
    """(seconds, the driver's peak RSS, each other process's peak RSS: KiB)."""
    cmd = [sys.executable, "-c", _COMPILE, str(corpus), str(out), workers, dask, str(unit)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    peaks: dict[int, int] = {}

    def read() -> int:
        for pid in [proc.pid, *descendants(proc.pid)]:
            peaks[pid] = max(peaks.get(pid, 0), status_kib("VmHWM", pid))
        return 0

    with PeakSampler(read, 0.1):
        stdout, _ = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"compile of {corpus} failed with exit status {proc.returncode}")
    driver = peaks.pop(proc.pid, 0)
    return float(stdout.split()[-1]), driver, sorted((v for v in peaks.values() if v), reverse=True)


def _compile_rows(work: Path, args: argparse.Namespace) -> list[Row]:
    count = max(8, args.clips // 4)
    unit = max(1, count // 8)  # 8 units: both Dask workers busy, the same for every engine
    corpus = esc50_wavs(work / "corpus", count)
    times: dict[str, list[float]] = {name: [] for name in ENGINES}
    drivers: dict[str, int] = {name: 0 for name in ENGINES}
    others: dict[str, list[int]] = {name: [] for name in ENGINES}
    for _ in range(max(1, args.repeats)):  # interleaved: a drift of the machine hits all alike
        for name, (workers, dask) in ENGINES.items():
            out = work / "out"
            took, driver, rest = _timed_compile(corpus, out, workers, dask, unit)
            shutil.rmtree(out, ignore_errors=True)
            times[name].append(took)
            drivers[name] = max(drivers[name], driver)
            if len(rest) > len(others[name]) or sum(rest) > sum(others[name]):
                others[name] = rest
    workload = (
        f"compile scaling: {count} ESC-50 clips (5 s, 44.1 kHz), librosa log-mel 128, "
        f"units of {unit}, median of {max(1, args.repeats)} interleaved rounds"
    )
    rows: list[Row] = []
    for name in ENGINES:
        took = statistics.median(times[name])
        extra: dict[str, Any] = {
            "seconds": round(took, 2),
            "driver_peak_rss_mib": round(drivers[name] / 1024, 1),
            "worker_peak_rss_mib": [round(k / 1024, 1) for k in others[name]],
        }
        rows.append(rate_row(workload, name, count, took, None, rows[0] if rows else None, **extra))
    return rows


# -- listing a long manifest ----------------------------------------------------------------


def write_manifest(path: Path, lines: int) -> Path:
    """A JSON-lines manifest of ``lines`` utterances (files that need not exist: a listing
    reads only the manifest), about 90 bytes a line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        step = 100_000
        for start in range(0, lines, step):
            f.write(
                "".join(
                    f'{{"audio_filepath": "audio/{n // 1000:05d}/{n:08d}.flac", '
                    f'"duration": {1 + n % 17 * 0.75}, "text": "utterance {n % 977}"}}\n'
                    for n in range(start, min(lines, start + step))
                )
            )
    return path


def _listing_row(work: Path, lines: int) -> Row:
    manifest = write_manifest(work / "manifest.jsonl", lines)
    size = manifest.stat().st_size
    proc = subprocess.run(
        [sys.executable, "-c", _LIST, str(manifest)], capture_output=True, text=True, check=False
    )
    if proc.returncode:
        raise RuntimeError(f"listing {manifest} failed: {proc.stderr[-2000:]}")
    got = json.loads(proc.stdout.splitlines()[-1])
    manifest.unlink()
    grown = (got["peak_kib"] - got["base_kib"]) * 1024
    return rate_row(
        f"compile scaling: listing a {lines}-line JSON-lines manifest ({size / 2**20:.0f} MiB)",
        "open_corpus manifest",
        got["inputs"],
        got["seconds"],
        seconds=round(got["seconds"], 2),
        peak_rss_mib=round(got["peak_kib"] / 1024, 1),
        grown_mib=round(grown / 2**20, 1),
        bytes_per_input=round(grown / max(1, got["inputs"])),
        unit_items_seconds=round(got["unit_seconds"], 3),
        unit_inputs=got["unit_inputs"],
    )

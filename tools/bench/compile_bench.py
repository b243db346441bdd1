"""dlop-compile against one epoch of the naive per-sample DataLoader, and compile memory at 10x scale."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dlop.compiler.demo import DEMO_RECIPE
from dlop.compiler.pipeline import compile_corpus
from dlop.compiler.recipe import build_recipe

from .common import Row, rate_row
from .corpus import esc50_wavs, replicate
from .naive import epoch, naive_loader
from .procmem import PeakSampler, tree_rss_kib


def corpus_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "audio").iterdir())


@dataclass(frozen=True)
class Made:
    """What the compile section leaves for the runtime section."""

    corpus: Path
    archive: Path
    naive_rate: float  # samples/s of the naive per-sample DataLoader


def run(work: Path, clips: int, scale: int, workers: int) -> tuple[list[Row], Made]:
    corpus = esc50_wavs(work / "esc", clips)
    raw = corpus_bytes(corpus)
    wl = f"compile: ESC-50-shaped {clips} clips, 5 s 44.1 kHz WAV ({raw / 2**20:.0f} MiB) -> 128-mel log-mel"
    t0 = time.perf_counter()
    n = epoch(naive_loader(corpus, batch_size=64, workers=workers))
    t_naive = time.perf_counter() - t0
    naive = rate_row(
        wl, f"naive DataLoader epoch ({workers} workers)", n, t_naive, seconds=round(t_naive, 2)
    )
    naive_rate = naive.samples_per_s or 0.0
    rows = [naive]
    archives = {}
    for fft in ("float64", "float32"):
        recipe = build_recipe(
            {**DEMO_RECIPE, "source": str(corpus), "fft_dtype": fft, "shard_bytes": "4GiB"}
        )
        out = work / f"esc-{fft}"
        t0 = time.perf_counter()
        index = compile_corpus(recipe, out, workers=workers, progress=False, overwrite=True)
        took = time.perf_counter() - t0
        size = sum(s.bytes for s in index.shards)
        rows.append(
            rate_row(
                wl,
                f"dlop-compile, fft {fft} ({workers} workers)",
                index.num_samples,
                took,
                base=naive,
                base_name="naive epoch",
                seconds=round(took, 2),
                archive_MiB=round(size / 2**20),
                vs_raw_bytes=round(size / raw, 2),
            )
        )
        archives[fft] = out
    shutil.rmtree(archives["float32"], ignore_errors=True)
    big = replicate(corpus, work / "esc-x", scale)
    out = work / "esc-x-archive"
    cmd = [
        sys.executable,
        "-m",
        "dlop.tools.compile_cli",
        str(big),
        "-o",
        str(out),
        "-q",
        "--workers",
        str(workers),
        "--preset",
        "librosa",
        "--sample-rate",
        "44100",
        "--n-fft",
        "1024",
        "--hop-length",
        "512",
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    with PeakSampler(lambda: tree_rss_kib(proc.pid), 0.1) as peak:
        proc.wait()
    took = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(
            f"compile of the {scale}x corpus failed with exit status {proc.returncode}"
        )
    rows.append(
        Row(
            f"compile memory: {clips * scale} clips ({scale}x, {raw * scale / 2**30:.1f} GiB of WAV)",
            f"dlop-compile, {workers} workers, peak RSS of all processes",
            clips * scale / took,
            extra={"peak_rss_MiB": round(peak.peak / 1024), "seconds": round(took, 1)},
        )
    )
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(big, ignore_errors=True)
    return rows, Made(corpus=corpus, archive=archives["float64"], naive_rate=naive_rate)

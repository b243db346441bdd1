"""dlop-compile against its own limit and one epoch of the naive per-sample DataLoader.

In one run, per core: decode-only samples/s (the corpus's files through
soundfile.read and through the compiler's own decode), featurize-only
samples/s on pre-decoded audio (batched as the compiler does), their combined
limit 1 / (1/decode + 1/featurize) with the faster decode, and the compile's
samples/s at 1 and N workers as a fraction of N x that limit, with its peak
RSS; and compile memory at 10x scale.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import soundfile as sf
import torch

from dlop.compiler.decode import decode_audio
from dlop.compiler.demo import DEMO_RECIPE
from dlop.compiler.features import feature_config, featurize_clips
from dlop.compiler.items import GROUP_SAMPLES
from dlop.compiler.pipeline import CHUNK_ITEMS

from .common import Row, rate_row
from .corpus import esc50_wavs, replicate
from .naive import epoch, naive_loader
from .procmem import PeakSampler, tree_rss_kib

FEATURIZE_CLIPS = 200  # pre-decoded clips held for the featurize-only row (about 170 MiB)


def corpus_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "audio").iterdir())


@dataclass(frozen=True)
class Made:
    """What the compile section leaves for the runtime section."""

    corpus: Path
    archive: Path
    naive_rate: float  # samples/s of the naive per-sample DataLoader


_COMPILE = """
import json, sys, time
from dlop.compiler.pipeline import compile_corpus
from dlop.compiler.recipe import build_recipe
options, out, workers = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
recipe = build_recipe(options)
t0 = time.perf_counter()
index = compile_corpus(recipe, out, workers=workers, progress=False, overwrite=True)
print(index.num_samples, time.perf_counter() - t0)
"""


def timed_compile(options: dict[str, Any], out: Path, workers: int) -> tuple[float, int, int]:
    """(seconds, peak RSS in KiB of the compile and its workers, samples): the recipe
    ``options`` compiled in a fresh process, as dlop-compile runs, timed from after
    its imports."""
    cmd = [sys.executable, "-c", _COMPILE, json.dumps(options), str(out), str(workers)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    with PeakSampler(lambda: tree_rss_kib(proc.pid), 0.1) as peak:
        stdout, _ = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"compile into {out} failed with exit status {proc.returncode}")
    samples, seconds = stdout.split()[-2:]
    return float(seconds), peak.peak, int(samples)


def _timed_compile(corpus: Path, out: Path, workers: int) -> tuple[float, int]:
    """(seconds, peak RSS in KiB): DEMO_RECIPE compiled in a fresh process."""
    options = {**DEMO_RECIPE, "source": str(corpus), "shard_bytes": "4GiB"}
    took, peak, _ = timed_compile(options, out, workers)
    return took, peak


def _decode_rate(files: list[Path]) -> float:
    """Clips/s of soundfile.read alone, one core."""
    t0 = time.perf_counter()
    for f in files:
        sf.read(f, dtype="float32", always_2d=True)
    return len(files) / (time.perf_counter() - t0)


def _dlop_decode_rate(files: list[Path]) -> float:
    """Clips/s of the compiler's own decode (its length and finiteness checks and
    downmix included), one core: it converts 16-bit PCM faster than soundfile.read,
    so the limit takes whichever decode is faster."""
    t0 = time.perf_counter()
    for f in files:
        decode_audio(f, f.name, mix="mean")  # the recipe's default downmix
    return len(files) / (time.perf_counter() - t0)


def _featurize_rate(files: list[Path], repeats: int = 3) -> float:
    """Clips/s of featurization alone on pre-decoded audio, one torch thread, grouped as
    a worker groups its inputs, float16 output included (median of repeats)."""
    cfg = feature_config(
        str(DEMO_RECIPE["preset"]),
        sample_rate=DEMO_RECIPE["sample_rate"],
        n_fft=DEMO_RECIPE["n_fft"],
        hop_length=DEMO_RECIPE["hop_length"],
        n_mels=DEMO_RECIPE["n_mels"],
    )
    waves = [torch.from_numpy(sf.read(f, dtype="float32")[0]) for f in files]
    size = CHUNK_ITEMS["audio"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times = []
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            for g in range(0, len(waves), size):
                group = waves[g : g + size]
                held = sum(w.numel() for w in group)
                step = max(1, len(group) * GROUP_SAMPLES // max(held, 1))
                for k in range(0, len(group), step):
                    for feat in featurize_clips(group[k : k + step], cfg):
                        feat.to(torch.float16)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return len(waves) / statistics.median(times)


def run(work: Path, clips: int, scale: int, workers: int) -> tuple[list[Row], Made]:
    corpus = esc50_wavs(work / "esc", clips)
    raw = corpus_bytes(corpus)
    files = sorted((corpus / "audio").iterdir())
    wl = (
        f"compile: ESC-50-shaped {clips} clips, 5 s 44.1 kHz WAV ({raw / 2**20:.0f} MiB) "
        "-> 128-mel log-mel"
    )
    t0 = time.perf_counter()
    n = epoch(naive_loader(corpus, batch_size=64, workers=workers))
    t_naive = time.perf_counter() - t0
    naive = rate_row(
        wl, f"naive DataLoader epoch ({workers} workers)", n, t_naive, seconds=round(t_naive, 2)
    )
    naive_rate = naive.samples_per_s or 0.0
    rows = [naive]
    # the limit, per core: decode alone and featurize alone, in this run
    sf_decode = _decode_rate(files)
    own_decode = _dlop_decode_rate(files)
    decode = max(sf_decode, own_decode)
    featurize = _featurize_rate(files[:FEATURIZE_CLIPS])
    limit = 1 / (1 / decode + 1 / featurize)
    per_core = "1 core"
    rows.append(Row(wl, f"decode only: soundfile.read ({per_core})", sf_decode))
    rows.append(Row(wl, f"decode only: dlop decode_audio ({per_core})", own_decode))
    rows.append(
        Row(
            wl,
            f"featurize only: pre-decoded, groups of {CHUNK_ITEMS['audio']} ({per_core})",
            featurize,
        )
    )
    rows.append(Row(wl, f"limit: 1 / (1/faster decode + 1/featurize) ({per_core})", limit))
    archive = work / "esc-archive"
    for w in sorted({1, workers}):
        out = work / f"esc-{w}"
        took, peak = _timed_compile(corpus, out, w)
        rows.append(
            rate_row(
                wl,
                f"dlop-compile ({w} worker{'s' if w > 1 else ''})",
                clips,
                took,
                base=naive,
                base_name="naive epoch",
                of_limit=round(clips / took / (w * limit), 2),
                vs_naive_per_worker=round(clips / took / w / (naive_rate / workers), 2),
                peak_rss_MiB=round(peak / 1024),
                seconds=round(took, 2),
            )
        )
        if w == workers:
            out.rename(archive)
            size = sum(p.stat().st_size for p in archive.glob("*.dlop"))
            rows[-1].extra.update(
                archive_MiB=round(size / 2**20), vs_raw_bytes=round(size / raw, 2)
            )
        else:
            shutil.rmtree(out, ignore_errors=True)
    big = replicate(corpus, work / "esc-x", scale)
    out = work / "esc-x-archive"
    took, peak = _timed_compile(big, out, workers)
    rows.append(
        Row(
            f"compile memory: {clips * scale} clips ({scale}x, {raw * scale / 2**30:.1f} GiB of WAV)",
            f"dlop-compile, {workers} workers, peak RSS of all processes",
            clips * scale / took,
            extra={"peak_rss_MiB": round(peak / 1024), "seconds": round(took, 1)},
        )
    )
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(big, ignore_errors=True)
    return rows, Made(corpus=corpus, archive=archive, naive_rate=naive_rate)

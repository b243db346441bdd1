"""Benchmark corpora: ESC-50-shaped WAV clips, and a 10x replica made of hard links."""

from __future__ import annotations

import csv
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import soundfile as sf

from dlop.compiler.demo import CLASSES, synth


def esc50_wavs(
    root: Path, clips: int, seconds: float = 5.0, rate: int = 44100, seed: int = 0
) -> Path:
    """``clips`` mono int16 WAVs in the layout of ESC-50 (K. J. Piczak, 2015,
    https://github.com/karolpiczak/ESC-50): ``audio/{fold}-{id}-A-{target}.wav``
    plus ``meta/esc50.csv``; its clips are 5 s at 44.1 kHz."""
    (root / "audio").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    rows = []
    for n in range(clips):
        target = n % len(CLASSES)
        name = f"{1 + n % 5}-{n:06d}-A-{target}.wav"
        sf.write(
            root / "audio" / name,
            synth(CLASSES[target], rate, seconds, rng),
            rate,
            subtype="PCM_16",
        )
        rows.append((name, 1 + n % 5, target, CLASSES[target]))
    _write_csv(root, rows)
    return root


def replicate(src: Path, dst: Path, times: int) -> Path:
    """A corpus ``times`` as large whose files are hard links to src's (no extra disk)."""
    (dst / "audio").mkdir(parents=True, exist_ok=True)
    with open(src / "meta" / "esc50.csv") as fh:
        base = list(csv.DictReader(fh))
    rows = []
    for t in range(times):
        for r in base:
            name = f"r{t}-{r['filename']}"
            target = dst / "audio" / name
            if not target.exists():
                os.link(src / "audio" / r["filename"], target)
            rows.append((name, r["fold"], r["target"], r["category"]))
    _write_csv(dst, rows)
    return dst


def subset(src: Path, dst: Path, rows: Sequence[tuple[str, str, str, str]]) -> Path:
    """A corpus of ``rows`` of src's CSV alone (filename, fold, target, category), its
    files hard links to src's, made afresh."""
    shutil.rmtree(dst, ignore_errors=True)
    (dst / "audio").mkdir(parents=True)
    for row in rows:
        os.link(src / "audio" / row[0], dst / "audio" / row[0])
    _write_csv(dst, rows)
    return dst


def _write_csv(root: Path, rows: Sequence[tuple[object, object, object, object]]) -> None:
    (root / "meta").mkdir(exist_ok=True)
    with open(root / "meta" / "esc50.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["filename", "fold", "target", "category", "esc10", "src_file", "take"])
        for name, fold, target, cat in rows:
            w.writerow([name, fold, target, cat, "False", 0, "A"])

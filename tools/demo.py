"""``make demo``: build the demo corpus, compile it, read it back, print the speed-up.

Everything printed is measured in this run, on this machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dlop.formats import ArchiveReader
from dlop.runtime import Loader, open_archive

from .compile_cli import demo_progress
from .compile_cli import main as compile_main


def _rate(fn: Callable[[], object], samples: int, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return samples / best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dlop.tools.demo", description=__doc__)
    p.add_argument(
        "--out", type=Path, default=Path("demo-out"), help="where the corpus and archive go"
    )
    p.add_argument("--clips-per-class", type=int, default=40, help="demo corpus size (5 classes)")
    args = p.parse_args(argv)
    workers = os.cpu_count() or 1
    archive, corpus = args.out / "archive", args.out / "corpus"

    print("== 1. generate the demo corpus and compile it (dlop-compile --demo)")
    if not (corpus / "meta" / "esc50.csv").exists():
        from dlop.compiler.demo import make_demo_corpus

        print(f"generating demo corpus in {corpus}", file=sys.stderr)
        make_demo_corpus(corpus, clips_per_class=args.clips_per_class, on_clip=demo_progress)
    if compile_main(["--demo", str(args.out)]) != 0:
        return 1

    print("\n== 2. read it back")
    reader = ArchiveReader(archive)
    problems = reader.verify()
    print(
        f"verify: {problems or 'OK'}; {len(reader)} samples, fields "
        + ", ".join(
            f"{n} {f.kind if f.kind != 'array' else f.dtype + str(list(f.shape))}"
            for n, f in reader.fields.items()
        )
    )
    if problems:
        return 1
    sample = reader.sample(0)
    logmel = np.asarray(sample["logmel"])
    print(
        f"sample 0: {sample['key']!s} label {int(sample['label'])} ({sample['category']!s}), "
        f"logmel {logmel.shape} dB range {float(logmel.min()):.1f}..{float(logmel.max()):.1f}"
    )

    print(f"\n== 3. one epoch each, {workers} CPU core(s)")
    from torch.utils.data import DataLoader

    from .bench.naive import epoch, naive_loader

    n = len(reader)
    naive = _rate(lambda: epoch(naive_loader(corpus, batch_size=64, workers=workers)), n, repeats=1)
    print(
        f"naive DataLoader (decode + resample + log-mel per sample, {workers} workers): {naive:,.0f} samples/s"
    )
    loader = Loader(archive, batch_size=64, seed=0, fields=["logmel", "label"])
    for _ in loader:  # warm the page cache and the buffers
        pass
    fast = _rate(lambda: sum(len(b["label"]) for b in loader), n, repeats=20)
    print(f"dlop Loader (shuffled batches of 64 into reused buffers): {fast:,.0f} samples/s")
    ds = open_archive(archive, fields=["logmel", "label"])
    dl = DataLoader(ds, batch_size=64, shuffle=True)
    plain = _rate(lambda: sum(len(b["label"]) for b in dl), n, repeats=20)
    print(f"torch DataLoader over open_archive (__getitems__ fast path): {plain:,.0f} samples/s")
    print(
        f"\nspeed-up over the naive pipeline: Loader {fast / naive:,.0f}x, DataLoader {plain / naive:,.0f}x"
    )
    print(
        f"\ntry: dlop-inspect info {archive}\n     dlop-inspect show {archive} 0 --png sample.png"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

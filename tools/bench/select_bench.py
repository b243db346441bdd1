"""Choosing what to train on: the Loader over a selection and over a mixture, against
the Loader over one whole archive of the same samples."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from dlop.formats import ArchiveWriter, Field
from dlop.runtime import Loader, Source

from .common import Row, interleaved, loader_epoch, rate_row
from .format_bench import FRAMES, MELS, synthetic_logmel

BATCH = 256


def write(path: Path, n: int, seed: int) -> Path:
    """An ESC-50-shaped archive: logmel f16 [FRAMES, MELS], label and fold (1..5)."""
    fields = [
        Field("logmel", "f16", (FRAMES, MELS)),
        Field("label", "i64", ()),
        Field("fold", "i64", ()),
    ]
    rng = np.random.default_rng(seed)
    block = synthetic_logmel(rng, 64)
    with ArchiveWriter(path, fields, shard_bytes=1 << 30, overwrite=True) as w:
        for i in range(n):
            w.write({"logmel": block[i % 64], "label": i % 50, "fold": 1 + i % 5})
    return path


def run(work: Path, args: argparse.Namespace) -> list[Row]:
    n = max(args.clips, 3 * BATCH)
    whole = write(work / "whole", n, 0)
    parts = [write(work / f"part{k}", n // 3 + (k < n % 3), k + 1) for k in range(3)]
    size = FRAMES * MELS * 2
    fields = ["logmel", "label"]
    plain = Loader(whole, BATCH, seed=0, fields=fields)
    where = Loader(whole, BATCH, seed=0, fields=fields, where={"fold": [1, 2, 3, 4]})
    mixture = Loader(
        {name: Source(part, weight=1) for name, part in zip("abc", parts, strict=True)},
        BATCH,
        seed=0,
        fields=fields,
        samples_per_epoch=n,
    )
    counts = {"plain": n, "where": len(where.archive), "mixture": mixture.spec.num_samples}
    took = interleaved(
        {
            "plain": lambda: loader_epoch(plain),
            "where": lambda: loader_epoch(where),
            "mixture": lambda: loader_epoch(mixture),
        },
        args.repeats,
    )
    wl = f"select: ESC-50-shaped f16 [{FRAMES},{MELS}] x {n}, page cache warm, batches of {BATCH}"
    base = rate_row(wl, "dlop Loader, whole archive", n, took["plain"], size)
    return [
        base,
        rate_row(
            wl,
            "dlop Loader, where={'fold': [1, 2, 3, 4]} (80%)",
            counts["where"],
            took["where"],
            size,
            base,
            "whole archive",
            target=">=0.95x",
        ),
        rate_row(
            wl,
            "dlop Loader, mixture of 3 archives (same total), equal weights",
            counts["mixture"],
            took["mixture"],
            size,
            base,
            "whole archive",
            target=">=0.9x",
        ),
    ]

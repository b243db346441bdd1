"""Field groups: the Loader reading an archive's fields beside a group's, against the same
fields compiled into one archive.

``--clips`` samples of an ESC-50-shaped log-mel (float16 [64, 501], what the esc50
preset stores for a 5 s clip) and a 512-wide float32 embedding, the same bytes in both:

- ``one archive``: one compile_map of both fields;
- ``archive + group``: a compile_map of the log-mel, then add_fields of the embedding.

Each round reads 16 shuffled epochs of both fields from each (batch 64, the Loader's
defaults), in interleaved order (which goes first alternates); ``group_vs_one`` is the group's rate over the one
archive's, the median of the rounds' ratios with their range (1.0: no cost to reading a
field from a group's shards).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from dlop.compiler import add_fields, compile_map
from dlop.runtime import Loader

from .common import Row, no_collection

MELS, FRAMES, WIDTH, BATCH = 64, 501, 512, 64
EPOCHS = 16  # read per timing: one epoch of 2,000 samples lasts a few hundredths of a second


def logmel(i: int) -> np.ndarray:
    rng = np.random.default_rng(i)
    return rng.standard_normal((MELS, FRAMES), dtype=np.float32).astype(np.float16)


def embedding(i: int) -> np.ndarray:
    return np.random.default_rng(1_000_003 + i).standard_normal(WIDTH, dtype=np.float32)


def both(i: int) -> dict[str, Any]:
    return {"logmel": logmel(i), "embedding": embedding(i)}


def mel_only(i: int) -> dict[str, Any]:
    return {"logmel": logmel(i), "n": i}


def embed(sample: dict[str, Any]) -> dict[str, Any]:
    return {"embedding": embedding(int(sample["n"]))}


def _epochs(path: Path, seed: int) -> float:
    """Samples a second over EPOCHS shuffled epochs of both fields."""
    loader = Loader(path, batch_size=BATCH, fields=["logmel", "embedding"], shuffle=True, seed=seed)
    t0 = time.perf_counter()
    seen = 0
    for _ in range(EPOCHS):
        for batch in loader:
            seen += len(batch["embedding"])
    return seen / (time.perf_counter() - t0)


def run(work: Path, args: argparse.Namespace) -> list[Row]:
    clips, rounds, workers = args.clips, max(3, args.repeats), args.workers
    options = {"workers": workers, "progress": False, "overwrite": True}
    one, grouped = work / "one", work / "grouped"
    compile_map(both, list(range(clips)), one, **options)
    compile_map(mel_only, list(range(clips)), grouped, **options)
    add_fields(grouped, embed, "emb", workers=workers, progress=False, overwrite=True)
    rates: dict[str, list[float]] = {"one": [], "group": []}
    os.sync()  # the archives' pages written back before any clock starts
    _epochs(one, 0), _epochs(grouped, 0)  # both warm in the page cache
    with no_collection():
        for r in range(rounds):
            order = ("one", "group") if r % 2 == 0 else ("group", "one")
            for name in order:
                rates[name].append(_epochs(one if name == "one" else grouped, r + 1))
    ratios = [g / o for g, o in zip(rates["group"], rates["one"], strict=True)]
    workload = (
        f"field groups: {clips} samples, log-mel f16 [{MELS}, {FRAMES}] + embedding f32 "
        f"[{WIDTH}], Loader batch {BATCH}, shuffled"
    )
    base = Row(workload, "Loader, both fields in one archive", statistics.median(rates["one"]))
    group = Row(
        workload,
        "Loader, the log-mel from the archive and the embedding from its field group",
        statistics.median(rates["group"]),
        vs_baseline=round(statistics.median(ratios), 4),
        baseline=base.pipeline,
    )
    group.extra = {
        "group_vs_one": {
            "median": round(statistics.median(ratios), 4),
            "range": [round(min(ratios), 4), round(max(ratios), 4)],
        },
        "samples_per_s": {k: [round(v, 1) for v in vs] for k, vs in rates.items()},
    }
    return [base, group]

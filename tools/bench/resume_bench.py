"""Resuming in another world: time to the first batch of an epoch continued in another
shape, against a fresh start in that shape.

An archive of ``--resume-samples`` small samples (default a million). A Loader state is
saved half-way through an epoch, then, in interleaved rounds, a Loader of the new shape
is made and iterated to its first batch:

- ``fresh``: started at the epoch's beginning;
- ``continued``: loaded with the saved state, which leaves out what the old world read
  and deals the rest over the new one (docs/runtime.md, "Resuming in another world").

Two moves: world 8 to world 6 with the per-rank batch raised from 32 to 48, on one
node; and 8 ranks on 2 nodes to 6 on 3 (node dealing). ``continued_vs_fresh`` is the
continued time over the fresh one, the median of the rounds' ratios with their range
(the goal is at most 1.5x: continuing costs computing orders, never reading batches).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from dlop.formats import ArchiveWriter, Field
from dlop.runtime import Loader

from .common import Row, no_collection

ROUNDS = 5
MOVES = {
    "world 8 to 6, batch 32 to 48, one node": ((8, 1, 32), (6, 1, 48)),
    "8 ranks on 2 nodes to 6 ranks on 3 nodes": ((8, 2, 32), (6, 3, 48)),
}


def write(path: Path, n: int) -> Path:
    """``n`` samples of an int64 and an int32, in shards of 1 MiB."""
    if (path / "index.json").exists():
        return path
    fields = [Field("x", "i64", ()), Field("n", "i32", ())]
    with ArchiveWriter(path, fields, shard_bytes=1 << 20, overwrite=True) as w:
        for i in range(n):
            w.write({"x": np.int64(i), "n": np.int32(i % 97)})
    return path


def first_batch(path: Path, shape: tuple[int, int, int], state: dict[str, Any] | None) -> float:
    """Seconds from making the Loader (rank 2 of ``shape``) to its first batch."""
    world, nodes, batch = shape
    t0 = time.perf_counter()
    loader = Loader(path, batch, rank=2, world_size=world, nodes=nodes, seed=1)
    if state is not None:
        loader.load_state_dict(state)
    next(iter(loader))
    took = time.perf_counter() - t0
    loader.close()
    return took


def run(work: Path, args: argparse.Namespace) -> list[Row]:
    n, rounds = args.resume_samples, max(ROUNDS, args.repeats)
    path = write(work / "small.dlop", n)
    rows = []
    for move, (before, after) in MOVES.items():
        world, nodes, batch = before
        old = Loader(path, batch, rank=0, world_size=world, nodes=nodes, seed=1)
        state = {**old.state_dict(), "batches_done": len(old.batches()) // 2}
        old.close()
        took: dict[str, list[float]] = {"fresh": [], "continued": []}
        first_batch(path, after, None), first_batch(path, after, state)  # warm
        with no_collection():
            for r in range(rounds):
                for kind in ("fresh", "continued") if r % 2 == 0 else ("continued", "fresh"):
                    took[kind].append(first_batch(path, after, state if kind != "fresh" else None))
        ratios = [c / f for c, f in zip(took["continued"], took["fresh"], strict=True)]
        workload = f"resume in another world: {n} samples, half an epoch read, {move}"
        fresh = Row(workload, "fresh start: time to first batch", None)
        fresh.extra = {"ms": round(statistics.median(took["fresh"]) * 1e3, 1)}
        continued = Row(workload, "continued epoch: time to first batch", None)
        continued.extra = {
            "ms": round(statistics.median(took["continued"]) * 1e3, 1),
            "continued_vs_fresh": {
                "median": round(statistics.median(ratios), 3),
                "range": [round(min(ratios), 3), round(max(ratios), 3)],
            },
            "target": "<=1.5x a fresh start's",
            "seconds": {k: [round(t, 4) for t in v] for k, v in took.items()},
        }
        rows += [fresh, continued]
    return rows

"""Shuffle quality of the runtime's orders, and of MosaicML Streaming's where it is installed.

A window order, and an order that deals shards to nodes, is not a global
shuffle. Measured here on the orders alone (no data read; the orders are pure
functions of the shard sizes, the seed and the epoch), for an archive of
SHARDS shards of PER_SHARD samples read by NODES nodes of RANKS ranks in
batches of BATCH, over EPOCHS epochs:

- ``shards_per_batch``: distinct shards in a batch, mean over every rank's
  batches (higher mixes more shards, so more sources, speakers, sessions, into
  a batch; a global shuffle gives about min(BATCH, SHARDS)).
- ``epoch_corr``: Pearson correlation between a sample's step in one epoch and
  in the next, mean over consecutive epochs (0: the order starts afresh each
  epoch; 1: it repeats).
- ``node_shards``: the fraction of the archive's shards a node reads in an
  epoch, mean over nodes and epochs (what a cold node cache downloads).
- ``new_node_shards``: of those, the fraction the node did not read the epoch
  before (what it downloads again when its cache holds only its share).
- ``cache_shards``: how many shards a rank reads from at once, the cache a rank
  needs: dlop's ``window_shards``; for Streaming, its shuffle block in shards.

Streaming's py1e and py1br are run on the same shard sizes through its own
``get_partitions``/``get_shuffle`` (as its StreamingDataset composes them, one
worker per rank), at a block of ``window_shards`` shards' samples (the same
cache budget) and at its default block.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dlop.runtime import OrderSpec, rank_batches

from .common import Row

SHARDS, PER_SHARD, BATCH, NODES, RANKS, EPOCHS, SEED = 256, 250, 64, 2, 2, 3, 17
WINDOW = 8  # dlop's default window_shards

# an epoch -> each rank's batches (rank-major), as arrays of sample numbers
Order = Callable[[int], list[list[np.ndarray]]]


def dlop_order(mode: str, nodes: int, share: str = "keep", window: int = WINDOW) -> Order:
    sizes = (PER_SHARD,) * SHARDS
    world = NODES * RANKS  # nodes=1: the same ranks, the shards not dealt

    def order(epoch: int) -> list[list[np.ndarray]]:
        return [
            rank_batches(
                OrderSpec(
                    SHARDS * PER_SHARD,
                    BATCH,
                    seed=SEED,
                    rank=r,
                    world_size=world,
                    mode=mode,
                    shard_sizes=sizes,
                    window_shards=window,
                    nodes=nodes,
                    node_share=share,
                ),
                epoch,
            )
            for r in range(world)
        ]

    return order


def streaming_order(algo: str, block: int) -> Order:
    """Streaming's order for NODES nodes of RANKS ranks, one worker each."""
    from streaming.base.partition import get_partitions
    from streaming.base.shuffle import get_shuffle

    sizes = np.full(SHARDS, PER_SHARD, np.int64)

    def order(epoch: int) -> list[list[np.ndarray]]:
        ids = get_partitions("orig", SHARDS * PER_SHARD, NODES, NODES, RANKS, 1, BATCH)
        shuffle = get_shuffle(algo, sizes, NODES, SEED, epoch, block)
        ids = np.where(ids == -1, -1, shuffle[ids])
        ranks = ids.reshape(NODES * RANKS, -1, BATCH)  # (node, rank) major, one worker
        return [[b[b >= 0] for b in rank] for rank in ranks]

    return order


def quality(order: Order, ranks_per_node: int = RANKS) -> dict[str, float]:
    """The measures of the module docstring for ``order``."""
    shard_of = np.repeat(np.arange(SHARDS), PER_SHARD)
    n = SHARDS * PER_SHARD
    per_batch: list[int] = []
    steps: list[np.ndarray] = []
    node_reads: list[list[set[int]]] = []
    for epoch in range(EPOCHS):
        ranks = order(epoch)
        step = np.full(n, -1, np.int64)
        reads: list[set[int]] = [set() for _ in range(len(ranks) // ranks_per_node)]
        for r, batches in enumerate(ranks):
            for j, b in enumerate(batches):
                shards = np.unique(shard_of[b])
                per_batch.append(len(shards))
                reads[r // ranks_per_node].update(shards.tolist())
                fresh = b[step[b] < 0]
                step[fresh] = j
        steps.append(step)
        node_reads.append(reads)
    corr = []
    for a, b in itertools.pairwise(steps):
        both = (a >= 0) & (b >= 0)
        corr.append(float(np.corrcoef(a[both], b[both])[0, 1]))
    fractions = [len(s) / SHARDS for reads in node_reads for s in reads]
    new = [
        len(now - before) / max(1, len(now))
        for prev, cur in itertools.pairwise(node_reads)
        for before, now in zip(prev, cur, strict=True)
    ]
    return {
        "shards_per_batch": round(float(np.mean(per_batch)), 2),
        "epoch_corr": round(float(np.mean(corr)), 3),
        "node_shards": round(float(np.mean(fractions)), 3),
        "new_node_shards": round(float(np.mean(new)), 3),
    }


def orders(with_streaming: bool) -> list[tuple[str, Order, int]]:
    """(pipeline, order, cache shards per rank) for each order measured."""
    made: list[tuple[str, Order, int]] = [
        ("dlop order='global' (no nodes)", dlop_order("global", 1), SHARDS),
        (
            f"dlop order='window', window_shards={WINDOW} (no nodes)",
            dlop_order("window", 1),
            WINDOW,
        ),
        (
            f"dlop order='window', window_shards={WINDOW}, nodes={NODES} (node_share='keep')",
            dlop_order("window", NODES),
            WINDOW,
        ),
        (
            f"dlop order='window', window_shards={WINDOW}, nodes={NODES}, node_share='redeal'",
            dlop_order("window", NODES, "redeal"),
            WINDOW,
        ),
        (
            f"dlop order='global', nodes={NODES} (node_share='keep')",
            dlop_order("global", NODES),
            SHARDS // NODES,
        ),
    ]
    if with_streaming:
        same = WINDOW * PER_SHARD
        default = max(4_000_000 // NODES, 1 << 18)
        for algo in ("py1e", "py1br"):
            made.append(
                (f"Streaming {algo}, block of {WINDOW} shards", streaming_order(algo, same), WINDOW)
            )
            made.append(
                (
                    f"Streaming {algo}, default block ({default} samples)",
                    streaming_order(algo, default),
                    min(SHARDS // NODES, default // PER_SHARD),
                )
            )
    return made


def rows(with_streaming: bool) -> list[Row]:
    wl = (
        f"shuffle quality: {SHARDS} shards of {PER_SHARD} samples, {NODES} nodes x {RANKS} "
        f"ranks, batches of {BATCH}, {EPOCHS} epochs (orders only)"
    )
    return [
        Row(wl, name, extra={**quality(order), "cache_shards": cache})
        for name, order, cache in orders(with_streaming)
    ]


def run(work: Path, args: argparse.Namespace) -> list[Row]:
    """dlop's orders only; bench-peers adds Streaming's (peer_rows)."""
    return rows(with_streaming=False)

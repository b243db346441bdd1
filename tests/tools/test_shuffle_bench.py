"""dlop-bench's shuffle section: its measures on orders whose answers are known, and
the rows it gives for dlop's orders (and Streaming's where it is installed)."""

from __future__ import annotations

import numpy as np
import pytest

from dlop.tools.bench import cli, shuffle_bench
from dlop.tools.bench.shuffle_bench import BATCH, PER_SHARD, SHARDS, quality

N = SHARDS * PER_SHARD


def _ranks(order: np.ndarray, world: int = 4) -> list[list[np.ndarray]]:
    """``order`` dealt to ``world`` ranks in turn, batch by batch."""
    batches = [order[i : i + BATCH] for i in range(0, len(order), BATCH)]
    return [batches[r::world] for r in range(world)]


def test_measures_of_known_orders() -> None:
    same = quality(lambda epoch: _ranks(np.arange(N)))
    assert same["epoch_corr"] == pytest.approx(1.0)
    # batches of 64 in shards of 250: about one batch in four straddles two shards
    assert same["shards_per_batch"] == pytest.approx(1.25, abs=0.01)
    assert same["node_shards"] == 1.0  # each node takes two batches in four: every shard
    shuffled = quality(lambda epoch: _ranks(np.random.default_rng(epoch).permutation(N)))
    assert abs(shuffled["epoch_corr"]) < 0.05
    assert shuffled["shards_per_batch"] > 50
    assert shuffled["node_shards"] == 1.0 and shuffled["new_node_shards"] == 0.0


def test_the_section_gives_dlops_orders() -> None:
    rows = {r.pipeline: r.extra for r in shuffle_bench.rows(with_streaming=False)}
    assert "shuffle" in cli.SECTIONS and "shuffle" in cli.DEFAULT_SECTIONS
    keep = rows["dlop order='window', window_shards=8, nodes=2 (node_share='keep')"]
    redeal = rows["dlop order='window', window_shards=8, nodes=2, node_share='redeal'"]
    flat = rows["dlop order='window', window_shards=8 (no nodes)"]
    assert keep["node_shards"] <= 0.51 and keep["new_node_shards"] == 0.0
    assert redeal["new_node_shards"] > 0.3 and flat["node_shards"] == 1.0
    assert 6 < keep["shards_per_batch"] <= 9


def test_streamings_rows_where_it_is_installed() -> None:
    pytest.importorskip("streaming")
    rows = [r for r in shuffle_bench.rows(with_streaming=True) if "Streaming" in r.pipeline]
    assert len(rows) == 4 and all(r.extra["node_shards"] == 0.5 for r in rows)

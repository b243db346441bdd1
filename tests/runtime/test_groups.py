"""A batch's shard groups, worked out once for all its fields: shards and rows against a
sample-by-sample count, and plans that share them read what per-field plans read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dlop.runtime import open_archive
from dlop.runtime.gather.engine import run_share
from dlop.runtime.gather.fields import Locator, batch_groups
from dlop.runtime.gather.plan import Rows

from .helpers import make_archive


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_archive(tmp_path_factory.mktemp("g") / "a", n=37)


@pytest.mark.parametrize(
    "idx",
    [[], [0, 1, 2], [36], [20, 21, 21], [0, 3, 3, 8, 20, 21, 36], [4, 2, 9, 30, 31], [36, 0, 20]],
)
def test_batch_groups_give_each_index_its_shard_and_row(archive: Path, idx: list[int]) -> None:
    ds = open_archive(archive)
    assert ds.reader.num_shards > 3
    groups = batch_groups(torch.tensor(idx, dtype=torch.int64), ds.starts)
    for got in groups:
        assert got.dtype == np.int64 and got.flags.c_contiguous and len(got) == len(idx)
    for j, i in enumerate(idx):  # counted sample by sample
        k = max(s for s in range(ds.reader.num_shards) if ds.shard_starts[s] <= i)
        assert (groups.shards[j], groups.rows[j]) == (k, i - ds.shard_starts[k])


def test_fields_of_a_batch_share_its_shard_groups(archive: Path) -> None:
    """Archive.plan works out the groups once: each fixed field is one Rows step over
    every shard the batch touches, all reading the same arrays (no per-field copy), and
    the batch matches sample-by-sample reads."""
    ds = open_archive(archive, fields=["logmel", "label", "speech"])
    idx = torch.tensor([0, 3, 3, 8, 20, 21, 36])
    batch, plan = ds.plan(idx)
    rows = [s for s in plan.steps if isinstance(s, Rows)]
    assert sorted(s.table.row_bytes for s in rows) == [8, 20 * 2]  # label, logmel
    assert len({len(s.table) for s in rows}) == 1 and len(rows[0].table) > 3
    a, b = rows
    assert a.shards is not None and b.shards is not None
    assert np.shares_memory(a.rows, b.rows) and np.shares_memory(a.shards, b.shards)
    run_share(plan.steps, streaming=False)
    for j, i in enumerate(idx.tolist()):
        one = ds[i]
        assert torch.equal(batch["logmel"][j], one["logmel"])
        assert int(batch["label"][j]) == int(one["label"])
        n = int(batch["speech_lengths"][j])
        assert torch.equal(batch["speech"][j, :n], one["speech"])


def test_plan_grouped_matches_plan(archive: Path) -> None:
    ds = open_archive(archive, fields=["logmel", "speech"])
    idx = torch.tensor([1, 2, 9, 10, 30])
    groups = batch_groups(idx, ds.starts)
    for name, g in ds.gathers.items():
        alone, alone_steps = g.plan(idx, None)
        shared, shared_steps = g.plan_grouped(idx, groups, None)
        run_share(alone_steps + shared_steps, streaming=False)
        assert alone.keys() == shared.keys()
        for key in alone:
            assert torch.equal(alone[key], shared[key]), (name, key)


@pytest.mark.parametrize(
    "sizes",
    [
        [1024] * 50 + [7],
        [5000],
        [3, 0, 900, 900, 0, 0, 901, 1],  # empty and tiny shards among large ones
        [1] * 300,  # blocks too small for the table: the binary search serves
        [100, 4096, 64, 4096, 4096, 2000],
    ],
)
def test_the_locator_agrees_with_a_binary_search(sizes: list[int]) -> None:
    starts = torch.from_numpy(np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64))
    total = sum(sizes)
    locator = Locator(starts, total)
    assert locator.steps <= Locator.MAX_STEPS
    rng = np.random.default_rng(len(sizes))
    for idx in (np.arange(total), rng.integers(0, total, 5000), np.zeros(0, np.int64)):
        indices = torch.from_numpy(idx.astype(np.int64))
        got, want = locator.groups(indices), batch_groups(indices, starts)
        np.testing.assert_array_equal(got.shards, want.shards)
        np.testing.assert_array_equal(got.rows, want.rows)
    if len(sizes) > 1 and min(sizes) >= Locator.MIN_BLOCK:
        assert locator.table is not None  # the table, not the binary search
    if locator.table is not None:  # past the end: refused here (else by the copy's row check)
        with pytest.raises(IndexError):
            locator.groups(torch.tensor([total + (1 << 20)]))

"""A batch's shard groups, worked out once for all its fields: runs and rows against a
sample-by-sample count, and plans that share them read what per-field plans read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dlop.runtime import open_archive
from dlop.runtime.gather.engine import run_share
from dlop.runtime.gather.fields import batch_groups, shard_groups
from dlop.runtime.gather.plan import Rows

from .helpers import make_archive


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_archive(tmp_path_factory.mktemp("g") / "a", n=37)


@pytest.mark.parametrize(
    "idx",
    [[], [0, 1, 2], [36], [20, 21, 21], [0, 3, 3, 8, 20, 21, 36], [4, 2, 9, 30, 31]],
)
def test_batch_groups_rows_are_rows_within_each_shard(archive: Path, idx: list[int]) -> None:
    ds = open_archive(archive)
    assert ds.reader.num_shards > 3
    indices = torch.tensor(idx, dtype=torch.int64)
    groups = batch_groups(indices, ds.starts)
    assert groups.runs == shard_groups(indices, ds.starts)
    assert groups.rows.dtype == np.int64 and groups.rows.flags.c_contiguous
    shard = np.searchsorted(ds.shard_starts, idx, side="right") - 1
    assert groups.rows.tolist() == (np.asarray(idx, np.int64) - ds.shard_starts[shard]).tolist()
    for k, a, b in groups.runs:
        assert set(shard[a:b].tolist()) == {k}
    assert [k for k, _, _ in groups.runs] == sorted(set(shard.tolist()))


def test_fields_of_a_batch_share_its_shard_groups(archive: Path) -> None:
    """Archive.plan works out the groups once: every fixed field's Rows steps read the
    same row arrays (no per-field copy), and the batch matches sample-by-sample reads."""
    ds = open_archive(archive, fields=["logmel", "label", "speech"])
    idx = torch.tensor([0, 3, 3, 8, 20, 21, 36])
    batch, plan = ds.plan(idx)
    rows = [s for s in plan.steps if isinstance(s, Rows)]
    by_field: dict[int, list[Rows]] = {}
    for step in rows:
        by_field.setdefault(step.src.data_ptr(), []).append(step)
    assert len(rows) >= 4 and len({len(v) for v in by_field.values()}) == 1
    logmel_rows = [s.rows for s in rows if s.src.shape[1] == 20 * 2]
    label_rows = [s.rows for s in rows if s.src.shape[1] == 8]
    assert logmel_rows and len(logmel_rows) == len(label_rows)
    for a, b in zip(logmel_rows, label_rows, strict=True):
        assert np.shares_memory(a, b)
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

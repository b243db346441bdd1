"""IterableArchive in DataLoader worker processes: epochs reach persistent workers, every
sample once per epoch in a new order, bucketing, and exact resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from dlop.runtime import IterableArchive, Loader
from dlop.runtime.errors import UsageError

from .helpers import make_archive


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_archive(tmp_path_factory.mktemp("it") / "a", n=40)


def labels(batches: list[dict[str, torch.Tensor]]) -> list[list[int]]:
    return [b["label"].tolist() for b in batches]


@pytest.mark.slow
def test_persistent_workers_see_each_epoch_and_resume_exactly(archive: Path) -> None:
    ds = IterableArchive(archive, batch_size=4, seed=7, drop_last=True)
    loader = DataLoader(
        ds, batch_size=None, num_workers=2, persistent_workers=True, multiprocessing_context="fork"
    )
    epochs = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        got = labels(list(loader))
        flat = [x for b in got for x in b]
        assert sorted(flat) == list(range(40))  # every sample exactly once
        epochs.append(got)
    assert len({str(e) for e in epochs}) == 3  # a new order each epoch
    # Resume: stop after 3 batches of epoch 1, save, continue in a fresh DataLoader.
    ds.set_epoch(1)
    it = iter(loader)
    taken = [next(it)["label"].tolist() for _ in range(3)]
    state = ds.state_dict(batches_done=3)
    del it
    assert taken == epochs[1][:3]
    fresh = IterableArchive(archive, batch_size=4, seed=7, drop_last=True)
    fresh.load_state_dict(state)
    resumed = DataLoader(
        fresh,
        batch_size=None,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context="fork",
    )
    assert labels(list(resumed)) == epochs[1][3:]
    assert labels(list(resumed)) == epochs[1]  # the iteration after starts the epoch over


def test_in_process_order_matches_the_loader_with_bucketing(archive: Path) -> None:
    ds = IterableArchive(archive, batch_size=5, seed=3, bucket_by="speech")
    ds.set_epoch(2)
    loader = Loader(archive, 5, seed=3, bucket_by="speech")
    loader.set_epoch(2)
    expected = [b["label"].tolist() for b in loader]
    got = labels(list(ds))
    assert got == expected
    first = IterableArchive(archive, batch_size=5, seed=3, bucket_by="speech")
    first.set_epoch(2)
    it = iter(first)
    for _ in range(4):
        next(it)
    state = first.state_dict()  # counted in process: no DataLoader workers
    assert state["batches_done"] == 4 and state["epoch"] == 2
    again = IterableArchive(archive, batch_size=5, seed=3, bucket_by="speech")
    again.load_state_dict(state)
    assert labels(list(again)) == expected[4:]
    loader.close()


def test_iterable_misuse_is_refused(archive: Path) -> None:
    with pytest.raises(UsageError, match="bucket_by must name a ragged field"):
        IterableArchive(archive, 4, bucket_by="label")
    ds = IterableArchive(archive, 4, seed=1)
    with pytest.raises(UsageError, match="seed"):
        ds.load_state_dict({**IterableArchive(archive, 4, seed=2).state_dict(), "epoch": 0})
    with pytest.raises(UsageError, match="epoch must be at least 0"):
        ds.set_epoch(-1)

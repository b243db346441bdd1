"""A new pass without set_epoch reshuffles (as DataLoader(shuffle=True) does); set_epoch
stays authoritative and resume exact. The documented Charades pipeline on clips of
varying size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from dlop.runtime import IterableArchive, Loader, RandomTemporalCrop
from dlop.runtime.batch import Batch

from .helpers import make_archive


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_archive(tmp_path_factory.mktemp("e") / "a", n=41)


def labels(batches: object) -> list[list[int]]:
    return [b["label"].tolist() for b in batches]  # type: ignore[attr-defined]


def reference(archive: Path, epoch: int) -> list[list[int]]:
    loader = Loader(archive, 4, seed=3, prefetch=0)
    loader.set_epoch(epoch)
    try:
        return labels(loader)
    finally:
        loader.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_second_pass_without_set_epoch_is_the_next_epoch(archive: Path, prefetch: int) -> None:
    loader = Loader(archive, 4, seed=3, prefetch=prefetch)
    try:
        first, second, third = labels(loader), labels(loader), labels(loader)
        assert loader.epoch == 2
        assert first == reference(archive, 0) and second == reference(archive, 1)
        assert third == reference(archive, 2) and first != second
        loader.set_epoch(0)  # authoritative: the first epoch again, then on from there
        assert labels(loader) == first and labels(loader) == second
    finally:
        loader.close()


def test_resume_then_the_next_pass_moves_on(archive: Path) -> None:
    loader = Loader(archive, 4, seed=3, prefetch=0)
    loader.set_epoch(5)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    loader.close()
    resumed = Loader(archive, 4, seed=3, prefetch=0)
    try:
        resumed.load_state_dict(state)
        assert labels(resumed) == reference(archive, 5)[2:]
        assert labels(resumed) == reference(archive, 6)
        assert resumed.state_dict()["epoch"] == 6
    finally:
        resumed.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_an_iteration_that_yields_nothing_uses_up_no_epoch(archive: Path, prefetch: int) -> None:
    """A trainer's iter() only to check the loader is iterable (PyTorch Lightning does it
    before the first epoch) leaves the first real pass at epoch 0."""
    loader = Loader(archive, 4, seed=3, prefetch=prefetch)
    try:
        iter(loader)
        assert labels(loader) == reference(archive, 0)
        iter(loader)
        assert labels(loader) == reference(archive, 1) and loader.epoch == 1
        # a state saved at an epoch's end: its pass yields nothing, the next is the next epoch
        done = loader.state_dict()
        resumed = Loader(archive, 4, seed=3, prefetch=prefetch)
        try:
            resumed.load_state_dict(done)
            assert labels(resumed) == []
            assert labels(resumed) == reference(archive, 2)
        finally:
            resumed.close()
    finally:
        loader.close()


@pytest.mark.parametrize("persistent", [False, True])
def test_iterable_archive_under_workers_moves_on_too(archive: Path, persistent: bool) -> None:
    ds = IterableArchive(archive, 4, seed=3)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent)

    def one_pass() -> list[list[int]]:
        return [b["label"].tolist() for b in sorted(loader, key=lambda b: b.position)]

    first, second = one_pass(), one_pass()
    assert first == reference(archive, 0) and second == reference(archive, 1)
    assert ds.epoch == 1
    ds.set_epoch(0)
    assert one_pass() == first


def test_temporal_crop_of_clips_whose_height_and_width_vary() -> None:
    """frames_lengths [B, 2] (height, width): every clip's frames are valid."""
    frames = torch.arange(4 * 6).view(4, 6, 1, 1, 1).expand(4, 6, 5, 7, 3).to(torch.uint8)
    lengths = torch.tensor([[5, 7], [3, 7], [5, 4], [2, 2]])
    out = RandomTemporalCrop(frames=3)(
        Batch(frames=frames.clone(), frames_lengths=lengths), torch.Generator().manual_seed(0)
    )
    assert out["frames"].shape == (4, 3, 5, 7, 3)
    assert torch.equal(out["frames_lengths"], lengths)
    seq = out["frames"][:, :, 0, 0, 0].long()
    assert ((seq[:, 1:] - seq[:, :-1]) == 1).all()
    # every axis varies ([B, 3]: frames, height, width): frames come first
    lengths3 = torch.tensor([[6, 5, 7], [2, 3, 7], [4, 5, 4], [1, 2, 2]])
    out = RandomTemporalCrop(frames=3)(
        Batch(frames=frames.clone(), frames_lengths=lengths3), torch.Generator().manual_seed(0)
    )
    assert out["frames_lengths"][:, 0].tolist() == [3, 2, 3, 1]
    assert out["frames_lengths"][:, 1:].tolist() == lengths3[:, 1:].tolist()


def test_another_worker_count_without_set_epoch_is_refused(archive: Path) -> None:
    """Workers find the epoch by counting the passes each served: a pass with another
    worker count could mix two epochs, so it needs set_epoch."""
    ds = IterableArchive(archive, 4, seed=3)
    two = DataLoader(ds, batch_size=None, num_workers=2)
    assert len(list(two)) == 11
    with pytest.raises(Exception, match="this pass runs 1 worker"):
        list(DataLoader(ds, batch_size=None, num_workers=0))
    ds.set_epoch(1)
    assert labels(sorted(DataLoader(ds, batch_size=None), key=lambda b: b.position)) == (
        reference(archive, 1)
    )


def _changed(batches: list) -> None:
    """What a user might do with the batches they were given: reorder, drop, write."""
    batches[0][:] = batches[0][::-1].copy()
    batches[1][:] = 0
    batches.pop()
    batches.reverse()


def test_changing_the_batches_handed_out_changes_nothing_read(archive: Path) -> None:
    """Loader.batches() and IterableArchive.batches() handed out the lists the order
    keeps: a user who reversed, dropped or wrote into them changed the epoch the loader
    then read (a batch lost, samples repeated), silently."""
    loader = Loader(archive, 4, seed=3, fields=["label"])
    want = [b.tolist() for b in loader.batches()]
    _changed(loader.batches())
    assert [b.tolist() for b in loader.batches()] == want
    assert [batch["label"].tolist() for batch in loader] == want

    iterable = IterableArchive(archive, 4, seed=3, fields=["label"])
    want = [b.tolist() for b in iterable.batches()]
    _changed(iterable.batches())
    assert [b.tolist() for b in iterable.batches()] == want
    assert [batch["label"].tolist() for batch in iterable] == want

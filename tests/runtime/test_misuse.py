"""Misuse fails at the call with a dlop error naming the argument, what arrived and what is allowed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dlop.formats import ArchiveWriter, DlopError, Field
from dlop.runtime import Loader, LoaderError, open_archive
from dlop.runtime.errors import SampleIndexError, UsageError, UsageTypeError

from .helpers import fail_planning, make_archive


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_archive(tmp_path_factory.mktemp("m") / "a", n=23)


def test_resume_state_out_of_range_is_refused(archive: Path) -> None:
    loader = Loader(archive, 4, seed=1)
    state = loader.state_dict()
    for done in (-1, 10**6, "2", 1.5, None):
        with pytest.raises((UsageError, UsageTypeError), match="batches_done"):
            loader.load_state_dict({**state, "batches_done": done})
    with pytest.raises(UsageError, match="epoch"):
        loader.load_state_dict({**state, "epoch": -3})
    with pytest.raises(UsageTypeError, match="state_dict"):
        loader.load_state_dict([("epoch", 0)])  # type: ignore[arg-type]
    loader.load_state_dict({**state, "batches_done": len(loader)})  # an epoch's end is a state
    assert list(loader) == []
    loader.close()


def test_loader_arguments_are_checked_at_the_call(archive: Path) -> None:
    loader = Loader(archive, 4)
    with pytest.raises(UsageError, match="epoch must be at least 0, got -1"):
        loader.set_epoch(-1)
    with pytest.raises(UsageTypeError, match="epoch must be an integer"):
        loader.set_epoch(1.5)  # type: ignore[arg-type]
    loader.close()
    for kwargs, message in [
        ({"batch_size": 0}, "batch_size must be at least 1"),
        ({"batch_size": True}, "batch_size must be an integer"),
        ({"batch_size": 4, "prefetch": -1}, "prefetch must be at least 0"),
        ({"batch_size": 4, "order": "random"}, "order must be 'global' or 'window'"),
        ({"batch_size": 4, "bucket_by": "label"}, "bucket_by must name a ragged field"),
        ({"batch_size": 4, "rank": 2, "world_size": 2}, "rank must be 0..1"),
    ]:
        with pytest.raises(DlopError, match=message):
            Loader(archive, **kwargs)  # type: ignore[arg-type]


def test_a_huge_batch_size_is_one_batch_of_everything(archive: Path) -> None:
    loader = Loader(archive, batch_size=10**12, shuffle=False)
    batches = [b["label"].clone() for b in loader]
    assert len(batches) == 1 and batches[0].tolist() == list(range(23))
    loader.close()


def test_dataset_indices_are_checked(archive: Path) -> None:
    ds = open_archive(archive)
    with pytest.raises(UsageTypeError, match=r"ds\[i\]\['label'\]"):
        ds["label"]  # type: ignore[index]
    with pytest.raises(UsageTypeError, match="integer"):
        ds[1.0]  # type: ignore[index]
    with pytest.raises(SampleIndexError, match="sample 23 out of range"):
        ds[23]
    assert ds[-1]["key"] == "k022"
    for bad in ([2**63], [2**70], [-1], torch.tensor([23])):
        with pytest.raises(SampleIndexError, match="out of range"):
            ds.__getitems__(bad)  # type: ignore[arg-type]
    for bad_type in ([1.5], "12", torch.tensor([1.0]), [[1, 2], [3]]):
        with pytest.raises(UsageTypeError):
            ds.__getitems__(bad_type)  # type: ignore[arg-type]
    assert ds.__getitems__(np.array([3, 1], dtype=np.uint64))["label"].tolist() == [3, 1]


def test_fields_as_one_name_or_a_list(archive: Path) -> None:
    assert list(open_archive(archive, fields="logmel").fields) == ["logmel"]
    assert list(Loader(archive, 4, fields="label").archive.fields) == ["label"]
    with pytest.raises(UsageError, match="more than once"):
        open_archive(archive, fields=["label", "label"])
    with pytest.raises(UsageTypeError, match="names"):
        open_archive(archive, fields=[1])  # type: ignore[list-item]
    with pytest.raises(DlopError, match="no field"):
        open_archive(archive, fields="logmels")


@pytest.fixture(scope="module")
def crossed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two samples long in different dimensions: padding both would take terabytes."""
    n = 2_000_000
    path = tmp_path_factory.mktemp("crossed") / "a"
    with ArchiveWriter(path, [Field("grid", "u8", (None, None))]) as w:
        w.write({"grid": np.ones((1, n), np.uint8)})
        w.write({"grid": np.ones((n, 1), np.uint8)})
    return path


def test_padding_to_an_impossible_batch_fails_early(crossed: Path) -> None:
    ds = open_archive(crossed)
    message = r"field 'grid': padding 2 samples \(sizes 1..2000000 x 1..2000000\)"
    with pytest.raises(UsageError, match=message):
        ds.__getitems__([0, 1])
    assert ds.__getitems__([1])["grid"].shape == (1, 2_000_000, 1)
    for prefetch in (0, 2):
        with pytest.raises((LoaderError, UsageError), match=message):
            list(Loader(ds, 2, prefetch=prefetch))


def test_an_open_archive_with_other_fields_or_padding_is_refused(archive: Path) -> None:
    ds = open_archive(archive, fields=["label", "speech"], pad_value=-1.0)
    with pytest.raises(UsageError, match=r"fields \['label', 'speech'\] and fields=\['label'\]"):
        Loader(ds, 4, fields="label")
    with pytest.raises(UsageError, match=r"padded with -1\.0 and pad_value=0\.0"):
        Loader(ds, 4, pad_value=0.0)
    loader = Loader(ds, 4, fields=["label", "speech"], pad_value=-1.0)  # matching: taken as is
    assert loader.archive is ds
    padded = next(iter(loader))
    assert (padded["speech"] == -1.0).any()  # the archive's pad_value applies
    loader.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_loader_errors_are_wrapped_alike_and_usage_errors_kept(
    archive: Path, prefetch: int
) -> None:
    # a pad value the field cannot hold is refused when the archive opens, not per batch
    message = r"field 'image' \(u8\) is padded with pad_value=-3.5, which it cannot hold"
    with pytest.raises(UsageError, match=message):
        open_archive(archive, fields=["image"], pad_value=-3.5)  # image is u8
    with pytest.raises(UsageError, match=message):
        Loader(archive, 8, fields=["image"], pad_value=-3.5, prefetch=prefetch)

    ds = open_archive(archive)
    fail_planning(ds, 2)  # batch 1
    loader = Loader(ds, 4, shuffle=False, prefetch=prefetch)
    message = r"/a: gathering batch 1 of epoch 0 failed: OSError: simulated read failure"
    with pytest.raises(LoaderError, match=message) as caught:
        list(loader)
    assert isinstance(caught.value.__cause__, OSError)
    loader.close()

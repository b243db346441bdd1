"""What used to fail only at the first batch is refused when the Loader is made, naming
the fields; a missing key names the batch's fields."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dlop.formats import ArchiveWriter, Field
from dlop.runtime import IterableArchive, Loader, Mixup, RandomResizedCrop, SpecAugment, UsageError

from .helpers import make_archive


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_archive(tmp_path_factory.mktemp("f") / "a", n=10)


def test_a_transform_on_a_missing_field_is_refused_at_once(archive: Path) -> None:
    with pytest.raises(UsageError, match=r"reads field 'fbank'.*they have image, key, label"):
        Loader(archive, 4, transforms=[SpecAugment("fbank")])
    with pytest.raises(UsageError, match=r"reads field 'mask'"):
        Loader(archive, 4, transforms=[RandomResizedCrop(8, masks=("mask",))])
    Loader(archive, 4, transforms=[SpecAugment("speech")]).close()  # a field it has


def test_mixup_with_too_few_classes_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a"
    fields = [Field("x", "f32", (3,)), Field("label", "i64", ())]
    with ArchiveWriter(path, fields, metadata={"classes": ["a", "b", "c", "d"]}) as w:
        for i in range(8):
            w.write({"x": np.zeros(3, np.float32), "label": i % 4})
    with pytest.raises(UsageError, match=r"one-hot targets of 2 classes.*has 4"):
        Loader(path, 4, transforms=[Mixup(fields=("x",), num_classes=2)])
    Loader(path, 4, transforms=[Mixup(fields=("x",), num_classes=4)]).close()


def test_drop_last_leaving_no_batch_is_refused(archive: Path) -> None:
    with pytest.raises(UsageError, match=r"batch_size=16 with drop_last=True leaves no batch"):
        Loader(archive, 16, drop_last=True)
    Loader(archive, 16).close()  # without drop_last: one short batch
    # the same for the DataLoader front end, in this process, before any worker starts
    with pytest.raises(UsageError, match=r"batch_size=16 with drop_last=True leaves no batch"):
        IterableArchive(archive, 16, drop_last=True)
    assert len(list(IterableArchive(archive, 16))) == 1


def test_a_missing_key_names_the_fields(archive: Path) -> None:
    loader = Loader(archive, 4, fields=["label", "logmel"])
    try:
        batch = next(iter(loader))
        with pytest.raises(
            KeyError, match=r"'x': the batch has no such field; it has label, logmel"
        ):
            batch["x"]
    finally:
        loader.close()

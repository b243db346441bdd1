"""The Loader and IterableArchive take one description of what to read and how to order
it (runtime.order.reading): the same keywords, the same defaults, the same errors."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

from dlop.runtime import IterableArchive, Loader, UsageTypeError
from dlop.runtime.iterable import ITERABLE_ORDER
from dlop.runtime.loader import LOADER_ORDER
from dlop.runtime.order.reading import Reading

from .helpers import make_archive


def shared(front: type) -> dict[str, object]:
    params = inspect.signature(front).parameters
    return {n: p.default for n, p in params.items() if n in Reading.__dataclass_fields__}


def test_both_front_ends_show_every_shared_keyword_with_its_default() -> None:
    want = {f.name: f.default for f in dataclasses.fields(Reading)}
    assert shared(Loader) == want and shared(IterableArchive) == want
    assert list(inspect.signature(Loader).parameters)[:2] == ["archive", "batch_size"]
    assert list(inspect.signature(IterableArchive).parameters)[:2] == ["archive", "batch_size"]


@pytest.mark.parametrize("front", [Loader, IterableArchive])
def test_a_misspelt_keyword_is_refused_with_the_closest_name(tmp_path: Path, front: type) -> None:
    path = make_archive(tmp_path / "a", n=8)
    match = rf"{front.__name__} got an unexpected keyword bucketby=; did you mean bucket_by="
    with pytest.raises(UsageTypeError, match=match):
        front(path, 4, bucketby="speech")


def test_a_loader_keyword_is_not_taken_by_the_iterable(tmp_path: Path) -> None:
    path = make_archive(tmp_path / "a", n=8)
    with pytest.raises(UsageTypeError, match="IterableArchive got an unexpected keyword device="):
        IterableArchive(path, 4, device="cpu")


def test_the_same_settings_give_the_same_batches(tmp_path: Path) -> None:
    path = make_archive(tmp_path / "a", n=30, shard_bytes=600)
    settings = {"seed": 3, "order": "window", "window_shards": 2, "bucket_by": "speech"}
    loader = Loader(path, 4, **settings)  # type: ignore[arg-type]
    iterable = IterableArchive(path, 4, **settings)  # type: ignore[arg-type]
    assert [b.tolist() for b in loader.batches(1)] == [
        b.tolist() for b in iterable.batch_order().batches(1)
    ]
    loader.close()


@pytest.mark.parametrize("front", [Loader, IterableArchive])
def test_arguments_come_by_position_in_each_front_ends_order(tmp_path: Path, front: type) -> None:
    path = make_archive(tmp_path / "a", n=30, shard_bytes=600)
    order = LOADER_ORDER if front is Loader else ITERABLE_ORDER
    assert list(inspect.signature(front).parameters) == ["archive", "batch_size", *order]
    by_position = front(path, 4, False, 3, True)
    by_name = front(path, 4, shuffle=False, seed=3, drop_last=True)
    assert by_position.reading == by_name.reading
    with pytest.raises(UsageTypeError, match="got seed both by position and by name"):
        front(path, 4, True, 3, seed=3)
    with pytest.raises(UsageTypeError, match=rf"takes at most {len(order) + 2} arguments"):
        front(path, 4, *[None] * (len(order) + 1))


def test_the_loaders_own_arguments_come_by_position_too(tmp_path: Path) -> None:
    path = make_archive(tmp_path / "a", n=30, shard_bytes=600)
    loader = Loader(path, 4, True, 0, False, "cpu", None, None, (), None, 0)
    assert loader.device == torch.device("cpu") and loader.prefetch == 0
    with pytest.raises(UsageTypeError, match="got prefetch both by position and by name"):
        Loader(path, 4, True, 0, False, "cpu", None, None, (), None, 0, prefetch=1)
    iterable = IterableArchive(
        path, 4, True, 0, False, None, None, None, None, "global", 8, None, 64, 2
    )
    assert iterable.worker_buffers == 2

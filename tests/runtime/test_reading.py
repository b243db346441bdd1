"""The Loader and IterableArchive take one description of what to read and how to order
it (runtime.order.reading): the same keywords, the same defaults, the same errors."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path

import pytest

from dlop.runtime import IterableArchive, Loader, ReadingOptions, UsageTypeError
from dlop.runtime.order.reading import Reading

from .helpers import make_archive


def test_the_typed_keywords_are_the_settings_with_their_types() -> None:
    # ReadingOptions (what a type checker sees) and Reading (the defaults) name the same
    # settings with the same types
    typed = typing.get_type_hints(ReadingOptions)
    fields = typing.get_type_hints(Reading)
    assert typed == fields
    assert list(typed) == [f.name for f in dataclasses.fields(Reading)]
    for front in (Loader, IterableArchive):
        params = list(inspect.signature(front).parameters.values())
        assert [p.name for p in params[:2]] == ["archive", "batch_size"]
        assert all(p.kind is not p.POSITIONAL_OR_KEYWORD for p in params[2:])
        assert params[-1].kind is params[-1].VAR_KEYWORD


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
def test_settings_come_by_name_only(tmp_path: Path, front: type) -> None:
    path = make_archive(tmp_path / "a", n=30, shard_bytes=600)
    with pytest.raises(TypeError, match="positional argument"):
        front(path, 4, False)

"""Several archives read as one: addressing across archives, the Loader over them,
and refusals of schemas and recipes that differ."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlop.formats import ArchiveWriter, Field
from dlop.runtime import Loader, UsageError, open_archive

RECIPE = {"source": "/corpus/a", "features": {"kind": "logmel", "n_mels": 3}, "dtype": "float16"}


def write(
    path: Path,
    prefix: str,
    n: int,
    feature: Field | None = None,
    recipe: dict[str, Any] | None = None,
) -> Path:
    feature = feature or Field("x", "f32", (None, 3))
    fields = [Field.str_("key"), Field("label", "i64", ()), feature]
    with ArchiveWriter(path, fields, shard_bytes=300, recipe=recipe or RECIPE) as w:
        for i in range(n):
            shape = tuple(1 + i % 4 if d is None else d for d in feature.shape)
            w.write(
                {
                    "key": f"{prefix}{i}",
                    "label": i % 3,
                    "x": np.full(shape, i, feature.np_dtype),
                }
            )
    return path


def test_archives_read_as_one(tmp_path: Path) -> None:
    a = write(tmp_path / "a", "a", 11)
    b = write(tmp_path / "b", "b", 7, recipe={**RECIPE, "source": "/corpus/new"})
    ds = open_archive([a, b])
    assert len(ds) == 18 and ds[11]["key"] == "b0" and ds[-1]["key"] == "b6"
    batch = ds.__getitems__([12, 3, 17])
    assert batch["key"] == ["b1", "a3", "b6"]
    assert batch["x_lengths"].tolist() == [2, 4, 3]
    keys = {f"a{i}" for i in range(11)} | {f"b{i}" for i in range(7)}
    for world in (1, 2, 3):
        seen = []
        for rank in range(world):
            loader = Loader([a, b], 4, bucket_by="x", rank=rank, world_size=world, seed=world)
            seen += [k for batch in loader for k in batch["key"]]
        assert set(seen) == keys
    picked = open_archive([a, b], where={"label": 1})
    assert [picked[i]["key"] for i in range(len(picked))] == ["a1", "a4", "a7", "a10", "b1", "b4"]
    again = pickle.loads(pickle.dumps(picked))  # spawned DataLoader workers reopen it
    assert len(again) == 6 and again[5]["key"] == "b4"


def test_a_field_that_differs_is_named(tmp_path: Path) -> None:
    a = write(tmp_path / "a", "a", 5)
    b = write(tmp_path / "b", "b", 5, feature=Field("x", "f16", (None, 3)))
    with pytest.raises(UsageError, match=r"field 'x' is array f32\[None, 3\].*array f16") as e:
        open_archive([a, b])
    assert str(a) in str(e.value) and str(b) in str(e.value)
    c = write(tmp_path / "c", "c", 5, feature=Field("x", "f32", (None, 4)))
    with pytest.raises(UsageError, match="field 'x'"):
        Loader([a, c], 2)
    # the fields both hold alike are read as one
    assert len(open_archive([a, b], fields=["key", "label"])) == 10


def test_recipes_that_differ_are_refused_unless_allowed(tmp_path: Path) -> None:
    a = write(tmp_path / "a", "a", 5)
    other = {**RECIPE, "features": {"kind": "logmel", "n_mels": 40}}
    b = write(tmp_path / "b", "b", 5, recipe=other)
    with pytest.raises(UsageError, match="allow_recipe_mismatch=True"):
        Loader([a, b], 2)
    assert len(Loader([a, b], 2, allow_recipe_mismatch=True).batches(0)) == 5


def test_a_state_loads_only_into_the_same_archives_in_the_same_order(tmp_path: Path) -> None:
    a = write(tmp_path / "a", "a", 9)
    b = write(tmp_path / "b", "b", 9)
    c = write(tmp_path / "c", "c", 9, recipe={**RECIPE, "dtype": "float16"})
    saved = Loader([a, b], 4, prefetch=0)
    it = iter(saved)
    next(it)
    state = saved.state_dict()
    del it
    Loader([a, b], 4, prefetch=0).load_state_dict(state)
    with pytest.raises(UsageError, match="archives="):
        Loader([b, a], 4, prefetch=0).load_state_dict(state)
    one = Loader(a, 4, prefetch=0).state_dict()
    with pytest.raises(UsageError, match="archives="):
        Loader(c, 4, prefetch=0).load_state_dict(one)  # as many samples, other archive
    mixed = Loader({"x": a, "y": b}, 4, prefetch=0).state_dict()
    with pytest.raises(UsageError, match="archives="):
        Loader({"x": a, "y": c}, 4, prefetch=0, allow_recipe_mismatch=True).load_state_dict(mixed)


def test_an_archive_named_twice_is_refused(tmp_path: Path) -> None:
    a = write(tmp_path / "a", "a", 5)
    with pytest.raises(UsageError, match=r"names .*/a twice"):
        open_archive([a, tmp_path / "." / "a"])
    with pytest.raises(UsageError, match="twice"):
        Loader([str(a), a], 2)
    # sources of a mixture that choose from one archive stay allowed
    halves = {
        "low": open_archive(a, indices=[0, 1]),
        "high": open_archive(a, indices=[2, 3, 4]),
    }
    assert sum(len(x) for x in Loader(halves, 5, prefetch=0).batches(0)) == 5


def test_the_same_fields_in_another_order_read_as_one(tmp_path: Path) -> None:
    a = write(tmp_path / "a", "a", 5)
    b = tmp_path / "b"
    fields = [Field("x", "f32", (None, 3)), Field("label", "i64", ()), Field.str_("key")]
    with ArchiveWriter(b, fields, shard_bytes=300, recipe=RECIPE) as w:
        for i in range(3):
            w.write({"key": f"b{i}", "label": i, "x": np.full((2, 3), i, np.float32)})
    ds = open_archive([a, b])
    assert [ds[i]["key"] for i in range(5, 8)] == ["b0", "b1", "b2"]
    assert ds[7]["x"].tolist() == [[2.0] * 3] * 2


def test_a_field_one_archive_lacks_is_named_with_both_in_either_order(tmp_path: Path) -> None:
    a = write(tmp_path / "a", "a", 5)
    b = tmp_path / "b"  # field y where a has x
    fields = [Field.str_("key"), Field("label", "i64", ()), Field("y", "f32", (None, 3))]
    with ArchiveWriter(b, fields, shard_bytes=300, recipe=RECIPE) as w:
        for i in range(5):
            w.write({"key": f"b{i}", "label": i % 3, "y": np.full((2, 3), i, np.float32)})
    for first, second in ((a, b), (b, a)):
        for fields in (None, ["x"], ["key", "y"]):
            with pytest.raises(UsageError) as refused:
                open_archive([first, second], fields=fields)
            said = str(refused.value)
            assert f"archives {first} and {second} cannot be read as one" in said
    with pytest.raises(UsageError, match=rf"field 'x' is in {a} but not in {b}"):
        open_archive([b, a], fields=["x"])

"""What docs/runtime.md and docs/choosing.md promise about padding and mixtures, held
to the behaviour: pad values a field cannot hold are refused when an archive opens, and
a mixture's repeats per epoch and per rank are the ones the docs' rule counts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dlop.formats import ArchiveWriter, Field
from dlop.runtime import IterableArchive, Loader, UsageError, UsageTypeError, open_archive

from .helpers import weighted

RAGGED = {
    "u8": np.uint8,
    "i8": np.int8,
    "u16": np.uint16,
    "i64": np.int64,
    "f16": np.float16,
    "f32": np.float32,
    "bool": np.bool_,
}


@pytest.fixture(scope="module")
def ragged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ragged field of each kind of dtype, and a fixed u8 field."""
    path = tmp_path_factory.mktemp("pad") / "rag"
    fields = [Field(f"r_{d}", d, (None,)) for d in RAGGED] + [Field("fixed", "u8", (3,))]
    with ArchiveWriter(path, fields) as w:
        for i in range(6):
            sample = {f"r_{d}": np.ones(1 + i, t) for d, t in RAGGED.items()}
            w.write({**sample, "fixed": np.full(3, i, np.uint8)})
    return path


CANNOT_HOLD = [
    ("u8", -1),  # wrapped to 255 before
    ("u8", 0.5),  # truncated to 0 before
    ("u8", 256),
    ("u8", -0.0001),
    ("u8", float("nan")),
    ("u8", float("inf")),
    ("i8", -129),
    ("i8", 127.5),
    ("u16", 70000),
    ("i64", 2**63),
    ("i64", 1e300),
    ("f16", 70000),
    ("f16", -65520.0),
    ("f32", 1e39),
    ("f32", 10**400),
    ("bool", 2),
    ("bool", -1),
    ("bool", 0.5),
]


@pytest.mark.parametrize(("dtype", "value"), CANNOT_HOLD)
def test_a_pad_value_the_field_cannot_hold_is_refused_on_open(
    ragged: Path, dtype: str, value: float
) -> None:
    message = rf"field 'r_{dtype}' \({dtype}\) is padded with pad_value=.*which it cannot hold"
    with pytest.raises(UsageError, match=message):
        open_archive(ragged, fields=[f"r_{dtype}"], pad_value=value)
    with pytest.raises(UsageError, match=message):
        Loader(ragged, 4, fields=[f"r_{dtype}"], pad_value=value)
    with pytest.raises(UsageError, match=message):
        IterableArchive(ragged, 4, fields=[f"r_{dtype}"], pad_value=value)
    # read beside other fields, or every field read by default: refused as well
    with pytest.raises(UsageError, match="which it cannot hold"):
        open_archive(ragged, fields=["fixed", f"r_{dtype}"], pad_value=value)
    with pytest.raises(UsageError, match="which it cannot hold"):
        open_archive(ragged, pad_value=value)


HOLDS = [
    ("u8", 255),
    ("u8", 7.0),
    ("u8", True),
    ("i8", -128),
    ("u16", np.uint16(65535)),
    ("i64", -(2**63)),
    ("f16", -65504.0),
    ("f16", float("-inf")),
    ("f32", float("nan")),
    ("f32", 0.1),
    ("bool", 1),
    ("bool", False),
]


@pytest.mark.parametrize(("dtype", "value"), HOLDS)
def test_a_pad_value_the_field_holds_pads_with_exactly_that(
    ragged: Path, dtype: str, value: float
) -> None:
    name = f"r_{dtype}"
    ds = open_archive(ragged, fields=[name], pad_value=value)
    batch = ds.__getitems__([0, 5])
    pad = batch[name][0, 1:]  # sample 0 holds 1 value, sample 5 holds 6
    want = torch.full_like(pad, value)
    torch.testing.assert_close(pad, want, rtol=0, atol=0, equal_nan=True)
    loader = Loader(ragged, 6, fields=[name], pad_value=value, shuffle=False, prefetch=0)
    padded = next(iter(loader))[name]
    torch.testing.assert_close(padded[0, 1:], want, rtol=0, atol=0, equal_nan=True)
    loader.close()


def test_a_pad_value_for_fields_never_padded_is_not_checked_against_them(ragged: Path) -> None:
    # fixed-shape fields are never padded: -1 applies to the i8 field read beside them
    ds = open_archive(ragged, fields=["fixed", "r_i8"], pad_value=-1)
    assert ds.__getitems__([0, 2])["r_i8"][0].tolist() == [1, -1, -1]
    with pytest.raises(UsageTypeError, match="pad_value must be a number, got str"):
        open_archive(ragged, fields=["r_f32"], pad_value="0")  # type: ignore[arg-type]


# Mixtures: two sources of 30 and 11 samples (docs/choosing.md's example).
SIZES = {"a": 30, "b": 11}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mix")
    fields = [Field.str_("key"), Field("x", "u8", (None,))]
    out = {}
    for name, n in SIZES.items():
        with ArchiveWriter(root / name, fields, shard_bytes=200) as w:
            for i in range(n):
                w.write({"key": f"{name}{i}", "x": np.full(1 + i % 5, 7, np.uint8)})
        out[name] = root / name
    return out


def epoch_keys(
    sources: Mapping[str, Any], batch_size: int, world: int, epoch: int, **options: object
) -> list[list[str]]:
    """Each rank's keys in one epoch."""
    ranks = []
    for rank in range(world):
        loader = Loader(sources, batch_size, rank=rank, world_size=world, prefetch=0, **options)
        loader.set_epoch(epoch)
        ranks.append([k for batch in loader for k in batch["key"]])
        loader.close()
    return ranks


def rounded(n: int, unit: int, drop_last: bool) -> int:
    """The docs' rule: the epoch rounded up (down with drop_last) to a multiple of unit."""
    return (n // unit if drop_last else -(-n // unit)) * unit


@pytest.mark.parametrize("bucket", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_default_weights_repeat_exactly_what_rounding_adds(
    sources: dict[str, Path], world: int, drop_last: bool, bucket: bool
) -> None:
    batch, total = 4, sum(SIZES.values())
    unit = batch * world if bucket else world
    want = rounded(total, unit, drop_last)
    options = {"drop_last": drop_last, **({"bucket_by": "x"} if bucket else {})}
    # with drop_last each rank's last incomplete batch is dropped as well (docs/runtime.md)
    share = want // world // batch * batch if drop_last else want // world
    for epoch in range(4):
        ranks = epoch_keys(sources, batch, world, epoch, **options)
        assert [len(r) for r in ranks] == [share] * world  # equal shares
        seen = Counter(k for r in ranks for k in r)
        assert sum(seen.values()) == share * world
        if drop_last:  # rounded down: nothing repeated
            assert max(seen.values()) == 1
        else:  # every sample at least once, exactly want - total repeats
            assert len(seen) == total
            assert sum(c - 1 for c in seen.values()) == want - total
            assert max(seen.values()) <= 2


def test_the_counts_the_docs_give_for_their_example(sources: dict[str, Path]) -> None:
    def draws_and_repeats(world: int, **options: object) -> tuple[int, int]:
        keys = [k for r in epoch_keys(sources, 4, world, 1, **options) for k in r]
        return len(keys), len(keys) - len(set(keys))

    assert draws_and_repeats(3) == (42, 1)
    assert draws_and_repeats(4) == (44, 3)
    assert draws_and_repeats(1, bucket_by="x") == (44, 3)
    assert draws_and_repeats(3, bucket_by="x") == (48, 7)


@pytest.mark.parametrize("per_source", [False, True])
@pytest.mark.parametrize("weights", [{"a": 1, "b": 3}, {"a": 1, "b": 9}])
def test_an_upsampled_source_gives_every_sample_as_evenly_as_it_can(
    sources: dict[str, Path], weights: dict[str, float], per_source: bool
) -> None:
    # b (11 samples) is drawn c > 11 times an epoch: each of its samples c // 11 or
    # c // 11 + 1 times, every epoch; the extra turns go round across epochs
    spe = 120
    extra: Counter[str] = Counter()
    epochs = 11
    for epoch in range(epochs):
        (keys,) = epoch_keys(
            weighted(sources, weights),
            4,
            1,
            epoch,
            samples_per_epoch=spe,
            batch_per_source=per_source,
        )
        seen = Counter(k for k in keys if k.startswith("b"))
        c = sum(seen.values())
        assert c > 11
        assert len(seen) == 11
        assert set(seen.values()) <= {c // 11, c // 11 + 1}
        extra.update(k for k, n in seen.items() if n > c // 11)
        a = Counter(k for k in keys if k.startswith("a"))
        ca = sum(a.values())
        # a holds its share (but batch_per_source's rounding to whole batches): even too
        assert set(a.values()) <= {ca // 30, ca // 30 + 1} and len(a) == min(ca, 30)
    # over 11 epochs each sample of b had the same number of extra turns
    assert len(set(extra.values())) <= 1


@pytest.mark.parametrize("world", [1, 2, 3])
def test_batch_per_source_rounds_each_source_to_whole_batches(tmp_path: Path, world: int) -> None:
    fields = [Field.str_("key")]
    paths = {}
    for name in ("p", "q"):
        with ArchiveWriter(tmp_path / name, fields) as w:
            for i in range(5):
                w.write({"key": f"{name}{i}"})
        paths[name] = tmp_path / name
    batch = 4
    for epoch in range(3):
        ranks = epoch_keys(paths, batch, world, epoch, batch_per_source=True)
        keys = [k for r in ranks for k in r]
        assert len(keys) == rounded(10, batch * world, False)
        for name in ("p", "q"):
            seen = Counter(k for k in keys if k.startswith(name))
            count = sum(seen.values())
            assert count % batch == 0 and abs(count - 5) < batch  # off by less than a batch
            if count >= 5:  # rounded up: every sample, count - 5 repeats, evenly
                assert len(seen) == 5 and count - len(seen) == count - 5
                assert set(seen.values()) <= {count // 5, count // 5 + 1}
            else:  # rounded down: 5 - count left out, none repeated
                assert len(seen) == count and set(seen.values()) == {1}
        if world == 1:  # the docs' example: 8 draws from one source, 4 from the other
            per = sorted(sum(k.startswith(n) for k in keys) for n in ("p", "q"))
            assert per == [4, 8]


# The rest of what the two pages promise about padding and mixtures.


def test_lengths_and_sources_are_int64(sources: dict[str, Path]) -> None:
    batch = next(iter(Loader(sources, 4, prefetch=0)))
    assert batch["x_lengths"].dtype == torch.int64 and batch["x_lengths"].shape == (4,)
    assert batch["source"].dtype == torch.int64 and batch["source"].shape == (4,)
    assert set(batch["source"].tolist()) <= {0, 1}


def test_text_and_bytes_fields_take_any_pad_value(tmp_path: Path) -> None:
    path = tmp_path / "t"
    with ArchiveWriter(path, [Field.str_("s"), Field.bytes_("b")]) as w:
        w.write({"s": "a", "b": b"xy"})
        w.write({"s": "abc", "b": b""})
    got = open_archive(path, pad_value=1e39).__getitems__([0, 1])
    assert got["s"] == ["a", "abc"] and got["b"] == [b"xy", b""]


def test_a_usage_error_while_padding_a_batch_is_not_wrapped(tmp_path: Path) -> None:
    path = tmp_path / "wide"
    with ArchiveWriter(path, [Field("g", "f32", (None, None))]) as w:
        w.write({"g": np.zeros((1, 3_000_000), np.float32)})
        w.write({"g": np.zeros((3_000_000, 1), np.float32)})
    for prefetch in (0, 2):
        loader = Loader(path, 2, shuffle=False, prefetch=prefetch)
        with pytest.raises(UsageError) as caught:
            list(loader)
        assert type(caught.value) is UsageError  # as it is: not a LoaderError around it
        if prefetch:  # where in the loader thread it was raised, as a note
            notes = "".join(getattr(caught.value, "__notes__", []))
            assert "in the loader thread" in notes and "Traceback" in notes
        loader.close()


def test_what_a_mixture_refuses(sources: dict[str, Path], tmp_path: Path) -> None:
    other = tmp_path / "other"
    with ArchiveWriter(other, [Field.str_("key"), Field("g", "i64", ())]) as w:
        w.write({"key": "o0", "g": 1})
    with pytest.raises(UsageError, match=r"'g'|field"):
        Loader({**sources, "o": other}, 4)  # not one schema
    with pytest.raises(UsageError, match="indices= does not apply to a mixture"):
        Loader(sources, 4, indices=[0, 1])
    with pytest.raises(UsageError, match="order='window' does not apply to a mixture"):
        Loader(sources, 4, order="window")
    named = tmp_path / "named"
    with ArchiveWriter(named, [Field.str_("key"), Field("source", "i64", ())]) as w:
        w.write({"key": "n0", "source": 1})
    with pytest.raises(UsageError, match="leave it out with fields="):
        Loader({"n": named, "m": named}, 1)
    assert next(iter(Loader({"n": named}, 1, fields=["key"])))["key"] == ["n0"]
    with pytest.raises(UsageError):
        Loader({"a": sources["a"], "u": "s3://bucket/archive"}, 4)  # sources are local


def test_an_open_archive_source_takes_the_loaders_fields_and_padding(
    sources: dict[str, Path],
) -> None:
    opened = open_archive(sources["a"], fields=["key"], pad_value=3)
    loader = Loader({"a": opened, "b": sources["b"]}, 41, fields=["key", "x"], pad_value=9)
    batch = next(iter(loader))
    assert "x" in batch and int(batch["x"].max()) == 9  # padded with the Loader's value


def test_weights_counts_and_rounding_by_weight(sources: dict[str, Path]) -> None:
    def per_source(epoch: int, weights: dict[str, float], **options: object) -> list[int]:
        loader = Loader(weighted(sources, weights), 4, prefetch=0, **options)
        loader.set_epoch(epoch)
        counts = [0, 0]
        for b in loader:
            for s in b["source"].tolist():
                counts[s] += 1
        return counts

    # weight 0 leaves a source out; the default epoch is then the other's samples
    assert [per_source(e, weights={"a": 1, "b": 0}) for e in range(2)] == [[30, 0]] * 2
    # counts by largest remainders, the same every epoch: 100 * (1/3, 2/3) -> 33, 67
    assert {
        tuple(per_source(e, weights={"a": 1, "b": 2}, samples_per_epoch=100)) for e in range(3)
    } == {(33, 67)}
    # what rounding up adds is drawn by weight: 41 -> 44 at world 1 with bucket_by
    assert per_source(0, weights={"a": 1, "b": 3}, bucket_by="x") == [11, 33]


def test_drop_last_leaves_out_a_different_set_each_epoch(sources: dict[str, Path]) -> None:
    left_out = []
    for epoch in range(3):
        keys = {k for r in epoch_keys(sources, 4, 4, epoch, drop_last=True) for k in r}
        left_out.append(
            frozenset({f"a{i}" for i in range(30)} | {f"b{i}" for i in range(11)}) - keys
        )
    assert all(left_out) and len(set(left_out)) == 3


def test_batches_of_one_source_and_batches_that_mix(sources: dict[str, Path]) -> None:
    def batches(
        seed: int, weights: dict[str, float] | None = None, **options: object
    ) -> list[set[int]]:
        mixed = sources if weights is None else weighted(sources, weights)
        loader = Loader(mixed, 4, prefetch=0, seed=seed, **options)
        return [set(b["source"].tolist()) for b in loader]

    orders = set()
    for seed in range(6):
        one = batches(seed, batch_per_source=True, weights={"a": 1, "b": 1}, samples_per_epoch=20)
        assert all(len(s) == 1 for s in one)
        order = tuple(next(iter(s)) for s in one)
        assert sorted(order) == [0, 0, 0, 1, 1]  # weights apportion batches: 3 and 2
        orders.add(order)
    assert len(orders) > 1  # the batches of all sources are shuffled
    assert any(len(s) > 1 for s in batches(0))  # otherwise batches mix sources


def test_a_state_of_another_mixture_is_refused(sources: dict[str, Path]) -> None:
    loader = Loader(sources, 4, samples_per_epoch=40)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    for other in ({"samples_per_epoch": 44}, {"samples_per_epoch": 40, "batch_per_source": True}):
        with pytest.raises(UsageError, match="saved with"):
            Loader(sources, 4, **other).load_state_dict(state)  # type: ignore[arg-type]
    Loader(sources, 4, samples_per_epoch=40).load_state_dict(state)  # the same: taken

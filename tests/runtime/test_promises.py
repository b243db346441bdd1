"""What docs/runtime.md and docs/choosing.md promise about padding and mixtures, held
to the behaviour: pad values a field cannot hold are refused when an archive opens, and
a mixture's repeats per epoch and per rank are the ones the docs' rule counts."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from dlop.formats import ArchiveWriter, Field
from dlop.runtime import IterableArchive, Loader, UsageError, UsageTypeError, open_archive

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
    sources: dict[str, Path], batch_size: int, world: int, epoch: int, **options: object
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
            sources,
            4,
            1,
            epoch,
            weights=weights,
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

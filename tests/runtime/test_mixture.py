"""Weighted mixtures: proportions, determinism, passes without replacement, exact
shares under DDP, resume, batches from one source, bucketing, and the errors."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dlop.formats import ArchiveWriter, Field
from dlop.runtime import Loader, Source, UsageError, UsageTypeError
from dlop.runtime.order import mixture
from dlop.runtime.order.mixture import stream_slice

from .helpers import weighted

SIZES = {"ls": 300, "ps": 500, "cv": 60}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mix")
    fields = [Field.str_("key"), Field("label", "i64", ()), Field("speech", "f32", (None, 2))]
    out = {}
    for name, n in SIZES.items():
        with ArchiveWriter(root / name, fields, shard_bytes=2000) as w:
            for i in range(n):
                w.write(
                    {
                        "key": f"{name}{i}",
                        "label": i,
                        "speech": np.full((1 + i % 9, 2), i, np.float32),
                    }
                )
        out[name] = root / name
    return out


def keys(loader: Loader) -> list[list[str]]:
    return [batch["key"] for batch in loader]


def test_proportions_over_an_epoch_of_100000(corpora: dict[str, Path]) -> None:
    weights = {"ls": 0.2, "ps": 0.5, "cv": 0.3}
    loader = Loader(
        weighted(corpora, weights), 2000, samples_per_epoch=100_000, fields="label", seed=1
    )
    counts: Counter[int] = Counter()
    for batch in loader:
        counts.update(batch["source"].tolist())
    assert sum(counts.values()) == 100_000
    for s, name in enumerate(loader.sources):
        assert abs(counts[s] / 100_000 - weights[name]) < 0.01


def test_same_seed_same_order_new_order_each_epoch(corpora: dict[str, Path]) -> None:
    def make(seed: int) -> Loader:
        return Loader(weighted(corpora, {"ls": 1, "ps": 1, "cv": 1}), 16, seed=seed, prefetch=0)

    a, b = make(5), make(5)
    assert all(np.array_equal(x, y) for x, y in zip(a.batches(0), b.batches(0), strict=True))
    assert keys(a) == keys(b)
    assert not all(np.array_equal(x, y) for x, y in zip(a.batches(0), a.batches(1), strict=True))
    assert not all(
        np.array_equal(x, y) for x, y in zip(a.batches(0), make(6).batches(0), strict=True)
    )


def test_a_source_is_drawn_without_replacement_until_used_up(corpora: dict[str, Path]) -> None:
    # ps (500) gives 200 samples an epoch: epochs 0-1 and the first half of 2 are one pass
    loader = Loader(
        weighted({"ls": corpora["ls"], "ps": corpora["ps"]}, {"ls": 0.6, "ps": 0.4}),
        50,
        samples_per_epoch=500,
        fields="key",
    )
    epochs = []
    for epoch in range(5):
        loader.set_epoch(epoch)
        epochs.append([k for batch in loader for k in batch["key"] if k.startswith("ps")])
    assert [len(e) for e in epochs] == [200] * 5
    assert len(set(epochs[0] + epochs[1])) == 400  # pass 0, items 0-399
    assert len(set(epochs[3] + epochs[4])) == 400  # pass 1, items 100-499
    assert set(Counter(k for e in epochs for k in e).values()) == {2}  # two whole passes
    assert set(epochs[0]) != set(epochs[3])  # the second pass is reshuffled


@pytest.mark.parametrize("per_source", [False, True])
def test_no_sample_twice_across_ranks(corpora: dict[str, Path], per_source: bool) -> None:
    weights = {"ls": 0.3, "ps": 0.7}
    sources = {"ls": corpora["ls"], "ps": corpora["ps"]}
    for world in (1, 2, 3):
        seen: list[str] = []
        for rank in range(world):
            loader = Loader(
                weighted(sources, weights),
                8,
                samples_per_epoch=301,
                batch_per_source=per_source,
                rank=rank,
                world_size=world,
                fields="key",
                prefetch=0,
            )
            loader.set_epoch(3)
            for batch in keys(loader):
                seen += batch
                if per_source:
                    assert len({k[:2] for k in batch}) == 1 and len(batch) == 8
        assert len(seen) == len(set(seen))
        unit = 8 * world if per_source else world
        assert len(seen) == -(-301 // unit) * unit  # rounded up to equal shares, no repeats


@pytest.mark.parametrize("world", [2, 3])
def test_bucketed_mixture_repeats_no_sample_across_ranks(
    corpora: dict[str, Path], world: int
) -> None:
    seen: list[int] = []
    batches = []
    for rank in range(world):
        loader = Loader(
            weighted({"cv": corpora["cv"], "ls": corpora["ls"]}, {"cv": 1, "ls": 1}),
            8,
            samples_per_epoch=100,
            bucket_by="speech",
            bucket_window=2,
            rank=rank,
            world_size=world,
            fields=["label", "speech"],
            prefetch=0,
        )
        for epoch in range(2):
            got = loader.batches(epoch)
            assert all(len(b) == 8 for b in got)
            if epoch == 1:
                seen += np.concatenate(got).tolist()
        batches.append(len(loader.batches(1)))
    assert len(set(batches)) == 1  # as many batches on every rank
    assert len(seen) == len(set(seen)) == -(-100 // (8 * world)) * 8 * world


def test_a_source_between_one_and_two_shares_repeats_nothing_in_an_epoch(
    corpora: dict[str, Path],
) -> None:
    # cv holds 60 and gives 40 a share: epochs cross passes at every offset
    loader = Loader(
        weighted({"cv": corpora["cv"], "ls": corpora["ls"]}, {"cv": 0.5, "ls": 0.5}),
        10,
        samples_per_epoch=80,
        fields="key",
        prefetch=0,
    )
    for epoch in range(6):
        drawn = np.concatenate(loader.batches(epoch))
        assert len(drawn) == 80 and len(np.unique(drawn)) == 80, epoch


def test_every_pass_is_a_permutation_and_no_epoch_repeats() -> None:
    gen = np.random.default_rng(0)
    for _ in range(150):
        n = int(gen.integers(2, 50))
        count = int(gen.integers(1, n + 1))
        pool = np.arange(n) * 3 + 1
        epochs = [
            stream_slice(pool, 5, 1, e * count, count, True) for e in range(3 * n // count + 3)
        ]
        assert all(len(np.unique(x)) == count for x in epochs), (n, count)
        stream = np.concatenate(epochs)
        for p in range(len(stream) // n):
            assert sorted(stream[p * n : (p + 1) * n].tolist()) == pool.tolist(), (n, count, p)
    # a pass is a pure function of (seed, pass): the same computed afresh or after others
    late = stream_slice(np.arange(40), 3, 0, 7 * 30, 30, True)
    mixture.clear_passes()
    assert np.array_equal(stream_slice(np.arange(40), 3, 0, 7 * 30, 30, True), late)


def test_resume_mid_epoch(corpora: dict[str, Path]) -> None:
    mixed = weighted(corpora, {"ls": 0.5, "ps": 0.25, "cv": 0.25})
    kw = dict(
        samples_per_epoch=400,
        bucket_by="speech",
        rank=1,
        world_size=2,
        seed=9,
    )
    loader = Loader(mixed, 16, **kw)  # type: ignore[arg-type]
    loader.set_epoch(4)
    full = [(b["key"], b["source"].tolist()) for b in loader]
    loader.set_epoch(4)
    it = iter(loader)
    head = [(b["key"], b["source"].tolist()) for _, b in zip(range(5), it, strict=False)]
    state = loader.state_dict()
    del it
    assert isinstance(state["mixture"], dict) and "batches_done" in state
    resumed = Loader(mixed, 16, **kw)  # type: ignore[arg-type]
    resumed.load_state_dict(state)
    resumed.set_epoch(4)
    assert head + [(b["key"], b["source"].tolist()) for b in resumed] == full
    other = Loader(weighted(corpora, {"ls": 0.4, "ps": 0.35, "cv": 0.25}), 16, **kw)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="mixture"):
        other.load_state_dict(state)


def test_bucketing_across_the_mixture(corpora: dict[str, Path]) -> None:
    loader = Loader(corpora, 10, bucket_by="speech", bucket_window=4, prefetch=0)
    spread = []
    total = 0
    for batch in loader:
        lengths = batch["speech_lengths"]
        spread.append(int(lengths.max() - lengths.min()))
        total += len(lengths)
        names = {loader.sources[s] for s in batch["source"].tolist()}
        assert all(k.startswith(tuple(names)) for k in batch["key"])
    assert total == sum(SIZES.values())  # default: every sample once, by the sources' sizes
    assert np.mean(spread) <= 2


def test_mixture_errors(corpora: dict[str, Path]) -> None:
    two = {"ls": corpora["ls"], "ps": corpora["ps"]}
    with pytest.raises(UsageError, match="at least 0"):
        Loader(weighted(two, {"ls": -1, "ps": 2}), 4)
    with pytest.raises(UsageError, match="add up to 0"):
        Loader(weighted(two, {"ls": 0, "ps": 0}), 4)
    with pytest.raises(UsageTypeError, match="must be a number"):
        Loader(weighted(two, {"ls": "1", "ps": 1}), 4)
    with pytest.raises(UsageError, match=r"ls: where=.* selects no sample of 300"):
        high = {"label": list(range(300, 400))}
        Loader({"ls": Source(two["ls"], weight=1, where=high), "ps": Source(two["ps"], 1)}, 4)
    with pytest.raises(UsageError, match="samples_per_epoch= is for mixtures"):
        Loader(corpora["ls"], 4, samples_per_epoch=10)
    with pytest.raises(UsageTypeError, match="unexpected keyword weights="):
        Loader(two, 4, weights={"ls": 1, "ps": 1})  # type: ignore[call-arg]
    with pytest.raises(UsageError, match="window"):
        Loader(two, 4, order="window")
    for key in ("cache_dir", "cache_bytes", "storage_options"):  # not a TypeError
        with pytest.raises(UsageError, match=rf"{key}= is for an archive read through the"):
            Loader(two, 4, **{key: {"a": 1} if key == "storage_options" else 1})  # type: ignore[arg-type]
    with pytest.raises(UsageTypeError, match="must be a path"):
        Loader({"ls": 3}, 4)


def test_a_mixed_batch_is_planned_without_torch_kernels_over_the_batch(
    corpora: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch.searchsorted goes parallel over a batch of indices; waking its threads from
    # the Loader's producer thread cost milliseconds per batch of a mixture.
    loader = Loader(corpora, 64, fields=["label", "speech"], seed=2, prefetch=0)
    sizes: list[int] = []
    searchsorted = torch.searchsorted

    def counted(sorted_sequence: torch.Tensor, values: Any, **kw: Any) -> torch.Tensor:
        sizes.append(values.numel() if isinstance(values, torch.Tensor) else 1)
        return searchsorted(sorted_sequence, values, **kw)

    monkeypatch.setattr(torch, "searchsorted", counted)
    got = [(b["label"].clone(), b["source"].clone()) for b in loader]
    monkeypatch.undo()
    assert max(sizes, default=0) <= 2  # a batch's first and last sample at most
    again = Loader(corpora, 64, fields=["label", "speech"], seed=2, prefetch=0)
    want = [(b["label"].clone(), b["source"].clone()) for b in again]
    assert all(
        torch.equal(x, y) and torch.equal(s, t) for (x, s), (y, t) in zip(got, want, strict=True)
    )
    assert sum(len(x) for x, _ in got) == sum(SIZES.values())


def sequential_pass(seed: int, source: int, p: int, count: int, n: int) -> np.ndarray:
    """Pass ``p`` computed from pass 0, one pass after another (the definition)."""
    order = mixture.pass_permutation(seed, source, 0, n)
    for q in range(1, p + 1):
        order = mixture.rearranged(
            order, mixture.pass_permutation(seed, source, q, n), q * n % count, count
        )
    return order


def test_a_far_pass_is_the_one_computed_pass_after_pass() -> None:
    gen = np.random.default_rng(1)
    for _ in range(60):
        n = int(gen.integers(2, 40))
        count = int(gen.integers(1, n + 1))
        for p in sorted(gen.integers(0, 60, size=4).tolist()):
            mixture.clear_passes()
            want = sequential_pass(4, 2, p, count, n)
            assert np.array_equal(mixture.pass_positions(4, 2, p, count, n), want), (n, count, p)


def test_a_state_of_a_far_epoch_loads_without_computing_every_pass(
    corpora: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # pass p followed from pass 0 one at a time: a state's epoch of 2**62 (hostile, or
    # a long run resumed in a fresh process) took a pass per epoch, forever
    two = weighted({"ls": corpora["ls"], "cv": corpora["cv"]}, {"ls": 1, "cv": 1})
    loader = Loader(two, 10, fields="key", prefetch=0, samples_per_epoch=100)  # cv: 50 of 60
    state = {**loader.state_dict(), "epoch": 2**62}
    made: list[int] = []
    permutation = mixture.pass_permutation

    def counted(seed: int, source: int, p: int, n: int) -> np.ndarray:
        made.append(p)
        if len(made) > 1000:
            raise AssertionError("a pass computed per epoch")
        return permutation(seed, source, p, n)

    monkeypatch.setattr(mixture, "pass_permutation", counted)
    mixture.clear_passes()
    loader.load_state_dict(state)
    assert loader.epoch == 2**62 and len(loader.batches()) == len(loader.batches(0))


def test_weights_near_the_float_maximum_keep_their_ratio() -> None:
    from dlop.runtime.order.mixture import check_weights

    assert check_weights(["a", "b"], {"a": 1e308, "b": 1e308}, [10, 10]) == [0.5, 0.5]
    assert check_weights(["a", "b"], {"a": 1.0, "b": 3.0}, [10, 10]) == [0.25, 0.75]


@pytest.mark.parametrize("asked", [10**12, 2**28 + 1])
def test_an_epoch_too_large_to_plan_is_refused_at_once(
    corpora: dict[str, Path], asked: int
) -> None:
    with pytest.raises(UsageError, match=r"samples_per_epoch must be 1\.\.268435456"):
        Loader(corpora, 16, samples_per_epoch=asked)


def test_a_source_drawn_too_many_times_over_is_refused(corpora: dict[str, Path]) -> None:
    weights = {"ls": 0, "ps": 0, "cv": 1}  # cv holds 60 samples
    with pytest.raises(UsageError, match=r"from source 'cv' of 60, each 166666 times"):
        Loader(weighted(corpora, weights), 16, samples_per_epoch=10**7)
    Loader(weighted(corpora, weights), 16, samples_per_epoch=60 * 1000)  # 1000 times over is fine


def test_a_source_carries_its_weight_and_selection(corpora: dict[str, Path]) -> None:
    """Source(path, weight=, where=) reads exactly as the same mixture of an Archive
    opened with that where, batch for batch and state for state."""
    from dlop.runtime import open_archive

    even = {"label": list(range(0, SIZES["ps"], 2))}
    as_sources = Loader(
        {"ls": Source(corpora["ls"], weight=2), "ps": Source(corpora["ps"], weight=1, where=even)},
        8,
        fields=["key", "label"],
        seed=3,
        samples_per_epoch=400,
    )
    as_before = Loader(
        {"ls": Source(corpora["ls"], 2), "ps": Source(open_archive(corpora["ps"], where=even), 1)},
        8,
        fields=["key", "label"],
        seed=3,
        samples_per_epoch=400,
    )
    got, want = keys(as_sources), keys(as_before)
    assert got == want and len(got) == 50
    drawn = [k for batch in got for k in batch if k.startswith("ps")]
    assert drawn and all(int(k[2:]) % 2 == 0 for k in drawn)  # the source's own where held
    assert as_sources.state_dict() == as_before.state_dict()
    # a selection is a source's own: where= and indices= for the whole mixture are refused
    for key, value in (("where", {"label": [1]}), ("indices", [1])):
        with pytest.raises(UsageError, match=rf"{key}= does not apply to a mixture: give each"):
            Loader(
                {"ps": Source(corpora["ps"], where=even), "cv": corpora["cv"]}, 4, **{key: value}
            )  # type: ignore[arg-type]


def test_source_weights_are_given_in_one_place(corpora: dict[str, Path]) -> None:
    from dlop.runtime import open_archive

    with pytest.raises(UsageError, match=r"sources \['cv'\] have no weight while \['ls'\]"):
        Loader({"ls": Source(corpora["ls"], weight=1), "cv": Source(corpora["cv"])}, 4)
    narrowed = open_archive(corpora["cv"], where={"label": [1, 2]})
    with pytest.raises(UsageError, match=r"an open Archive with a selection of its own"):
        Loader({"cv": Source(narrowed, where={"label": [1]}), "ls": corpora["ls"]}, 4)
    with pytest.raises(UsageTypeError, match=r"a path, a list of paths, an open Archive or a"):
        Loader({"cv": 3, "ls": corpora["ls"]}, 4)

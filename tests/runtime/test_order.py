"""Epoch order: exact coverage, DistributedSampler semantics, bucketing, windows."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from torch.utils.data import DistributedSampler

from dlop.runtime import OrderSpec, rank_batches


@pytest.mark.parametrize("n", [1, 10, 37, 64])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_coverage_and_equal_batch_counts(
    n: int, world: int, shuffle: bool, drop_last: bool
) -> None:
    per_rank = [
        rank_batches(OrderSpec(n, 4, shuffle, 7, drop_last, r, world), epoch=2)
        for r in range(world)
    ]
    counts = {len(b) for b in per_rank}
    assert len(counts) == 1, "every rank has the same number of batches"
    seen = Counter(int(i) for batches in per_rank for b in batches for i in b)
    if world == 1 and not drop_last:
        assert seen == Counter(range(n))  # exactly once
    elif drop_last:
        assert max(seen.values(), default=1) == 1  # never twice
        kept = n // world
        assert sum(seen.values()) == world * (kept - kept % 4)
    else:
        assert set(seen) == set(range(n))  # everything, padded by < world repeats
        assert sum(seen.values()) == world * math.ceil(n / world)
    for batches in per_rank:
        assert all(np.all(np.diff(b) >= 0) for b in batches)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [True, False])
def test_same_samples_per_rank_as_distributed_sampler(world: int, drop_last: bool) -> None:
    n = 23
    for r in range(world):
        ours = np.concatenate(
            rank_batches(OrderSpec(n, 1, False, 0, drop_last, r, world), 0) or [np.zeros(0)]
        )
        theirs = list(DistributedSampler(range(n), world, r, shuffle=False, drop_last=drop_last))
        assert sorted(ours.tolist()) == sorted(theirs)


def test_shuffle_changes_with_epoch_and_seed() -> None:
    a = rank_batches(OrderSpec(100, 10, seed=1), 0)
    assert [b.tolist() for b in a] == [
        b.tolist() for b in rank_batches(OrderSpec(100, 10, seed=1), 0)
    ]
    assert [b.tolist() for b in a] != [
        b.tolist() for b in rank_batches(OrderSpec(100, 10, seed=1), 1)
    ]
    assert [b.tolist() for b in a] != [
        b.tolist() for b in rank_batches(OrderSpec(100, 10, seed=2), 0)
    ]


def test_bucketing_groups_lengths_and_keeps_batch_order_random() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(100, 1600, 2000)
    spec = OrderSpec(2000, 32, seed=3, bucket_window=16)
    batches = rank_batches(spec, 0, lengths)
    assert Counter(int(i) for b in batches for i in b) == Counter(range(2000))
    spread = np.mean([lengths[b].max() - lengths[b].min() for b in batches])
    assert spread < 0.1 * (lengths.max() - lengths.min())
    means = [lengths[b].mean() for b in batches]
    assert abs(np.corrcoef(np.arange(len(means)), means)[0, 1]) < 0.3  # not sorted overall
    for world in (2, 3):
        per_rank = [
            rank_batches(OrderSpec(2000, 32, seed=3, rank=r, world_size=world), 0, lengths)
            for r in range(world)
        ]
        assert len({len(b) for b in per_rank}) == 1
        assert {int(i) for batches in per_rank for b in batches for i in b} == set(range(2000))


def test_window_order_stays_within_windows() -> None:
    sizes = (10, 12, 8, 10, 10, 9)
    starts = np.cumsum((0, *sizes))
    spec = OrderSpec(sum(sizes), 5, seed=4, mode="window", shard_sizes=sizes, window_shards=2)
    from dlop.runtime import epoch_order

    order = epoch_order(spec, 0)
    assert sorted(order.tolist()) == list(range(sum(sizes)))
    shard_of = np.searchsorted(starts, order, side="right") - 1
    pos = 0
    seen_windows = []
    while pos < len(order):
        first = shard_of[pos]
        window = {first}
        # the window's two shards make up the next (size_a + size_b) samples
        partner = next((s for s in shard_of[pos:] if s != first), None)
        if partner is not None:
            window.add(partner)
        total = sum(sizes[s] for s in window)
        assert set(shard_of[pos : pos + total]) == window
        seen_windows.append(window)
        pos += total
    assert len(seen_windows) == 3


def test_bad_specs() -> None:
    with pytest.raises(ValueError, match="rank"):
        OrderSpec(10, 2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        OrderSpec(10, 0)


@pytest.mark.parametrize("bucketed", [False, True])
def test_order_stage_state_round_trips(bucketed: bool) -> None:
    from dlop.runtime.order.epochs import BatchOrder

    lengths = np.random.default_rng(1).integers(1, 500, 103) if bucketed else None
    spec = OrderSpec(103, 8, seed=4, rank=1, world_size=2, bucket_window=3)
    first = BatchOrder(spec, lengths)
    first.set_epoch(5)
    start = first.begin()
    assert start == 0
    first.handed_out(4)
    state = first.state_dict()
    assert state == {"epoch": 5, "batches_done": 4}
    second = BatchOrder(spec, lengths)
    second.reset(state)
    assert second.begin() == 4 and second.epoch == 5
    assert [b.tolist() for b in second.batches()] == [b.tolist() for b in first.batches()]
    assert second.begin() == 0  # only the next iteration resumes
    second.handed_out(len(second.batches()))
    third = BatchOrder(spec, lengths)
    third.reset(second.state_dict())  # an epoch's end is a state too
    assert third.begin() == len(third.batches())


def test_order_stage_refuses_states_outside_the_epoch() -> None:
    from dlop.runtime.errors import UsageError, UsageTypeError
    from dlop.runtime.order.epochs import BatchOrder

    order = BatchOrder(OrderSpec(20, 4))
    for bad in ({"epoch": -1, "batches_done": 0}, {"epoch": 0, "batches_done": 6}):
        with pytest.raises(UsageError):
            order.reset(bad)
    with pytest.raises(UsageTypeError, match="batches_done"):
        order.reset({"epoch": 0, "batches_done": "2"})


def test_set_epoch_after_reset_keeps_the_resume() -> None:
    from dlop.runtime.order.epochs import BatchOrder

    spec = OrderSpec(40, 4, seed=1)
    order = BatchOrder(spec)
    order.reset({"epoch": 3, "batches_done": 3})
    order.set_epoch(3)  # the usual loop: load the state, then set_epoch(epoch)
    assert order.begin() == 3 and order.epoch == 3
    order.set_epoch(3)  # once the iteration began, set_epoch starts the epoch over
    assert order.begin() == 0
    order.reset({"epoch": 3, "batches_done": 3})
    order.set_epoch(4)  # another epoch drops the resume
    assert order.begin() == 0 and order.epoch == 4


@pytest.mark.parametrize("n", [1, 10, 37, 400, 1600])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("how", ["global", "window", "bucket"])
def test_uneven_shares_read_every_sample_exactly_once(n: int, world: int, how: str) -> None:
    sizes = (n // 3, n - 2 * (n // 3), n // 3)
    lengths = np.random.default_rng(1).integers(1, 50, n) if how == "bucket" else None
    per_rank = []
    for r in range(world):
        spec = OrderSpec(
            n, 16, seed=3, rank=r, world_size=world, even_shares=False,
            mode="window" if how == "window" else "global", shard_sizes=sizes,
            window_shards=1, bucket_window=2,
        )  # fmt: skip
        per_rank.append(rank_batches(spec, epoch=1, bucket_lengths=lengths))
    seen = [int(i) for batches in per_rank for b in batches for i in b]
    assert sorted(seen) == list(range(n))  # no repeat, no drop
    counts = [sum(len(b) for b in batches) for batches in per_rank]
    if how != "bucket":  # rank r: every world-th sample from r
        assert counts == [len(range(r, n, world)) for r in range(world)]
    assert max(len(b) for b in per_rank) - min(len(b) for b in per_rank) <= 1


def test_uneven_shares_refuse_drop_last() -> None:
    with pytest.raises(ValueError, match="no drop_last"):
        OrderSpec(10, 4, drop_last=True, world_size=3, even_shares=False)

"""What the first places of an order hold, found without making the whole order
(runtime.order.partial and epochs.node_taken): the same samples as the whole order's."""

from __future__ import annotations

import functools
import random
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from dlop.runtime.order import epochs, partial


def test_the_extension_makes_numpys_own_swaps() -> None:
    """Built here (the install compiles it) and equal to this numpy's shuffle: where a
    numpy draws otherwise, this fails and resumes fall back to whole shuffles."""
    assert partial.compiled is not None, "runtime/order/_shuffle.c was not built"
    assert partial.numpy_draw() is not None


@pytest.mark.parametrize("fast", [True, False])
def test_the_head_holds_what_the_whole_shuffle_puts_first(
    fast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not fast:
        monkeypatch.setattr(partial, "numpy_draw", lambda: None)
    draw = random.Random(3)
    for _ in range(300):
        n = draw.choice([1, 2, 3, 5, 64, 1000, draw.randint(1, 5000)])
        count = draw.choice([0, 1, n - 1, n, n + 3, draw.randint(0, n)])
        seed = draw.randint(0, 2**32)
        whole = np.arange(n, dtype=np.int64) * 7 + 3
        np.random.default_rng(seed).shuffle(whole)
        data = np.arange(n, dtype=np.int64) * 7 + 3
        got = partial.head(np.random.default_rng(seed), data, count)
        k = max(0, min(count, n))
        assert len(got) == k and sorted(got.tolist()) == sorted(whole[:k].tolist())
        if 0 < k < n:
            assert np.array_equal(data[k:], whole[k:])  # the places passed are settled


def test_arrays_the_extension_cannot_take_are_shuffled_by_numpy() -> None:
    for data in (np.arange(100, dtype=np.int32), np.arange(200, dtype=np.int64)[::2]):
        want = data.copy()
        np.random.default_rng(5).shuffle(want)
        got = partial.head(np.random.default_rng(5), data, 30)
        assert sorted(got.tolist()) == sorted(want[:30].tolist())


def test_hostile_calls_of_the_extension_are_refused() -> None:
    shuffle = partial.compiled
    if shuffle is None:
        pytest.skip("runtime/order/_shuffle.c was not built")
    gen = np.random.default_rng(0)
    with pytest.raises(ValueError):
        shuffle.shuffle_from(object(), np.arange(4), 1, 0)  # not a bit generator's capsule
    with pytest.raises((TypeError, BufferError)):
        shuffle.shuffle_from(gen.bit_generator.capsule, b"\0" * 16, 1, 0)  # read-only
    for wrong in (bytearray(16), np.arange(4, dtype=np.float64), np.arange(4, dtype=">i8")):
        with pytest.raises(ValueError, match="int64"):
            shuffle.shuffle_from(gen.bit_generator.capsule, wrong, 1, 0)
    with pytest.raises((ValueError, BufferError)):  # not contiguous
        shuffle.shuffle_from(gen.bit_generator.capsule, np.arange(8)[::2], 1, 0)
    data = np.arange(10, dtype=np.int64)
    shuffle.shuffle_from(gen.bit_generator.capsule, data, -5, 0)  # places below 1: whole
    assert sorted(data.tolist()) == list(range(10))
    shuffle.shuffle_from(gen.bit_generator.capsule, data, 99, 0)  # past the end: no swap
    assert sorted(data.tolist()) == list(range(10))


def _spec(draw: random.Random) -> epochs.OrderSpec:
    sizes = tuple(draw.choice([0, 1, 3, 7, 20, 50, 200]) for _ in range(draw.randint(1, 10)))
    even = draw.random() < 0.8
    nodes = draw.randint(1, 4)
    return epochs.OrderSpec(
        sum(sizes), draw.randint(1, 6), rank=0,
        world_size=nodes * draw.randint(1, 3), nodes=nodes, shard_sizes=sizes,
        mode=draw.choice(["global", "window"]), window_shards=draw.randint(1, 4),
        shuffle=draw.random() < 0.85, node_share=draw.choice(["keep", "redeal"]),
        seed=draw.randint(0, 99), even_shares=even,
        drop_last=draw.random() < 0.4 if even else False,
    )  # fmt: skip


def test_what_a_node_took_is_the_head_of_its_order() -> None:
    """node_taken is the set of node_rest's first places, for every order setting, the
    whole epoch or what an earlier world left, with and without that world's nodes."""
    draw = random.Random(8)
    tried = 0
    while tried < 400:
        spec = _spec(draw)
        if not spec.num_samples:
            continue
        epoch = draw.randint(0, 3)
        rest = np.flatnonzero(np.random.default_rng(tried).random(spec.num_samples) < 0.7)
        old_nodes = draw.randint(1, 3)
        before = replace(spec, nodes=old_nodes, world_size=old_nodes * 2)
        for earlier in (None, before):
            shares = epochs.node_shares(spec, epoch, rest, earlier)
            for node in range(spec.nodes):
                whole = epochs.node_rest(spec, epoch, node, rest, shares)
                seq, ends, mine = shares
                for count in {0, 1, len(whole) // 2, len(whole), len(whole) + 5}:
                    parts = epochs.pieces(spec, seq, ends, mine[node])
                    got = epochs.node_taken(spec, epoch, node, parts, rest, count)
                    assert set(got.tolist()) == set(whole[:count].tolist()), (spec, count)
        tried += 1


def test_both_ways_of_drawing_are_the_algorithms_they_name() -> None:
    """The two draws the extension can match a numpy with, against plain Python
    Fisher-Yates walks that draw each place's partner from the same 32-bit stream:
    masked (numpy 1.26 to 2.4) and Lemire's multiply-and-reject."""
    compiled = partial.compiled
    if compiled is None:
        pytest.skip("runtime/order/_shuffle.c was not built")

    def masked(next32: Any, i: int) -> int:
        mask = (1 << i.bit_length()) - 1
        while (value := next32() & mask) > i:
            pass
        return value

    def lemire(next32: Any, i: int) -> int:
        span = i + 1
        m = next32() * span
        if (m & 0xFFFFFFFF) < span:
            reject = (0xFFFFFFFF - i) % span
            while (m & 0xFFFFFFFF) < reject:
                m = next32() * span
        return m >> 32

    for draw, partner in enumerate((masked, lemire)):
        for n, first in ((2, 1), (50, 1), (3000, 1), (3000, 1700)):
            gen = np.random.default_rng(n + draw)
            bits = gen.bit_generator.ctypes
            next32 = functools.partial(bits.next_uint32, bits.state)
            want = list(range(n))
            for i in range(n - 1, first - 1, -1):
                j = partner(next32, i)
                want[i], want[j] = want[j], want[i]
            got = np.arange(n, dtype=np.int64)
            gen = np.random.default_rng(n + draw)
            compiled.shuffle_from(gen.bit_generator.capsule, got, first, draw)
            assert got.tolist() == want, (draw, n, first)


def test_an_extension_that_refuses_to_run_leaves_the_shuffle_to_numpy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A build whose extension refuses every call (as a 32-bit one did) is checked once
    and set aside: heads still come, from numpy's whole shuffle."""

    class Refusing:
        @staticmethod
        def shuffle_from(*args: Any) -> None:
            raise ValueError("shuffle_from: more than 2^32 - 2 places")

    monkeypatch.setattr(partial, "compiled", Refusing)
    partial.numpy_draw.cache_clear()
    try:
        assert partial.numpy_draw() is None
        want = np.arange(500, dtype=np.int64)
        np.random.default_rng(2).shuffle(want)
        got = partial.head(np.random.default_rng(2), np.arange(500, dtype=np.int64), 120)
        assert sorted(got.tolist()) == sorted(want[:120].tolist())
    finally:
        partial.numpy_draw.cache_clear()


@pytest.mark.parametrize("sizes", [(3, 3), (5, 3), (8, -1)])
def test_shard_sizes_that_do_not_count_the_samples_are_refused(sizes: tuple[int, ...]) -> None:
    """A node's share is cut from the shard sizes and the sample count alike: an order
    whose sizes do not sum to its samples (or count less than none) is refused."""
    with pytest.raises(ValueError, match="sum to num_samples"):
        epochs.OrderSpec(7, 2, world_size=2, nodes=2, shard_sizes=sizes)
    assert epochs.OrderSpec(7, 2, world_size=2, nodes=2, shard_sizes=(4, 3)).dealt


def test_what_a_wide_world_took_is_found_from_one_deal(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shards are dealt to nodes in one sequence for every node: finding what each
    of 16 old nodes read draws that deal once, not once a node (nodes x shards)."""
    drawn = []
    real = epochs.rng

    def counted(seed: int, epoch: int, stream: int) -> np.random.Generator:
        drawn.append(stream)
        return real(seed, epoch, stream)

    monkeypatch.setattr(epochs, "rng", counted)
    sizes = (10,) * 200
    spec = epochs.OrderSpec(sum(sizes), 4, world_size=16, nodes=16, shard_sizes=sizes)
    content = epochs.Content(spec.num_samples, order=lambda: epochs.epoch_order(spec, 0))
    everything = np.arange(spec.num_samples)
    left = epochs.left_after(spec, 0, epochs.Shape(16, 16, 4, 3), None, everything, content)
    assert drawn.count(epochs.NODE_DEAL_STREAM) == 1
    assert len(left) == spec.num_samples - 16 * 3 * 4  # each rank's three batches of four

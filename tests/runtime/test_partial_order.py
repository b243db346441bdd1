"""What the first places of an order hold, found without making the whole order
(runtime.order.partial and epochs.node_taken): the same samples as the whole order's."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dlop.runtime.order import partial


def test_the_extension_makes_numpys_own_swaps() -> None:
    """Built here (the install compiles it) and equal to this numpy's shuffle: where a
    numpy draws otherwise, this fails and resumes fall back to whole shuffles."""
    assert partial._shuffle is not None, "runtime/order/_shuffle.c was not built"
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
    shuffle = partial._shuffle
    if shuffle is None:
        pytest.skip("runtime/order/_shuffle.c was not built")
    gen = np.random.default_rng(0)
    with pytest.raises(ValueError):
        shuffle.shuffle_from(object(), np.arange(4), 1, 0)  # not a bit generator's capsule
    with pytest.raises((TypeError, BufferError)):
        shuffle.shuffle_from(gen.bit_generator.capsule, b"\0" * 16, 1, 0)  # read-only
    with pytest.raises(ValueError, match="whole number"):
        shuffle.shuffle_from(gen.bit_generator.capsule, bytearray(12), 1, 0)
    data = np.arange(10, dtype=np.int64)
    shuffle.shuffle_from(gen.bit_generator.capsule, data, -5, 0)  # places below 1: whole
    assert sorted(data.tolist()) == list(range(10))
    shuffle.shuffle_from(gen.bit_generator.capsule, data, 99, 0)  # past the end: no swap
    assert sorted(data.tolist()) == list(range(10))

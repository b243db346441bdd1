"""What the first places of a shuffle hold, found without finishing the shuffle.

numpy's ``Generator.shuffle`` is a Fisher-Yates walk from the last place down: once it
has passed place ``k``, places ``k`` to the end are settled and places ``0`` to ``k - 1``
hold, in some order, the samples that end up there. ``head(gen, data, k)`` returns those
``k`` samples (as a set: not in the order the whole shuffle would give them) after
``len(data) - k`` swaps instead of ``len(data) - 1``. A resume in another world uses it
to learn which samples an earlier world's ranks had read.

The swaps are made by ``runtime/order/_shuffle.c``, draw for draw as numpy makes them.
That is checked against numpy the first time it is needed; where it differs (another
numpy's shuffle) or the extension was not built, the data is shuffled whole by numpy,
with the same result, only slower.
"""

from __future__ import annotations

import functools
import importlib
import threading
from types import ModuleType

import numpy as np

compiled: ModuleType | None
try:
    compiled = importlib.import_module("._shuffle", __package__)
except ImportError:  # built without a C compiler
    compiled = None

# Places the extension takes (its draws are numpy's 32-bit ones below this).
MAX_PLACES = (1 << 32) - 2
DRAWS = (0, 1)  # the extension's ways to draw a place's partner: masked, Lemire's
_checking = threading.Lock()


@functools.cache
def numpy_draw() -> int | None:
    """The extension's way of drawing that makes numpy's own swaps here (whole shuffles
    of a few lengths and seeds equal numpy's, each generator left where numpy leaves
    it); None if neither does, the extension was not built or it refuses to run."""
    with _checking:  # threads asking at once check once
        return _checked_draw()


def _checked_draw() -> int | None:
    if compiled is None:
        return None
    for draw in DRAWS:
        try:
            same = all(_same(draw, n, s) for n in (1, 2, 3, 17, 1000, 65537) for s in (0, 1, 9))
        except (ValueError, TypeError, BufferError):
            return None
        if same:
            return draw
    return None


def _same(draw: int, n: int, seed: int) -> bool:
    assert compiled is not None
    ours, theirs = np.random.default_rng(seed), np.random.default_rng(seed)
    a = np.arange(n, dtype=np.int64)
    b = a.copy()
    compiled.shuffle_from(ours.bit_generator.capsule, a, 1, draw)
    theirs.shuffle(b)
    return bool(np.array_equal(a, b)) and ours.integers(1 << 62) == theirs.integers(1 << 62)


def head(gen: np.random.Generator, data: np.ndarray, count: int) -> np.ndarray:
    """The samples ``gen.shuffle(data)`` puts in the first ``count`` places of ``data``
    (a 1-D int64 array the caller owns; shuffled in place, in part or whole), as a view
    of ``data``, in no set order. ``gen`` is left where it stands after those swaps: use
    it for nothing else afterwards."""
    n = len(data)
    count = max(0, min(count, n))
    if count == n or count == 0:
        return data[:count]  # every sample, or none: no swap needed
    draw = numpy_draw()  # not None: the extension is there and makes numpy's swaps
    if (
        compiled is not None
        and draw is not None
        and n <= MAX_PLACES
        and data.dtype == np.int64
        and data.flags.c_contiguous
        and data.flags.writeable
    ):
        with gen.bit_generator.lock:
            compiled.shuffle_from(gen.bit_generator.capsule, data, count, draw)
    else:
        gen.shuffle(data)
    return data[:count]

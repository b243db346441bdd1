"""Batches by length budget: as many samples as fit a budget of frames, in length buckets.

A budget caps the frames of a batch along one ragged field (``bucket_by``): the
sum of its samples' lengths (``max_frames``, Lhotse's ``max_duration`` counted
in frames), or its padded size, the longest length times the count
(``max_padded_frames``, what the memory of a padded batch follows), with
``batch_size`` as an optional cap on the count. A sample longer than the budget
gets a batch of its own.

How an epoch's order (a node's share of it, or the whole epoch; runtime.order.epochs)
becomes batches, a pure function of (seed, epoch, settings):

1. Buckets: a sample's bucket is given by its length and the bucket edges
   (by default ``num_buckets`` buckets of about equal total frames, from the
   lengths of every sample read, or ``bucket_edges``). With a mixture's
   ``batch_per_source`` a bucket is also one source's.
2. Runs: the order is cut into consecutive runs of about ``bucket_window`` steps
   per bucket (``run_frames`` frames: ``bucket_window * ranks * buckets *
   budget``), so a batch's samples lie within one run of the order (window
   order's locality, a shard cache's bound).
3. Within a run, each bucket's samples are sorted by length (ties kept in the
   shuffled order) and cut greedily into batches that fit the budget and cap.
4. Steps: each run's bucket's batches are grouped ``ranks`` at a time, one
   batch per rank, so the ranks of one step read the same bucket and take about
   the same time. A bucket's last batches that make no whole step are split
   (halving the largest, which keeps every piece within the budget) into one
   batch per rank; with fewer samples than ranks, its samples are repeated (the
   documented padding); ``drop_last`` drops those batches instead (chosen at
   random); ``even_shares=False`` keeps them as they are, after every step.
5. The steps of the whole epoch are shuffled, and step ``s`` gives rank ``r``
   its batch ``r``: dealt position ``s * ranks + r``.

Where shards are dealt to nodes each node cuts its own share; nodes whose
steps fall short of the most any node has split their largest steps (each of
their batches halved) until every node has as many, so every rank of the world
has the same number of batches; a node that cannot split (batches of one
sample) repeats its first steps.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import UsageError, check_int

BUDGET_KINDS = ("sum", "padded")
MAX_BUCKETS = 1 << 12  # buckets a budget may name (each sorted and cut on its own)


@dataclass(frozen=True)
class Budget:
    """A batch's budget of frames along the bucketed field: the sum of its lengths
    (``padded`` False) or the longest times the count (``padded`` True); the bucket
    ``edges`` (bucket ``i`` holds lengths in ``[edges[i-1], edges[i])``); the shortest
    length of any sample (``least``, which bounds a batch's count)."""

    frames: int
    padded: bool = False
    edges: tuple[int, ...] = ()
    least: int = 0

    @property
    def buckets(self) -> int:
        return len(self.edges) + 1

    def setting(self) -> list[object]:
        """What a state records of it: [frames, "sum" | "padded", edges]."""
        return [self.frames, BUDGET_KINDS[self.padded], list(self.edges)]

    def most_samples(self) -> int:
        """The most samples a batch within this budget can hold."""
        return max(1, self.frames // max(1, self.least))

    def run_frames(self, window: int, ranks: int) -> int:
        """Frames of one run of the order (step 2 of the module docstring)."""
        return window * ranks * self.buckets * self.frames

    def run_samples(self, window: int, ranks: int) -> int | None:
        """The most samples one run holds (None: unbounded, samples of length 0)."""
        if self.least < 1:
            return None
        return self.run_frames(window, ranks) // self.least + 1


def equal_frame_edges(lengths: np.ndarray, buckets: int) -> tuple[int, ...]:
    """Edges cutting ``lengths`` into up to ``buckets`` buckets of about equal total
    frames (fewer where lengths repeat): integer arithmetic, the same on every CPU."""
    if len(lengths) == 0 or buckets <= 1:
        return ()
    s = np.sort(lengths.astype(np.int64, copy=False))
    total = np.cumsum(s)
    targets = [int(total[-1]) * k // buckets for k in range(1, buckets)]
    at = np.searchsorted(total, np.asarray(targets, dtype=np.int64), side="right")
    cut = s[np.minimum(at, len(s) - 1)]
    edges = np.unique(cut[(cut > s[0]) & (cut <= s[-1])])
    return tuple(int(e) for e in edges)


def make_budget(
    owner: str,
    lengths: np.ndarray,
    max_frames: object,
    max_padded_frames: object,
    num_buckets: object,
    bucket_edges: Sequence[int] | None,
) -> Budget | None:
    """The budget a front end's settings ask for (None: batches of ``batch_size``), its
    edges from ``lengths`` (of every sample read) unless given; each setting checked
    and named in errors."""
    if max_frames is not None and max_padded_frames is not None:
        raise UsageError(
            f"{owner} takes max_frames= (the sum of a batch's lengths) or max_padded_frames= "
            "(its longest length times its count), not both"
        )
    given = max_frames if max_padded_frames is None else max_padded_frames
    name = "max_frames" if max_padded_frames is None else "max_padded_frames"
    if given is None:
        if bucket_edges is not None:
            raise UsageError(f"{owner} bucket_edges= is for budget batches: give max_frames=")
        return None
    frames = check_int(f"{owner} {name}", given, low=1)
    buckets = check_int(f"{owner} num_buckets", num_buckets, low=1, high=MAX_BUCKETS)
    if bucket_edges is None:
        edges = equal_frame_edges(lengths, buckets)
    else:
        if isinstance(bucket_edges, str | bytes) or not isinstance(
            bucket_edges, Sequence | np.ndarray
        ):
            raise UsageError(
                f"{owner} bucket_edges must be a list of increasing lengths, got {bucket_edges!r:.80}"
            )
        if len(bucket_edges) >= MAX_BUCKETS:
            raise UsageError(f"{owner} bucket_edges names more than {MAX_BUCKETS - 1} edges")
        edges = tuple(
            check_int(f"{owner} bucket_edges[{i}]", e, low=1) for i, e in enumerate(bucket_edges)
        )
        if any(b <= a for a, b in itertools.pairwise(edges)):
            raise UsageError(f"{owner} bucket_edges must increase, got {list(edges)}")
    least = int(lengths.min()) if len(lengths) else 0
    return Budget(frames, max_padded_frames is not None, edges, least)


def cut(lengths: np.ndarray, ends: np.ndarray, budget: Budget, cap: int) -> np.ndarray:
    """Where the greedy batches of ``lengths`` (ascending within each segment, segments
    ending at ``ends``) begin: each takes as many samples as fit the budget and ``cap``,
    at least one, and no batch crosses a segment's end."""
    n = len(lengths)
    starts: list[int] = []
    before = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    frames = budget.frames
    i, seg = 0, 0
    while i < n:
        while ends[seg] <= i:
            seg += 1
        starts.append(i)
        hi = min(int(ends[seg]), i + cap)
        if budget.padded:  # count * longest, both grow with the count: the first over
            m = min(hi - i, frames // max(1, int(lengths[i])))
            need = np.arange(1, m + 1, dtype=np.int64) * lengths[i : i + m]
            k = int(np.searchsorted(need, frames, side="right"))
        else:
            k = int(np.searchsorted(before, before[i] + frames, side="right")) - 1 - i
        i += max(1, min(k, hi - i))
    return np.asarray(starts, dtype=np.int64)


def split_to(batches: list[np.ndarray], count: int) -> list[np.ndarray]:
    """``batches`` split into ``count`` by halving the largest in turn (each half keeps
    within its batch's budget); fewer where batches of one sample are all that is left."""
    out = list(batches)
    while len(out) < count:
        i = max(range(len(out)), key=lambda j: len(out[j]))
        if len(out[i]) < 2:
            break
        half = len(out[i]) // 2
        out[i : i + 1] = [out[i][:half], out[i][half:]]
    return out


def budget_steps(
    order: np.ndarray,
    lengths: np.ndarray,
    groups: np.ndarray | None,
    budget: Budget,
    cap: int,
    ranks: int,
    window: int,
    even: bool,
    drop_last: bool,
    gen: np.random.Generator | None,
) -> tuple[list[list[np.ndarray]], list[np.ndarray]]:
    """The epoch's steps (``ranks`` batches each, one bucket's), shuffled by ``gen`` (None:
    not shuffled, the last of a bucket's batches dropped), and the batches after them
    that make no whole step (``even`` False only); see the module docstring.
    ``order``: the samples in epoch order; ``lengths``: indexed by sample number."""
    if len(order) == 0:
        return [], []
    size = lengths[order].astype(np.int64, copy=False)
    key = np.searchsorted(np.asarray(budget.edges, dtype=np.int64), size, side="right")
    if groups is not None:
        _, source = np.unique(groups, return_inverse=True)
        key = source.astype(np.int64) * budget.buckets + key
    run = (np.cumsum(size) - size) // max(1, budget.run_frames(window, ranks))
    by = np.lexsort((size, key, run))  # stable: equal lengths keep the shuffled order
    samples, size, key, run = order[by], size[by], key[by], run[by]
    change = np.flatnonzero((np.diff(key) != 0) | (np.diff(run) != 0)) + 1
    ends = np.concatenate([change, [len(samples)]]).astype(np.int64)
    starts = cut(size, ends, budget, cap)
    seg_of = np.searchsorted(ends, starts, side="right")  # each batch's segment
    bounds = np.concatenate([starts, [len(samples)]])
    pieces = [samples[a:b] for a, b in itertools.pairwise(bounds.tolist())]
    firsts = [*np.flatnonzero(np.diff(seg_of, prepend=-1)).tolist(), len(pieces)]
    steps: list[list[np.ndarray]] = []
    tail: list[np.ndarray] = []
    for a, b in itertools.pairwise(firsts):
        mine = pieces[a:b]
        if drop_last and even and len(mine) % ranks:
            extra = len(mine) % ranks
            if gen is None:
                mine = mine[: len(mine) - extra]
            else:
                dropped = set(gen.choice(len(mine), extra, replace=False).tolist())
                mine = [x for i, x in enumerate(mine) if i not in dropped]
        whole = len(mine) - len(mine) % ranks
        steps += [mine[i : i + ranks] for i in range(0, whole, ranks)]
        rest = mine[whole:]
        if not rest:
            continue
        if not even:
            tail += rest
        else:
            split = split_to(rest, ranks)
            if len(split) < ranks:  # fewer samples than ranks: repeated, in turn
                split = [split[i % len(split)] for i in range(ranks)]
            steps.append(split)
    if gen is not None:
        steps = [steps[i] for i in gen.permutation(len(steps))]
    return steps, tail


def equalize(steps: list[list[np.ndarray]], target: int, ranks: int) -> list[list[np.ndarray]]:
    """``steps`` made ``target`` in number: the step with the most samples split in two
    (each of its batches halved, the halves dealt to two steps next to each other)
    while one has two samples per rank, then the first steps repeated; or trimmed,
    where a node reads others' samples for want of its own (runtime.order.epochs)."""
    if len(steps) >= target:
        return steps[:target]
    out = [list(s) for s in steps]
    place: list[tuple[int, ...]] = [(i,) for i in range(len(out))]  # the order they end in
    heap = [(-sum(len(b) for b in s), i) for i, s in enumerate(out)]
    heapq.heapify(heap)
    while len(out) < target and heap:
        total, i = heapq.heappop(heap)
        if -total < 2 * ranks:
            break
        halves = sorted(split_to(out[i], 2 * ranks), key=len, reverse=True)
        out[i] = halves[0::2]
        out.append(halves[1::2])
        place.append((*place[i], len(out)))
        for j in (i, len(out) - 1):
            heapq.heappush(heap, (-sum(len(b) for b in out[j]), j))
    result = [out[i] for i in sorted(range(len(out)), key=place.__getitem__)]
    whole = len(result)
    while len(result) < target and whole:
        result.append(result[(len(result) - whole) % whole])
    return result

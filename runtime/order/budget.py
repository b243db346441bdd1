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
   the same time. A run's bucket's last batches that make no whole step are
   split (halving the largest, which keeps every piece within the budget) into
   one batch per rank; with fewer samples than ranks, its samples are repeated
   (the documented padding); ``drop_last`` drops those batches instead (chosen
   at random); ``even_shares=False`` keeps them as they are, after every step.
   A run's bucket's steps are shuffled.
5. The epoch's sequence of buckets, one per step, is shuffled (stream
   ``BUCKET_STREAM``, the same on every node), and each bucket's steps fill its
   places in run order: step ``s`` gives rank ``r`` its batch ``r``, dealt
   position ``s * ranks + r``.

Where shards are dealt to nodes each node cuts its own share, and every node
takes the same number of steps of each bucket: the most any node has (the
fewest with ``drop_last``, the others trimmed). A node short of steps in a bucket
splits its largest steps there (each of their batches halved); one that cannot
(batches of one sample) repeats its steps of that bucket, or, holding none,
of the nearest bucket it holds. So the ranks of the whole world read one bucket
a step, and every rank has the same number of batches.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import UsageError, check_int

BUDGET_KINDS = ("sum", "padded")
MAX_BUCKETS = 1 << 12  # buckets a budget may name (each sorted and cut on its own)
MAX_FRAMES = 1 << 40  # a budget's frames (about 350 years of speech at 100 frames a second)
BUCKET_STREAM = 4  # the random stream of an epoch's sequence of buckets (runtime.order.epochs.rng)
DEFAULT_BUCKETS = 10


@dataclass(frozen=True)
class Budget:
    """A batch's budget of frames along the bucketed field: the sum of its lengths
    (``padded`` False) or the longest times the count (``padded`` True); the bucket
    ``edges`` (bucket ``i`` holds lengths in ``[edges[i-1], edges[i])``), made from
    the lengths read into ``asked`` buckets (0: given); the shortest length of any
    sample (``least``) and the most samples a batch can hold (``most``)."""

    frames: int
    padded: bool = False
    edges: tuple[int, ...] = ()
    least: int = 0
    most: int = 1
    asked: int = 0

    @property
    def buckets(self) -> int:
        return len(self.edges) + 1

    def setting(self) -> list[object]:
        """What a state records of it: [frames, "sum" | "padded", edges]."""
        return [self.frames, BUDGET_KINDS[self.padded], list(self.edges)]

    def over(self, lengths: np.ndarray) -> Budget:
        """This budget over the samples of ``lengths`` (an archive before an append): its
        edges made again from them where they were made from the lengths read."""
        edges = equal_frame_edges(lengths, self.asked) if self.asked else self.edges
        least = int(lengths.min()) if len(lengths) else 0
        return Budget(self.frames, self.padded, edges, least, fitting(lengths, self), self.asked)

    def run_frames(self, window: int, ranks: int) -> int:
        """Frames of one run of the order (step 2 of the module docstring), at most an
        int64's."""
        return min(window * ranks * self.buckets * self.frames, 2**62)

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


def fitting(lengths: np.ndarray, budget: Budget, cap: int | None = None) -> int:
    """The most samples of ``lengths`` one batch within ``budget`` (and ``cap``) holds: the
    shortest ones, as many as fit; at least one."""
    s = np.sort(lengths.astype(np.int64, copy=False))[: cap or len(lengths)]
    if budget.padded:  # k samples fit where k times the k-th shortest does
        k = int(np.count_nonzero(np.arange(1, len(s) + 1, dtype=np.int64) * s <= budget.frames))
    else:
        k = int(np.searchsorted(np.cumsum(s), budget.frames, side="right"))
    return max(1, k)


def make_budget(
    owner: str,
    lengths: np.ndarray | None,
    max_frames: object,
    max_padded_frames: object,
    num_buckets: object,
    bucket_edges: Sequence[int] | None,
) -> Budget | None:
    """The budget a front end's settings ask for (None: batches of ``batch_size``), its
    edges from ``lengths`` (the bucketed field's, of every sample read; None without
    ``bucket_by``, which a budget needs) unless given; each setting checked and named
    in errors, a budget's settings refused without a budget."""
    if max_frames is not None and max_padded_frames is not None:
        raise UsageError(
            f"{owner} takes max_frames= (the sum of a batch's lengths) or max_padded_frames= "
            "(its longest length times its count), not both"
        )
    given = max_frames if max_padded_frames is None else max_padded_frames
    name = "max_frames" if max_padded_frames is None else "max_padded_frames"
    if given is None:
        for key, value in (("bucket_edges", bucket_edges), ("num_buckets", num_buckets)):
            if value is not None:
                raise UsageError(f"{owner} {key}= is for budget batches: give max_frames=")
        return None
    frames = check_int(f"{owner} {name}", given, low=1, high=MAX_FRAMES)
    assert lengths is not None, "a budget is refused without bucket_by first"
    if num_buckets is not None and bucket_edges is not None:
        raise UsageError(f"{owner} takes num_buckets= or bucket_edges=, not both")
    asked = DEFAULT_BUCKETS if num_buckets is None else num_buckets
    buckets = check_int(f"{owner} num_buckets", asked, low=1, high=MAX_BUCKETS)
    if bucket_edges is None:
        edges = equal_frame_edges(lengths, buckets)
    else:
        buckets = 0  # given
        if (
            isinstance(bucket_edges, str | bytes)
            or not isinstance(bucket_edges, Sequence | np.ndarray)
            or np.ndim(bucket_edges) != 1
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
    budget = Budget(frames, max_padded_frames is not None, edges, least, 1, buckets)
    return Budget(frames, budget.padded, edges, least, fitting(lengths, budget), buckets)


def cut(lengths: np.ndarray, ends: np.ndarray, budget: Budget, cap: int) -> np.ndarray:
    """Where the greedy batches of ``lengths`` (ascending within each segment, segments
    ending at ``ends``) begin: each takes as many samples as fit the budget and ``cap``,
    at least one, and no batch crosses a segment's end."""
    n = len(lengths)
    starts: list[int] = []
    segment_ends = ends.tolist()
    frames = budget.frames
    # the running sums of lengths (max_frames), searched with bisect over a Python list of
    # the segment's: a search a batch at a fraction of a numpy call's cost, and no more
    # than a segment's sums held as Python ints at once
    sums = None if budget.padded else np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    local: list[int] = []
    lo, held = 0, -1  # the segment ``local`` holds (``held``) and its first sample
    i, seg = 0, 0
    while i < n:
        while segment_ends[seg] <= i:
            seg += 1
        starts.append(i)
        hi = min(segment_ends[seg], i + cap)
        if sums is None:  # count * longest, both grow with the count: the first over
            m = min(hi - i, frames // max(1, int(lengths[i])))
            need = np.arange(1, m + 1, dtype=np.int64) * lengths[i : i + m]
            k = int(np.searchsorted(need, frames, side="right"))
        else:
            if held != seg:
                lo, held = segment_ends[seg - 1] if seg else 0, seg
                local = sums[lo : segment_ends[seg] + 1].tolist()
            at = i - lo
            k = bisect.bisect_right(local, local[at] + frames, at, hi - lo + 1) - 1 - at
        i += max(1, min(k, hi - i))
    return np.asarray(starts, dtype=np.int64)


def split_to(batches: list[np.ndarray], count: int) -> list[np.ndarray]:
    """``batches`` split into ``count`` by halving the largest in turn (each half keeps
    within its batch's budget), each half where its batch was; fewer where batches of
    one sample are all that is left."""
    pieces: list[tuple[tuple[int, ...], np.ndarray]] = [((i,), b) for i, b in enumerate(batches)]
    heap = [(-len(b), i) for i, b in enumerate(batches)]
    heapq.heapify(heap)
    while len(pieces) < count and heap:
        size, i = heapq.heappop(heap)
        if -size < 2:
            break
        place, batch = pieces[i]
        half = len(batch) // 2
        pieces[i] = ((*place, 0), batch[:half])
        pieces.append(((*place, 1), batch[half:]))
        heapq.heappush(heap, (-half, i))
        heapq.heappush(heap, (-(len(batch) - half), len(pieces) - 1))
    return [b for _, b in sorted(pieces, key=lambda p: p[0])]


Steps = dict[int, list[list[np.ndarray]]]  # a bucket's key -> its steps, in run order


@dataclass(frozen=True)
class Evening:
    """What every node of a world reads of each bucket, where shards are dealt to nodes:
    ``counts`` steps of each bucket's key; ``spare``, for a bucket some node holds no
    sample of, the steps another node makes of it (that node repeats them)."""

    counts: dict[int, int]
    spare: Steps


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
) -> tuple[Steps, list[np.ndarray]]:
    """The epoch's steps (``ranks`` batches each) by bucket, in run order, each run's
    shuffled by ``gen`` (None: not shuffled, the last of a bucket's batches dropped),
    and the batches that make no whole step (``even`` False only); see the module
    docstring. ``order``: the samples in epoch order; ``lengths``: by sample number.
    A bucket's key is its number, plus its group's times the buckets with ``groups``."""
    steps: Steps = {}
    tail: list[np.ndarray] = []
    if len(order) == 0:
        return steps, tail
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
        made = [mine[i : i + ranks] for i in range(0, whole, ranks)]
        rest = mine[whole:]
        if rest and not even:
            tail += rest
        elif rest:
            split = split_to(rest, ranks)
            if len(split) < ranks:  # fewer samples than ranks: repeated, in turn
                split = [split[i % len(split)] for i in range(ranks)]
            made.append(split)
        if gen is not None:
            made = [made[i] for i in gen.permutation(len(made))]
        steps.setdefault(int(key[bounds[a]]), []).extend(made)
    return steps, tail


def fit_steps(steps: list[list[np.ndarray]], target: int, ranks: int) -> list[list[np.ndarray]]:
    """``steps`` made ``target`` in number: trimmed; or the step with the most samples split
    in two (each of its batches halved, the halves dealt to two steps next to each
    other) while one has two samples per rank, then the steps repeated in turn."""
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


def arrange(
    steps: Steps,
    ranks: int,
    evening: Evening | None = None,
    gen: np.random.Generator | None = None,
) -> list[list[np.ndarray]]:
    """The epoch's steps in order: each bucket's made as many as ``evening`` says (default:
    as many as it has; ``fit_steps``; a bucket this node holds none of takes the
    evening's spare steps), the sequence of buckets shuffled by ``gen`` (None: in key
    order), each bucket's steps filling its places in turn."""
    counts = {k: len(v) for k, v in steps.items()} if evening is None else evening.counts
    keys = sorted(k for k, n in counts.items() if n > 0)
    fitted = {}
    for k in keys:
        own = steps.get(k) or (evening.spare.get(k, []) if evening is not None else [])
        fitted[k] = fit_steps(own, counts[k], ranks)
        if len(fitted[k]) != counts[k]:
            raise RuntimeError(f"bucket {k}: {len(fitted[k])} steps made of {counts[k]}")
    labels = np.repeat(np.asarray(keys, dtype=np.int64), [len(fitted[k]) for k in keys])
    if gen is not None:
        labels = gen.permutation(labels)
    taken = dict.fromkeys(keys, 0)
    out = []
    for k in labels.tolist():
        out.append(fitted[k][taken[k]])
        taken[k] += 1
    return out

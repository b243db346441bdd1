"""Which samples each rank sees, batch by batch, in each epoch: a pure function of (seed, epoch).

Because the order is recomputed from a handful of integers, resuming needs
no index lists: the state is (seed, epoch, batches done).

Orders
  global  A full permutation of the epoch (the archive should fit the page
          cache, or random reads go to disk).
  window  Out-of-core: the shard order is permuted, then samples are shuffled
          within consecutive windows of ``window_shards`` shards. Reads stay
          inside a window's shards; a sample only ever shares a batch with
          samples of the same window, so correlations within a shard (same
          source, same speaker) survive at the scale of a window, and shards
          should be written from a shuffled corpus when that matters.

Nodes (``nodes`` > 1, an archive's shards known)
  The shards are dealt to nodes first: their order is permuted (``node_share``
  "keep": once for all epochs, so a node reads the same share every epoch and
  a node-local cache that holds about 1/nodes of the archive downloads it
  once; "redeal": anew each epoch) and the samples, taken shard by shard in
  that order, are cut into ``nodes`` consecutive spans of equal size (give or
  take one). At most nodes - 1 shards are split between two nodes. Each epoch
  orders a node's span on its own (global: a permutation of the span; window:
  its pieces of shards permuted, shuffled within windows of ``window_shards``),
  evens it to the same size on every node (repeating its own first samples,
  or others' when it has none because N < nodes; or trimming its tail with
  drop_last: each rank still gets ceil(N / world), or floor), and deals it to the node's local ranks as below, with local rank and
  ranks per node for rank and world. Ranks are numbered node by node (rank =
  node * ranks_per_node + local rank), as torchrun numbers them.

Distribution (``torch.utils.data.DistributedSampler`` semantics)
  drop_last=False: the epoch is padded by repeating its first samples until
  it divides evenly, so each rank gets ceil(N / world) samples (at most
  world - 1 samples are seen twice). drop_last=True: its tail is dropped, so
  each rank gets floor(N / world) and the last incomplete batch is dropped
  too. Rank r takes every world-th sample starting at r. Every rank has the
  same number of batches.
  even_shares=False (like Lightning's UnrepeatedDistributedSampler): nothing
  is repeated or dropped; rank r takes every world-th sample starting at r
  (every world-th batch with bucketing or groups), so ranks may have
  different numbers of samples and batches. For evaluation: a DDP step with a
  collective per batch would wait forever on the rank with fewer batches.

Bucketing (``bucket_lengths``)
  The shuffled epoch is cut into windows of ``bucket_window`` batches per
  rank; each window is sorted by length and cut into batches; the batches of
  the whole epoch are then shuffled and dealt out to ranks in turn (padded by
  repeating batches, or trimmed with drop_last, so counts stay equal).

Budgets (``OrderSpec.budget``; runtime.order.budget)
  Batches hold as many samples as fit a budget of frames, cut within length
  buckets and dealt a step (one batch per rank, one bucket) at a time; where
  shards are dealt to nodes, every node takes as many steps of each bucket
  (``steps_target``), in one sequence of buckets, so every rank has as many
  batches and the whole world reads one bucket a step.

Selections and mixtures (runtime.archive.selection, runtime.order.mixture)
  A draw (``Draw``) gives an epoch's samples as archive sample numbers, in
  epoch order, and optionally the group (mixture source) of each. A selection
  draws ``selection[share_order(...)]``: the orders above over positions in
  the selection. With groups, batches are cut within each group (each batch
  from one group), then shuffled and dealt out to ranks as with bucketing.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar, overload

import numpy as np

from ..errors import UsageError, check_int
from . import partial
from .budget import BUCKET_STREAM, Budget, Evening, Steps, arrange, budget_steps


@dataclass(frozen=True)
class OrderSpec:
    num_samples: int
    batch_size: int
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = False
    rank: int = 0
    world_size: int = 1
    mode: str = "global"  # global | window
    shard_sizes: tuple[int, ...] = ()
    window_shards: int = 8
    bucket_window: int = 64
    even_shares: bool = True  # False: no sample repeated or dropped, shares may differ
    nodes: int = 1  # nodes the world spans, world_size // nodes ranks each
    node_share: str = "keep"  # keep | redeal: a node's shards, fixed or dealt anew each epoch
    # batches by a budget of frames (runtime.order.budget), batch_size capping the count
    budget: Budget | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in 0..world_size-1 ({self.world_size})")
        if self.mode not in ("global", "window"):
            raise ValueError(f"order {self.mode!r} must be global or window")
        if not self.even_shares and self.drop_last:
            raise ValueError("even_shares=False reads every sample once: it takes no drop_last")
        if self.nodes < 1 or self.world_size % self.nodes:
            raise ValueError(
                f"world_size {self.world_size} is not a whole number of nodes ({self.nodes}): "
                "every node runs the same number of ranks"
            )
        if self.node_share not in NODE_SHARES:
            raise ValueError(f"node_share {self.node_share!r} must be one of {NODE_SHARES}")
        if self.shard_sizes and (
            min(self.shard_sizes) < 0 or sum(self.shard_sizes) != self.num_samples
        ):
            raise ValueError(
                f"shard_sizes must be counts that sum to num_samples ({self.num_samples}), "
                f"got {len(self.shard_sizes)} summing to {sum(self.shard_sizes)}"
            )

    @property
    def local_size(self) -> int:
        """Ranks per node."""
        return self.world_size // self.nodes

    def shards_in_flight(self, batches_held: int, bucketing: bool, local_ranks: int) -> int:
        """At most how many distinct shards the ``local_ranks`` ranks of one node hold at
        once, in any epoch, while each holds ``batches_held`` consecutive batches (the
        one being made, those asked for ahead, those made and not yet taken), the ranks
        taking their steps together (as DDP's collectives keep them).

        In global order each sample of those batches may lie in another shard. In window
        order the node's ranks take turns at the samples of the same windows of
        ``window_shards`` shards: the held batches read a run of ``batches_held *
        batch_size * local_ranks`` consecutive samples of the node's epoch, which reads
        two windows in part and whole ones between, at most as many as the smallest
        windows (the smallest shards, whatever shards an epoch puts together) fit in
        it. With bucketing the epoch's batches are shuffled after they are cut, so each
        held batch counts the windows of its own bucket window's run."""
        sizes = sorted(n for n in self.shard_sizes if n > 0)
        if not sizes:
            return 0
        # a node reads its share of the shards (dealt to nodes: at most one shard split)
        node_shards = min(len(sizes), -(-len(sizes) // self.nodes) + (self.nodes > 1))
        if self.mode == "global":
            return min(node_shards, local_ranks * batches_held * self.batch_size)
        w = self.window_shards
        # samples in the k smallest windows conceivable, k = 1, 2, ...
        smallest_windows = np.cumsum(sizes)[w - 1 :: w]

        def windows(run: int) -> int:
            whole = int(np.searchsorted(smallest_windows, run - 2, side="right"))
            return whole + 2

        if bucketing:
            run = self.bucket_window * self.batch_size * local_ranks
            if self.budget is not None:  # a batch lies within one run of the order
                most = self.budget.run_samples(self.bucket_window, local_ranks)
                run = sum(sizes) if most is None else most
            count = batches_held * windows(run)
        else:
            count = windows(batches_held * self.batch_size * local_ranks)
        return min(node_shards, count * w)

    @property
    def node(self) -> int:
        return self.rank // self.local_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_size

    @property
    def dealt(self) -> bool:
        """Whether shards are dealt to nodes (several nodes, the shards known)."""
        return self.nodes > 1 and bool(self.shard_sizes)


NODE_SHARES = ("keep", "redeal")
NODE_DEAL_STREAM = 3  # the random stream that deals shards to nodes
NODE_STREAM = 1 << 20  # node j's order within its span: stream NODE_STREAM + j
MAX_EPOCH = 2**63 - 1  # an epoch number is an int64 (IterableArchive shares it with workers)


def check_epoch(name: str, epoch: object) -> int:
    """``epoch`` as an int in 0..MAX_EPOCH, or a Usage(Type)Error naming ``name``."""
    n = check_int(name, epoch, low=0)
    if n > MAX_EPOCH:
        raise UsageError(f"{name} must be at most {MAX_EPOCH} (an int64), got {n}")
    return n


# An epoch -> its samples (archive sample numbers, in epoch order) and the group of each (or None).
Draw = Callable[[int], tuple[np.ndarray, np.ndarray | None]]


def rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    """The generator of one random stream of an epoch (0: sample order, 1: batch order,
    2 and up: other stages' streams)."""
    return np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, epoch, stream])


@overload
def read_only(array: np.ndarray) -> np.ndarray: ...
@overload
def read_only(array: np.ndarray | None) -> np.ndarray | None: ...


def read_only(array: np.ndarray | None) -> np.ndarray | None:
    """A view of ``array`` that refuses writes: what an order keeps for later batches and
    epochs is shared by every batch cut from it, and a write would change them all."""
    if array is None:
        return None
    view = array.view()
    view.flags.writeable = False
    return view


def epoch_order(spec: OrderSpec, epoch: int) -> np.ndarray:
    """The whole epoch's sample order (before distribution)."""
    n = spec.num_samples
    if not spec.shuffle:
        return np.arange(n, dtype=np.int64)
    gen = rng(spec.seed, epoch, 0)
    if spec.mode == "global" or not spec.shard_sizes:
        return gen.permutation(n).astype(np.int64, copy=False)
    starts = np.concatenate([[0], np.cumsum(spec.shard_sizes)]).astype(np.int64)
    return _windowed(gen, list(itertools.pairwise(starts.tolist())), spec.window_shards)


def _windowed(gen: np.random.Generator, ranges: list[tuple[int, int]], window: int) -> np.ndarray:
    """The window order of ``ranges`` of sample numbers (shards, or pieces of them): the
    ranges permuted, then their samples shuffled within consecutive windows of
    ``window`` ranges."""
    return _windowed_parts(gen, [np.arange(a, b) for a, b in ranges], window)


def _windowed_parts(
    gen: np.random.Generator, parts: list[np.ndarray], window: int, head: int | None = None
) -> np.ndarray:
    """``_windowed`` of the samples of each part (a shard's, or some of them); with
    ``head``, only the samples of its first ``head`` places (``_ordered``): the windows
    up to the one that holds place ``head``, that one shuffled only as far as it must be."""
    mixed = [parts[i] for i in gen.permutation(len(parts))]
    out, at = [], 0
    for w in range(0, len(mixed), window):
        if head is not None and at >= head:
            break
        samples = np.concatenate(mixed[w : w + window])
        if head is None or at + len(samples) <= head:
            gen.shuffle(samples)  # as gen.permutation, in the copy concatenate made
            out.append(samples)
        else:
            out.append(partial.head(gen, samples.astype(np.int64, copy=False), head - at))
        at += len(samples)
    return np.concatenate(out).astype(np.int64, copy=False) if out else np.zeros(0, np.int64)


def _ordered(
    spec: OrderSpec, gen: np.random.Generator, parts: list[np.ndarray], head: int | None = None
) -> np.ndarray:
    """A node's ``parts`` (pieces of shards, in the deal's order; fresh arrays, reordered
    here) in ``spec``'s order. With ``head``, only the samples of its first ``head``
    places, in no set order, made by settling those places alone: a global order
    shuffled from its end down to place ``head`` (runtime.order.partial), a window
    order up to the window that holds it."""
    if not spec.shuffle or not parts:
        order = np.concatenate(parts or [np.zeros(0, np.int64)])
        return order if head is None else order[:head]
    if spec.mode == "window":
        return _windowed_parts(gen, parts, spec.window_shards, head)
    order = parts[0] if len(parts) == 1 else np.concatenate(parts)
    if head is not None:
        return partial.head(gen, order.astype(np.int64, copy=False), head)
    gen.shuffle(order)  # as gen.permutation, in place: the parts are the caller's copies
    return order


def share_order(spec: OrderSpec, epoch: int) -> np.ndarray:
    """What this rank's node shares out for the epoch: its span, ordered and evened
    (``node_order``) where shards are dealt to nodes; otherwise the whole epoch."""
    return node_order(spec, epoch) if spec.dealt else epoch_order(spec, epoch)


def node_span(spec: OrderSpec, epoch: int, node: int | None = None) -> list[tuple[int, int]]:
    """The samples dealt to ``node`` (default: this rank's) for ``epoch``: (start, stop)
    ranges of sample numbers, one per shard or piece of a shard, in the deal's order."""
    return Spans(spec, epoch).of(spec.node if node is None else node)


class Spans:
    """The shards' deal of an epoch (``node_span``), made once for every node's span."""

    def __init__(self, spec: OrderSpec, epoch: int) -> None:
        self.nodes = spec.nodes
        self.sizes = np.asarray(spec.shard_sizes, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.shards = dealt_shards(spec, epoch)
        self.ends = np.cumsum(self.sizes[self.shards])  # where each ends in the sequence

    def of(self, node: int) -> list[tuple[int, int]]:
        """Node ``node``'s span: its (start, stop) ranges of sample numbers."""
        n, shards, ends = int(self.starts[-1]), self.shards, self.ends
        lo, hi = n * node // self.nodes, n * (node + 1) // self.nodes
        first = int(np.searchsorted(ends, lo, side="right"))
        span = []
        for i in range(first, len(shards)):
            begin = int(ends[i] - self.sizes[shards[i]])
            if begin >= hi:
                break
            a, b = max(lo, begin), min(hi, int(ends[i]))
            if a < b:
                k = int(shards[i])
                span.append((int(self.starts[k]) + a - begin, int(self.starts[k]) + b - begin))
        return span

    def pieces(self, node: int) -> list[np.ndarray]:
        """Node ``node``'s span, one array of sample numbers per piece."""
        return [np.arange(a, b, dtype=np.int64) for a, b in self.of(node)]


def dealt_shards(spec: OrderSpec, epoch: int) -> np.ndarray:
    """The order the shards are dealt to nodes in for ``epoch`` (the same in every world:
    it depends on the seed, the epoch with ``node_share="redeal"``, and the shards)."""
    if not spec.shuffle:
        return np.arange(len(spec.shard_sizes))
    dealing = 0 if spec.node_share == "keep" else epoch
    return rng(spec.seed, dealing, NODE_DEAL_STREAM).permutation(len(spec.shard_sizes))


def node_order(spec: OrderSpec, epoch: int) -> np.ndarray:
    """This rank's node's samples for the epoch, in order: its span (``node_span``)
    ordered, then evened to ranks-per-node times each rank's share (see the module
    docstring), unless ``even_shares`` is False."""
    parts = Spans(spec, epoch).pieces(spec.node)
    # a node with no samples of its own (N < nodes) repeats others'
    return _node_share(spec, epoch, spec.node, parts, np.arange(spec.num_samples, dtype=np.int64))


def _node_share(
    spec: OrderSpec, epoch: int, node: int, parts: list[np.ndarray], every: np.ndarray
) -> np.ndarray:
    """Node ``node``'s ``parts`` (pieces of shards, in the deal's order) ordered, and
    evened to its ranks' share of ``every`` sample of the epoch (repeating ``every``
    where the node holds none)."""
    gen = rng(spec.seed, epoch, NODE_STREAM + node)
    order = _ordered(spec, gen, parts).astype(np.int64, copy=False)
    if not spec.even_shares:
        return order
    if spec.budget is not None:  # evened by steps, not samples (runtime.order.budget)
        return order if len(order) else every
    return _fit(order if len(order) else every, _evened_size(spec, len(every)))


def _evened_size(spec: OrderSpec, n: int) -> int:
    """A node's evened share of an epoch of ``n`` samples: ranks per node times each
    rank's ceil(n / world), or floor with drop_last."""
    each = n // spec.world_size if spec.drop_last else -(-n // spec.world_size)
    return spec.local_size * each


def node_rest(
    spec: OrderSpec,
    epoch: int,
    node: int,
    rest: np.ndarray,
    shares: tuple[np.ndarray, np.ndarray, list[np.ndarray]] | None = None,
) -> np.ndarray:
    """``node_order`` of what is left of an epoch, ``rest`` (positions, ascending): node
    ``node``'s share of it (``node_shares``, given or made here without a world before)
    ordered as ``node_order`` orders a span, in pieces of shards, and evened to its
    ranks' share. Given every position it is ``node_order``."""
    seq, ends, mine = node_shares(spec, epoch, rest) if shares is None else shares
    return _node_share(spec, epoch, node, pieces(spec, seq, ends, mine[node]), rest)


def node_taken(
    spec: OrderSpec, epoch: int, node: int, parts: list[np.ndarray], rest: np.ndarray, count: int
) -> np.ndarray:
    """The samples of ``_node_share(spec, epoch, node, parts, rest)[:count]`` (``parts``: the
    node's share of ``rest`` in pieces, ``pieces``; the caller's, reordered here), in no
    set order (and without the repeats of evening, but for a node holding none or a
    budget's order): what node ``node``'s ranks read first, with only as much of the
    node's order made as settles those places (``_ordered``)."""
    if not parts or spec.budget is not None:
        return _node_share(spec, epoch, node, parts, rest)[:count]
    if spec.even_shares:  # evening repeats the order's first samples, or trims its tail
        count = min(count, _evened_size(spec, len(rest)))
    head = min(count, sum(len(p) for p in parts))
    return _ordered(spec, rng(spec.seed, epoch, NODE_STREAM + node), parts, head)


def pieces(
    spec: OrderSpec, seq: np.ndarray, ends: np.ndarray, picked: np.ndarray
) -> list[np.ndarray]:
    """The samples ``seq[picked]`` (picked ascending; ``ends``: where each shard's run ends
    in ``seq``) in pieces of shards, as a node's order takes them: one piece where the
    order mixes them all (global, or not shuffled); fresh arrays the caller may reorder."""
    if not len(picked):
        return []
    if not spec.shuffle or spec.mode == "global":
        return [seq[picked]]  # ordered whole: the pieces need not be found
    # a piece ends where the picked indices skip or a shard's run ends
    skips = np.flatnonzero(np.diff(picked) != 1) + 1
    runs = np.searchsorted(picked, ends[:-1])
    cuts = np.union1d(skips, runs[(runs > 0) & (runs < len(picked))])
    return np.split(seq[picked], cuts)


def node_shares(
    spec: OrderSpec, epoch: int, rest: np.ndarray, before: OrderSpec | None = None
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """How the positions ``rest`` (ascending) of ``epoch`` are shared out to the nodes:
    ``rest`` in the sequence the shards are dealt in (``node_span``'s, each shard's
    ascending), where each shard's run ends in it, and each node's share as ascending
    indices into that sequence, equal in size (to one sample). Without ``before``, the
    sequence is cut into consecutive spans, as ``node_span`` cuts a whole epoch. With
    ``before`` (the world that read the epoch until now, its shards dealt to nodes), node
    ``j`` first takes what is left of the shards node ``j`` of that world was dealt (its
    cache holds them), up to its share; the rest fills the shares in the deal's order."""
    deal = _Deal(spec, epoch, rest)
    seq, ends = deal.sequence()
    n, nodes = len(seq), spec.nodes
    bounds = [n * j // nodes for j in range(nodes + 1)]
    if before is None or not before.dealt:
        return seq, ends, [np.arange(bounds[j], bounds[j + 1]) for j in range(nodes)]
    # Every world deals the shards in one sequence (it depends on the seed and epoch
    # only), so node j of the world before held one span of it: the indices of seq
    # from held[j] to held[j + 1].
    total = spec.num_samples
    held = [deal.index(total * j // before.nodes) for j in range(before.nodes + 1)]
    # (start, stop) of seq each node keeps of its own span, up to its share; ascending
    own = [
        (held[j], min(held[j + 1], held[j] + bounds[j + 1] - bounds[j]))
        for j in range(min(before.nodes, nodes))
    ]
    ranges = [[r] for r in own] + [[] for _ in range(len(own), nodes)]
    # the rest, in the deal's order, fills each node's share up to its size
    gaps, at = [], 0
    for a, b in [*own, (n, n)]:
        if at < a:
            gaps.append((at, a))
        at = max(at, b)
    need = [bounds[j + 1] - bounds[j] - sum(b - a for a, b in ranges[j]) for j in range(nodes)]
    j = 0
    for a, b in gaps:
        while a < b:
            while not need[j]:
                j += 1
            step = min(need[j], b - a)
            ranges[j].append((a, a + step))
            need[j] -= step
            a += step
    mine = [
        np.concatenate([np.arange(a, b) for a, b in sorted(r)] or [np.zeros(0, np.int64)])
        for r in ranges
    ]
    return seq, ends, mine


class _Deal(Spans):
    """The positions ``rest`` (ascending) of an epoch in the sequence the shards are dealt
    to nodes in (``node_span``'s), each shard's ascending."""

    def __init__(self, spec: OrderSpec, epoch: int, rest: np.ndarray) -> None:
        super().__init__(spec, epoch)
        self.rest = rest
        self.first = np.searchsorted(rest, self.starts[:-1])
        self.last = np.searchsorted(rest, self.starts[1:])
        self.run_ends = np.cumsum((self.last - self.first)[self.shards])  # ends, in rest's

    def sequence(self) -> tuple[np.ndarray, np.ndarray]:
        """``rest`` in the deal's sequence, and where each shard's run ends in it."""
        runs = [self.rest[self.first[k] : self.last[k]] for k in self.shards]
        seq = np.concatenate(runs) if runs else np.zeros(0, np.int64)
        return seq, self.run_ends

    def index(self, at: int) -> int:
        """How many of ``rest`` come before index ``at`` of the whole epoch's sequence."""
        i = int(np.searchsorted(self.ends, at, side="right"))
        if i == len(self.shards):
            return int(self.run_ends[-1]) if len(self.run_ends) else 0
        k = int(self.shards[i])
        within = at - int(self.ends[i]) + int(self.sizes[k])
        below = int(np.searchsorted(self.rest, self.starts[k] + within)) - int(self.first[k])
        return int(self.run_ends[i]) - int(self.last[k] - self.first[k]) + below


def _fit(seq: np.ndarray, size: int) -> np.ndarray:
    """``seq`` trimmed to ``size``, or padded to it by repeating it from the start."""
    if len(seq) >= size or len(seq) == 0:
        return seq[:size]
    return np.resize(seq, size)


def _even(seq: np.ndarray, world: int, drop_last: bool, even: bool = True) -> np.ndarray:
    """Pads (repeating from the start) or trims seq so that world divides its length
    (``even=False``: seq as it is)."""
    n = len(seq)
    if not even:
        return seq
    return _fit(seq, n - n % world if drop_last else math.ceil(n / world) * world)


def rank_batches(
    spec: OrderSpec,
    epoch: int,
    bucket_lengths: np.ndarray | None = None,
    samples: np.ndarray | None = None,
    groups: np.ndarray | None = None,
    target: Evening | None = None,
) -> list[np.ndarray]:
    """This rank's batches for the epoch, each sorted ascending (for locality of reads).

    ``samples``: the epoch's samples in order (default ``share_order``);
    ``groups``: the group of each, batches cut within groups;
    ``bucket_lengths``: indexed by sample number;
    ``target``: budget batches' steps per node (``steps_target``).
    """
    rank = spec.local_rank if spec.dealt else spec.rank
    return world_batches(spec, epoch, (rank,), bucket_lengths, samples, groups, target)[0]


def world_batches(
    spec: OrderSpec,
    epoch: int,
    ranks: Sequence[int],
    bucket_lengths: np.ndarray | None = None,
    samples: np.ndarray | None = None,
    groups: np.ndarray | None = None,
    target: Evening | None = None,
) -> list[list[np.ndarray]]:
    """``rank_batches`` of each of ``ranks`` (of the node's ranks where shards are dealt to
    nodes), the epoch's order and cuts made once for all of them."""
    evened, batches = _dealing(spec, epoch, bucket_lengths, samples, groups, target)
    world, b = _dealt_world(spec), spec.batch_size
    if batches is not None:
        return [[np.sort(batches[i]) for i in evened[rank::world]] for rank in ranks]
    out = []
    for rank in ranks:
        mine = evened[rank::world]
        cut = [mine[i : i + b] for i in range(0, len(mine), b)]
        if spec.drop_last and cut and len(cut[-1]) < b:
            cut.pop()
        out.append([np.sort(x) for x in cut])
    return out


def world_taken(
    spec: OrderSpec,
    epoch: int,
    done: int,
    bucket_lengths: np.ndarray | None = None,
    samples: np.ndarray | None = None,
    groups: np.ndarray | None = None,
    target: Evening | None = None,
) -> np.ndarray:
    """The samples of every rank's first ``done`` batches (``world_batches``), found
    without cutting the batches: rank ``r`` takes the dealt positions ``r, r + world,
    ...``, so the first ``done`` batches of all ranks are the dealing's first positions."""
    evened, batches = _dealing(spec, epoch, bucket_lengths, samples, groups, target)
    world = _dealt_world(spec)
    if batches is None:
        return evened[: done * spec.batch_size * world]
    picked = [batches[i] for i in evened[: done * world]]
    return np.concatenate(picked) if picked else np.zeros(0, np.int64)


def _dealt_world(spec: OrderSpec) -> int:
    # with shards dealt to nodes, the order is the node's, evened: its ranks share it out
    return spec.local_size if spec.dealt else spec.world_size


def _dealing(
    spec: OrderSpec,
    epoch: int,
    bucket_lengths: np.ndarray | None,
    samples: np.ndarray | None,
    groups: np.ndarray | None,
    target: Evening | None = None,
) -> tuple[np.ndarray, list[np.ndarray] | None]:
    """How the epoch is dealt to ranks: (the evened order, None), its position ``p`` going
    to rank ``p % world``; or, where batches are cut before they are dealt (bucketing,
    groups, a budget), (the evened batch numbers, the batches), number ``p`` to rank
    ``p % world``."""
    order = share_order(spec, epoch) if samples is None else samples
    b = spec.batch_size
    world = _dealt_world(spec)
    if spec.budget is not None:
        by_bucket, tail = _budget_steps(spec, epoch, order, bucket_lengths, groups)
        sequence = rng(spec.seed, epoch, BUCKET_STREAM) if spec.shuffle else None
        steps = arrange(by_bucket, world, target, sequence)
        batches = [x for step in steps for x in step] + tail
        return np.arange(len(batches)), batches
    if bucket_lengths is None and groups is None:
        return _even(order, world, spec.drop_last, spec.even_shares), None
    window = b * spec.bucket_window * world
    parts = [order] if groups is None else [order[groups == g] for g in np.unique(groups)]
    batches = []
    for part in parts:
        step = window if bucket_lengths is not None else max(len(part), 1)
        for start in range(0, len(part), step):
            chunk = part[start : start + step]
            if bucket_lengths is not None:
                chunk = chunk[np.argsort(bucket_lengths[chunk], kind="stable")]
            batches += [chunk[i : i + b] for i in range(0, len(chunk), b)]
    if spec.drop_last:
        batches = [x for x in batches if len(x) == b]
    if spec.shuffle:
        perm = rng(spec.seed, epoch, 1).permutation(len(batches))
        batches = [batches[i] for i in perm]
    return _even(np.arange(len(batches)), world, spec.drop_last, spec.even_shares), batches


def _budget_steps(
    spec: OrderSpec,
    epoch: int,
    order: np.ndarray,
    lengths: np.ndarray | None,
    groups: np.ndarray | None,
) -> tuple[Steps, list[np.ndarray]]:
    """runtime.order.budget.budget_steps of ``order`` under ``spec``'s budget."""
    assert spec.budget is not None and lengths is not None, "a budget needs lengths"
    return budget_steps(
        order,
        lengths,
        groups,
        spec.budget,
        spec.batch_size,
        _dealt_world(spec),
        spec.bucket_window,
        spec.even_shares,
        spec.drop_last,
        rng(spec.seed, epoch, 1) if spec.shuffle else None,
    )


def steps_target(
    spec: OrderSpec,
    epoch: int,
    orders: Sequence[tuple[OrderSpec, np.ndarray]],
    size: int,
    lengths: np.ndarray | None,
    groups: np.ndarray | None = None,
) -> Evening | None:
    """Budget batches with shards dealt to nodes: the steps of each bucket every node
    makes (``Evening``), the most any node's own order of ``orders`` (every node's first
    rank and order, ``size`` positions in all) makes there, or the fewest with
    drop_last; None where nodes are not evened so. ``groups``: by position."""
    if spec.budget is None or not spec.dealt or not spec.even_shares:
        return None
    made = [
        _budget_steps(head, epoch, order, lengths, None if groups is None else groups[order])[0]
        for head, order in orders
    ]
    # a node with no samples of its own reads every position (``_node_share``)
    own = [m for (_, order), m in zip(orders, made, strict=True) if len(order) < size] or made
    keys = sorted({k for m in own for k, steps in m.items() if steps})
    pick = min if spec.drop_last else max
    counts = {k: pick(len(m.get(k, [])) for m in own) for k in keys}
    spare = {}
    for k in keys:
        if counts[k] and any(not m.get(k) for m in made):
            spare[k] = next(m[k] for m in own if m.get(k))
    return Evening(counts, spare)


@dataclass(frozen=True)
class Shape:
    """A world an epoch was partly read in before this one: its ranks, nodes and per-rank
    batch size, and the batches each of its ranks had taken (they step together)."""

    world_size: int
    nodes: int
    batch_size: int
    batches_done: int

    def spec(self, like: OrderSpec) -> OrderSpec:
        """``like`` (this world's order settings) in that world, as its rank 0."""
        return replace(
            like, world_size=self.world_size, nodes=self.nodes, batch_size=self.batch_size, rank=0
        )

    def as_list(self) -> list[int]:
        return [self.world_size, self.nodes, self.batch_size, self.batches_done]


MAX_SHAPES = 16  # earlier worlds one epoch may have been read in (a state holds each)
# Positions left of an epoch from which the nodes' orders are made on threads at once
# (world_orders): below it, starting threads costs more than it saves.
PARALLEL_ORDER_SAMPLES = 1 << 16
MAX_WORLD = 1 << 20  # ranks a state's world may name
MAX_NODES = 1 << 12  # nodes a state's world may name (each costs a share to compute)
MAX_BATCH = 1 << 31  # a per-rank batch size a state may name


@dataclass(frozen=True)
class Content:
    """What an epoch holds, by position: its ``size``, each position's group (a mixture's
    source, with batch_per_source) and bucketing length, and its ``order`` of the
    positions where shards are not dealt to nodes (``epoch_order``, which no world
    setting changes; None for a mixture's draw, whose positions are in order already)."""

    size: int
    groups: np.ndarray | None = None
    lengths: np.ndarray | None = None
    order: Callable[[], np.ndarray] | None = None  # computed when first asked, then kept


def left_after(
    spec: OrderSpec,
    epoch: int,
    shape: Shape,
    before: Shape | None,
    rest: np.ndarray,
    content: Content,
) -> np.ndarray:
    """The positions ``rest`` (ascending) of ``epoch`` less every rank's first
    ``batches_done`` batches of world ``shape`` reading them (``before``: the world that
    read the epoch until that one, if any); ascending."""
    world = shape.spec(spec)
    earlier = None if before is None else before.spec(spec)
    plain = content.lengths is None and content.groups is None and world.budget is None
    if plain and world.dealt and content.order is not None:  # not a mixture's draw
        # each node's ranks read the first places of its order: only those are made
        count = shape.batches_done * world.batch_size * world.local_size
        parts_of: Callable[[int], list[np.ndarray]]
        if earlier is None and len(rest) == content.size:  # the first world: node_order's
            parts_of = Spans(world, epoch).pieces  # the deal made once, for every node
        else:
            seq, ends, mine = node_shares(world, epoch, rest, earlier)
            parts_of = lambda node: pieces(world, seq, ends, mine[node])  # noqa: E731
        taken = _by_node(
            lambda node: node_taken(world, epoch, node, parts_of(node), rest, count),
            range(world.nodes),
            len(rest),
        )
    else:
        orders = world_orders(world, epoch, rest, content, None, earlier)
        target = steps_target(world, epoch, orders, len(rest), content.lengths, content.groups)
        taken = [
            world_taken(
                head,
                epoch,
                shape.batches_done,
                content.lengths,
                order,
                None if content.groups is None else content.groups[order],
                target,
            )
            for head, order in orders
        ]
    kept = np.ones(content.size, dtype=bool)
    kept[np.concatenate(taken)] = False
    if len(rest) == content.size:  # every position (the first world): no lookup of rest
        return np.flatnonzero(kept)
    left: np.ndarray = rest[kept[rest]]
    return left


def world_orders(
    spec: OrderSpec,
    epoch: int,
    rest: np.ndarray,
    content: Content,
    nodes: Sequence[int] | None = None,
    before: OrderSpec | None = None,
) -> list[tuple[OrderSpec, np.ndarray]]:
    """How world ``spec`` orders the positions ``rest`` (ascending) of ``epoch``: for each
    node whose ranks share an order (of ``nodes``, default all), its first rank's spec and
    that order. A mixture's draw is in order already (its sources are local: no shards
    dealt to nodes). Without shards dealt to nodes, one order for the whole world: the
    epoch's (``content.order``), less what is not in ``rest``. Dealt to nodes, each node's
    share of the rest (``node_rest``), favouring the shards the same node of the world
    ``before`` was dealt (``node_shares``)."""
    if content.order is None:
        return [(replace(spec, rank=0), rest)]
    if not spec.dealt:
        order = content.order()
        if len(rest) < content.size:
            kept = np.zeros(content.size, dtype=bool)
            kept[rest] = True
            order = order[kept[order]]
        return [(replace(spec, rank=0), order)]
    shares = node_shares(spec, epoch, rest, before)
    wanted = list(range(spec.nodes) if nodes is None else nodes)

    def ordered(node: int) -> tuple[OrderSpec, np.ndarray]:
        return replace(spec, rank=node * spec.local_size), node_rest(
            spec, epoch, node, rest, shares
        )

    return _by_node(ordered, wanted, len(rest))


T = TypeVar("T")


def _by_node(make: Callable[[int], T], nodes: Sequence[int], samples: int) -> list[T]:
    """``make(node)`` for each of ``nodes``, side by side on threads where the ``samples``
    they order are many: each node's order is its own shuffle, which numpy (and
    runtime.order.partial) makes without the GIL."""
    if len(nodes) < 2 or samples < PARALLEL_ORDER_SAMPLES:
        return [make(node) for node in nodes]
    with ThreadPoolExecutor(min(len(nodes), os.cpu_count() or 1)) as pool:
        return list(pool.map(make, nodes))


class BatchOrder:
    """The order stage: this consumer's batches, epoch by epoch, and how many of the
    current epoch were handed out.

    State: ``{"epoch", "batches_done"}``; with the spec (seed, sizes, rank,
    world size, bucketing, window) that is all it takes to continue exactly.
    ``reset(state)`` makes the next iteration start after ``batches_done``
    (``set_epoch`` of the same epoch keeps that). An iteration begun without a
    ``set_epoch`` since the previous one runs the next epoch.
    """

    def __init__(
        self,
        spec: OrderSpec,
        lengths: np.ndarray | None = None,
        owner: str = "Loader",
        draw: Draw | None = None,
        selection: np.ndarray | None = None,
        redraw: Callable[[int, int], Draw] | None = None,
    ) -> None:
        self.owner = owner  # who errors name
        self.spec = spec
        self.selection = selection  # the archive's samples the epoch's positions are
        self.lengths = lengths
        self.draw = draw  # None: the whole archive (or selection), in epoch_order
        # (world_size, batch_size) -> the draw a world of that shape makes (a mixture's
        # epoch is sized for its world): an epoch continued from another world reads the
        # rest of the draw it began with
        self.redraw = redraw
        self.epoch = 0
        self.batches_done = 0
        self._resume = False
        # Whether this epoch has handed out a batch (in this pass, or before the state a
        # reset resumes from): the next iteration then moves to the next epoch. An
        # iteration that yields nothing (an iter() only to check the loader) uses none up.
        self._took = False
        # Earlier worlds epoch ``shapes_epoch`` was partly read in: this world reads the
        # rest of it (``left_after``). Other epochs are read whole.
        self.shapes: tuple[Shape, ...] = ()
        self.shapes_epoch = -1
        self._cached: dict[tuple[int, tuple[Shape, ...]], list[np.ndarray]] = {}
        self._rests: tuple[int, dict[tuple[Shape, ...], np.ndarray]] | None = None
        self._contents: tuple[tuple[int, int, int], Content, np.ndarray | None] | None = None
        # (epoch, spec): that epoch reads the archive as it was before an append (the
        # samples of its earlier generations, spec's), where a state saved then left it
        self.appended: tuple[int, OrderSpec] | None = None

    def spec_for(self, epoch: int) -> OrderSpec:
        """The spec ``epoch`` is read under: the archive before an append for the epoch a
        state saved then continues (``read_earlier``), else the whole archive's."""
        if self.appended is not None and self.appended[0] == epoch:
            return self.appended[1]
        return self.spec

    def read_earlier(self, epoch: int, spec: OrderSpec | None) -> None:
        """Epoch ``epoch`` reads the ``spec.num_samples`` samples the archive held before an
        append (its first shards), as a state saved then expects; later epochs read all.
        None: every epoch reads the whole archive."""
        appended = None if spec is None else (epoch, spec)
        if appended != self.appended:
            self.appended = appended
            self._cached.clear()
            self._rests = self._contents = None

    def batches(self, epoch: int | None = None) -> list[np.ndarray]:
        """The sample indices of each batch of ``epoch`` (default: the current one): the
        rest of it where it began in other worlds (``follow``)."""
        epoch = self.epoch if epoch is None else epoch
        return self._made(epoch, self.shapes if epoch == self.shapes_epoch else ())

    def whole_count(self, epoch: int | None = None) -> int:
        """Batches this rank reads in a whole ``epoch`` (default: the current one) in this
        world; an epoch continued from another world reads only the rest (``batches``)."""
        return len(self._made(self.epoch if epoch is None else epoch, ()))

    def _made(self, epoch: int, shapes: tuple[Shape, ...]) -> list[np.ndarray]:
        """This rank's batches of ``epoch`` after the worlds ``shapes`` read part of it;
        the latest two asked are kept (a continued epoch's, and its whole count's)."""
        key = (epoch, shapes)
        if key not in self._cached:
            spec = self.spec_for(epoch)
            budgeted = spec.budget is not None and spec.dealt  # every node's steps count
            if shapes:
                content, samples = self._content(epoch, shapes[0])
                node = spec.node if spec.dealt else 0
                rest = self._rest(epoch, shapes)
                before = shapes[-1].spec(spec)
                nodes = None if budgeted else (node,)
                orders = world_orders(spec, epoch, rest, content, nodes, before)
                target = steps_target(
                    spec, epoch, orders, len(rest), content.lengths, content.groups
                )
                mine = orders[node if budgeted else 0][1]
                groups = None if content.groups is None else content.groups[mine]
                picked = mine if samples is None else samples[mine]
                made = rank_batches(spec, epoch, self.lengths, picked, groups, target)
            elif self.draw is not None:
                made = rank_batches(spec, epoch, self.lengths, *self.draw(epoch))
            else:
                order = self._samples(share_order(spec, epoch))
                target = None
                if budgeted:
                    heads = [replace(spec, rank=j * spec.local_size) for j in range(spec.nodes)]
                    orders = [(h, self._samples(node_order(h, epoch))) for h in heads]
                    target = steps_target(spec, epoch, orders, spec.num_samples, self.lengths)
                made = rank_batches(spec, epoch, self.lengths, order, None, target)
            while len(self._cached) >= 2:
                del self._cached[next(iter(self._cached))]
            self._cached[key] = made
        return self._cached[key]

    def _samples(self, positions: np.ndarray) -> np.ndarray:
        """Positions of the epoch as archive sample numbers (through the selection)."""
        return positions if self.selection is None else self.selection[positions]

    def _content(self, epoch: int, first: Shape) -> tuple[Content, np.ndarray | None]:
        """What ``epoch`` holds when it began in world ``first`` (``Content``), and the
        archive sample of each position (None: position p is sample p); kept for the
        latest asked."""
        key = (epoch, first.world_size, first.batch_size) if self.draw else (epoch, 0, 0)
        if self._contents is None or self._contents[0] != key:
            groups, order, samples = None, None, self.selection
            if self.draw is not None:
                if self.redraw is None:
                    raise UsageError(f"{self.owner}: this draw continues only in its own world")
                samples, groups = self.redraw(first.world_size, first.batch_size)(epoch)
                size = len(samples)
            else:
                spec = self.spec_for(epoch)
                size = spec.num_samples
                if samples is not None:
                    samples = samples[:size]
                order = functools.cache(lambda: read_only(epoch_order(spec, epoch)))
            lengths = self.lengths
            if lengths is not None:
                lengths = lengths[:size] if samples is None else lengths[samples]
            content = Content(size, read_only(groups), read_only(lengths), order)
            self._contents = (key, content, read_only(samples))
        return self._contents[1], self._contents[2]

    def _rest(self, epoch: int, shapes: tuple[Shape, ...]) -> np.ndarray:
        """What is left of ``epoch`` after ``shapes`` (``left_after``), built a world at a time from what
        the worlds before it left (kept for this epoch's latest worlds)."""
        if self._rests is None or self._rests[0] != epoch:
            self._rests = (epoch, {})
        kept = self._rests[1]
        if shapes not in kept:
            content, _ = self._content(epoch, shapes[0])
            if len(shapes) > 1:
                rest, before = self._rest(epoch, shapes[:-1]), shapes[-2]
            else:
                rest, before = np.arange(content.size, dtype=np.int64), None
            spec = self.spec_for(epoch)
            kept[shapes] = read_only(left_after(spec, epoch, shapes[-1], before, rest, content))
        return kept[shapes]

    def hold(self) -> tuple[Any, ...]:
        """The position, for ``restore`` when a load is given up."""
        return (
            self.epoch,
            self.batches_done,
            self._resume,
            self._took,
            self.shapes_epoch,
            self.shapes,
            self.appended,
        )

    def restore(self, held: tuple[Any, ...]) -> None:
        self.epoch, self.batches_done, self._resume, self._took = held[:4]
        self.follow(held[4], held[5])
        if held[6] != self.appended:
            self._cached.clear()
            self._rests = self._contents = None
        self.appended = held[6]

    def follow(self, epoch: int, shapes: tuple[Shape, ...]) -> None:
        """Epoch ``epoch`` was partly read in the worlds ``shapes``: it reads the rest."""
        self.shapes, self.shapes_epoch = shapes, epoch

    def set_epoch(self, epoch: int) -> None:
        """Starts ``epoch`` at its beginning, except that a state just loaded by
        ``reset`` for this same epoch is kept: the usual loop loads a state once,
        then calls ``set_epoch(epoch)`` at the top of every epoch."""
        epoch = check_epoch(f"{self.owner}.set_epoch epoch", epoch)
        if self._resume and epoch == self.epoch:
            return
        self.epoch = epoch
        self.batches_done = 0
        self._resume = False
        self._took = False
        self.follow(-1, ())  # the whole epoch, in this world

    def begin(self) -> int:
        """Starts an iteration; returns its first batch number. The first iteration after
        ``set_epoch`` (or ``reset``) runs that epoch; a later one without a ``set_epoch``
        between runs the next epoch once this one has handed out a batch, as a DataLoader
        reshuffles every pass."""
        if self._resume:
            start = self.batches_done
        else:
            if self._took:
                self.epoch += 1
            start = 0
            self._took = False
        self._resume = False
        self.batches_done = start
        return start

    def handed_out(self, count: int) -> None:
        """``count`` batches of the current epoch have reached the consumer."""
        self.batches_done = count
        self._took = True

    def refuse_empty(self, where: str) -> None:
        """Refuses a batch size that, with drop_last, leaves this rank no batch at all."""
        if self.spec.drop_last and self.spec.num_samples and not self.batches(0):
            if self.spec.budget is not None:
                raise UsageError(
                    f"{where}: drop_last=True leaves no batch of the budget's in epoch 0: no "
                    f"length bucket holds a whole step of {_dealt_world(self.spec)} batch(es) "
                    "(one per rank); drop drop_last, or use fewer buckets or a smaller budget"
                )
            raise UsageError(
                f"{where}: batch_size={self.spec.batch_size} with drop_last=True leaves no "
                f"batch: each rank's share of the {self.spec.num_samples} samples is smaller; "
                "lower batch_size or drop drop_last"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batches_done": self.batches_done, **self.earlier()}

    def earlier(self, epoch: int | None = None) -> dict[str, Any]:
        """``{"earlier": [[world_size, nodes, batch_size, batches_done], ...]}``: the worlds
        ``epoch`` (default: the current one) was partly read in before this one; {} if none."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shapes or epoch != self.shapes_epoch:
            return {}
        return {"earlier": [shape.as_list() for shape in self.shapes]}

    def reset(self, state: dict[str, Any], where: str = "loader state") -> None:
        """Continues from ``state`` (checked: ``epoch`` at least 0, ``batches_done``
        within the epoch's batches, each earlier world a world). A state saved in another
        world (ranks, nodes or per-rank batch size) continues its epoch here: the samples
        that world handed out are left out, and the rest is read in this world."""
        epoch = check_epoch(f"{where} epoch", state.get("epoch"))
        shapes = self._earlier_shapes(state.get("earlier", []), epoch, where)
        world, nodes, batch = here = (self.spec.world_size, self.spec.nodes, self.spec.batch_size)
        # a state without its world (the order stage's own) is this world's; one saved
        # before nodes were recorded ran on one node
        saved = (
            state.get("world_size", world),
            state.get("nodes", 1 if "world_size" in state else nodes),
            state.get("batch_size", batch),
        )
        moved = saved != here
        if moved:
            world, nodes, batch = _checked_world(where, *saved)
        count = self._count(Shape(world, nodes, batch, 0), shapes, epoch)
        done = check_int(
            f"{where} batches_done (epoch {epoch} has {count} batches)",
            state.get("batches_done"),
            low=0,
            high=count,
        )
        if moved:
            if len(shapes) >= MAX_SHAPES:
                raise UsageError(
                    f"{where}: epoch {epoch} was read in {MAX_SHAPES + 1} worlds; finish it in "
                    f"this one before changing again, or start at set_epoch({epoch + 1})"
                )
            shapes, done = (*shapes, Shape(world, nodes, batch, done)), 0
        self.follow(epoch, shapes)
        self.epoch, self.batches_done, self._resume = epoch, done, True
        self._took = done > 0 or bool(shapes)

    def _count(self, shape: Shape, shapes: tuple[Shape, ...], epoch: int) -> int:
        """The most batches a rank of world ``shape`` has in ``epoch`` after ``shapes`` (its
        first rank's, or each node's first rank's)."""
        current = self.spec_for(epoch)
        if current.even_shares and shape.spec(current) == replace(current, rank=0):
            return len(self._made(epoch, shapes))
        content, _ = self._content(epoch, shapes[0] if shapes else shape)
        left = self._rest(epoch, shapes) if shapes else np.arange(content.size, dtype=np.int64)
        spec = shape.spec(current)
        if (
            content.lengths is None
            and content.groups is None
            and (spec.even_shares or not spec.dealt)
        ):
            # rank 0's share of the evened rest (each node's is evened alike), counted
            n, world, b = len(left), spec.world_size, spec.batch_size
            if spec.even_shares:
                n = n - n % world if spec.drop_last else -(-n // world) * world
            mine = -(-n // world)
            return mine // b if spec.drop_last else -(-mine // b)
        orders = world_orders(
            spec, epoch, left, content, None, shapes[-1].spec(current) if shapes else None
        )
        target = steps_target(spec, epoch, orders, len(left), content.lengths, content.groups)
        return max(
            len(world_batches(first, epoch, (0,), content.lengths, order, groups, target)[0])
            for first, order in orders
            for groups in [None if content.groups is None else content.groups[order]]
        )

    def _earlier_shapes(self, given: object, epoch: int, where: str) -> tuple[Shape, ...]:
        """A state's ``earlier`` worlds, each checked, its batches_done within its epoch."""
        if not isinstance(given, list) or len(given) > MAX_SHAPES:
            raise UsageError(
                f"{where} earlier must be a list of at most {MAX_SHAPES} worlds, got {given!r:.80}"
            )
        shapes: tuple[Shape, ...] = ()
        for i, item in enumerate(given):
            name = f"{where} earlier[{i}]"
            if not isinstance(item, list) or len(item) != 4:
                raise UsageError(
                    f"{name} must be [world_size, nodes, batch_size, batches_done], got {item!r:.80}"
                )
            world, nodes, batch = _checked_world(name, *item[:3])
            count = self._count(Shape(world, nodes, batch, 0), shapes, epoch)
            done = check_int(
                f"{name} batches_done (that world has {count} batches)", item[3], low=0, high=count
            )
            shapes = (*shapes, Shape(world, nodes, batch, done))
        return shapes


def _checked_world(where: str, world: object, nodes: object, batch: object) -> tuple[int, int, int]:
    """A state's (world_size, nodes, batch_size), each checked and named in errors."""
    w = check_int(f"{where} world_size", world, low=1, high=MAX_WORLD)
    n = check_int(f"{where} nodes", nodes, low=1, high=min(w, MAX_NODES))
    b = check_int(f"{where} batch_size", batch, low=1, high=MAX_BATCH)
    if w % n:
        raise UsageError(f"{where}: world_size {w} is not a whole number of nodes {n}")
    return w, n, b

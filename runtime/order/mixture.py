"""Mixtures: each epoch drawn from several sources in chosen proportions.

Sources are read as one archive (runtime.archive.concat), each source a contiguous
range of its sample numbers; a source's pool is the samples of its range
that the selection keeps. Each epoch takes ``counts[s]`` samples from source
``s``: its share of the epoch by weight (largest remainders, so the counts
add up exactly, the same every epoch).

Source ``s`` is read as an endless stream of passes over its pool, each pass
a permutation seeded by (seed, pass, s): without replacement until the pool
is used up, then the next pass, reshuffled. An epoch that crosses into a new
pass repeats no sample as long as the source holds at least its share of an
epoch (``pass_order``); a source of ``n`` drawn ``c > n`` times gives each
sample ``c // n`` or ``c // n + 1`` times (``stream_slice``: whole copies of
the pool and ``c % n`` items of a stream of that many an epoch). Epoch ``e``
takes the stream's items ``e * counts[s]`` to ``(e + 1) * counts[s]``, so an
epoch is a pure function of (seed, epoch): resuming needs no index lists.

The epoch's draws are then shuffled together (seed, epoch), or, unshuffled,
interleaved evenly by source. Its size is ``samples_per_epoch`` rounded so
that every rank gets the same number of samples (up to a multiple of the
world size, down with drop_last); with ``batch_per_source`` or ``bucket_by``,
to a multiple of ``batch_size`` times the world size, so that batches are
whole and every rank gets as many (``batch_per_source`` also rounds each
source's share to whole batches, by less than one batch per source; batches by a
budget of frames round to nothing: runtime.order.budget evens their steps). What
rounding up adds is drawn from the sources by weight: with the sources' sizes
as weights, an epoch of ``N`` rounded up to ``R`` repeats exactly ``R - N``
samples.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import UsageError, UsageTypeError
from .epochs import Draw, rng

SOURCE_STREAM = 1000  # random stream of source s's passes: SOURCE_STREAM + s
MIX_STREAM = 2  # random stream that shuffles an epoch's draws together
# An epoch's order is made whole at its start (about 24 bytes a sample), and a source
# smaller than its share is drawn pass by pass: samples_per_epoch and the passes a source
# makes in one epoch are bounded, so a mistyped size is refused instead of hanging.
MAX_EPOCH_SAMPLES = 1 << 28
MAX_PASSES_PER_EPOCH = 1 << 16


@dataclass(frozen=True)
class Source:
    """One source of a mixture with its settings beside it (as MosaicML Streaming's
    ``Stream``), the one place a source's settings are given: ``path`` is an archive, a
    list of archives read as one, or an open Archive; ``weight`` its share of each
    epoch (given for every source, or for none: then the sources' sizes); ``where`` a
    selection of its own samples.

    ``Loader({"ls": Source("ls.dlop", weight=0.7), "ps": Source("ps.dlop", weight=0.3,
    where={"split": "clean"})}, 32)`` draws 70% of each epoch from ls.dlop and 30%
    from the clean samples of ps.dlop; a bare path stands for ``Source(path)``."""

    path: Any
    weight: float | None = None
    where: Mapping[str, Any] | None = None


def source_weights(sources: Mapping[Any, Any], owner: str) -> dict[Any, float] | None:
    """The mixture's weights, the sources' own (Source.weight): given for every source,
    or for none (None: proportional to the sources' sizes)."""
    own = {
        n: s.weight for n, s in sources.items() if isinstance(s, Source) and s.weight is not None
    }
    if not own:
        return None
    lacking = [str(n) for n in sources if n not in own]
    if lacking:
        raise UsageError(
            f"{owner} mixture sources {lacking} have no weight while {sorted(map(str, own))} "
            "have one; give every source a weight (Source(path, weight=...)), or none"
        )
    return own


@dataclass(frozen=True)
class Mixture:
    names: tuple[str, ...]
    pools: tuple[np.ndarray, ...]  # each source's samples, ascending
    weights: tuple[float, ...]  # summing to 1
    samples_per_epoch: int  # as asked for
    counts: tuple[int, ...]  # samples drawn from each source per epoch
    batch_per_source: bool

    @property
    def epoch_size(self) -> int:
        return sum(self.counts)

    def settings(self) -> dict[str, object]:
        """What shapes the mixture's order, for loader states."""
        return {
            "sources": list(self.names),
            "weights": [round(w, 12) for w in self.weights],
            "samples_per_epoch": self.samples_per_epoch,
            "sizes": [len(p) for p in self.pools],
            "batch_per_source": self.batch_per_source,
        }


def check_weights(
    names: Sequence[str], weights: Mapping[Any, float] | None, sizes: Sequence[int]
) -> list[float]:
    """``weights`` (source name -> Source.weight; None: proportional to the sources'
    sizes) as a list in source order, summing to 1."""
    if weights is None:
        raw = [float(n) for n in sizes]
    else:
        bad = [n for n in names if isinstance(weights[n], bool) or not _is_number(weights[n])]
        if bad:
            raise UsageTypeError(
                f"mixture source {bad[0]!r}: Source weight must be a number, got "
                f"{weights[bad[0]]!r}"
            )
        raw = [float(weights[n]) for n in names]
        wrong = [n for n, w in zip(names, raw, strict=True) if not math.isfinite(w) or w < 0]
        if wrong:
            raise UsageError(
                f"mixture source {wrong[0]!r}: Source weight is {weights[wrong[0]]!r}; "
                "weights must be finite and at least 0"
            )
    top = max(raw, default=0.0)
    if not top > 0:
        raise UsageError(f"mixture weights {raw} add up to 0; give some source a positive weight")
    # weights near the float maximum add up to inf: then scaled to the largest first
    scaled = raw if math.isfinite(sum(raw)) else [w / top for w in raw]
    total = sum(scaled)
    empty = [n for n, w, k in zip(names, raw, sizes, strict=True) if w > 0 and k == 0]
    if empty:
        raise UsageError(
            f"mixture source {empty[0]!r} has weight {raw[list(names).index(empty[0])]} "
            "but no samples; give it weight 0 or an archive that holds samples"
        )
    return [w / total for w in scaled]


def _is_number(x: object) -> bool:
    return isinstance(x, int | float | np.integer | np.floating)


def check_passes(
    owner: str, names: Sequence[str], pools: Sequence[np.ndarray], counts: Sequence[int]
) -> None:
    """Refuses an epoch that draws some source more than MAX_PASSES_PER_EPOCH times over."""
    for name, pool, count in zip(names, pools, counts, strict=True):
        if len(pool) and count / len(pool) > MAX_PASSES_PER_EPOCH:
            raise UsageError(
                f"{owner} samples_per_epoch draws {count} samples from source {name!r} of "
                f"{len(pool)}, each {count // len(pool)} times an epoch (at most "
                f"{MAX_PASSES_PER_EPOCH}); give it a smaller weight or the epoch fewer samples"
            )


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split by ``weights``: floors, then one more to the largest remainders
    (ties to the earlier source), so the parts add up to ``total`` exactly."""
    exact = [total * w for w in weights]
    parts = [math.floor(x) for x in exact]
    order = sorted(range(len(parts)), key=lambda i: (-(exact[i] - parts[i]), i))
    for i in order[: total - sum(parts)]:
        parts[i] += 1
    return parts


def epoch_counts(
    weights: Sequence[float],
    samples_per_epoch: int,
    batch_size: int,
    world_size: int,
    drop_last: bool,
    batch_per_source: bool,
    bucketing: bool = False,
) -> list[int]:
    """Samples each source gives an epoch (see the module docstring for the rounding).

    Bucketing cuts each window of the epoch into batches and deals them to ranks:
    an epoch of whole batches, as many for every rank, needs no batch repeated or
    cut short (runtime.order.epochs.rank_batches)."""
    whole = batch_per_source or bucketing
    unit = batch_size * world_size if whole else world_size
    rounding = math.floor if drop_last else math.ceil
    total = int(rounding(samples_per_epoch / unit)) * unit
    if total == 0:
        raise UsageError(
            f"Loader samples_per_epoch={samples_per_epoch} with drop_last makes no whole "
            f"{'batch' if whole else 'sample'} for each of {world_size} rank(s)"
        )
    if batch_per_source:
        return [k * batch_size for k in apportion(total // batch_size, weights)]
    return apportion(total, weights)


PASS_CACHE_ENTRIES = 8  # passes kept per process (each a permutation of a pool)
_passes: OrderedDict[tuple[int, int, int, int, int], np.ndarray] = OrderedDict()
_passes_lock = threading.Lock()


def pass_order(pool: np.ndarray, seed: int, source: int, p: int, count: int) -> np.ndarray:
    """Pass ``p`` of a source's stream, where each epoch takes ``count`` items."""
    out: np.ndarray = pool[pass_positions(seed, source, p, count, len(pool))]
    return out


def pass_positions(seed: int, source: int, p: int, count: int, n: int) -> np.ndarray:
    """Pass ``p`` as positions in a pool of ``n``.

    An epoch that crosses from pass p-1 into pass p takes the last ``t`` items of
    p-1 and the first ``count - t`` of p; p's head is rearranged so that those
    hold none of the samples of p-1's actual tail. With ``count <= n`` there are
    always ``count - t`` samples outside that tail, so no epoch repeats a sample;
    a source smaller than its share repeats. p-1's actual tail depends on p-1's own
    rearrangement, so passes are computed one after another, from the latest one
    kept or the latest ``anchor`` (a pass that needs only p-1's own permutation):
    a far epoch (a resumed run, a state's epoch) costs a few passes, not one per epoch.
    """
    if p == 0 or count > n:
        return pass_permutation(seed, source, p, n)
    q = anchor(p, count, n)
    with _passes_lock:
        known = [k for (s, src, k, c, m) in _passes if (s, src, c, m) == (seed, source, count, n)]
        kept = [k for k in known if q <= k <= p]
        if kept:
            q = max(kept)
            order = _passes[(seed, source, q, count, n)]
    if not kept:
        order = pass_permutation(seed, source, q, n)
        if q:
            prev = pass_permutation(seed, source, q - 1, n)
            order = rearranged(prev, order, (q * n) % count, count)
    while q < p:
        q += 1
        order = rearranged(order, pass_permutation(seed, source, q, n), (q * n) % count, count)
    with _passes_lock:
        _passes[(seed, source, p, count, n)] = order
        while len(_passes) > PASS_CACHE_ENTRIES:
            _passes.popitem(last=False)
    return order


def anchor(p: int, count: int, n: int) -> int:
    """The latest pass ``q <= p`` whose rearrangement reads only pass q-1's own permutation.

    ``rearranged`` moves items only within the first ``count`` positions of a pass, so
    pass q-1's last ``t = q * n % count`` items are those of its permutation when
    ``count + t <= n`` (and t = 0 reads nothing). ``t`` steps by ``n - count`` modulo
    ``count``, so an anchor lies at most about ``count / (n - count)`` passes back."""
    q = p
    while q > 0 and (q * n) % count > n - count:
        q -= 1
    return q


def clear_passes() -> None:
    """Forgets the passes kept (they are recomputed, the same, when next asked for)."""
    with _passes_lock:
        _passes.clear()


def pass_permutation(seed: int, source: int, p: int, n: int) -> np.ndarray:
    out: np.ndarray = rng(seed, p, SOURCE_STREAM + source).permutation(n)
    return out


def rearranged(prev: np.ndarray, order: np.ndarray, t: int, count: int) -> np.ndarray:
    """``order`` rearranged so that its first ``count - t`` items hold none of ``prev``'s
    last ``t``: the shortest head holding that many others, those first, then the rest
    of the head, then the remainder as it was."""
    if t == 0:
        return order
    in_tail = np.zeros(len(order), bool)
    in_tail[prev[len(prev) - t :]] = True
    flags = in_tail[order]
    end = int(np.searchsorted(np.cumsum(~flags), count - t)) + 1
    head, head_flags = order[:end], flags[:end]
    return np.concatenate([head[~head_flags], head[head_flags], order[end:]])


def stream_slice(
    pool: np.ndarray, seed: int, source: int, start: int, count: int, shuffle: bool
) -> np.ndarray:
    """The ``count`` items of source ``source``'s endless stream of passes from ``start``
    (the epoch's share; ``start`` a multiple of it). Shuffled, a count above the pool's
    size ``n`` gives each sample ``count // n`` or ``count // n + 1`` times, in no
    particular order (the mixture shuffles the epoch's draws together)."""
    n = len(pool)
    if count == 0 or n == 0:
        return np.zeros(0, np.int64)
    if shuffle and count > n:
        # Every sample q or q + 1 times: q whole copies of the pool (the epoch's draws are
        # shuffled together after), and r more from a stream of r a epoch, which repeats
        # none within an epoch and gives each sample its turn across epochs. The stream's
        # own passes at count c would straddle two passes unevenly: some samples twice,
        # others not at all.
        q, r = divmod(count, n)
        more = stream_slice(pool, seed, source, start // count * r, r, shuffle)
        return np.concatenate([np.tile(pool, q), more])
    first, last = start // n, (start + count - 1) // n
    parts = [
        pass_order(pool, seed, source, p, count) if shuffle else pool
        for p in range(first, last + 1)
    ]
    off = start - first * n
    return np.concatenate(parts)[off : off + count]


def mixture_draw(mix: Mixture, seed: int, shuffle: bool) -> Draw:
    """The order stage's draw of a mixture: the epoch's samples and each one's source."""

    def draw(epoch: int) -> tuple[np.ndarray, np.ndarray | None]:
        parts = [
            stream_slice(pool, seed, s, epoch * c, c, shuffle)
            for s, (pool, c) in enumerate(zip(mix.pools, mix.counts, strict=True))
        ]
        samples = np.concatenate(parts).astype(np.int64)
        groups = np.repeat(np.arange(len(parts)), [len(p) for p in parts])
        if shuffle:
            perm = rng(seed, epoch, MIX_STREAM).permutation(len(samples))
        else:  # evenly interleaved: the i-th of c draws at (i + 0.5) / c of the epoch
            keys = np.concatenate([(np.arange(len(p)) + 0.5) / len(p) for p in parts if len(p)])
            perm = np.argsort(keys, kind="stable")
        return samples[perm], (groups[perm] if mix.batch_per_source else None)

    return draw

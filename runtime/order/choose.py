"""What a Loader trains on: its archive argument opened, and its order stage built.

The argument is a path, a list of paths read as one, an open ``Archive``, or
a mixture: a dict of source name -> any of those or a ``Source`` (its weight, its
selection)
(runtime.order.mixture). ``where``/``indices`` choose samples (runtime.archive.selection);
the order stage then orders the selection, or draws the mixture.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from dlop.formats.urls import is_url

from ..archive.dataset import Archive
from ..archive.opening import open_for_loader
from ..archive.selection import digest, shard_counts
from ..batch import Batch
from ..errors import UsageError, UsageTypeError, check_int
from ..gather.engine import CopyEngine
from ..gather.fields import Allocate
from ..gather.plan import CopyPlan
from .budget import fitting, make_budget
from .distributed import launcher_nodes, placement
from .epochs import NODE_SHARES, BatchOrder, Draw, OrderSpec
from .mixture import (
    MAX_EPOCH_SAMPLES,
    Mixture,
    Source,
    check_passes,
    check_weights,
    epoch_counts,
    mixture_draw,
    source_weights,
)

SOURCE_KEY = "source"  # the batch entry naming each sample's mixture source


@dataclass
class Choice:
    """The Loader's archive and order stage; for a mixture, its sources."""

    archive: Archive
    spec: OrderSpec
    order: BatchOrder
    mixture: Mixture | None = None
    source_starts: np.ndarray | None = None  # each source's first sample number
    # budget batches: each bucket's most samples per batch and its samples (bounds())
    _bounds: list[tuple[int, np.ndarray]] | None = field(default=None, repr=False)

    def settings(self, spec: OrderSpec | None = None) -> dict[str, Any]:
        """What, besides the spec, shapes the order (for loader states): the archives
        read (``archive_identities``), the selection's fingerprint, the mixture. Under
        ``spec`` of an epoch read over the archive as it was before an append
        (earlier_spec), the archive named is that one: its first shards."""
        archives = archive_identities(self.archive)
        if spec is not None and spec is not self.spec:
            shards = self.archive.readers[0].index.shards[: len(spec.shard_sizes)]
            archives = [shards_identity(shards)]
        if self.mixture is not None:
            pools = np.concatenate(self.mixture.pools)
            return {
                "archives": archives,
                "selection": digest(pools),
                "mixture": self.mixture.settings(),
            }
        return {"archives": archives, "selection": digest(self.archive.selection), "mixture": None}

    def buffer_numel(self, name: str) -> int | None:
        """Elements a reusable buffer for field ``name`` needs to hold one of this order's
        batches (None: fresh tensors): ``batch_size`` samples (at most every one); by a
        budget, the most any bucket's batch can need (``bounds``)."""
        gather = self.archive.gathers[name]
        if self.spec.budget is None:
            return gather.buffer_numel(self.most_samples())
        needs = [gather.buffer_numel(count, among) for count, among in self.bounds()]
        if None in needs:
            return None
        return max((n for n in needs if n is not None), default=0)

    def most_samples(self) -> int:
        """The most samples one batch of this order holds."""
        if self.spec.budget is None:
            return min(self.spec.batch_size, max(1, self.spec.num_samples))
        return max((count for count, _ in self.bounds()), default=1)

    def bounds(self) -> list[tuple[int, np.ndarray]]:
        """Budget batches: for each bucket, the most samples one of its batches holds and
        the samples it draws from (those the order chooses)."""
        if self._bounds is None:
            budget, lengths = self.spec.budget, self.order.lengths
            assert budget is not None and lengths is not None
            if self.mixture is not None:
                chosen = np.concatenate(self.mixture.pools)
            elif self.archive.selection is not None:
                chosen = self.archive.selection
            else:
                chosen = np.arange(len(lengths), dtype=np.int64)
            size = lengths[chosen]
            bucket = np.searchsorted(np.asarray(budget.edges, dtype=np.int64), size, side="right")
            self._bounds = []
            for b in np.unique(bucket):
                among = chosen[bucket == b]
                count = fitting(size[bucket == b], budget, self.spec.batch_size)
                self._bounds.append((count, among))
        return self._bounds

    def check_budget(self, batches_held: int, bucketing: bool, readers: str) -> None:
        """Refuses, before any batch, a shard cache too small for what this order holds
        in flight on the node in any epoch (OrderSpec.shards_in_flight): each rank's
        readers hold ``batches_held`` consecutive batches (``readers`` says how, for the
        message), every rank on the node (the launcher's LOCAL_WORLD_SIZE, else
        world_size / nodes) the same."""
        told = launcher_nodes()
        spec = self.spec
        local = told[0] if told is not None else spec.local_size
        window = f", window_shards={spec.window_shards}" if spec.mode == "window" else ""
        bucket = f", bucket_window={spec.bucket_window}" if bucketing else ""
        why = (
            f"order={spec.mode!r}{window}{bucket}, batch_size={spec.batch_size}, "
            f"{readers}, {local} rank(s) on this node"
        )
        count = spec.shards_in_flight(batches_held, bucketing, local)
        self.archive.supply.check_budget(count, why)

    def sources_of(self, indices: np.ndarray) -> torch.Tensor | None:
        """Each sample's source number (``int64 [B]``, an index into the mixture's
        names); None without a mixture."""
        if self.source_starts is None:
            return None
        found = np.searchsorted(self.source_starts, indices, side="right") - 1
        return torch.from_numpy(found.astype(np.int64, copy=False))

    def gather(
        self, indices: torch.Tensor, out: Allocate | None = None, engine: CopyEngine | None = None
    ) -> Batch:
        """The batch of ascending sample numbers ``indices`` (Archive.gather), its
        sources named (``name_sources``)."""
        return self.name_sources(self.archive.gather(indices, out, engine), indices.numpy())

    def plan(self, indices: np.ndarray, buffers: dict[str, torch.Tensor]) -> tuple[Batch, CopyPlan]:
        """The gather stage's plan of a batch into ``buffers`` (Archive.plan), its
        sources named (``name_sources``)."""
        batch, plan = self.archive.plan(torch.from_numpy(indices), buffers)
        return self.name_sources(batch, indices), plan

    def plan_packed(
        self, batches: list[np.ndarray], buffers: dict[str, torch.Tensor]
    ) -> tuple[list[Batch], CopyPlan] | None:
        """``batches`` planned one after another into ``buffers`` as one plan
        (Archive.plan_packed), their sources named; None where they are planned one
        by one."""
        cuts = np.cumsum([0, *map(len, batches)]).tolist()
        indices = np.concatenate(batches)
        got = self.archive.plan_packed(torch.from_numpy(indices), cuts, buffers)
        if got is None:
            return None
        made, plan = got
        return [
            self.name_sources(batch, indices[a:b])
            for batch, (a, b) in zip(made, itertools.pairwise(cuts), strict=True)
        ], plan

    def name_sources(self, batch: Batch, indices: np.ndarray) -> Batch:
        """``batch`` of samples ``indices``; a mixture's also names each sample's source
        (``batch["source"]``, an index into the mixture's names)."""
        sources = self.sources_of(indices)
        if sources is not None:
            batch[SOURCE_KEY] = sources
        return batch


def archive_identities(archive: Archive) -> list[list[Any]]:
    """Each archive read, in order, as ``[fingerprint, num_samples]``: the fingerprint
    hashes its index's shard list (file, samples, CRC-32 of each shard), so another
    archive, or the same ones in another order, gives other identities."""
    return [shards_identity(reader.index.shards) for reader in archive.readers]


def shards_identity(shards: Sequence[Any]) -> list[Any]:
    """``[fingerprint, num_samples]`` of an archive of these shards (archive_identities)."""
    h = hashlib.sha256()
    for info in shards:
        h.update(f"{info.file}\0{info.num_samples}\0{info.crc32}\n".encode())
    return [h.hexdigest()[:16], sum(int(info.num_samples) for info in shards)]


def earlier_spec(spec: OrderSpec, shards: int, lengths: np.ndarray | None) -> OrderSpec:
    """``spec`` over the archive's first ``shards`` shards: the archive as it was before an
    append (earlier_generation), a budget's edges made from their ``lengths`` (the
    bucketed field's, of every sample) as a Loader opened then made them."""
    sizes = spec.shard_sizes[:shards]
    count = sum(sizes)
    budget = spec.budget
    if budget is not None and lengths is not None:
        budget = budget.over(lengths[:count])
    return replace(spec, num_samples=count, shard_sizes=sizes, budget=budget)


def earlier_generation(archive: Archive, saved: object) -> tuple[int, list[Any]] | None:
    """When ``saved`` (a state's ``archives``) names an earlier generation of the one archive
    read whole (the archive before an append: the shards of its first generations), the
    number of those shards and that identity; else None."""
    if len(archive.readers) != 1 or archive.selection is not None:
        return None
    if not isinstance(saved, list) or len(saved) != 1:
        return None
    index = archive.readers[0].index
    shards = 0
    for generation in index.generations[:-1]:
        shards += generation.shards
        identity = shards_identity(index.shards[:shards])
        if identity == saved[0]:
            return shards, identity
    return None


def choose(
    archive: Any, open_options: dict[str, Any], owner: str = "Loader", **order: Any
) -> Choice:
    """Opens ``archive`` with ``open_options`` (fields, pad_value, where, indices,
    allow_recipe_mismatch; plus samples_per_epoch and batch_per_source for a mixture) and builds the order stage from ``order`` (OrderSpec's settings, rank and
    world_size as the Loader takes them, bucket_by); ``owner`` (Loader, IterableArchive)
    is who errors name."""
    if order["mode"] not in ("global", "window"):
        raise UsageError(f"{owner} order must be 'global' or 'window', got {order['mode']!r}")
    mixing = {k: open_options.pop(k) for k in ("samples_per_epoch", "batch_per_source")}
    order["rank"], order["world_size"], order["nodes"] = placement(
        order["rank"], order["world_size"], order["nodes"], order.pop("node_rank"), owner
    )
    if order["node_share"] not in NODE_SHARES:
        raise UsageError(
            f"{owner} node_share must be one of {NODE_SHARES}, got {order['node_share']!r}"
        )
    bucket_by = order.pop("bucket_by")
    asked = {k: order.pop(k) for k in BUDGET_SETTINGS}
    budgeted = asked["max_frames"] is not None or asked["max_padded_frames"] is not None
    if bucket_by is None and budgeted:
        raise UsageError(
            f"{owner} max_frames= and max_padded_frames= budget the frames of a ragged "
            "field: name it, bucket_by='<field>'"
        )
    if not order["even_shares"] and order["drop_last"]:
        raise UsageError(
            f"{owner} even_shares=False reads every sample exactly once across ranks and "
            "drop_last=True drops samples; pass one of them"
        )
    if isinstance(archive, Mapping):
        return choose_mixture(archive, open_options, mixing, bucket_by, asked, order, owner)
    given = [k for k, v in mixing.items() if v not in (None, False)]
    if given:
        raise UsageError(
            f"{owner} {given[0]}= is for mixtures: pass the archives as a dict of "
            f"source name -> path, e.g. {owner}({{'a': path_a, 'b': path_b}}, {given[0]}=...)"
        )
    if isinstance(archive, Sequence) and not isinstance(archive, str | bytes):
        local_only(list(archive), f"{owner} got a list of archives", owner)
    ds = open_for_loader(
        archive, open_options.pop("fields"), open_options.pop("pad_value"), **open_options
    )
    check_bucket_by(ds, bucket_by)
    sel = ds.selection
    sizes = ds.shard_sizes if sel is None else shard_counts(sel, ds.shard_starts)
    lengths = ds.lengths(bucket_by) if bucket_by else None
    order = with_budget(order, owner, asked, lengths, sel)
    spec = OrderSpec(num_samples=len(ds), shard_sizes=sizes, **order)
    order_stage = BatchOrder(spec, lengths, owner, selection=sel)
    return Choice(ds, spec, order_stage)


def source_paths(
    name: object, source: object, owner: str = "Loader"
) -> tuple[list[Any], np.ndarray | None]:
    """A mixture source's archive paths, and its own selection (an open Archive's)."""
    if not isinstance(name, str):
        raise UsageTypeError(f"{owner} mixture sources are named by str, got {name!r}")
    what = f"{owner} mixture source {name!r}"
    if isinstance(source, Source):
        paths, own = source_paths(name, source.path, owner)
        if source.where is None:
            return paths, own
        if own is not None:
            raise UsageError(
                f"{what}: an open Archive with a selection of its own and a Source where=; "
                "give the Source the archive's path, or open the Archive with that where"
            )
        return paths, Archive(paths, fields=[], where=source.where).selection
    if isinstance(source, Archive):
        return local_only(list(source.paths), what, owner), source.selection
    if isinstance(source, str | os.PathLike):
        return local_only([source], what, owner), None
    if isinstance(source, Sequence) and source and not isinstance(source, bytes):
        return local_only(list(source), what, owner), None
    raise UsageTypeError(
        f"{owner} mixture source {name!r} must be a path, a list of paths, an open "
        f"Archive or a Source, got {type(source).__name__}"
    )


def local_only(paths: list[Any], what: str, owner: str) -> list[Any]:
    """``paths``, refused when one is a URL: archives read as one and mixtures take
    local archives for now (a URL is read alone, through the shard cache)."""
    urls = [p for p in paths if is_url(p)]
    if urls:
        raise UsageError(
            f"{what}: {urls[0]} is a URL, and several archives read as one or mixed take "
            f"local paths for now; read the URL alone ({owner}(url, ...)) or copy the "
            "archives to local disk"
        )
    return paths


def choose_mixture(
    sources: Mapping[Any, Any],
    open_options: dict[str, Any],
    mixing: dict[str, Any],
    bucket_by: str | None,
    asked: dict[str, Any],
    order: dict[str, Any],
    owner: str = "Loader",
) -> Choice:
    if not sources:
        raise UsageError(f"{owner} got an empty dict of sources; name at least one archive")
    for key in ("where", "indices"):  # a source's own selection is its Source's
        if open_options.get(key) is not None:
            raise UsageError(
                f"{owner} {key}= does not apply to a mixture: give each source its own "
                f"selection, {owner}({{'a': Source(path_a, where=...), ...}})"
            )
    for key in ("storage_options", "cache_dir", "cache_bytes"):
        if open_options.get(key) is not None:
            raise UsageError(
                f"{owner} {key}= is for an archive read through the shard cache (at a URL, or "
                "a local zstd archive); a mixture's sources are local archives, read in place"
            )
    if order["mode"] != "global":
        raise UsageError(f"{owner} order='window' does not apply to a mixture; use order='global'")
    order = {**order, "nodes": 1}  # a mixture's sources are local: no shards dealt to nodes
    names = list(sources)
    parts = [source_paths(n, sources[n], owner) for n in names]
    paths = [p for ps, _ in parts for p in ps]
    pad = open_options.pop("pad_value")
    ds = Archive(paths, pad_value=0.0 if pad is None else pad, **open_options)
    if SOURCE_KEY in ds.fields:
        raise UsageError(
            f"{ds.path}: a mixture's batches name each sample's source as {SOURCE_KEY!r}, "
            f"and the archives have a field of that name; leave it out with fields=[...]"
        )
    check_bucket_by(ds, bucket_by)
    reader_starts = np.cumsum([0] + [r.num_samples for r in ds.readers], dtype=np.int64)
    firsts = np.cumsum([0] + [len(ps) for ps, _ in parts])
    pools = []
    for s, (_, own) in enumerate(parts):
        lo, hi = int(reader_starts[firsts[s]]), int(reader_starts[firsts[s + 1]])
        pools.append(np.arange(lo, hi, dtype=np.int64) if own is None else own + lo)
    lengths = ds.lengths(bucket_by) if bucket_by else None
    order = with_budget(order, owner, asked, lengths, np.concatenate(pools))
    # budget batches cut whole steps of any number of samples: no rounding to batches
    whole_batches = order["budget"] is None
    # a budget's epoch needs no rounding to ranks either: its steps are evened
    batch_size, world = order["batch_size"], order["world_size"] if whole_batches else 1
    per_source = bool(mixing["batch_per_source"])
    rounds = per_source and whole_batches  # each source's count to whole batches
    weights = check_weights(names, source_weights(sources, owner), [len(p) for p in pools])
    wanted = mixing["samples_per_epoch"]
    if wanted is None:  # the pools the weights draw from
        wanted = sum(len(p) for p, w in zip(pools, weights, strict=True) if w > 0)
    wanted = check_int(f"{owner} samples_per_epoch", wanted, low=1, high=MAX_EPOCH_SAMPLES)
    bucketing = bucket_by is not None and whole_batches
    counts = epoch_counts(weights, wanted, batch_size, world, order["drop_last"], rounds, bucketing)
    check_passes(owner, names, pools, counts)
    mix = Mixture(tuple(names), tuple(pools), tuple(weights), wanted, tuple(counts), per_source)
    spec = OrderSpec(num_samples=mix.epoch_size, **order)
    draw = mixture_draw(mix, order["seed"], order["shuffle"])

    def redraw(world_size: int, batch_size: int) -> Draw:
        """The draw of a world of that shape: its epoch's counts are rounded to it."""
        counts = epoch_counts(
            weights, wanted, batch_size, world_size if whole_batches else 1, order["drop_last"],
            rounds, bucketing,
        )  # fmt: skip
        check_passes(
            f"{owner} state of a world of {world_size} x {batch_size}", names, pools, counts
        )
        if sum(counts) > MAX_EPOCH_SAMPLES:
            raise UsageError(
                f"{owner} state: a world of {world_size} ranks of batches of {batch_size} "
                f"rounds the mixture's epoch to {sum(counts)} samples, over {MAX_EPOCH_SAMPLES}"
            )
        return mixture_draw(replace(mix, counts=tuple(counts)), order["seed"], order["shuffle"])

    starts = reader_starts[firsts[:-1]]
    stage = BatchOrder(spec, lengths, owner, draw=draw, redraw=redraw)
    return Choice(ds, spec, stage, mix, starts)


BUDGET_SETTINGS = ("max_frames", "max_padded_frames", "num_buckets", "bucket_edges")


def with_budget(
    order: dict[str, Any],
    owner: str,
    asked: dict[str, Any],
    lengths: np.ndarray | None,
    chosen: np.ndarray | None,
) -> dict[str, Any]:
    """``order`` with its budget (``asked``: the budget settings; None without one), its
    bucket edges from the lengths of the ``chosen`` samples (None: all), and a batch size
    that caps the count: the one given, or the most samples the budget holds."""
    read = lengths if lengths is None or chosen is None else lengths[chosen]
    budget = make_budget(owner, read, **asked)
    batch = order["batch_size"]
    if budget is not None and batch is None:
        batch = budget.most  # as many as the budget lets a batch hold
    return {**order, "budget": budget, "batch_size": batch}


def check_bucket_by(archive: Archive, bucket_by: object) -> None:
    """Refuses a ``bucket_by`` that is not one of the archive's ragged fields."""
    if bucket_by is None:
        return
    f = archive.fields.get(bucket_by) if isinstance(bucket_by, str) else None
    if f is None or not f.ragged:
        ragged = [n for n, g in archive.fields.items() if g.ragged]
        raise UsageError(
            f"{archive.path}: bucket_by must name a ragged field among {ragged}, got {bucket_by!r}"
        )

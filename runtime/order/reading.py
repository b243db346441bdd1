"""What a front end reads and how it orders it, declared once: ``Reading``.

The Loader and IterableArchive take the same settings after their archive and
batch size (docs/choosing.md): how batches are ordered (shuffle, seed, ranks,
nodes, window order, bucketing, shares) and what is read (fields, padding, a
selection, a mixture's epoch, the node-local cache). Each front end adds
only its own (the Loader: device, transforms, prefetch; IterableArchive: worker
buffers) and takes the rest as keywords, typed by ``ReadingOptions`` (editors
complete them, a type checker checks a call) and checked here at run time, so an
option is declared, defaulted and named in errors in one place. Everything after
the archive and batch size is given by name.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

import numpy as np

from ..errors import UsageTypeError, check_int
from .distributed import placement

# The words ``order`` and ``node_share`` take (checked at run time too, naming them).
OrderMode = Literal["global", "window"]
NodeShare = Literal["keep", "redeal"]


class ReadingOptions(TypedDict, total=False):
    """The keywords a Loader and an IterableArchive share, as a type checker sees them:
    ``Reading``'s fields, each optional (its default is Reading's)."""

    shuffle: bool
    seed: int
    drop_last: bool
    rank: int | None
    world_size: int | None
    order: OrderMode
    window_shards: int
    bucket_by: str | None
    bucket_window: int
    max_frames: int | None
    max_padded_frames: int | None
    num_buckets: int | None
    bucket_edges: Sequence[int] | None
    even_shares: bool
    nodes: int | None
    node_rank: int | None
    node_share: NodeShare
    fields: Sequence[str] | str | None
    pad_value: float | None
    where: Mapping[str, Any] | None
    indices: Sequence[int] | np.ndarray | None
    allow_recipe_mismatch: bool
    samples_per_epoch: int | None
    batch_per_source: bool
    cache_dir: str | os.PathLike[str] | None
    cache_bytes: int | None
    block_cache_bytes: int | None
    storage_options: Mapping[str, Any] | None


# Settings that belong elsewhere: where they are given instead.
MOVED = {
    "weights": "; a mixture source's weight is its Source's: "
    "{'a': Source(path_a, weight=0.7), 'b': Source(path_b, weight=0.3)}",
}


@dataclass(frozen=True)
class Reading:
    """The settings a Loader and an IterableArchive share (see their docstrings and
    docs/choosing.md): the order stage's, then what to read."""

    # how batches are ordered (runtime.order.epochs)
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = False
    rank: int | None = None
    world_size: int | None = None
    order: OrderMode = "global"
    window_shards: int = 8
    bucket_by: str | None = None
    bucket_window: int = 64
    # batches by a budget of frames of bucket_by (runtime.order.budget)
    max_frames: int | None = None
    max_padded_frames: int | None = None
    num_buckets: int | None = None  # 10 with a budget, unless bucket_edges are given
    bucket_edges: Sequence[int] | None = None
    even_shares: bool = True
    nodes: int | None = None
    node_rank: int | None = None
    node_share: NodeShare = "keep"
    # what is read (runtime.archive, runtime.order.mixture, runtime.storage.cached)
    fields: Sequence[str] | str | None = None
    pad_value: float | None = None
    where: Mapping[str, Any] | None = None
    indices: Sequence[int] | np.ndarray | None = None
    allow_recipe_mismatch: bool = False
    samples_per_epoch: int | None = None
    batch_per_source: bool = False
    cache_dir: str | os.PathLike[str] | None = None
    cache_bytes: int | None = None
    block_cache_bytes: int | None = None
    # options of the fsspec filesystem of an archive at a URL (credentials, an endpoint,
    # client settings): passed on, never kept in a state or shown
    storage_options: Mapping[str, Any] | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def given(cls, owner: str, options: Mapping[str, Any], own: Sequence[str] = ()) -> Reading:
        """The settings of ``options`` (keywords given to ``owner``), refusing a name that
        is none of them, nor one of the front end's ``own`` keywords, with the closest one
        (a type checker does so before the run; this is for a call it did not check)."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key in options:
            if key not in names:
                hint = MOVED.get(key)
                if hint is None:
                    near = difflib.get_close_matches(key, [*names, *own], n=1)
                    hint = f"; did you mean {near[0]}=?" if near else ""
                raise UsageTypeError(f"{owner} got an unexpected keyword {key}={hint}")
        return cls(**options)

    def in_this_process(self, owner: str = "IterableArchive") -> Reading:
        """The settings with ``rank``, ``world_size`` and ``nodes`` worked out here (from
        torch.distributed and the launcher's environment when not given): DataLoader
        workers have no process group."""
        rank, world, nodes = placement(
            self.rank, self.world_size, self.nodes, self.node_rank, owner
        )
        return dataclasses.replace(self, rank=rank, world_size=world, nodes=nodes)

    def open_options(self) -> dict[str, Any]:
        """What to read, as runtime.order.choose takes it (the cache's only when given,
        so archives that take no cache see none)."""
        cache = {
            "cache_dir": self.cache_dir,
            "cache_bytes": self.cache_bytes,
            "block_cache_bytes": self.block_cache_bytes,
            "storage_options": self.storage_options,
        }
        return {
            "fields": self.fields,
            "pad_value": self.pad_value,
            "where": self.where,
            "indices": None if self.indices is None else np.asarray(self.indices),
            "allow_recipe_mismatch": self.allow_recipe_mismatch,
            "samples_per_epoch": self.samples_per_epoch,
            "batch_per_source": self.batch_per_source,
            **{k: v for k, v in cache.items() if v is not None},
        }

    def order_options(self, owner: str, batch_size: int | None) -> dict[str, Any]:
        """How to order, as runtime.order.choose takes it, numbers checked."""
        budgeted = self.max_frames is not None or self.max_padded_frames is not None
        if batch_size is None and not budgeted:
            raise UsageTypeError(
                f"{owner} batch_size must be an int, got None; only batches by a budget of "
                "frames (max_frames= or max_padded_frames=) take none"
            )
        return {
            "batch_size": None
            if batch_size is None
            else check_int(f"{owner} batch_size", batch_size, low=1),
            "shuffle": self.shuffle,
            "seed": check_int(f"{owner} seed", self.seed),
            "drop_last": self.drop_last,
            "rank": self.rank,
            "world_size": self.world_size,
            "mode": self.order,
            "window_shards": check_int(f"{owner} window_shards", self.window_shards, low=1),
            "bucket_by": self.bucket_by,
            "bucket_window": check_int(f"{owner} bucket_window", self.bucket_window, low=1),
            "max_frames": self.max_frames,
            "max_padded_frames": self.max_padded_frames,
            "num_buckets": self.num_buckets,
            "bucket_edges": self.bucket_edges,
            "even_shares": self.even_shares,
            "nodes": self.nodes,
            "node_rank": self.node_rank,
            "node_share": self.node_share,
        }

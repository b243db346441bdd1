"""What a front end reads and how it orders it, declared once: ``Reading``.

The Loader and IterableArchive take the same settings after their archive and
batch size (docs/choosing.md): how batches are ordered (shuffle, seed, ranks,
nodes, window order, bucketing, shares) and what is read (fields, padding, a
selection, a mixture's weights, the node-local cache). Each front end adds
only its own (the Loader: device, transforms, prefetch; IterableArchive: worker
buffers) and takes the rest as keywords checked here, so an option is declared,
defaulted and named in errors in one place. Each front end still takes its
arguments by position in the order it always has (its ``*_ORDER`` tuple names
that order, nothing else); ``keywords`` shows them in its signature
(``help(Loader)``, ``inspect.signature``) as they were written out before.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import UsageTypeError, check_int
from .distributed import placement


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
    order: str = "global"
    window_shards: int = 8
    bucket_by: str | None = None
    bucket_window: int = 64
    even_shares: bool = True
    nodes: int | None = None
    node_rank: int | None = None
    node_share: str = "keep"
    # what is read (runtime.archive, runtime.order.mixture, runtime.storage.cached)
    fields: Sequence[str] | str | None = None
    pad_value: float | None = None
    where: Mapping[str, Any] | None = None
    indices: Sequence[int] | np.ndarray | None = None
    allow_recipe_mismatch: bool = False
    weights: Mapping[str, float] | None = None
    samples_per_epoch: int | None = None
    batch_per_source: bool = False
    cache_dir: str | os.PathLike[str] | None = None
    cache_bytes: int | None = None
    # options of the fsspec filesystem of an archive at a URL (credentials, an endpoint,
    # client settings): passed on, never kept in a state or shown
    storage_options: Mapping[str, Any] | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def given(
        cls,
        owner: str,
        options: Mapping[str, Any],
        positional: Sequence[Any] = (),
        order: Sequence[str] = (),
        own: Mapping[str, tuple[Any, Any]] | None = None,
    ) -> tuple[Reading, dict[str, Any]]:
        """The settings of ``options`` (keywords given to ``owner``) and ``positional``
        (the values after the batch size, named by ``order``: the front end's order of
        arguments), refusing a name that is none of them with the closest one; and the
        front end's ``own`` arguments (name -> (value given by name, its default)), with
        those given by position in their place."""
        own = dict(own or {})
        if len(positional) > len(order):
            raise UsageTypeError(
                f"{owner} takes at most {len(order) + 2} arguments by position (archive, "
                f"batch_size, {', '.join(order)}), got {len(positional) + 2}"
            )
        names = [f.name for f in dataclasses.fields(cls)]
        for key in options:
            if key not in names:
                near = difflib.get_close_matches(key, [*names, *own], n=1)
                hint = f"; did you mean {near[0]}=?" if near else ""
                raise UsageTypeError(f"{owner} got an unexpected keyword {key}={hint}")
        by_position = dict(zip(order, positional, strict=False))
        for key in by_position:
            named, default = own.get(key, (None, None))
            if key in options or (key in own and named is not default):
                raise UsageTypeError(f"{owner} got {key} both by position and by name")
        settings = {k: v for k, v in by_position.items() if k not in own}
        resolved = {k: by_position.get(k, given) for k, (given, _) in own.items()}
        return cls(**settings, **options), resolved

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
            "storage_options": self.storage_options,
        }
        return {
            "fields": self.fields,
            "pad_value": self.pad_value,
            "where": self.where,
            "indices": None if self.indices is None else np.asarray(self.indices),
            "allow_recipe_mismatch": self.allow_recipe_mismatch,
            "weights": self.weights,
            "samples_per_epoch": self.samples_per_epoch,
            "batch_per_source": self.batch_per_source,
            **{k: v for k, v in cache.items() if v is not None},
        }

    def order_options(self, owner: str, batch_size: int) -> dict[str, Any]:
        """How to order, as runtime.order.choose takes it, numbers checked."""
        return {
            "batch_size": check_int(f"{owner} batch_size", batch_size, low=1),
            "shuffle": self.shuffle,
            "seed": check_int(f"{owner} seed", self.seed),
            "drop_last": self.drop_last,
            "rank": self.rank,
            "world_size": self.world_size,
            "mode": self.order,
            "window_shards": check_int(f"{owner} window_shards", self.window_shards, low=1),
            "bucket_by": self.bucket_by,
            "bucket_window": check_int(f"{owner} bucket_window", self.bucket_window, low=1),
            "even_shares": self.even_shares,
            "nodes": self.nodes,
            "node_rank": self.node_rank,
            "node_share": self.node_share,
        }


# The arguments both front ends take last by position, in this order (what to choose and
# where the cache lives); each front end's order names what comes before them.
CHOOSING = (
    "where",
    "indices",
    "allow_recipe_mismatch",
    "weights",
    "samples_per_epoch",
    "batch_per_source",
    "cache_dir",
    "cache_bytes",
    "even_shares",
    "nodes",
    "node_rank",
    "node_share",
    "storage_options",
)


def keywords(init: Callable[..., None], order: Sequence[str]) -> inspect.Signature:
    """``init``'s signature as a caller sees it: its ``*positional`` and ``**options``
    spelled out as the arguments of ``order`` (by position or by name, defaults from
    ``init``'s own keywords or Reading's), then Reading's other settings by name."""
    own = inspect.signature(init)
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    params = [p for p in own.parameters.values() if p.kind not in kinds]
    first = [p for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    mine = {p.name: p for p in params if p.kind is p.KEYWORD_ONLY}
    fields = {f.name: f for f in dataclasses.fields(Reading)}

    def param(name: str, kind: Any) -> inspect.Parameter:
        if name in mine:
            return mine[name].replace(kind=kind)
        f = fields[name]
        return inspect.Parameter(name, kind, default=f.default, annotation=f.type)

    listed = [param(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in order]
    rest = [param(n, inspect.Parameter.KEYWORD_ONLY) for n in [*mine, *fields] if n not in order]
    return own.replace(parameters=[*first, *listed, *rest])

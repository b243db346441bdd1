"""The Loader's state: where it is in the order, and the settings that shape the order.

The position is the order stage's (``epoch``, ``batches_done``); the settings
are compared when a state is loaded, so a state saved under other settings
(another seed, batch size, selection, mixture...) is refused rather than
resumed somewhere else.
"""

from __future__ import annotations

from typing import Any

from ..errors import UsageError, UsageTypeError
from ..order.epochs import OrderSpec

STATE_FORMAT = "dlop-loader-state"
STATE_VERSION = 1
# Settings that shape the order: a state saved under others is refused.
STATE_SETTINGS = (
    "seed",
    "num_samples",
    "batch_size",
    "shuffle",
    "drop_last",
    "world_size",
    "order",
    "window_shards",
    "bucket_by",
    "bucket_window",
    "even_shares",
    "nodes",
    "node_share",
    "budget",
)
# What a state saved before a setting was recorded had (it was the only choice then).
SETTING_DEFAULTS: dict[str, Any] = {
    "even_shares": True,
    "nodes": 1,
    "node_share": "keep",
    "budget": None,
}
# The world's shape: a state saved in another one continues its epoch here (what that
# world handed out is left out of the rest), where that can be done exactly.
RESHAPING = ("world_size", "nodes", "batch_size")
# The samples chosen: the archives read, in order (runtime.order.choose.archive_identities), a
# fingerprint of the selection (None: the whole archive) and a mixture's sources, weights
# and sizes. A state without selection and mixture chose the whole archive; one without
# archives was saved before they were recorded and is refused.
CHOICE_SETTINGS = ("archives", "selection", "mixture")


def order_settings(
    spec: OrderSpec, bucket_by: str | None, choice: dict[str, Any]
) -> dict[str, Any]:
    """The settings that shape an order (``STATE_SETTINGS``), the rank and the choice of
    samples (``CHOICE_SETTINGS``); the Loader's and IterableArchive's states hold them."""
    return {
        "seed": spec.seed,
        "num_samples": spec.num_samples,
        "batch_size": spec.batch_size,
        "shuffle": spec.shuffle,
        "drop_last": spec.drop_last,
        "rank": spec.rank,
        "world_size": spec.world_size,
        "order": spec.mode,
        "window_shards": spec.window_shards,
        "bucket_by": bucket_by,
        "bucket_window": spec.bucket_window,
        "even_shares": spec.even_shares,
        "nodes": spec.nodes,
        "node_share": spec.node_share,
        "budget": None if spec.budget is None else spec.budget.setting(),
        **choice,
    }


def loader_state(
    spec: OrderSpec, position: dict[str, int], bucket_by: str | None, choice: dict[str, Any]
) -> dict[str, Any]:
    """A Loader state: ``position`` (the order stage's) plus the settings."""
    return {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        **position,
        **order_settings(spec, bucket_by, choice),
    }


def check_state(state: object, mine: dict[str, Any]) -> dict[str, Any]:
    """``state`` if this Loader (whose own state is ``mine``) can continue from it."""
    if not isinstance(state, dict):
        raise UsageTypeError(
            f"Loader.load_state_dict takes the dict state_dict() returned, got {type(state).__name__}"
        )
    if not same(state.get("format"), STATE_FORMAT) or not same(state.get("version"), STATE_VERSION):
        raise UsageError(
            f"not a dlop Loader state: format {state.get('format')!r} version "
            f"{state.get('version')!r}, expected {STATE_FORMAT!r} version {STATE_VERSION}"
        )
    check_settings(state, mine, "loader")
    return state


def check_settings(state: dict[str, Any], mine: dict[str, Any], what: str) -> None:
    """Refuses a ``what`` state saved under other order settings or another choice of
    samples (a missing choice entry is the whole archive's). Any rank's state serves every
    rank: ranks step together, so each holds the same position. A state of another world
    (``RESHAPING``: ranks, nodes, per-rank batch size) continues here
    (runtime.order.epochs.BatchOrder.reset); a mixture's epoch size follows its world."""
    moved = any(not same(state.get(k, SETTING_DEFAULTS.get(k)), mine[k]) for k in RESHAPING)
    rank, world = state.get("rank"), state.get("world_size")
    if (
        not isinstance(rank, int)
        or not isinstance(world, int)
        or isinstance(rank, bool)
        or not 0 <= rank < world
    ):
        raise UsageError(
            f"{what} state rank {rank!r:.40} is not a rank of its world_size {world!r:.40}"
        )
    derived = {"num_samples"} if moved and mine.get("mixture") is not None else set()
    for key in (*STATE_SETTINGS, *CHOICE_SETTINGS):
        saved = state.get(key, SETTING_DEFAULTS.get(key))
        if key not in RESHAPING and key not in derived and not same(saved, mine[key]):
            raise UsageError(
                f"{what} state was saved with {key}={saved!r:.200}, this {what} has "
                f"{mine[key]!r:.200}; resume with the settings and samples it was saved with"
            )


def same(saved: object, mine: object) -> bool:
    """``saved == mine``, False where the comparison is no plain truth value (a state
    holding an array where a number or list belongs)."""
    try:
        return bool(saved == mine)
    except (ValueError, TypeError, RuntimeError):
        return False

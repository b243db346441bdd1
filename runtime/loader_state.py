"""The Loader's state: where it is in the order, and the settings that shape the order.

The position is the order stage's (``epoch``, ``batches_done``); the settings
are compared when a state is loaded, so a state saved under other settings
(another seed, batch size, selection, mixture...) is refused rather than
resumed somewhere else.
"""

from __future__ import annotations

from typing import Any

from .errors import UsageError, UsageTypeError
from .order import OrderSpec

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
)
# The samples chosen: a fingerprint of the selection (None: the whole archive) and a
# mixture's sources, weights and sizes. A state without them chose the whole archive.
CHOICE_SETTINGS = ("selection", "mixture")


def loader_state(
    spec: OrderSpec, position: dict[str, int], bucket_by: str | None, choice: dict[str, Any]
) -> dict[str, Any]:
    """A Loader state: ``position`` (the order stage's) plus the settings."""
    return {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        **position,
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
        **choice,
    }


def check_state(state: object, mine: dict[str, Any]) -> dict[str, Any]:
    """``state`` if this Loader (whose own state is ``mine``) can continue from it."""
    if not isinstance(state, dict):
        raise UsageTypeError(
            f"Loader.load_state_dict takes the dict state_dict() returned, got {type(state).__name__}"
        )
    if state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
        raise UsageError(
            f"not a dlop Loader state: format {state.get('format')!r} version "
            f"{state.get('version')!r}, expected {STATE_FORMAT!r} version {STATE_VERSION}"
        )
    for key in (*STATE_SETTINGS, *CHOICE_SETTINGS):
        if state.get(key) != mine[key]:
            raise UsageError(
                f"loader state was saved with {key}={state.get(key)!r:.200}, this loader has "
                f"{mine[key]!r:.200}; resume with the settings and samples it was saved with"
            )
    if state.get("rank") != mine["rank"]:
        raise UsageError(
            f"loader state is rank {state.get('rank')}'s, this loader is rank {mine['rank']}"
        )
    return state

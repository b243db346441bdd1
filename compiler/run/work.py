"""What a worker does with a chunk of a unit's inputs: the one seam between the engines
(local processes, Dask) and the work itself.

A Work is small and picklable: it travels to every worker once (a pool's
initializer, a Dask task) and makes each input's Outcome there. PresetWork decodes
and featurizes by a Recipe (items.py); compiling a user's own Dataset or function is
another Work (dlop.compiler.custom).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from ..corpus.records import Item
from ..recipe import Recipe, build_recipe
from ..urls import fetch_inputs
from .items import CorpusShape, Outcome, process_items

# Inputs featurized together as one task of a local pool, cut from each unit's first
# input (the bytes do not depend on the grouping, featurize_clips).
CHUNK_ITEMS = {"audio": 16, "video": 2, "image": 4}


def process_fetched(
    chunk: list[Item],
    recipe: Recipe,
    shape: CorpusShape,
    storage_options: dict[str, Any] | None,
    systems: dict[str, Any],
) -> list[Outcome]:
    """process_items on one chunk, the bytes of its URL inputs fetched first and let go
    after it (a worker holds one chunk's input bytes at a time). An object that cannot be
    read is a bad input, recorded with the reason. The items given are not changed.
    ``systems``: the storages, by scheme, that one compile's worker reuses
    across its chunks (a new S3 client costs more than a chunk's fetches)."""
    copies = [replace(item) for item in chunk]
    fetch_inputs(copies, storage_options, systems)
    return process_items(copies, recipe, shape)


def chunk_items(recipe: Recipe, media: str) -> int:
    """Inputs per chunk (CHUNK_ITEMS): an image compile that keeps whole images (no crop,
    or tiles covering the image) goes one image at a time, since a worker holds a whole
    chunk's samples at once; a cropped image's samples are small, and a few to a chunk
    save the pool's per-chunk round trip."""
    vision = recipe.vision
    if media == "image" and (vision.crop is None or vision.tile is not None):
        return 1
    return CHUNK_ITEMS[media]


class Work(Protocol):
    """Makes the outcomes of a chunk of inputs, in order; never raises for bad input."""

    def chunk_items(self) -> int:
        """Inputs per chunk: the inputs a local pool's worker is given at a time."""
        ...

    def outcomes(self, chunk: list[Item], systems: dict[str, Any]) -> Iterable[Outcome]:
        """Each input's outcome, in order. ``systems``: the storages one
        worker reuses across chunks."""
        ...

    def name(self, item: Item) -> str:
        """The input as errors.jsonl names it."""
        ...

    def item_timeout(self) -> float | None:
        """Seconds an input may take before its worker is killed and it is recorded as
        bad; None: no limit."""
        ...

    def guarded(self) -> bool:
        """Whether the inputs run only in worker processes, one worker too (a user's code,
        which may exit, crash or hang), never in the compiling process."""
        ...


_RECIPES: dict[str, Recipe] = {}  # a worker builds each compile's recipe once


@dataclass(frozen=True)
class PresetWork:
    """Decode and featurize by a recipe (its JSON: what build_recipe reads back)."""

    recipe_json: dict[str, Any]
    digest: str
    shape: CorpusShape
    storage_options: dict[str, Any] | None = None

    @property
    def recipe(self) -> Recipe:
        recipe = _RECIPES.get(self.digest)
        if recipe is None:
            recipe = _RECIPES[self.digest] = build_recipe(self.recipe_json)
        return recipe

    def chunk_items(self) -> int:
        return chunk_items(self.recipe, self.shape.media)

    def outcomes(self, chunk: list[Item], systems: dict[str, Any]) -> Iterable[Outcome]:
        return process_fetched(chunk, self.recipe, self.shape, self.storage_options, systems)

    def name(self, item: Item) -> str:
        return item.path or item.key

    def item_timeout(self) -> float | None:
        return None  # dlop's own decoders: a hostile file is an error, never a hang

    def guarded(self) -> bool:
        return False  # one worker featurizes in the compiling process, with no round trips

"""What a worker does with a chunk of a unit's inputs: the one seam between the engines
(local processes, Dask) and the work itself.

A Work is small and picklable: it travels to every worker once (a pool's
initializer, a Dask task) and makes each input's Outcome there. PresetWork decodes
and featurizes by a Recipe (items.py); compiling a user's own Dataset or function is
another Work (dlop.compiler.custom).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from ..corpus.records import Item
from ..recipe import Recipe, build_recipe
from .items import CorpusShape, Outcome


class Work(Protocol):
    """Makes the outcomes of a chunk of inputs, in order; never raises for bad input."""

    def chunk_items(self) -> int:
        """Inputs per chunk: the inputs a local pool's worker is given at a time."""
        ...

    def outcomes(self, chunk: list[Item], systems: dict[str, Any]) -> Iterable[Outcome]:
        """Each input's outcome, in order. ``systems``: the fsspec filesystems one
        worker reuses across chunks."""
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
        from .units import chunk_items

        return chunk_items(self.recipe, self.shape.media)

    def outcomes(self, chunk: list[Item], systems: dict[str, Any]) -> Iterable[Outcome]:
        from .units import process_fetched

        return process_fetched(chunk, self.recipe, self.shape, self.storage_options, systems)

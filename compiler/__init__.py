"""Offline compilation: corpus sources -> decoders -> featurizers -> shard writer.

``corpus`` lists a SOURCE by its layout into inputs; ``audio`` and ``vision`` decode
and featurize them; ``run`` processes them in work units on local processes or Dask
and drives the compile from taking OUT to its index; ``output`` is what a compile
writes and how (OUT's guard, the journal, the units' commit records, the index merged
from them), below the run and never importing it. ``recipe`` holds the options,
``urls`` the storage a compile reads and writes through, ``errors`` the compiler's
errors. ``custom`` compiles a user's own Dataset or function.

Importable from here: ``compile_corpus``, the preset compile (``dlop-compile SOURCE``)
of a ``Recipe`` that ``build_recipe`` makes from a recipe file's options; and
``compile_dataset`` and ``compile_map``; ``add_fields`` and ``drop_fields``, which add
a field group to an archive (``groups``) or drop one.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names below, for type checkers; at run time imported on first use
    from .custom import compile_dataset, compile_map
    from .groups import add_fields, drop_fields
    from .recipe import Recipe, build_recipe
    from .run.pipeline import compile_corpus

__all__ = [
    "Recipe",
    "add_fields",
    "build_recipe",
    "compile_corpus",
    "compile_dataset",
    "compile_map",
    "drop_fields",
]

# the module each name comes from
_HOMES = {
    "Recipe": ".recipe",
    "build_recipe": ".recipe",
    "compile_corpus": ".run.pipeline",
    "compile_dataset": ".custom",
    "compile_map": ".custom",
    "add_fields": ".groups",
    "drop_fields": ".groups",
}


def __getattr__(name: str) -> Any:
    # imported on first use: `import dlop.compiler` stays light (no torch)
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home, __name__), name)

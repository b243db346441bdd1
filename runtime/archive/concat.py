"""Several archives read as one: the paths an archive argument names and the check
that they hold the same schema (their shards come from one LocalSupply,
runtime.storage.supply).

The shards of archives ``a, b, ...`` are numbered one after another, so the
gathers (which address a list of shards by ``starts``) read across archives
unchanged: sample ``i`` of ``b`` is sample ``len(a) + i`` of the whole.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dlop.formats import ArchiveReader

from ..errors import UsageError, UsageTypeError

ArchivePaths = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]

# Recipe entries that change where a compile read or how it stored bytes, not what a
# sample holds: archives that differ only in these are read as one without asking.
RECIPE_STORAGE_KEYS = frozenset(
    {"source", "layout", "images", "masks", "codec", "feature_codec", "shard_bytes", "on_error"}
)


def archive_paths(path: object, distinct: bool = False) -> tuple[Path, ...]:
    """The archive folders ``path`` names: one path, or a list of them; with
    ``distinct``, a list that names one archive twice is refused (its samples would
    be read twice an epoch; a mixture's sources may choose from one archive)."""
    if isinstance(path, str | os.PathLike):
        return (Path(path),)
    if isinstance(path, Sequence) and not isinstance(path, bytes):
        paths = list(path)
        bad = [p for p in paths if not isinstance(p, str | os.PathLike)]
        if bad or not paths:
            raise UsageTypeError(
                "archives are given as a path or a non-empty list of paths, got "
                f"{'an empty list' if not paths else repr(bad[0])}"
            )
        if distinct:
            refuse_repeats(paths)
        return tuple(Path(p) for p in paths)
    raise UsageTypeError(f"an archive is a path or a list of paths, got {type(path).__name__}")


def refuse_repeats(paths: Sequence[str | os.PathLike[str]]) -> None:
    seen: dict[Path, object] = {}
    for p in paths:
        key = Path(p).resolve()
        if key in seen:
            raise UsageError(
                f"the list of archives to read as one names {key} twice (as {seen[key]!s} "
                f"and {p!s}): its samples would be read twice an epoch; name each archive "
                "once (to read some samples more often, mix sources with weights)"
            )
        seen[key] = p


def sample_recipe(recipe: dict[str, Any]) -> dict[str, Any]:
    """The recipe entries that shape what a sample holds."""
    return {k: v for k, v in recipe.items() if k not in RECIPE_STORAGE_KEYS}


def check_compatible(
    readers: Sequence[ArchiveReader], names: Sequence[str] | None, allow_recipe_mismatch: bool
) -> None:
    """Refuses archives that differ in the name, kind, dtype, shape or storage (raw or
    compressed) of a field read (``names``, default all), or (unless
    ``allow_recipe_mismatch``) in a recipe entry that shapes samples."""
    first = readers[0]
    for other in readers[1:]:
        a, b = first.fields, other.fields
        if names is None and set(a) != set(b):  # the same fields in another order read alike
            only = [n for n in a if n not in b] or [n for n in b if n not in a]
            raise UsageError(
                f"archives {first.directory} and {other.directory} cannot be read as one: "
                f"fields {list(a)} and {list(b)} differ (field {only[0]!r}); open them "
                "with fields=[...] naming the fields they share"
            )
        for name in list(a) if names is None else names:
            fa, fb = a.get(name), b.get(name)
            if fa is None and fb is None:
                continue  # in neither: the archive's own check names the field
            if fa is None or fb is None:
                has, lacks = (other, first) if fa is None else (first, other)
                raise UsageError(
                    f"archives {first.directory} and {other.directory} cannot be read as one: "
                    f"field {name!r} is in {has.directory} but not in {lacks.directory}; read "
                    "fields they share (fields=[...])"
                )
            mine = (fa.kind, fa.dtype, fa.shape, fa.codec.mappable)
            theirs = (fb.kind, fb.dtype, fb.shape, fb.codec.mappable)
            if mine != theirs:
                raise UsageError(
                    f"archives {first.directory} and {other.directory} cannot be read as one: "
                    f"field {name!r} is {describe(fa)} in the first and {describe(fb)} in the "
                    "second; compile them with one recipe, or leave the field out (fields=[...])"
                )
        ra, rb = sample_recipe(first.index.recipe), sample_recipe(other.index.recipe)
        if ra != rb and not allow_recipe_mismatch:
            keys = sorted(k for k in ra.keys() | rb.keys() if ra.get(k) != rb.get(k))
            raise UsageError(
                f"archives {first.directory} and {other.directory} were compiled with "
                f"different recipes (recipe {keys[0]!r}: {ra.get(keys[0])!r} and "
                f"{rb.get(keys[0])!r}); recompile one, or pass allow_recipe_mismatch=True "
                "if the features are comparable"
            )


def describe(f: Any) -> str:
    return f"{f.kind} {f.dtype}{list(f.shape)} {f.codec.describe()}"

"""An append (``dlop-compile --append``): the inputs of SOURCE that the archive in OUT does
not hold yet, compiled into a generation of their own (formats.generations).

The archive's inputs are known by identity (Corpus.identity_texts: a preset's input
key, a function's input, a Dataset's index), recorded by every compile beside its
shards. An append takes the inputs whose identity no generation holds, in corpus
order, and numbers its work units after the archive's, so none of its files has a
name the archive uses: the archive's files are never written, and a reader that
opened its index reads it to its end. The append keeps a copy of the index it
appends to until it ends (guard.BASE_COPY), so that a --resume appends to the same
archive whether or not the new index was published before it stopped.

Where the archive's last generation records the listing file it listed (ESC-50's CSV,
formats.generations.Listed) and that file begins with the same bytes now, the layout
lists the lines after them only (list_for_append): beyond its new inputs, an append then
pays for hashing that file and reading the archive's input identities, not for listing
every input again.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dlop.formats import (
    ERRORS_NAME,
    INDEX_NAME,
    DlopError,
    Field,
    FormatError,
    Index,
    parse_index,
)
from dlop.formats.generations import (
    IDENTITY_BYTES,
    MAX_GENERATIONS,
    errors_name,
    inputs_name,
    parse_identities,
    units_cut,
)

from ..corpus.records import Corpus, Known, Picked
from ..errors import CompileError
from ..output.guard import BASE_COPY
from ..output.journal import changed_options
from ..output.merge import plan_metadata, source_path
from ..output.store import Store
from ..recipe import Recipe


@dataclass(frozen=True)
class Appending:
    """What an append compiles: the archive it appends to (its index, the names of its
    files, the sha256 of its index), the inputs it does not hold, and the number of the
    append's first unit (after the archive's)."""

    base: Index
    files: frozenset[str]
    digest: str
    corpus: Corpus
    first_unit: int


def list_for_append(store: Store, resume: bool, lister: Callable[[Known | None], Corpus]) -> Corpus:
    """The corpus an append lists (``lister``, given what the archive in OUT says of the
    listing its last compile read, or None): the lines of the listing file after the ones
    the archive listed, where the layout can list those alone (Corpus.after) and none of
    them names an input the archive holds; else the whole listing. An archive that cannot
    be read is listed for in full: take_base says what is wrong with it."""
    base = _readable_base(store, resume)
    listed = None if base is None or not base.generations else base.generations[-1].listed
    if base is None or listed is None:
        return lister(None)
    skipped = any(g.skipped for g in base.generations)
    corpus = lister(Known(listed, base.metadata, skipped, tuple(f.name for f in base.fields)))
    if corpus.after is None:
        return corpus
    try:
        held = held_inputs(store, base)
    except CompileError:
        return lister(None)
    # a line after them naming an input listed before: its repeat's number (SPEC.md §6.2)
    # counts the ones before, which only the whole listing sees (identities alike among
    # the new lines, which check_distinct refuses, can only make this relist in vain)
    if np.isin(corpus.identities(), held, assume_unique=True).any():
        return lister(None)
    return corpus


def _readable_base(store: Store, resume: bool) -> Index | None:
    """The archive an append adds to, or None where it cannot be read now: OUT's own
    checks, then take_base, say why (OUT a file, an index missing or damaged)."""
    try:
        data = store.read(BASE_COPY if resume else INDEX_NAME)
        return None if data is None else parse_index(store.url, data)
    except (OSError, DlopError):
        return None


def take_base(
    store: Store, resume: bool, recipe: Recipe, corpus: Corpus, fields: tuple[Field, ...]
) -> Appending | Index:
    """Reads the archive in OUT (for a resume, the append's copy of it), checks that this
    compile's recipe, schema and corpus facts are its own, and cuts the corpus down to the
    inputs it does not hold. Returns the archive itself, with nothing written, when it
    holds every input already."""
    where = f"{store.url}/{BASE_COPY if resume else INDEX_NAME}"
    data = store.read(BASE_COPY if resume else INDEX_NAME)
    if data is None:
        raise CompileError(
            f"{where}: missing; "
            + (
                "no interrupted append here: an interrupted first compile resumes with "
                "--resume alone"
                if resume
                else "OUT holds no archive to append to"
            )
        )
    try:
        base = parse_index(where, data)
    except FormatError as e:
        raise CompileError(f"{e}; nothing was appended") from None
    if resume:
        published = _published(store, base)
        if published is not None:  # it got past its index: only the tidying up was left
            return published
    if corpus.after is not None and (
        not base.generations or base.generations[-1].listed != corpus.after
    ):
        raise CompileError(
            f"{where}: the archive changed while its corpus was listed (another append into "
            "OUT?); nothing was appended, run the append again"
        )
    check_same(recipe, corpus, fields, base, store.url)
    check_room(base, store.url)
    held = held_inputs(store, base)
    ids = corpus.identities()
    check_distinct(ids, corpus, store.url)
    # ids are distinct (check_distinct), which is all assume_unique needs for their answers
    new = np.flatnonzero(~np.isin(ids, held, assume_unique=True))
    if not len(new):
        if resume:
            raise CompileError(
                f"{store.url}: none of the inputs the interrupted append was adding is "
                "listed now; list the corpus as it was when the append began and run "
                "--append --resume again (--overwrite would replace the whole archive, not "
                "only this append)"
            )
        where = f"of {corpus.root}" if corpus.root else "given"
        print(
            f"dlop-compile: {store.url} holds all {corpus.prefix + len(ids)} inputs {where} already; "
            "nothing to append",
            file=sys.stderr,
            flush=True,
        )
        return base
    digest = hashlib.sha256(data).hexdigest()
    # by the inputs' places in the whole listing: the same whether the lines before the
    # new ones were listed or not (list_for_append)
    places = (new + corpus.prefix).astype(np.int64)
    picked = hashlib.sha256(corpus.fingerprint.encode() + digest.encode() + places.tobytes())
    first_unit = units_cut(base.generations)  # each has units (check_room)
    if not resume:
        store.write(BASE_COPY, data)  # before the journal: a resume always finds it
    return Appending(
        base,
        files_of(base),
        digest,
        replace(
            corpus, items=Picked(corpus.items, new), fingerprint=picked.hexdigest(), ids=ids[new]
        ),
        first_unit,
    )


def _published(store: Store, base: Index) -> Index | None:
    """The index an interrupted append published before it stopped (its base's generations,
    then one more), or None when OUT's index is still the base."""
    data = store.read(INDEX_NAME)
    if data is None:
        return None
    try:
        index = parse_index(f"{store.url}/{INDEX_NAME}", data)
    except FormatError:
        return None
    count = len(base.generations)
    if (
        len(index.generations) == count + 1
        and index.generations[:count] == base.generations
        and index.shards[: len(base.shards)] == base.shards
    ):
        return index
    return None


def check_room(base: Index, where: str) -> None:
    """Refuses an append the archive has no room or names for: a generation past
    MAX_GENERATIONS, or a generation that records no work units (its shards' names
    could not be told from the new ones')."""
    if len(base.generations) >= MAX_GENERATIONS:
        raise CompileError(
            f"{where}: the archive holds {len(base.generations)} generations, the most an "
            f"index lists (SPEC.md §8); compile the whole corpus afresh to append to it again"
        )
    bare = [g for g, gen in enumerate(base.generations) if gen.units is None]
    if bare:
        raise CompileError(
            f"{where}: generation {bare[0]} records no work units, so the names of its shards "
            "are not known apart from the ones an append would write; nothing was appended"
        )


def check_distinct(ids: np.ndarray, corpus: Corpus, where: str) -> None:
    """Refuses an append over a listing that names two inputs alike: by identity, the
    archive could not tell which of them it holds (one would be lost or written twice)."""
    order = np.argsort(ids, kind="stable")
    same = np.flatnonzero(ids[order][1:] == ids[order][:-1])
    if len(same):
        first, second = sorted(int(order[k]) for k in (same[0], same[0] + 1))
        texts = corpus.identity_texts()
        name = next(t for n, t in enumerate(texts) if n == second)
        raise CompileError(
            f"{where}: inputs {first + corpus.prefix} and {second + corpus.prefix} of the "
            f"corpus are both named {name!r:.200} "
            "(an input's identity: its key, path or value); an append tells inputs apart by "
            "it, so one of them would be lost or written twice. Give them distinct names, or "
            "compile the whole corpus afresh; nothing was appended"
        )


def files_of(index: Index) -> frozenset[str]:
    """Every file of an archive: its index, shards, each generation's files and its field
    groups' shards."""
    names = {INDEX_NAME, ERRORS_NAME, *(s.file for s in index.shards)}
    for g in range(len(index.generations)):
        names |= {errors_name(g), inputs_name(g)}
    names |= {s.info.file for g in index.field_groups for s in g.shards}
    return frozenset(names)


def held_inputs(store: Store, base: Index) -> np.ndarray:
    """The identities of the inputs every generation of the archive read."""
    if not base.generations:
        raise CompileError(
            f"{store.url}: the archive records no input identities (it was compiled by a dlop "
            "that predates --append), so an append cannot tell which inputs it holds; "
            "compile the whole corpus afresh (--overwrite) to append to it later"
        )
    held = []
    for g, gen in enumerate(base.generations):
        name = inputs_name(g)
        try:
            # no more than its generation's identities take: a file grown past them is
            # refused before it is read whole
            data = store.read(name, cap=gen.inputs * IDENTITY_BYTES)
            if data is None:
                raise CompileError(f"{store.url}/{name}: missing")
            held.append(parse_identities(f"{store.url}/{name}", data, gen))
        except (FormatError, CompileError) as e:
            raise CompileError(f"{e}; the archive is damaged, nothing was appended") from None
    return np.concatenate(held)


def check_same(
    recipe: Recipe, corpus: Corpus, fields: tuple[Field, ...], base: Index, where: str
) -> None:
    """Refuses an append whose recipe, schema or corpus facts (class names...) differ from
    the archive's, naming what differs: its samples would not mean what the archive's do.
    A list of names may grow at its end (new classes after the archive's)."""
    before, now = comparable(base.recipe), comparable(recipe.to_json())
    source = base.provenance.get("source")
    path = source.get("path") if isinstance(source, dict) else None
    if isinstance(path, str) and path != source_path(corpus):
        raise CompileError(
            f"{where}: --append reads its corpus from {source_path(corpus)!r}, the archive's "
            f"was read from {path!r}; an input's identity is its name within its corpus, "
            "so an append reads the same corpus, grown"
        )
    if before != now:
        raise CompileError(
            f"{where}: --append with another recipe than the archive's ("
            + "; ".join(changed_options(before, now))
            + "); append with the options it was compiled with, or compile afresh"
        )
    if base.fields != fields:
        theirs = {f.name: f.to_json() for f in base.fields}
        mine = {f.name: f.to_json() for f in fields}
        differ = [n for n in {**theirs, **mine} if theirs.get(n) != mine.get(n)]
        raise CompileError(
            f"{where}: --append would write fields {', '.join(differ)} otherwise than the "
            "archive holds them; append with the options it was compiled with"
        )
    metadata = json.loads(json.dumps(plan_metadata(recipe, corpus)))
    differ = sorted(
        k
        for k in {**metadata, **base.metadata}
        if not extends(base.metadata.get(k), metadata.get(k))
    )
    if differ:
        raise CompileError(
            f"{where}: --append of a corpus whose {', '.join(differ)} differ from the "
            "archive's (a label would mean another class); compile the whole corpus afresh"
        )


def extends(before: Any, now: Any) -> bool:
    """Whether a corpus fact ``now`` keeps ``before``: equal, or a list (class names) that
    goes on after it, each earlier entry at its index."""
    if isinstance(before, list) and isinstance(now, list):
        return now[: len(before)] == before
    return bool(before == now)


def comparable(recipe: dict[str, Any]) -> dict[str, Any]:
    """A recipe as an append compares it: a user compile's inputs by where they are listed
    from only (their count and fingerprint grow with them), and its code without the
    state a Dataset holds (which grows with it; compiler.custom computes some of the
    archive's samples again instead)."""
    inputs, code = recipe.get("inputs"), recipe.get("code")
    if recipe.get("compile") and isinstance(inputs, dict) and isinstance(code, dict):
        return {
            **recipe,
            "inputs": {k: v for k, v in inputs.items() if k == "source"},
            "code": {k: v for k, v in code.items() if k != "state"},
        }
    # a preset's SOURCE as given ("c", "./c", an absolute path): the folder it names is
    # compared instead (provenance's source path, check_same)
    return {k: v for k, v in recipe.items() if k != "source"}


def stored_form(sample: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], bytes]]:
    """A sample as the archive stores it, field by field: shape and bytes (a str's UTF-8),
    whether written (a user compile's conformed sample) or read back."""
    out: dict[str, tuple[tuple[int, ...], bytes]] = {}
    for name, value in sample.items():
        if isinstance(value, str):
            out[name] = ((), value.encode("utf-8"))
        elif isinstance(value, bytes | bytearray | memoryview):
            out[name] = ((len(value),), bytes(value))
        else:
            array = np.ascontiguousarray(np.asarray(value))
            out[name] = (tuple(array.shape), array.tobytes())
    return out

"""compile_dataset and compile_map: a user's own Dataset or function, compiled with the
guarantees of the built-in presets (work units, resume, Dask, errors.jsonl).

The driver first computes a few items itself (the probe) to infer the schema
(samples.py); the units then check every sample against it. When a later item shows
a fixed axis to vary, the compile starts again with that axis ragged (said on
stderr), so the archive's schema depends only on the items, never on the engine or
the order units ran in. A --resume takes the schema from the interrupted compile's
journal, after checking that the code, its arguments, the inputs and the options
are those it began with.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
import torch

from dlop.formats import Index
from dlop.formats.constants import MAX_ARCHIVE_SAMPLES
from dlop.formats.files import loads_bounded

from ..corpus.records import Corpus, input_text
from ..errors import AxisVaries, CompileError
from ..output.guard import committed_units
from ..output.journal import JOURNAL, MAX_JOURNAL_BYTES, Journal
from ..output.store import open_store
from ..recipe import (
    DTYPES,
    MAX_SHARD_BYTES,
    MAX_WORKERS,
    MIN_SHARD_BYTES,
    ON_ERROR_POLICIES,
    parse_size,
)
from ..run.driver import Run
from ..run.items import CorpusShape
from ..run.pipeline import heap_frozen, run_compile, unit_size
from ..run.units import sample_digest
from .code import changes, describe
from .guard import Prober
from .samples import (
    Mismatch,
    SampleError,
    Spec,
    conform,
    given_schema,
    infer,
    merge,
    widened,
)
from .work import (
    Inputs,
    UserWork,
    bare,
    describe_shape,
    item_name,
    reason,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

PROBE_ITEMS = 8  # items the driver computes to infer the schema
PROBE_TRIES = 64  # items it tries before giving up when all of them fail
PROBE_SECONDS = 1.0  # past this, the probe stops once it holds two samples
FLOAT_DTYPES = tuple(DTYPES)  # the presets' stored dtypes: float16, bfloat16, float32


@dataclass(frozen=True)
class CustomRecipe:
    """What a compile of a user's code records (index.json's ``recipe``), and the schema
    its items made. The interface of compiler.recipe.Recipe that a Run uses."""

    kind: str  # "dataset" | "map"
    code: dict[str, Any]
    inputs: dict[str, Any]  # count, fingerprint, and the listing's source when there is one
    seed: int
    schema: dict[str, Any] | None
    dtype: str | None
    codec: str
    shard_bytes: int
    on_error: str
    specs: dict[str, Spec] = field(default_factory=dict)
    structure: dict[str, Any] = field(default_factory=dict)
    images: None = None  # what output.guard.check_apart asks of a recipe
    masks: None = None

    @property
    def source(self) -> str:
        return str(self.inputs.get("source", ""))

    @property
    def feature_name(self) -> str:
        arrays = [s for s in self.specs.values() if s.kind == "array" and s.shape]
        ragged = [s for s in arrays if None in s.shape]
        return (ragged or arrays or list(self.specs.values()))[0].name

    def options(self) -> dict[str, Any]:
        """What the user chose besides the code and inputs."""
        return {
            "seed": self.seed,
            "schema": self.schema,
            "dtype": self.dtype,
            "codec": self.codec,
            "shard_bytes": self.shard_bytes,
            "on_error": self.on_error,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "compile": self.kind,
            "code": self.code,
            "inputs": self.inputs,
            **self.options(),
            "fields": [s.to_json() for s in self.specs.values()],
            "structure": self.structure,
        }

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()

    def fields(self) -> tuple[Any, ...]:
        return tuple(s.field(self.codec) for s in self.specs.values())


class Options(TypedDict, total=False):
    """The keywords of compile_dataset and compile_map, and what each means (the default
    is DEFAULTS')."""

    workers: int | None  # local worker processes (None: every core)
    dask: str | None  # a Dask scheduler address, or local:N for a LocalCluster
    resume: bool  # finish the interrupted compile in OUT
    append: bool  # add the inputs the archive in OUT does not hold (docs/compile.md)
    overwrite: bool  # replace the archive or interrupted compile in OUT
    on_error: str  # "skip": an item that raises (or gives None) is recorded; "fail": stop
    shard_bytes: int | str  # target shard size: bytes, or "256MiB"
    compression: str  # raw, zstd or zstd:LEVEL, for array fields
    unit_inputs: int | None  # items per work unit (None: 4096)
    schema: Mapping[str, Any] | None  # field -> dtype, or {"dtype", "shape": [null: ragged]}
    seed: int  # random, numpy and torch seeded from (seed, index) before each item
    dtype: str | None  # float16, bfloat16 or float32: every float field stored so
    progress: bool  # a progress bar (a line every 30 s when stderr is not a terminal)
    on_progress: Callable[[int], None] | None  # called with the items done so far
    storage_options: dict[str, Any] | None  # fsspec options for a URL OUT or inputs
    arguments: Any  # JSON values the Dataset or function was made with (recorded)
    # seconds an item may take, with workers > 1 or Dask, before its worker process is
    # killed and the item recorded as bad (None: no limit)
    item_timeout: float | None


DEFAULTS: dict[str, Any] = {
    "workers": None,
    "dask": None,
    "resume": False,
    "append": False,
    "overwrite": False,
    "on_error": "skip",
    "shard_bytes": 256 << 20,
    "compression": "raw",
    "unit_inputs": None,
    "schema": None,
    "seed": 0,
    "dtype": None,
    "progress": True,
    "on_progress": None,
    "storage_options": None,
    "arguments": None,
    "item_timeout": None,
}


def _chosen(options: Mapping[str, Any], who: str) -> dict[str, Any]:
    """Every keyword's value (DEFAULTS for those not given); a TypeError names an unknown
    one, with the closest known name."""
    for name in options:
        if name not in DEFAULTS:
            close = difflib.get_close_matches(name, DEFAULTS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{who}() got an unexpected keyword argument {name!r}{hint}")
    return {**DEFAULTS, **options}


@heap_frozen()
def compile_dataset(dataset: Any, out: str | os.PathLike[str], **options: Unpack[Options]) -> Index:
    """Compiles ``dataset[i]`` for every i in range(len(dataset)) into an archive at ``out``;
    returns its index. Reading it back (dlop.runtime.open_archive) gives each item as the
    Dataset gave it, arrays as tensors (docs/custom.md). The keywords are Options'."""
    chosen = _chosen(options, "compile_dataset")
    kind = type(dataset).__name__
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise CompileError(
            f"compile_dataset: a {kind} has no len() and [i]: give a map-style Dataset, or "
            "compile an iterable with compile_map(fn, inputs)"
        )
    try:
        count = dataset.__len__()
    except (Exception, SystemExit) as e:  # the user's code
        raise CompileError(f"compile_dataset: len() of the {kind} failed: {reason(e)}") from None
    if type(count) is not int or count < 1:
        raise CompileError(
            f"compile_dataset: len() of the {kind} is {count!r:.40}, not a positive int; "
            "nothing to compile"
        )
    if count > MAX_ARCHIVE_SAMPLES:
        raise CompileError(
            f"compile_dataset: len() of the {kind} is {count}, more items than an archive "
            f"holds ({MAX_ARCHIVE_SAMPLES})"
        )
    fingerprint = hashlib.sha256(f"dataset:{count}".encode()).hexdigest()
    inputs = {"count": count, "fingerprint": fingerprint}
    return _compile(dataset, True, Inputs(count), inputs, out, chosen)


@heap_frozen()
def compile_map(
    fn: Callable[[Any], Any],
    inputs: Sequence[Any] | str | os.PathLike[str],
    out: str | os.PathLike[str],
    **options: Unpack[Options],
) -> Index:
    """Compiles ``fn(x)`` for every x in ``inputs`` into an archive at ``out`` (as LitData's
    ``optimize``); returns its index. ``inputs``: a sequence of JSON values (str, numbers,
    lists, dicts), or a path or URL: a .jsonl file of one JSON value a line, or a folder
    whose files (sorted, recursively) are the inputs as path strings. The keywords are
    Options'."""
    chosen = _chosen(options, "compile_map")
    if not callable(fn):
        raise CompileError(f"compile_map: {fn!r:.80} is not callable")
    if isinstance(inputs, str | os.PathLike):
        values, listing = read_inputs(os.fspath(inputs), chosen["storage_options"])
    else:
        values, listing = list(inputs), {}
    if not values:
        raise CompileError("compile_map: no inputs; nothing to compile")
    digest = hashlib.sha256()
    for n, value in enumerate(values):
        try:
            digest.update(input_text(value).encode() + b"\n")
        except RecursionError:
            raise CompileError(
                f"compile_map: input {n} nests too deep to record in the archive's fingerprint"
            ) from None
        except (TypeError, ValueError):
            raise CompileError(
                f"compile_map: input {n} is a {type(value).__name__}: inputs are JSON values "
                "(str, numbers, lists, dicts), recorded in the archive's fingerprint"
            ) from None
    digest.update(json.dumps(listing.get("sizes", [])).encode())
    described = {"count": len(values), "fingerprint": digest.hexdigest()}
    if listing.get("source"):
        described["source"] = listing["source"]
    return _compile(fn, False, Inputs(len(values), values), described, out, chosen)


def _compile(
    target: Any,
    dataset: bool,
    items: Inputs,
    inputs: dict[str, Any],
    out: str | os.PathLike[str],
    options: dict[str, Any],
) -> Index:
    kind = "dataset" if dataset else "map"
    on_error = options["on_error"]
    if on_error not in ON_ERROR_POLICIES:
        raise CompileError(f"on_error {on_error!r} must be one of {ON_ERROR_POLICIES}")
    check_options(options)
    timeout, seed, dtype = options["item_timeout"], options["seed"], options["dtype"]
    codec = str(options["compression"])
    given = given_schema(options["schema"])
    code = described(target, dataset, options["arguments"])
    recipe = CustomRecipe(
        kind,
        code,
        inputs,
        seed,
        {k: {"dtype": d, "shape": None if s is None else list(s)} for k, (d, s) in given.items()}
        or None,
        dtype,
        codec,
        _shard_bytes(options["shard_bytes"]),
        on_error,
    )
    label = code["qualname"] if dataset else getattr(target, "__name__", "fn")
    out_text = os.fspath(out)
    storage_options = options["storage_options"]
    journal = _journal_recipe(out_text, storage_options) if options["resume"] else None
    item_seconds = 0.0  # unknown on a resume: chunks of CHUNK_ITEMS
    if options["append"] and journal is None:  # the archive's schema, its recipe checked
        specs, structure = _resumed(recipe, _archive_recipe(out_text, storage_options), out_text)
        _check_archive_samples(
            UserWork(target, dataset, specs, seed, label, 0.0, structure, timeout),
            replace(recipe, specs=specs, structure=structure),
            items,
            out_text,
        )
    elif journal is not None:
        specs, structure = _resumed(recipe, journal[0], out_text)
        _check_witnesses(
            UserWork(target, dataset, specs, seed, label, 0.0, structure, timeout),
            replace(recipe, specs=specs, structure=structure),
            items,
            journal[1],
            out_text,
            storage_options,
        )
    else:
        probe = UserWork(target, dataset, {}, seed, label)
        specs, structure, item_seconds = _probe(
            probe, items, given, None if dtype is None else DTYPES[dtype], on_error, timeout
        )
    resume, overwrite = options["resume"], options["overwrite"]
    while True:
        _check_lengths_names(specs)
        recipe = replace(recipe, specs=specs, structure=structure)
        work = UserWork(target, dataset, specs, seed, label, item_seconds, structure, timeout)
        run = _run(recipe, items, work, out_text, options)
        try:
            with _random_state_kept():  # one worker runs the items in this process
                return run_compile(
                    run,
                    workers=options["workers"],
                    dask=options["dask"],
                    resume=resume,
                    overwrite=overwrite,
                    append=options["append"],
                )
        except AxisVaries as e:
            specs = widened(specs, e.field, e.axis)
            print(
                f"dlop-compile: {e}; compiling again from the start with that axis ragged "
                "(pass schema= to declare it)",
                file=sys.stderr,
                flush=True,
            )
            resume, overwrite = False, True  # what the stopped compile wrote is gone


def check_options(options: Mapping[str, Any]) -> None:
    """Refuses ``workers``, ``item_timeout``, ``seed``, ``dtype`` and ``compression`` values
    (Options') that no compile of one's own code takes, each named."""
    workers = options["workers"]
    if workers is not None and (type(workers) is not int or not 1 <= workers <= MAX_WORKERS):
        raise CompileError(
            f"workers {workers!r:.40} must be an int from 1 to {MAX_WORKERS} (or None: one "
            "per core)"
        )
    timeout = options["item_timeout"]
    if timeout is not None and (
        type(timeout) not in (int, float) or not 0 < timeout < float("inf")
    ):
        raise CompileError(
            f"item_timeout {timeout!r} must be a positive number of seconds (or None: no limit)"
        )
    seed = options["seed"]
    if type(seed) is not int or seed < 0:
        raise CompileError(f"seed {seed!r} must be a non-negative integer")
    dtype = options["dtype"]
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise CompileError(f"dtype {dtype!r} must be one of {FLOAT_DTYPES} (or None: as given)")
    from dlop.formats.codecs import parse_codec
    from dlop.formats.errors import SchemaError

    try:
        parse_codec(str(options["compression"]))
    except SchemaError as e:
        raise CompileError(f"compression: {e}") from None


def described(target: Any, dataset: bool, arguments: Any) -> dict[str, Any]:
    """The recipe's ``code`` entry (code.describe) with the ``arguments`` given, if any."""
    code = describe(target, dataset)
    if arguments is not None:
        try:
            code["arguments"] = json.loads(json.dumps(arguments, sort_keys=True))
        except (TypeError, ValueError):
            raise CompileError(
                f"arguments {arguments!r:.80}: recorded in the recipe, so JSON values (str, "
                "numbers, lists, dicts)"
            ) from None
    return code


def _shard_bytes(value: int | str) -> int:
    """shard_bytes as bytes, within the presets' bounds (one shard per sample is not one)."""
    size = parse_size(value)
    if not MIN_SHARD_BYTES <= size <= MAX_SHARD_BYTES:
        raise CompileError(
            f"shard_bytes {value!r}: expected {MIN_SHARD_BYTES} bytes (4KiB) to "
            f"{MAX_SHARD_BYTES} (1TiB)"
        )
    return size


def _check_lengths_names(specs: dict[str, Spec]) -> None:
    """A batch holds a ragged field's lengths as ``<name>_lengths``: no field may be named so."""
    for spec in specs.values():
        if spec.kind == "array" and None in spec.shape and f"{spec.name}_lengths" in specs:
            raise CompileError(
                f"fields {spec.name!r} and {spec.name + '_lengths'!r}: {spec.name!r} varies in "
                f"length, and a batch holds its lengths as {spec.name + '_lengths'!r}; rename "
                "the second"
            )


def _run(
    recipe: CustomRecipe, items: Inputs, work: UserWork, out: str, options: dict[str, Any]
) -> Run:
    corpus = Corpus(
        recipe.kind,
        recipe.source,
        items,
        has_label=False,
        has_text=False,
        extra_fields={},
        metadata={"structure": recipe.structure, "compiled": recipe.kind},
        fingerprint=recipe.inputs["fingerprint"],
        media="custom",
        identity="input" if recipe.kind == "map" else "key",
    )
    given = options["unit_inputs"]
    return Run(
        recipe,  # type: ignore[arg-type]  # the part of Recipe a Run uses
        corpus,
        CorpusShape.of(corpus),
        recipe.fields(),
        out,
        options["storage_options"],
        unit_size(given, "custom"),
        given is not None,
        options["progress"],
        options["on_progress"],
        custom_work=work,
    )


def _probe(
    work: UserWork,
    items: Inputs,
    given: dict[str, Any],
    float_dtype: str | None,
    on_error: str,
    limit: float | None,
) -> tuple[dict[str, Spec], dict[str, Any], float]:
    """The schema and structure the first items make, computed in a guarded process of
    their own (guard.py: an item that exits, crashes or hangs there is a failed item; the
    seeds as in a worker), and the seconds an item took. The probe stops early once slow
    items have given two samples: any schema the probe misses, the compile finds (and
    starts again), so its length changes only how soon."""
    specs: dict[str, Spec] | None = None
    structure: dict[str, Any] = {}
    failures: list[str] = []
    good = 0
    started = time.perf_counter()
    took = [float("inf")]
    prober = Prober(work, limit)
    try:
        with _random_state_kept():  # where the probe runs in this process
            for n in range(min(len(items), PROBE_TRIES)):
                item = items[n]
                name = item_name(work.label, item, work.dataset)
                got = prober.answer(item)
                took.append(got.seconds)
                if got.kind in ("raised", "died", "bad"):  # units record it as a bad item
                    failures.append(got.text)
                    if on_error == "fail":
                        if got.kind == "bad":
                            raise SampleError(got.text)
                        raise CompileError(f"{failures[-1]} (--on-error fail)")
                    continue
                if got.kind == "none":
                    continue
                shape, leaves = got.shape, got.leaves
                if specs is None:
                    specs, structure = infer(leaves, name, given, float_dtype), shape
                elif bare(shape) != bare(structure):
                    first = next(iter(specs.values())).item
                    raise CompileError(
                        f"{name} gives a sample of another shape than {first} "
                        f"({describe_shape(structure)}, then {describe_shape(shape)}): every "
                        "item must give the same dict or tuple"
                    )
                specs = merge(specs, leaves, name)  # the values checked too (casts, ranges)
                del got, leaves  # one item held at a time, however large
                good += 1
                if good == PROBE_ITEMS or (
                    good >= 2 and time.perf_counter() - started > PROBE_SECONDS
                ):
                    break
    finally:
        prober.close()
    if specs is None:
        tried = min(len(items), PROBE_TRIES)
        why = f"; the first: {failures[0]}" if failures else " (each gave None)"
        raise CompileError(f"none of the first {tried} items gave a sample{why}")
    # the fastest call: the first pays for imports and compiling (numba, CUDA kernels)
    return specs, structure, min(took)


@contextlib.contextmanager
def _random_state_kept() -> Iterator[None]:
    """The caller's random, numpy and torch generators as they were, after the probe."""
    state = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])


def _journal_recipe(
    out: str, storage_options: dict[str, Any] | None
) -> tuple[dict[str, Any], int] | None:
    """The recipe and unit size in OUT's journal (an interrupted compile), or None when
    there is none (finish_run then says so)."""
    data = open_store(out, storage_options).read(JOURNAL)
    if data is None or len(data) > MAX_JOURNAL_BYTES:
        return None
    try:
        obj = loads_bounded(out, data, "the journal")
        recipe, unit_inputs = obj.get("recipe"), obj.get("unit_inputs")
    except (CompileError, AttributeError, ValueError):
        return None
    except Exception:  # a damaged journal: finish_run names what is wrong
        return None
    if not isinstance(recipe, dict) or type(unit_inputs) is not int or unit_inputs < 1:
        return None
    return recipe, unit_inputs


RESUME_CHECKS = 8  # items a resume computes again, spread over the committed units


def _check_witnesses(
    work: UserWork,
    recipe: CustomRecipe,
    items: Inputs,
    unit_inputs: int,
    out: str,
    storage_options: dict[str, Any] | None,
) -> None:
    """Refuses a resume when items the interrupted compile wrote now give other samples:
    up to RESUME_CHECKS of the inputs its committed units recorded a digest of
    (units.witness_positions), spread over them, are computed again (guarded, as the
    probe's) and compared. This sees what the recipe's digest cannot (data a Dataset
    reads from elsewhere, a setting, a range it holds) where it changes those items."""
    store = open_store(out, storage_options)
    journal = Journal(store.url, recipe.digest(), "", unit_inputs, len(items))
    seen = sorted(w for r in committed_units(store, journal).values() for w in r.witnesses)
    if not seen:
        return
    chosen = [seen[k * len(seen) // RESUME_CHECKS] for k in range(min(RESUME_CHECKS, len(seen)))]
    prober = Prober(work, work.timeout)
    try:
        for index, wrote in chosen:
            item = items[index]
            name = work.name(item)
            why = _differs(
                prober,
                item,
                name,
                _digest_of,
                wrote,
                "it now gives another sample than the one written",
            )
            if why:
                raise CompileError(
                    f"{out}: --resume refused: {name} was compiled by the interrupted compile "
                    f"and {why}. The code, or data it reads from elsewhere, changed in a way "
                    "its recipe cannot see; compile afresh (--overwrite)"
                )
    finally:
        prober.close()


def _digest_of(sample: dict[str, Any]) -> str:
    return sample_digest([sample])


def _differs(
    prober: Prober,
    item: Any,
    name: str,
    form: Callable[[dict[str, Any]], object],
    was: object,
    otherwise: str,
) -> str:
    """Why ``item``, computed again (guarded, as the probe's), is not the sample it was:
    the conformed sample's ``form`` is not ``was`` (``otherwise`` says so); "" when it is."""
    got = prober.answer(item)
    if got.kind != "sample":
        return f"it now {'gives None' if got.kind == 'none' else 'fails: ' + got.text}"
    try:
        sample = conform(got.leaves, prober.work.specs, name)
    except Mismatch as e:
        return e.message
    return "" if form(sample) == was else otherwise


def _archive_recipe(out: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """The recipe of the archive in OUT, which an append adds to (``"appended": True``
    marks it so, for _resumed's messages); a missing or damaged index is left to the
    compile's own checks of OUT (run.append), which name it."""
    from dlop.formats import INDEX_NAME, FormatError, parse_index

    data = open_store(out, storage_options).read(INDEX_NAME)
    try:
        recipe = {} if data is None else parse_index(f"{out}/{INDEX_NAME}", data).recipe
    except FormatError:
        recipe = {}
    return {**recipe, "appended": True}


def _check_archive_samples(work: UserWork, recipe: CustomRecipe, items: Inputs, out: str) -> None:
    """Refuses an append when inputs the archive holds now give other samples than it
    stores: of each generation, its first and last written inputs and some between
    (_written_inputs), found among the inputs given (by identity), are computed again
    (guarded, as the probe's) and compared, field by field, with the stored samples.
    This sees what the recipe cannot (a Dataset's settings, its items moved to other
    indices, data it reads from elsewhere). A URL OUT is not read back for it: its
    recipe is compared only."""
    from dlop.formats import ArchiveReader, FormatError
    from dlop.formats.urls import is_url

    from ..run.append import stored_form

    if is_url(out) or not os.path.isfile(os.path.join(out, "index.json")):
        return
    try:
        reader = ArchiveReader(out, field_groups=False)
    except FormatError:
        return  # the compile's own checks of OUT name what is wrong
    with reader:
        try:
            chosen = _written_inputs(reader, recipe.kind)
        except FormatError:
            return  # the append's own reading of the archive names what is wrong
        kind = "input" if recipe.kind == "map" else "key"
        listed = Corpus("", "", items, False, False, {}, {}, "", identity=kind)
        here = listed.identities()
        position = {bytes(v): n for n, v in enumerate(here)}
        prober = Prober(work, work.timeout)
        try:
            for sample_number, identity in chosen:
                n = position.get(identity)
                if n is None:
                    continue  # the input is no longer given
                item = items[n]
                name = work.name(item)
                stored = stored_form(reader.sample(sample_number))
                why = _differs(
                    prober,
                    item,
                    name,
                    stored_form,
                    stored,
                    "it now gives another sample than the archive stores",
                )
                if why:
                    raise CompileError(
                        f"{out}: --append refused: {name} is in the archive and {why}. The "
                        "code, its settings, its items' order, or data it reads from "
                        "elsewhere changed; compile afresh (--overwrite)"
                    )
        finally:
            prober.close()


APPEND_CHECKS = 4  # written inputs an append computes again per generation (first, last...)


def _written_inputs(reader: Any, kind: str) -> list[tuple[int, bytes]]:
    """(sample number, input identity) of up to APPEND_CHECKS inputs of each generation
    that wrote a sample, its first and last among them. A user compile writes one sample
    per input it does not skip, so a generation's written inputs are its samples in
    order; its skipped ones are told by their records' keys: a Dataset's index (its
    identity's text), or for a function the input's place in the list that generation
    was given, known for the first generation only (a later one that skipped inputs is
    left out)."""
    from dlop.formats.generations import identities
    from dlop.formats.skipped import read_skipped

    out: list[tuple[int, bytes]] = []
    first_sample = 0
    for g, gen in enumerate(reader.index.generations):
        ids = reader.input_identities(g)
        start, first_sample = first_sample, first_sample + gen.num_samples
        name, count = reader.index.errors_files()[g]
        keys = [str(e.get("key")) for e in read_skipped(reader.directory, count, name)]
        if not keys:
            skipped = np.zeros(len(ids), bool)
        elif kind == "dataset":
            skipped = np.isin(ids, identities(keys))
        elif g == 0:
            skipped = np.isin(np.arange(len(ids)).astype(str), keys)
        else:
            continue
        written = np.flatnonzero(~skipped)
        if len(written) != gen.num_samples or not len(written):
            continue
        picks = sorted(
            {k * (len(written) - 1) // (APPEND_CHECKS - 1) for k in range(APPEND_CHECKS)}
        )
        out += [(start + k, bytes(ids[written[k]])) for k in picks]
    return out


def _resumed(
    recipe: CustomRecipe, before: dict[str, Any], out: str
) -> tuple[dict[str, Spec], dict[str, Any]]:
    """The interrupted compile's schema, once its code, inputs and options are this one's;
    for an append (``before`` marked "appended"), the archive's, once its code and options
    are this one's (the inputs grow)."""
    append = bool(before.get("appended"))
    verb = "--append" if append else "--resume"
    if append and set(before) == {"appended"}:  # no archive in OUT: run.append says so
        return {}, {}
    if before.get("compile") != recipe.kind:
        raise CompileError(
            f"{out}: {verb} to a compile that was not a compile_{recipe.kind} (it recorded "
            f"{before.get('compile') or 'a preset recipe'!r}); compile afresh (--overwrite)"
        )
    code = before.get("code") or {}
    # a Dataset grows in its attributes (a longer list of files): an append compares its
    # code, and computes some of the archive's samples again instead (_check_archive_samples)
    problems = changes(code, {**recipe.code, "state": code.get("state")} if append else recipe.code)
    if (before.get("code") or {}).get("arguments") != recipe.code.get("arguments"):
        problems.append("the arguments given changed")
    inputs = before.get("inputs") or {}
    if not append and inputs.get("fingerprint") != recipe.inputs["fingerprint"]:
        problems.append(
            f"the inputs changed ({inputs.get('count')} inputs then, {recipe.inputs['count']} now"
            + (", or their values)" if inputs.get("count") == recipe.inputs["count"] else ")")
        )
    for key, value in recipe.options().items():
        if before.get(key) != value:
            problems.append(f"{key} was {json.dumps(before.get(key))}, now {json.dumps(value)}")
    if problems:
        since = "the archive was compiled" if append else "the interrupted compile began"
        raise CompileError(
            f"{out}: {verb} refused, since {since}: "
            + "; ".join(problems)
            + f". {'Append' if append else 'Resume'} with the same code and options, or "
            "compile afresh (--overwrite, or overwrite=True)"
        )
    try:
        specs = {s["name"]: Spec.from_json(s) for s in before["fields"]}
        structure = before["structure"]
    except (KeyError, TypeError, ValueError):
        raise CompileError(f"{out}: the journal's schema is damaged; compile afresh") from None
    return specs, structure


def read_inputs(
    where: str, storage_options: dict[str, Any] | None = None
) -> tuple[list[Any], dict[str, Any]]:
    """A function's inputs from ``where``: a .jsonl file (one JSON value a line), or a
    folder or URL prefix whose files, sorted, are the inputs as path strings (with their
    sizes in the fingerprint)."""
    from dlop.formats.storage import FetchError, TooLargeError, open_storage
    from dlop.formats.urls import is_url, local_path

    from ..urls import MAX_FETCH_BYTES

    where = local_path(where)  # a file:// URL is the path it names
    if where.endswith(".jsonl"):
        if is_url(where):
            try:
                raw = open_storage(where, storage_options, whole_urls=True).fetch(
                    where, cap=MAX_FETCH_BYTES
                )
            except TooLargeError:
                raise CompileError(f"{where}: larger than its {MAX_FETCH_BYTES}-byte cap") from None
            except FetchError as e:
                if isinstance(e.cause, FileNotFoundError):
                    raise CompileError(f"{where}: not found") from None
                raise
        else:
            try:
                with open(where, "rb") as f:
                    raw = f.read()
            except OSError as e:
                raise CompileError(f"{where}: cannot read it ({e.strerror or e})") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CompileError(f"{where}: not UTF-8 text (byte {e.start})") from None
        values = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    values.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise CompileError(f"{where}:{n}: not a JSON value ({e.msg})") from None
        return values, {}
    if is_url(where):
        inputs = open_storage(where, storage_options)
        if not inputs.lists:
            raise CompileError(
                f"{where}: this storage cannot be listed; give the inputs as a .jsonl file of "
                "their URLs"
            )
        listed = sorted(inputs.sizes().items())
        base = where.rstrip("/")
        return [f"{base}/{name}" for name, _ in listed], {
            "source": base,
            "sizes": [size for _, size in listed],
        }
    if not os.path.isdir(where):
        raise CompileError(f"{where}: inputs are a .jsonl file, a folder or a URL prefix")
    paths = []
    for root, dirs, names in os.walk(where):
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # .git, .ipynb_checkpoints
        paths += [os.path.join(root, n) for n in names if not n.startswith(".")]
    paths.sort()
    return paths, {"source": where, "sizes": [os.path.getsize(p) for p in paths]}

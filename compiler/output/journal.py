"""The journal of a compile: what it compiles and how its inputs are cut into units,
written into OUT before any work, so that a resume knows what it resumes."""

from __future__ import annotations

import contextlib
import json
import secrets
from typing import Any, NoReturn

from dlop.formats import FormatError
from dlop.formats.constants import JOURNAL_NAME, MAX_INDEX_BYTES
from dlop.formats.files import loads_bounded
from dlop.formats.units import MAX_COUNT, is_count

from ..errors import CompileError
from .store import Store

JOURNAL = JOURNAL_NAME  # a corpus listing skips folders holding one (corpus.place)
# The journal holds the recipe that the archive's index will hold (a user's schema and
# arguments as much as a preset's options), so it is bounded as the index is: a recipe
# the index could hold is never too large for the journal.
MAX_JOURNAL_BYTES = MAX_INDEX_BYTES


def changed_options(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``option was -> is now`` for each recipe option (nested ones dotted) that differs,
    or one line saying that no option differs by name (the digests differ all the same)."""
    return differing(before, now, "") or ["none by name (the digest differs)"]


def differing(before: dict[str, Any], now: dict[str, Any], at: str) -> list[str]:
    out: list[str] = []
    for key in sorted(set(before) | set(now), key=str):
        name, a, b = f"{at}{key}", before.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differing(a, b, f"{name}.")
        elif a != b:
            out.append(f"{name} {json.dumps(a)[:80]} -> {json.dumps(b)[:80]}")
    return out


class Journal:
    """What an unfinished compile compiles and how its inputs are cut into units.

    Written once, as soon as OUT is taken and before any work; each finished unit
    then has its own commit record (units.py), so the journal never changes (but for
    its ``run``, which every resume writes again before it deletes anything, so that
    units still running for the earlier run publish nothing more: see check_run).
    """

    def __init__(
        self,
        where: str,
        digest: str,
        fingerprint: str,
        unit_inputs: int,
        num_inputs: int,
        numerics: dict[str, Any] | None = None,
        recipe: dict[str, Any] | None = None,
        append: tuple[int, str] | None = None,
    ) -> None:
        self.where = where
        self.digest, self.fingerprint = digest, fingerprint
        self.recipe = recipe or {}  # the options themselves: a resume names what changed
        # compiler.audio.numerics.resume_key of the compile: a resume must write with the same
        self.numerics = numerics or {}
        self.unit_inputs, self.num_inputs = unit_inputs, num_inputs
        # an append (run.append): the number of its first unit, and the sha256 of the index
        # it appends to; None for a first compile
        self.append = append
        # Names this compile in the journal: a URL OUT has no lock, so a compile checks
        # that the journal still names it before it publishes more (check_run).
        self.run = secrets.token_hex(8)

    def save(self, store: Store) -> None:
        store.write(JOURNAL, self.encoded())

    def encoded(self) -> bytes:
        """The journal's bytes; a CompileError when they are more than any journal (or the
        archive's index, which holds the same recipe) may be."""
        obj = {
            "recipe_digest": self.digest,
            "fingerprint": self.fingerprint,
            "unit_inputs": self.unit_inputs,
            "num_inputs": self.num_inputs,
            "run": self.run,
            "numerics": self.numerics,
            "recipe": self.recipe,
            **({} if self.append is None else {"append": list(self.append)}),
        }
        data = json.dumps(obj).encode()
        if len(data) > MAX_JOURNAL_BYTES:
            fields = self.recipe.get("fields")
            many = f" ({len(fields)} fields)" if isinstance(fields, list) else ""
            raise CompileError(
                f"{self.where}: this compile's recipe{many} is {len(data)} bytes as JSON, more "
                f"than the {MAX_JOURNAL_BYTES} an archive's index holds; give fewer fields "
                "(an array for many numbers) or smaller arguments"
            )
        return data

    def check_run(self, store: Store) -> None:
        """Refuses to go on when the journal in OUT no longer names this compile: another
        compile took OUT over (--overwrite, or --resume) while this one ran."""
        data = store.read(JOURNAL)
        found: object = None
        if data is not None and len(data) <= MAX_JOURNAL_BYTES:
            with contextlib.suppress(FormatError):
                obj = loads_bounded(self.where, data, "the journal")
                found = obj.get("run") if isinstance(obj, dict) else None
        if found != self.run:
            raise CompileError(
                f"{self.where}: another compile took this output over while this one ran "
                f"(the journal names run {found!r:.40}, this is run {self.run!r}); this one "
                "stops without writing index.json. Run one compile per output prefix at a "
                "time, then --resume or --overwrite it"
            )

    def load(self, store: Store, unit_inputs_given: bool) -> None:
        """Reads and checks the journal of the interrupted compile in ``store``; takes its
        unit size unless one was given (which must then be the same)."""
        data = store.read(JOURNAL)
        if data is None:
            raise CompileError(f"{self.where}: no interrupted compile to resume (no {JOURNAL})")
        if len(data) > MAX_JOURNAL_BYTES:
            self._bad(f"{len(data)} bytes, more than the {MAX_JOURNAL_BYTES} a journal takes")
        try:
            obj = loads_bounded(self.where, data, "the journal")
        except FormatError as e:
            self._bad(e.problem)
        if not isinstance(obj, dict):
            self._bad(f"expected a JSON object, got {type(obj).__name__}")
        digest, fingerprint = self._text(obj, "recipe_digest"), self._text(obj, "fingerprint")
        num_inputs, size = obj.get("num_inputs"), obj.get("unit_inputs")
        if not is_count(num_inputs, MAX_COUNT) or num_inputs < 1:
            self._bad(f"'num_inputs' is {num_inputs!r:.40}, expected an integer 1 ... 2^64-1")
        if not is_count(size, MAX_COUNT) or size < 1:
            self._bad(f"'unit_inputs' is {size!r:.40}, expected an integer 1 ... 2^64-1")
        appended = obj.get("append")
        if appended != (None if self.append is None else list(self.append)):
            if self.append is None or appended is None:
                what = "an append (--append)" if appended is not None else "a first compile"
                raise CompileError(
                    f"{self.where}: the interrupted compile was {what}; resume it as it began "
                    f"({'with' if appended is not None else 'without'} --append and --resume)"
                )
            raise CompileError(
                f"{self.where}: the interrupted append began on another archive than the one "
                "it keeps as its base; it cannot be resumed, compile afresh (--overwrite)"
            )
        if digest != self.digest:
            theirs_recipe = obj.get("recipe")
            what = (
                "options that differ: " + "; ".join(changed_options(theirs_recipe, self.recipe))
                if isinstance(theirs_recipe, dict) and theirs_recipe
                else f"its recipe digest {digest:.16}..., this one's {self.digest:.16}..."
            )
            raise CompileError(
                f"{self.where}: --resume with a different recipe than the interrupted compile "
                f"({what}); resume with the same recipe and options, or compile afresh "
                "(--overwrite)"
            )
        if fingerprint != self.fingerprint or num_inputs != self.num_inputs:
            way_out = (
                "compile afresh (--overwrite)"
                if self.append is None
                else "list the corpus as it was when the append began and run --append "
                "--resume again (--overwrite would replace the whole archive, not only "
                "this append)"
            )
            raise CompileError(
                f"{self.where}: the corpus changed since the interrupted "
                f"{'compile' if self.append is None else 'append'} (it listed {num_inputs} "
                f"inputs, fingerprint {fingerprint:.16}...; now {self.num_inputs}, "
                f"{self.fingerprint:.16}...); {way_out}"
            )
        theirs = obj.get("numerics")
        if not isinstance(theirs, dict):
            raise CompileError(
                f"{self.where}: the interrupted compile recorded no numeric environment (an "
                "older dlop wrote it), so its shards may round differently from this one's; "
                "compile afresh (--overwrite)"
            )
        changed = [
            f"{k} {theirs.get(k)!r} -> {v!r}"
            for k, v in self.numerics.items()
            if theirs.get(k) != v
        ]
        if changed:
            raise CompileError(
                f"{self.where}: --resume in another numeric environment than the interrupted "
                f"compile ({'; '.join(changed)}): the two would round features differently "
                "within one archive; resume with the install that started it, or compile "
                "afresh (--overwrite). Another CPU alone is no difference (docs/compile.md)"
            )
        if unit_inputs_given and size != self.unit_inputs:
            raise CompileError(
                f"{self.where}: --resume with --unit-inputs {self.unit_inputs}, the interrupted "
                f"compile used {size}; drop --unit-inputs or give {size}"
            )
        self.unit_inputs = size

    def _text(self, obj: dict[str, object], key: str) -> str:
        value = obj.get(key)
        if not isinstance(value, str) or not value:
            self._bad(f"{key!r} is {value!r:.40}, expected a non-empty string")
        return value

    def _bad(self, problem: str) -> NoReturn:
        raise CompileError(
            f"{self.where}/{JOURNAL}: the journal is damaged: {problem}; it cannot be resumed, "
            "compile afresh (--overwrite)"
        )

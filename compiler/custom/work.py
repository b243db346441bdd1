"""Running a user's Dataset or function on each input, in a worker: the Work (run/work.py)
of compile_dataset and compile_map.

Before each item the worker seeds Python's ``random``, numpy's global generator and
torch's default generator from (seed, the item's global index), so an item that
draws random numbers draws the same ones on any engine and worker count. An
exception the user's code raises is the item's error (type, message and the
traceback's last frame), recorded in errors.jsonl; ``None`` for a whole sample skips
the item. A sample that breaks the schema stops the compile (samples.conform).
"""

from __future__ import annotations

import os
import random
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..corpus.records import Item
from ..run.items import Outcome
from ..run.processes import time_limit
from .samples import Mismatch, SampleError, Spec, conform, flatten

# Items a local pool's worker is given at a time, at most: a chunk costs a round trip and
# a file (a worker writes each item's arrays out as it makes them, so its size costs no
# memory), and should last about CHUNK_SECONDS so that slow items still spread over
# every worker. Chunks only group the work: the bytes never depend on them.
CHUNK_ITEMS = 64
CHUNK_SECONDS = 0.05
MAX_REASON_CHARS = 600


def seed_item(seed: int, index: int) -> None:
    """Seeds random, numpy.random and torch's CPU generator from (seed, index): four words
    of SplitMix64 over the pair (each a few microseconds, where numpy's SeedSequence
    takes tens)."""
    state = _mix(_mix(seed) ^ index)
    words = []
    for _ in range(3):
        state = _mix(state)
        words.append(state)
    random.seed(words[0])
    np.random.seed(words[1] & 0xFFFFFFFF)
    # the CPU generator only: torch.manual_seed would also queue a seed for CUDA, recording
    # a stack trace each time (a millisecond per item), and workers use no CUDA
    torch.default_generator.manual_seed(words[2])


_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """SplitMix64's step: a 64-bit value from any integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


@dataclass
class UserWork:
    """Calls ``target[i]`` (a Dataset) or ``target(input)`` (a function) per item."""

    target: Any
    dataset: bool
    specs: dict[str, Spec]
    seed: int
    label: str  # the Dataset's class or the function, for item names
    item_seconds: float = 0.0  # what an item took in the probe (sizes the chunks)
    structure: dict[str, Any] | None = None  # the shape every sample must have
    timeout: float | None = None  # seconds an item may take (item_timeout); None: no limit

    def chunk_items(self) -> int:
        if self.item_seconds <= 0:
            return CHUNK_ITEMS
        return max(1, min(CHUNK_ITEMS, int(CHUNK_SECONDS / self.item_seconds)))

    def outcomes(self, chunk: list[Item], systems: dict[str, Any]) -> Iterator[Outcome]:
        for item in chunk:
            yield self.outcome(item)

    def name(self, item: Item) -> str:
        return item_name(self.label, item, self.dataset)

    def item_timeout(self) -> float | None:
        return self.timeout

    def guarded(self) -> bool:
        return True

    def call(self, item: Item) -> Any:
        """The user's sample for one item (seeded first); raises what the code raises."""
        seed_item(self.seed, item.position)
        if self.dataset:
            return self.target[item.position]
        return self.target(item.extras["input"])

    def outcome(self, item: Item) -> Outcome:
        name = self.name(item)
        with _ONE_AT_A_TIME:  # the generators (and the timer) are the process's: one at a time
            here = os.getcwd()
            try:
                with time_limit(self.timeout):
                    sample = self.call(item)
            except (Exception, SystemExit) as e:  # the user's code: any failure is this item's
                return Outcome(item.key, reason=reason(e), path=name)
            finally:
                if os.getcwd() != here:  # an item that changed directory: the next starts here
                    os.chdir(here)
        if sample is None:
            return Outcome(item.key, reason="skipped: the code gave None for it", path=name)
        try:
            shape, leaves = sample_leaves(sample, name)
            if self.structure and bare(shape) != bare(self.structure):
                first = next(iter(self.specs.values())).item  # whose sample set the shape
                raise Mismatch(
                    f"{name} gives a sample of another shape than {first} "
                    f"({describe_shape(self.structure)}, then {describe_shape(shape)}): every "
                    "item must give the same dict or tuple"
                )
            return Outcome(item.key, samples=[conform(leaves, self.specs, name)])
        except SampleError as e:  # this item's sample: a bad item, as on_error says
            return Outcome(item.key, reason=_unnamed(str(e), name), path=name)
        except Mismatch as e:
            if e.widen is not None:  # the schema itself changes: the compile starts again
                return Outcome(item.key, stop=e.message, widen=e.widen)
            return Outcome(item.key, reason=_unnamed(e.message, name), path=name)


def _unnamed(message: str, name: str) -> str:
    """A message about an item without its leading name (errors.jsonl names it apart)."""
    return message.removeprefix(f"{name}: ")


# A Dask worker may run several units on threads of one process: seeding the process's
# generators and calling the user's code is one step, taken by one thread at a time.
_ONE_AT_A_TIME = threading.Lock()


def sample_leaves(sample: Any, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """flatten, with anything unexpected a value raises (a sparse or meta tensor, a
    mapping that fails) turned into a SampleError naming the item."""
    try:
        return flatten(sample, name)
    except SampleError:
        raise
    except Exception as e:  # the user's objects: whatever they raise is this item's
        raise SampleError(f"{name}: its sample cannot be stored: {reason(e)}") from None


def bare(structure: dict[str, Any]) -> Any:
    """A structure without its leaves' value types: two samples whose fields differ only in
    a value's type have the same shape (conform names the field and both types)."""
    if "fields" in structure:
        return (structure.get("type"), [(c.get("key"), bare(c)) for c in structure["fields"]])
    return structure.get("field")


def describe_shape(structure: dict[str, Any]) -> str:
    """A structure in brief: ``dict x, y.a`` or ``tuple 0, 1``."""
    names = [
        f"{c['key']}.{g['key']}" if "fields" in c else c["key"]
        for c in structure.get("fields", [])
        for g in (c.get("fields") or [c])
    ]
    return f"{structure.get('type')} {', '.join(names)}"[:200]


_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


def reason(e: BaseException) -> str:
    """``Type: message (at file:line in function)``: the exception and its last frame. An
    object's address in the message becomes ``0x...`` and the file is named without its
    folder, so a failure reads the same in every run and on every host."""
    try:
        said = str(e)
    except Exception as inner:  # an exception whose str() raises: the type still says much
        said = f"(its message could not be made: {type(inner).__name__})"
    text = _ADDRESS.sub("0x...", f"{type(e).__name__}: {said}")
    if len(text) > MAX_REASON_CHARS:
        text = text[:MAX_REASON_CHARS] + "..."
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None:
        code = tb.tb_frame.f_code
        filename = code.co_filename
        if filename.startswith("<"):  # code sent by value (cloudpickle) names no file:
            filename = tb.tb_frame.f_globals.get("__file__") or filename  # its module does
        text += f" (at {os.path.basename(filename)}:{tb.tb_lineno} in {code.co_name})"
    return text


MAX_NAME_CHARS = 200


def item_name(label: str, item: Item, dataset: bool) -> str:
    """``Label[17]`` for a Dataset's item; the input itself for a function's text input,
    else ``input 17``."""
    if dataset:
        return f"{label}[{item.position}]"
    value = item.extras.get("input")
    if isinstance(value, str) and value and len(value) <= MAX_NAME_CHARS and value.isprintable():
        return value
    return f"input {item.position}"


class Inputs(Sequence[Item]):
    """The inputs of a user compile as Items made on demand: ``count`` indices of a
    Dataset, or a function's ``values`` (kept as given)."""

    def __init__(self, count: int, values: Sequence[Any] | None = None) -> None:
        self.size, self.values = count, values

    def __len__(self) -> int:
        return self.size

    def _item(self, n: int) -> Item:
        if self.values is None:
            return Item(key=str(n), position=n)
        return Item(key=str(n), position=n, extras={"input": self.values[n]})

    def __getitem__(self, n: Any) -> Any:
        if isinstance(n, slice):
            return [self._item(k) for k in range(*n.indices(self.size))]
        if not -self.size <= n < self.size:
            raise IndexError(n)
        return self._item(n % self.size)

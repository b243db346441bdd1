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

import json
import random
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..corpus.records import Item
from ..run.items import Outcome
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

    def chunk_items(self) -> int:
        if self.item_seconds <= 0:
            return CHUNK_ITEMS
        return max(1, min(CHUNK_ITEMS, int(CHUNK_SECONDS / self.item_seconds)))

    def outcomes(self, chunk: list[Item], systems: dict[str, Any]) -> Iterator[Outcome]:
        for item in chunk:
            yield self.outcome(item)

    def name(self, item: Item) -> str:
        return item_name(self.label, item, self.dataset)

    def call(self, item: Item) -> Any:
        """The user's sample for one item (seeded first); raises what the code raises."""
        seed_item(self.seed, item.position)
        if self.dataset:
            return self.target[item.position]
        return self.target(item.extras["input"])

    def outcome(self, item: Item) -> Outcome:
        name = self.name(item)
        try:
            sample = self.call(item)
        except Exception as e:  # the user's code: any failure is this item's
            return Outcome(item.key, reason=reason(e), path=name)
        if sample is None:
            return Outcome(item.key, reason="skipped: the code gave None for it", path=name)
        try:
            _, leaves = flatten(sample, name)
            return Outcome(item.key, samples=[conform(leaves, self.specs, name)])
        except SampleError as e:
            return Outcome(item.key, stop=str(e))
        except Mismatch as e:
            return Outcome(item.key, stop=e.message, widen=e.widen)


def reason(e: BaseException) -> str:
    """``Type: message (at file:line in function)``: the exception and its last frame."""
    text = f"{type(e).__name__}: {e}"
    if len(text) > MAX_REASON_CHARS:
        text = text[:MAX_REASON_CHARS] + "..."
    frames = traceback.extract_tb(e.__traceback__)
    if frames:
        last = frames[-1]
        text += f" (at {last.filename}:{last.lineno} in {last.name})"
    return text


def item_name(label: str, item: Item, dataset: bool) -> str:
    """``Label[17]`` for a Dataset's item; the input itself for a function's text input,
    else ``input 17``."""
    if dataset:
        return f"{label}[{item.position}]"
    value = item.extras.get("input")
    return value if isinstance(value, str) and value else f"input {item.position}"


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


def input_text(value: Any) -> str:
    """A function input as the listing fingerprint sees it: its JSON."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))

"""Gathers that read sample by sample: text and bytes fields, as lists."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dlop.formats import FormatError, ShardReader

from .engine import private_copy
from .fields import FieldGather, Output, Planned, shard_groups
from .spans import copied_tables, decoded


def shard_text(shard: ShardReader, name: str) -> tuple[bytes, list[int]]:
    """A raw text field's values and offsets in ``shard``, copied out of its mapping."""
    return (
        private_copy(shard.values(name)).tobytes(),
        private_copy(shard.offsets(name)).tolist(),
    )


class TextGather(FieldGather):
    """str/bytes fields, as lists. Raw ones slice a per-shard copy of the (small) values
    region: about 0.3 us a sample against 5 us through ShardReader.get; zstd ones slice
    their decoded blocks. Both copies (of the values, or of the frames and tables) are
    made by the copy step (private_copy), so no mapped byte is read in Python and a
    batch needs no check of its shards first."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._text: dict[int, tuple[bytes, list[int]]] = {}

    def _block_bytes(self, k: int, local: list[int]) -> list[bytes]:
        """Samples ``local`` of shard ``k`` of a zstd field, from their decoded blocks."""
        shard, name = self.shards[k], self.field.name
        offsets = copied_tables(shard, name, keep=True)[0]  # (slices of a block: bounded)
        firsts: np.ndarray = shard.derived(
            ("first samples", name),
            lambda: shard.block_table(name)["first_sample"].astype(np.int64),
        )
        at = np.asarray(local, np.int64)
        blocks = np.searchsorted(firsts, at, side="right") - 1
        base = offsets[firsts[blocks]]  # a block's values begin with its first sample's
        lo, hi = (offsets[at] - base).tolist(), (offsets[at + 1] - base).tolist()
        # each block the batch touches decoded (or found in the block cache) once
        values = {b: decoded(shard, name, b) for b in set(blocks.tolist())}
        return [values[b][a:z].tobytes() for b, a, z in zip(blocks.tolist(), lo, hi, strict=True)]

    def _shard_text(self, k: int) -> tuple[bytes, list[int]]:
        cached = self._text.get(k)
        if cached is None:
            cached = self._text[k] = shard_text(self.shards[k], self.field.name)
        return cached

    def path_of(self, k: int) -> Path:
        return self.shards[k].path

    def plan(self, indices: torch.Tensor, out: Output) -> Planned:
        name, is_str = self.field.name, self.field.kind == "str"
        values: list[Any] = []
        for k, a, b in shard_groups(indices, self.starts):
            start = int(self.starts[k])
            local = [int(i) - start for i in indices[a:b].tolist()]
            if not self.field.codec.mappable:
                values += self._decoded_text(k, local, is_str)
                continue
            data, offsets = self._shard_text(k)
            if is_str:
                try:
                    values += [data[offsets[i] : offsets[i + 1]].decode("utf-8") for i in local]
                except UnicodeDecodeError:
                    raise self._not_utf8(
                        k, ((i, data[offsets[i] : offsets[i + 1]]) for i in local)
                    ) from None
            else:
                values += [data[offsets[i] : offsets[i + 1]] for i in local]
        return {name: values}, []

    def _decoded_text(self, k: int, local: list[int], is_str: bool) -> list[Any]:
        got = self._block_bytes(k, local)
        if not is_str:
            return got
        try:
            return [b.decode("utf-8") for b in got]
        except UnicodeDecodeError:
            raise self._not_utf8(k, zip(local, got, strict=True)) from None

    def _not_utf8(self, k: int, samples: Iterable[tuple[int, bytes]]) -> FormatError:
        """The error naming the first of ``samples`` (number in shard ``k``, bytes) that is
        not UTF-8, as ShardReader.get names it."""
        for i, b in samples:
            try:
                b.decode("utf-8")
            except UnicodeDecodeError as e:
                return FormatError(
                    self.path_of(k),
                    f"field {self.field.name!r} sample {i}: not UTF-8 ({e.reason})",
                )
        raise AssertionError("a sample failed to decode once, not twice")


class SlottedText(TextGather):
    """A raw text field over every shard of an archive, each shard's values and offsets
    copied in while it is mapped (``put``) and dropped when it is let go of (``clear``).
    A batch plans over ``take`` of the shards it touches; the caller excludes ``put``,
    ``clear`` and ``take`` from one another (runtime.archive.planning.Slots)."""

    def __init__(self, field: Any, starts: torch.Tensor, pad_value: float) -> None:
        super().__init__(field, [], starts, pad_value)
        if not field.codec.mappable:
            raise ValueError(f"field {field.name!r}: slotted text is for raw fields")
        self.paths: dict[int, Path] = {}

    def prepared(self, shard: ShardReader, whole: bool) -> tuple[tuple[bytes, list[int]], Path]:
        """A shard's text for ``put``, copied here (outside the caller's lock): kept by the
        shard (``whole``), or copied for one batch while it is still arriving (read only
        where ``ready`` allowed)."""
        name = self.field.name
        if whole:
            text: tuple[bytes, list[int]] = shard.derived(
                ("text", name), lambda: shard_text(shard, name)
            )
        else:
            text = shard_text(shard, name)
        return text, shard.path

    def put(self, k: int, prepared: tuple[tuple[bytes, list[int]], Path]) -> None:
        self._text[k], self.paths[k] = prepared

    def clear(self, k: int) -> None:
        self._text.pop(k, None)

    def has(self, ks: np.ndarray) -> int | None:
        """The first of shards ``ks`` without its text here, or None."""
        return next((k for k in ks.tolist() if k not in self._text), None)

    def take(self, ks: np.ndarray) -> SlottedText:
        """This gather over shards ``ks`` only: later ``put`` and ``clear`` calls here do
        not change it."""
        out = copy.copy(self)
        out._text = {k: self._text[k] for k in ks.tolist() if k in self._text}
        return out

    def _shard_text(self, k: int) -> tuple[bytes, list[int]]:
        return self._text[k]  # taken: every shard of the batch is here

    def path_of(self, k: int) -> Path:
        return self.paths[k]

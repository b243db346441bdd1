"""Gathers that read sample by sample: text and bytes fields, as lists."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from dlop.formats import FormatError

from .engine import private_copy
from .fields import FieldGather, Output, Planned, shard_groups
from .spans import copied_tables, decoded


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
            shard = self.shards[k]
            cached = (
                private_copy(shard.values(self.field.name)).tobytes(),
                private_copy(shard.offsets(self.field.name)).tolist(),
            )
            self._text[k] = cached
        return cached

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
                    self.shards[k].path,
                    f"field {self.field.name!r} sample {i}: not UTF-8 ({e.reason})",
                )
        raise AssertionError("a sample failed to decode once, not twice")

"""Choosing samples: ``where`` (values of scalar fields) and ``indices`` (sample numbers).

A selection is computed once, when the archive opens, from whole columns
(one vectorized comparison per shard and field; no per-sample Python), and
kept as an ascending ``int64`` array of sample numbers (in the archive, or in
archives read as one). The order stage then works on the selection as it
would on a whole archive: shuffle, DDP shares, drop_last, bucketing, window
order and resume see only the selected samples.

``where`` maps a field name to one value or a list of values; a sample is
kept when every named field holds one of its values. Fields must be scalars:
numeric or bool fields of shape ``()``, or ``str`` fields.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dlop.formats import Field, ShardReader

from ..errors import UsageError, UsageTypeError

Where = Mapping[str, Any]
COMPARE_BYTES = 1 << 22  # str values compared per step: its index array is 8x that


def scalar_field(fields: Mapping[str, Field], name: object, where: str) -> Field:
    """The field ``where={name: ...}`` names, refused unless it exists and is a scalar."""
    if not isinstance(name, str):
        raise UsageTypeError(f"{where}: where keys are field names (str), got {name!r}")
    f = fields.get(name)
    if f is None:
        raise UsageError(f"{where}: where names no field {name!r}; fields are {list(fields)}")
    if f.kind == "str" or (f.kind == "array" and f.shape == ()):
        return f
    shape = list(f.shape)
    raise UsageError(
        f"{where}: where={{{name!r}: ...}} needs a scalar field (shape [] or str), but "
        f"{name!r} is {f.kind} {f.dtype}{shape}; choose by a scalar field such as a label or fold"
    )


def same_type(a: Field | None, b: Field) -> bool:
    return a is not None and (a.kind, a.dtype, a.shape) == (b.kind, b.dtype, b.shape)


def value_type(field: Field) -> tuple[tuple[type, ...], str]:
    """The Python/numpy types a ``where`` value for ``field`` may have, and their name."""
    if field.kind == "str":
        return (str,), "str"
    if field.dtype == "bool":
        return (bool, np.bool_), "bool"
    if field.dtype[0] in "iu":
        return (int, np.integer), "int"
    return (int, float, np.integer, np.floating), "int or float"


def wanted_values(field: Field, value: object, where: str) -> list[Any]:
    """``value`` (one, or a list/tuple/set/array of them) checked against the field's type."""
    if isinstance(value, np.ndarray):
        values = list(value.reshape(-1).tolist())
    elif isinstance(value, list | tuple | set | frozenset | range):
        values = list(value)
    else:
        values = [value]
    types, want = value_type(field)
    boolean = want == "bool"
    wrong = [
        v
        for v in values
        if not isinstance(v, types) or (not boolean and isinstance(v, bool | np.bool_))
    ]
    if wrong:
        raise UsageTypeError(
            f"{where}: where={{{field.name!r}: ...}} compares with a {field.kind} {field.dtype} "
            f"field, so its values must be {want}; got {wrong[0]!r} ({type(wrong[0]).__name__})"
        )
    if field.kind != "str" and not boolean:
        check_range(field, values, where)
    return values


def check_range(field: Field, values: list[Any], where: str) -> None:
    """Refuses a value that the field's dtype cannot hold (no sample could equal it)."""
    dtype = np.dtype(field.np_dtype)
    low: int | float
    high: int | float
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        low, high = int(info.min), int(info.max)
        out = [v for v in values if not low <= int(v) <= high]
    else:
        finfo = np.finfo(dtype)
        low, high = float(finfo.min), float(finfo.max)
        out = [v for v in values if np.isfinite(float(v)) and not low <= float(v) <= high]
    if out:
        raise UsageError(
            f"{where}: where={{{field.name!r}: ...}} holds {out[0]!r}, which field "
            f"{field.name!r} ({field.dtype}) cannot hold: its values are {low}..{high}; "
            "check the value against dlop-inspect info"
        )


def column_mask(shard: ShardReader, field: Field, values: list[Any]) -> np.ndarray:
    """Which of the shard's samples hold one of ``values`` (bool ``[num_samples]``)."""
    n = shard.num_samples
    if field.kind == "str":
        return text_codes(shard, field, values) >= 0
    col = shard.read_range(field.name, 0, n)
    return np.isin(col, np.asarray(values, dtype=col.dtype)) if values else np.zeros(n, bool)


def text_codes(shard: ShardReader, field: Field, values: list[str]) -> np.ndarray:
    """Which of ``values`` each of the shard's samples of str ``field`` holds (``int64
    [num_samples]``, -1: none), compared as UTF-8 bytes, whole columns at once: a zstd
    field's blocks are each decoded once, never sample by sample."""
    name = field.name
    offsets = shard.offsets(name).astype(np.int64)
    if field.codec.mappable:
        data = shard.values(name)
    else:  # the blocks' values, one after another, are the column's (SPEC.md §4)
        blocks = len(shard.block_table(name))
        parts = [shard.decode_block(name, k, cached=False) for k in range(blocks)]
        data = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    lengths = np.diff(offsets)
    codes = np.full(shard.num_samples, -1, np.int64)
    for code, v in enumerate(values):
        b = np.frombuffer(v.encode("utf-8"), np.uint8)
        cand = np.flatnonzero(lengths == len(b))
        step = max(1, COMPARE_BYTES // max(len(b), 1))  # bounds the index arrays made
        for i in range(0, len(cand) if len(b) else 0, step):
            part = cand[i : i + step]
            same = (data[offsets[part, None] + np.arange(len(b))] == b).all(axis=1)
            codes[part[same]] = code
        if not len(b):
            codes[cand] = code
    return codes


def select(
    fields: Mapping[str, Field],
    shards: Sequence[ShardReader],
    where: Where | None,
    indices: object,
    what: str,
) -> np.ndarray | None:
    """The ascending sample numbers ``where`` and ``indices`` keep (both: those both
    keep); None when neither is given. ``what`` names the archive(s) in errors."""
    if where is None and indices is None:
        return None
    total = sum(s.num_samples for s in shards)
    keep = np.ones(total, bool)
    if where is not None:
        if not isinstance(where, Mapping):
            raise UsageTypeError(
                f"{what}: where must be a dict of field -> value(s), got {type(where).__name__}"
            )
        for name, value in where.items():
            f = scalar_field(fields, name, what)
            lacking = [s.path for s in shards if not same_type(s.fields.get(name), f)]
            if lacking:
                raise UsageError(
                    f"{what}: where names field {name!r}, which {lacking[0]} holds "
                    "otherwise or not at all; choose by a field every archive holds alike"
                )
            values = wanted_values(f, value, what)
            keep &= np.concatenate([column_mask(s, f, values) for s in shards] or [keep[:0]])
    if indices is not None:
        chosen = check_indices(indices, total, what)
        picked = np.zeros(total, bool)
        picked[chosen] = True
        keep &= picked
    selected = np.flatnonzero(keep).astype(np.int64)
    if not len(selected):
        raise UsageError(
            f"{what}: where={where!r}{' and indices' if indices is not None else ''} selects "
            f"no sample of {total}; check the values against dlop-inspect info"
        )
    return selected


def check_indices(indices: object, total: int, what: str) -> np.ndarray:
    """``indices`` as int64 sample numbers in 0..total-1, each at most once."""
    arr = np.asarray(indices)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise UsageTypeError(
            f"{what}: indices must be a 1-D array or list of integer sample numbers, "
            f"got {arr.dtype} of shape {list(arr.shape)}"
        )
    arr = arr.astype(np.int64)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= total):
        bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
        raise UsageError(f"{what}: indices holds sample {bad}, outside 0..{total - 1}")
    if len(np.unique(arr)) != len(arr):
        raise UsageError(
            f"{what}: indices names a sample more than once; a selection is a set "
            "(weight sources with a mixture to repeat samples)"
        )
    return arr


def digest(selection: np.ndarray | None) -> str | None:
    """A short fingerprint of a selection, for loader states (None: no selection)."""
    if selection is None:
        return None
    return hashlib.sha256(np.ascontiguousarray(selection, "<i8").tobytes()).hexdigest()[:16]


def shard_counts(selection: np.ndarray, starts: np.ndarray) -> tuple[int, ...]:
    """Selected samples per shard (``starts``: each shard's first sample, then the total)."""
    return tuple(np.diff(np.searchsorted(selection, starts)).tolist())


def parse_where(fields: Mapping[str, Field], terms: Sequence[str]) -> dict[str, list[Any]]:
    """``["fold=1,2,3", "category=dog"]`` (command-line terms) as a ``where`` dict, each
    value converted to its field's type."""
    out: dict[str, list[Any]] = {}
    for term in terms:
        name, sep, text = term.partition("=")
        if not sep:
            raise UsageError(f"--where {term!r}: expected FIELD=VALUE[,VALUE...], e.g. fold=1,2")
        f = scalar_field(fields, name, f"--where {term!r}")
        want = value_type(f)[1]
        convert = {"str": str, "bool": _parse_bool, "int": int}.get(want, float)
        try:
            out.setdefault(name, []).extend(convert(v) for v in text.split(","))  # type: ignore[operator]
        except ValueError:
            raise UsageError(
                f"--where {term!r}: {name} holds {want} values, got {text!r}"
            ) from None
    return out


def _parse_bool(text: str) -> bool:
    if text.lower() in ("true", "1"):
        return True
    if text.lower() in ("false", "0"):
        return False
    raise ValueError(text)

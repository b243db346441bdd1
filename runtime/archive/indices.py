"""Checks of what callers hand an archive: field names, and batches of sample numbers."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..errors import SampleIndexError, UsageError, UsageTypeError


def field_names(path: Path | str, fields: Sequence[str] | str | None) -> list[str] | None:
    """``fields`` as a list of names: a str is one name."""
    if fields is None:
        return None
    names = [fields] if isinstance(fields, str) else fields
    try:
        names = list(names)
    except TypeError:
        raise UsageTypeError(
            f"{path}: fields must be a field name or a list of them, got {type(fields).__name__}"
        ) from None
    wrong = [n for n in names if not isinstance(n, str)]
    if wrong:
        raise UsageTypeError(f"{path}: fields must be names (str), got {wrong!r}")
    if len(set(names)) != len(names):
        raise UsageError(f"{path}: fields {names} name a field more than once")
    return names


def batch_indices(
    path: Path | str, indices: Sequence[int] | torch.Tensor, size: int
) -> torch.Tensor:
    """``indices`` as a flat int64 tensor, each checked against 0..size-1."""
    if isinstance(indices, str | bytes):
        raise UsageTypeError(f"{path}: __getitems__ takes sample numbers, got {indices!r}")
    try:
        if isinstance(indices, torch.Tensor):
            if indices.dtype.is_floating_point or indices.dtype.is_complex:
                raise TypeError(indices.dtype)
            arr = indices.detach().cpu().reshape(-1).numpy()
        else:
            arr = np.asarray(indices).reshape(-1)
        if arr.dtype.kind not in "iub" and arr.size:
            arr = np.array([operator.index(x) for x in arr.tolist()], dtype=object)
    except (TypeError, ValueError) as e:
        raise UsageTypeError(
            f"{path}: __getitems__ takes a sequence of integer sample numbers, "
            f"got {type(indices).__name__} ({e})"
        ) from None
    if arr.dtype.kind == "b":
        raise UsageTypeError(f"{path}: __getitems__ takes sample numbers, not booleans")
    check_range(path, arr, size)
    return torch.from_numpy(arr.astype(np.int64))


def check_range(path: Path | str, arr: np.ndarray, size: int) -> None:
    """Refuses a sample number in ``arr`` outside 0..size-1 (negative ones do not count
    from the end)."""
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= size:
            bad = lo if lo < 0 else hi
            raise SampleIndexError(f"{path}: sample {bad} out of range 0..{size - 1}")

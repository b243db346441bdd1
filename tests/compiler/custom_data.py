"""Datasets and functions for the compile_dataset / compile_map tests: importable by
name (PYTHONPATH), by file path (dlop-compile --dataset FILE.py:NAME), and picklable."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

NUMPY_DTYPES = ("u1", "u2", "u4", "u8", "i1", "i2", "i4", "i8", "f2", "f4", "f8", "?")


class Everything:
    """Dict samples holding every kind of value an archive stores."""

    def __init__(self, n: int = 12) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        rng = np.random.default_rng(i)
        out: dict[str, Any] = {}
        for code in NUMPY_DTYPES:
            dtype = np.dtype(code)
            if dtype.kind == "f":
                value = rng.standard_normal((2, 3)).astype(dtype)
            elif dtype.kind == "b":
                value = rng.integers(0, 2, (2, 3)).astype(bool)
            else:
                info = np.iinfo(dtype)
                value = rng.integers(info.min, info.max, (2, 3), dtype=dtype, endpoint=True)
            out[f"a_{dtype.name}"] = value
        out["bf16"] = torch.randn(3, 2, generator=torch.Generator().manual_seed(i)).bfloat16()
        out["tensor_i64"] = torch.arange(i, i + 4)
        out["ragged"] = rng.standard_normal((i % 5 + 1, 4)).astype(np.float32)
        out["ragged_empty_ok"] = np.arange(i % 3, dtype=np.int32)  # 0 long for some items
        out["zero_d"] = np.array(i * 1.5, np.float32)
        out["py_int"] = i - 6
        out["py_float"] = i / 7
        out["py_bool"] = i % 2 == 0
        out["np_int"] = np.int32(i * 1000)
        out["np_float"] = np.float32(i) / 3
        out["text"] = f"item {i}: ünïcode ✓"
        out["blob"] = bytes(range(i % 4)) + b"\x00\xff"
        out["meta"] = {"id": i, "name": f"n{i}", "vec": np.full(3, i, np.int16)}
        return out


class Tuples:
    """Tuple samples: (ragged audio-like array, label, transcript, (weight, raw bytes))."""

    def __init__(self, n: int = 10) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        frames = np.arange((i % 4 + 2) * 3, dtype=np.int16).reshape(-1, 3) * (i + 1)
        return frames, i % 3, f"utterance {i}", (float(i) / 2, bytes([i, i + 1]))


class Drifting:
    """Fine up to item ``at``, then another dtype ("dtype") or rank ("rank")."""

    def __init__(self, n: int, at: int, what: str) -> None:
        self.n, self.at, self.what = n, at, what

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        x = np.ones((4, 2), np.float32)
        if i >= self.at:
            x = x.astype(np.float64) if self.what == "dtype" else x.reshape(8)
        return {"x": x}


class Widening:
    """A fixed length for the first ``fixed`` items, then lengths that vary."""

    def __init__(self, n: int = 24, fixed: int = 12) -> None:
        self.n, self.fixed = n, fixed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        length = 5 if i < self.fixed else 5 + i % 3
        return {"x": np.full((length, 2), i, np.float32), "y": i}


class Randomized:
    """Draws from random, numpy's global generator and torch: seeded per item by dlop."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "py": random.random(),
            "np": np.random.rand(3),
            "torch": torch.rand(2),
        }


def fails_some(x: int) -> dict[str, Any] | None:
    """Raises for inputs 3 mod 7; skips (None) inputs 5 mod 11; else a small sample."""
    if x % 7 == 3:
        raise ValueError(f"input {x} is unlucky")
    if x % 11 == 5:
        return None
    return {"x": np.arange(x % 6 + 1, dtype=np.float64), "n": x}


def cheap(x: int) -> dict[str, Any]:
    return {"x": np.full(4, x, np.float32), "n": x}


class Draws:
    """``n`` items drawn from random, numpy's global generator and torch (seeded per item by
    dlop), each times ``scale``: a Dataset that grows with ``n``."""

    def __init__(self, n: int, scale: float = 1.0) -> None:
        self.n, self.scale = n, scale

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "py": random.random() * self.scale,
            "np": np.random.rand(3) * self.scale,
            "torch": torch.rand(2) * self.scale,
        }

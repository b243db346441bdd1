"""Datasets a careless or hostile team might hand the compiler (tests/compiler/
test_hostile.py): importable by name and picklable, each misbehaving in one way."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

import numpy as np


class TokenIds:
    """Token ids padded to 512, as Python lists (a tokenizer's output)."""

    def __init__(self, n: int = 20) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = [101 + (i * 7 + k) % 3000 for k in range(i % 5 + 3)]
        return {"ids": ids + [0] * (512 - len(ids)), "mask": [True] * 3 + [False] * 2, "y": i}


class ManyFields:
    """A dict of ``width`` scalar fields a sample."""

    def __init__(self, n: int = 12, width: int = 400) -> None:
        self.n, self.width = n, width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {f"f{k:04d}": float(i * k) for k in range(self.width)}


class Plain:
    """Small samples whose values are their index; ``note`` only travels in the recipe."""

    def __init__(self, n: int = 12, note: str = "") -> None:
        self.n, self.note = n, note

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": np.full(4, i, np.float32), "y": i}


class Misbehaving(Plain):
    """Plain, but each item in ``at`` does ``what``: raise, exit, kill, segv, hang,
    thread (a non-daemon thread left running), late (float64 where the others give
    float32), raise_str (an exception whose str raises), sysexit, print (megabytes to
    stdout), chdir, none (gives None)."""

    def __init__(self, n: int, at: tuple[int, ...], what: str) -> None:
        super().__init__(n)
        self.at, self.what = at, what

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.misbehave(i, self.what) if i in self.at else super().__getitem__(i)

    def misbehave(self, i: int, w: str) -> dict[str, Any]:
        if w == "exit":
            os._exit(3)
        if w == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if w == "segv":
            import ctypes

            ctypes.string_at(0)
        if w == "hang":
            while True:
                time.sleep(0.05)
        if w == "thread":
            threading.Thread(target=time.sleep, args=(3600,)).start()
        if w == "late":
            return {"x": np.full(4, i, np.float64), "y": i}
        if w == "raise_str":
            raise BadStr()
        if w == "sysexit":
            raise SystemExit(7)
        if w == "raise":
            raise ValueError(f"item {i} is unlucky")
        if w == "print":
            sys.stdout.write("x" * (4 << 20) + "\n")
            sys.stdout.flush()
        if w == "chdir":
            os.chdir("/")
        if w == "none":
            return None  # type: ignore[return-value]
        return Plain.__getitem__(self, i)


class Hostile(Misbehaving):
    """Plain, with the misbehaviour ``plan`` names for each of its items."""

    def __init__(self, n: int, plan: dict[int, str]) -> None:
        super().__init__(n, tuple(plan), "")
        self.plan = plan

    def __getitem__(self, i: int) -> dict[str, Any]:
        what = self.plan.get(i)
        return self.misbehave(i, what) if what else Plain.__getitem__(self, i)


class BadStr(Exception):
    def __str__(self) -> str:
        raise ValueError("no str for you")


class FromFile:
    """Items whose values come from a file the recipe does not hash (only its path)."""

    def __init__(self, path: str, n: int = 24) -> None:
        self.path, self.n = path, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        with open(self.path) as f:
            offset = float(f.read())
        return {"x": np.full(4, i + offset, np.float32)}


class Ranged:
    """Items drawn from a range it holds."""

    def __init__(self, ids: range) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"id": self.ids[i]}


class Length:
    """A Dataset whose __len__ gives ``n`` (or raises when ``n`` is None)."""

    def __init__(self, n: Any) -> None:
        self.n = n

    def __len__(self) -> Any:
        if self.n is None:
            raise RuntimeError("no length today")
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": i}


class Odd:
    """Fine, but item 11 gives a masked array, 12 a sparse tensor, 13 a float for an int."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        x: Any = np.arange(3, dtype=np.float32)
        if i == 11:
            x = np.ma.masked_array(x, [True, False, False])
        if i == 12:
            x = torch.tensor(x).to_sparse()
        return {"x": x, "a": 1.5 if i == 13 else i}


class Locked(Plain):
    """Holds a lock: it cannot be pickled for a fork server's or Dask's workers."""

    def __init__(self, n: int = 12) -> None:
        super().__init__(n)
        self.lock = threading.Lock()


class Unloadable(Plain):
    """Cannot be unpickled in a worker: every worker process's start fails."""

    def __reduce__(self) -> Any:
        return (_refuse, ())


def _refuse() -> None:
    raise RuntimeError("this Dataset cannot be rebuilt in a worker")


class Unhurried(Plain):
    """Hangs as it is unpickled in a worker: every worker process's start hangs."""

    def __reduce__(self) -> Any:
        return (_hang, ())


def _hang() -> None:
    while True:
        time.sleep(0.05)


PICKLED = [0]  # how often a CountsPickles was pickled in this process


class CountsPickles(Plain):
    """Counts its pickles: a large Dataset pickled twice costs twice."""

    def __getstate__(self) -> dict[str, Any]:
        PICKLED[0] += 1
        return dict(self.__dict__)


class SlowlyKilled(Misbehaving):
    """Misbehaving, each item taking ``seconds`` (so that the pool gives it out one item
    to a chunk, CHUNK_SECONDS)."""

    def __init__(self, n: int, at: tuple[int, ...], what: str, seconds: float) -> None:
        super().__init__(n, at, what)
        self.seconds = seconds

    def __getitem__(self, i: int) -> dict[str, Any]:
        time.sleep(self.seconds)
        return super().__getitem__(i)

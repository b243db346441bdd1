"""Small archives with every field kind, for runtime tests."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dlop.formats import ArchiveWriter, Field, Zstd
from dlop.formats.constants import CRC_PIECE_BYTES
from dlop.formats.storage import Retry
from dlop.runtime import Archive, Source
from dlop.runtime.storage.cached import open_cached


def feature(i: int) -> np.ndarray:
    return (np.arange(20, dtype=np.float32).reshape(5, 4) + 100 * i).astype(np.float16)


def speech(i: int) -> np.ndarray:
    return np.full((3 + (i * 7) % 11, 3), i, np.float32) + np.arange(3, dtype=np.float32)


def make_archive(path: Path, n: int = 37, shard_bytes: int = 1000, zstd: bool = False) -> Path:
    codec = Zstd(block_bytes=200, shuffle=True) if zstd else "raw"
    fields = [
        Field.str_("key"),
        Field("label", "i64", ()),
        Field("logmel", "f16", (5, 4), codec=codec),
        Field("speech", "f32", (None, 3), codec=codec),
        Field("image", "u8", (None, None, 2)),
        Field.str_("text"),
    ]
    with ArchiveWriter(path, fields, shard_bytes=shard_bytes // 3 if zstd else shard_bytes) as w:
        for i in range(n):
            w.write(
                {
                    "key": f"k{i:03d}",
                    "label": i,
                    "logmel": feature(i),
                    "speech": speech(i),
                    "image": np.full((1 + i % 3, 2 + i % 2, 2), i % 256, np.uint8),
                    "text": "t" * (i % 4),
                }
            )
    return path


def open_remote(url: str, fields: Any = None, pad_value: float = 0.0, **options: Any) -> Archive:
    """The archive at ``url`` through the node-local cache, with the supply's own options
    (``retry``, ``storage_options``) that ``open_archive`` leaves at their defaults."""
    return Archive.over(open_cached(url, **options), fields, pad_value)


def weighted(paths: Mapping[str, Any], weights: Mapping[str, float]) -> dict[str, Source]:
    """A mixture's sources ``paths`` with their ``weights``."""
    return {name: Source(path, weight=weights[name]) for name, path in paths.items()}


def fail_planning(ds: Archive, at: int) -> None:
    """Makes the ``at``-th batch ``ds`` plans (from 1) fail as a read would."""
    plan, calls = ds.planner.plan, []

    def failing(*args: Any) -> Any:
        calls.append(args)
        if len(calls) == at:
            raise OSError("simulated read failure")
        return plan(*args)

    ds.planner.plan = failing  # type: ignore[method-assign]


def not_utf8_in_copies(monkeypatch: Any, shard: Any, name: str, row: int) -> None:
    """Makes the first byte of sample ``row`` of text field ``name`` in ``shard`` 0xFF
    (never UTF-8) in every copy the text gathers make of the shard's values, as a forged
    shard whose CRCs were forged along would hold it."""
    from dlop.runtime.gather import samples

    real = samples.private_copy
    target, at = shard.values(name).ctypes.data, int(shard.offsets(name)[row])

    def forged(view: np.ndarray) -> np.ndarray:
        got = real(view)
        if view.ctypes.data == target:
            got = got.copy()
            got[at] = 0xFF
        return got

    monkeypatch.setattr(samples, "private_copy", forged)


def in_forked_child(check: Callable[[], bool], timeout_s: int = 20) -> bool:
    """Whether ``check()`` holds when run in a child forked now (an exception in it, or
    its running past ``timeout_s``, say no)."""
    import os
    import signal

    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(timeout_s)  # a child waiting forever dies of it
            code = 0 if check() else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def piece_parts(attempts: int, lead: bool = False) -> Retry:
    """Fast retries, and a shard's values fetched in parts of whole CRC pieces on four
    threads. ``lead``: asked for in byte ranges before the header is read; without,
    the header first and then parts planned from it, so that a fault meets one part's
    request."""
    return Retry(
        attempts=attempts,
        backoff_s=0.001,
        max_backoff_s=0.01,
        part_bytes=CRC_PIECE_BYTES,
        parallel_parts=4,
        lead=lead,
    )

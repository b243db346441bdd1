"""Small samples on a many-shard archive: what a batch costs beyond its bytes.

Token and label archives, embeddings and short utterances hold samples of a few
bytes, where a batch's fixed costs, and any cost per shard a batch touches,
outweigh its copies. Two archives hold the same ``--small-samples`` samples
(``x``: 8 uint8, ``label``: int64; 16 bytes), one in about 1,000 shards and one
in 10. In interleaved rounds, for batches of 32, 256 and 1,024 in window and
global order:

- the Loader's epoch over each archive (from ``iter`` to the last batch);
- a bare gather of the same batches in the same order: ``numpy.take`` of each
  field's rows from whole in-memory arrays into reused buffers, nothing else.

``of_bare`` is the bare gather's time over the Loader's (1.0: the Loader costs
what the copies cost), ``many_vs_few_shards`` the Loader's time per batch on the
1,000-shard archive over the 10-shard one (1.0: no cost per shard touched);
each the median of the rounds' ratios, with their range. One configuration
(batches of 256, global order) is also read through
``DataLoader(IterableArchive(...), num_workers=2)`` and through
``DataLoader(open_archive(...), batch_size=256, shuffle=True)``, whose batches
cross a process boundary.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
from torch.utils.data import DataLoader

from dlop.formats import ArchiveWriter, Field
from dlop.runtime import IterableArchive, Loader, batch_as_is, open_archive

from .common import Row, no_collection

BATCHES = (32, 256, 1024)
ORDERS: tuple[Literal["window", "global"], ...] = ("window", "global")
SHARDS = (1000, 10)
SAMPLE_BYTES = 16


def write(path: Path, n: int, shards: int) -> Path:
    """``n`` samples in about ``shards`` shards; ``label`` is the sample's number."""
    fields = [Field("x", "u8", (8,)), Field("label", "i64", ())]
    per = -(-n // shards)
    x = np.arange(n, dtype=np.int64) % 251
    with ArchiveWriter(path, fields, shard_bytes=per * SAMPLE_BYTES, overwrite=True) as w:
        for i in range(n):
            w.write({"x": np.full(8, x[i], np.uint8), "label": i})
    return path


def bare(path: Path, batches: list[np.ndarray]) -> Callable[[], int]:
    """The bare gather of ``batches``: each field's rows taken into reused buffers."""
    ds = open_archive(path)
    whole = {
        name: np.concatenate([np.asarray(s.array(name)) for s in ds.shards]) for name in ds.fields
    }
    size = max(len(b) for b in batches)
    out = {name: np.empty((size, *a.shape[1:]), a.dtype) for name, a in whole.items()}

    def epoch() -> int:
        samples = 0
        for idx in batches:
            for name, a in whole.items():
                np.take(a, idx, axis=0, out=out[name][: len(idx)])
            samples += len(idx)
        return samples

    return epoch


def epoch_of(loader: Any) -> Callable[[], int]:
    def epoch() -> int:
        return sum(len(b["label"]) for b in loader)

    return epoch


def rounds_of(fns: dict[str, Callable[[], int]], rounds: int) -> dict[str, list[float]]:
    """Seconds of one epoch of each fn, per round, the fns taken in turn each round
    (after one untimed epoch each), with the garbage collector off."""
    for fn in fns.values():
        fn()
    took: dict[str, list[float]] = {name: [] for name in fns}
    with no_collection():
        for _ in range(max(1, rounds)):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                took[name].append(time.perf_counter() - t0)
    return took


def ratio(a: list[float], b: list[float]) -> dict[str, Any]:
    """Median and range of the rounds' ratios a/b."""
    r = [x / y for x, y in zip(a, b, strict=True)]
    return {"median": round(statistics.median(r), 3), "range": [round(min(r), 3), round(max(r), 3)]}


def run(work: Path, args: argparse.Namespace) -> list[Row]:
    n, rounds = args.small_samples, max(3, args.repeats)
    # at least 64 samples a shard (a small --small-samples makes fewer shards)
    paths = {k: write(work / f"shards{k}", n, min(k, max(1, n // 64))) for k in SHARDS}
    counts = {k: len(open_archive(p).shards) for k, p in paths.items()}
    rows: list[Row] = []
    for order in ORDERS:
        for batch in BATCHES:
            loaders = {k: Loader(p, batch, seed=0, order=order) for k, p in paths.items()}
            batches = loaders[SHARDS[0]].batches()
            fns = {f"loader{k}": epoch_of(loader) for k, loader in loaders.items()}
            fns["bare"] = bare(paths[SHARDS[0]], batches)
            took = rounds_of(fns, rounds)
            wl = (
                f"small samples: {n} x {SAMPLE_BYTES} bytes (x u8[8], label i64), "
                f"batches of {batch}, {order} order"
            )
            per_batch = {name: statistics.median(t) / len(batches) for name, t in took.items()}
            bare_row = Row(
                wl,
                "bare gather: numpy.take into reused buffers",
                n / statistics.median(took["bare"]),
            )
            bare_row.extra = {"us_per_batch": round(per_batch["bare"] * 1e6, 2)}
            rows.append(bare_row)
            for k in SHARDS:
                rows.append(
                    Row(
                        wl,
                        f"dlop Loader, {counts[k]} shards",
                        n / statistics.median(took[f"loader{k}"]),
                        extra={
                            "us_per_batch": round(per_batch[f"loader{k}"] * 1e6, 2),
                            "of_bare": ratio(took["bare"], took[f"loader{k}"]),
                            **(
                                {
                                    "many_vs_few_shards": ratio(
                                        took[f"loader{k}"], took[f"loader{SHARDS[1]}"]
                                    ),
                                    "target": (
                                        ">=0.25x bare at 1024, >=0.1x at 32, global; "
                                        "<=1.5x the 10-shard archive"
                                    ),
                                }
                                if k == SHARDS[0]
                                else {}
                            ),
                        },
                    )
                )
            for loader in loaders.values():
                loader.close()
    rows += worker_rows(paths[SHARDS[0]], counts[SHARDS[0]], n, rounds)
    return rows


def worker_rows(path: Path, shards: int, n: int, rounds: int) -> list[Row]:
    """Batches of 256 in global order through DataLoader worker processes."""
    batch = 256
    loader = Loader(path, batch, seed=0, order="global")
    batches = loader.batches()
    iterable = IterableArchive(path, batch, seed=0, order="global")
    in_workers = [
        DataLoader(
            iterable,
            batch_size=None,
            num_workers=2,
            persistent_workers=True,
            collate_fn=batch_as_is,
        ),
        DataLoader(
            open_archive(path),
            batch_size=batch,
            shuffle=True,
            num_workers=2,
            persistent_workers=True,
        ),
    ]
    took = rounds_of(
        {
            "loader": epoch_of(loader),
            "iterable": epoch_of(in_workers[0]),
            "map": epoch_of(in_workers[1]),
            "bare": bare(path, batches),
        },
        rounds,
    )
    wl = (
        f"small samples: {n} x {SAMPLE_BYTES} bytes in {shards} shards, batches of {batch}, "
        "global order, through DataLoader workers"
    )
    names = {
        "loader": "dlop Loader (in process)",
        "iterable": "DataLoader(IterableArchive, num_workers=2, collate_fn=batch_as_is)",
        "map": "DataLoader(open_archive, batch_size=256, shuffle=True, num_workers=2)",
    }
    rows = [
        Row(
            wl,
            name,
            n / statistics.median(took[key]),
            extra={
                "us_per_batch": round(statistics.median(took[key]) / len(batches) * 1e6, 2),
                "of_bare": ratio(took["bare"], took[key]),
            },
        )
        for key, name in names.items()
    ]
    loader.close()
    in_workers.clear()
    return rows

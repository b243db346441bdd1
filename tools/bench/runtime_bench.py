"""Loader and DataLoader throughput against the gather limit, ragged speech, and memory at scale."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from dlop.compiler.demo import DEMO_RECIPE
from dlop.compiler.recipe import build_recipe
from dlop.compiler.run.pipeline import compile_corpus
from dlop.formats import ArchiveWriter, Field
from dlop.runtime import Archive, IterableArchive, Loader, open_archive
from dlop.runtime.gather.fields import as_tensor

from .common import Row, best_of, first_batch_ms, interleaved, loader_epoch, rate_row
from .format_bench import FRAMES, MELS, synthetic_logmel
from .procmem import status_kib

BATCH = 256


def bare_gather(ds: Archive, buffers: int = 1) -> Callable[[], None]:
    """One epoch of the Loader's order as bare ``torch.index_select(out=)`` calls over the
    mapped logmel shard on the calling thread, into ``buffers`` rotating outputs: the
    limit the Loader is measured against."""
    assert len(ds.shards) == 1
    src = as_tensor(ds.shards[0].array("logmel"), ds.fields["logmel"].dtype)
    batches = [torch.from_numpy(b) for b in Loader(ds, BATCH, seed=0).batches(0)]
    ring = [torch.zeros((BATCH, *src.shape[1:]), dtype=src.dtype) for _ in range(buffers)]

    def epoch() -> None:
        for j, b in enumerate(batches):
            torch.index_select(src, 0, b, out=ring[j % buffers][: len(b)])

    return epoch


def epoch_time(loader: Iterable[Any], repeats: int) -> float:
    """Median epoch time after one untimed epoch (page cache, ring buffers, threads warm)."""
    loader_epoch(loader)
    return best_of(lambda: loader_epoch(loader), repeats)


def run(
    work: Path,
    archive: Path,
    corpus: Path,
    naive_rate: float,
    workers: int,
    repeats: int,
    speech_utts: int,
    memory_gib: list[float],
) -> list[Row]:
    ds = open_archive(archive)
    n = len(ds)
    size = FRAMES * MELS * 2
    wl = f"runtime: ESC-50-shaped f16 [{FRAMES},{MELS}] x {n}, raw, page cache warm, shuffled batches of {BATCH}"
    # A prefetching loader needs several output buffers, while one reused buffer
    # stays in cache: the bare gather runs over one buffer and over three.
    bare, bare3 = bare_gather(ds), bare_gather(ds, 3)
    # What a training loop reads (features and labels); the bare gather covers the features.
    train = open_archive(archive, fields=["logmel", "label"])
    loader = Loader(train, BATCH, seed=0)
    first_ms = first_batch_ms(loader)
    sync = Loader(train, BATCH, seed=0, prefetch=0)
    every = Loader(ds, BATCH, seed=0)
    dl = DataLoader(train, batch_size=BATCH, shuffle=True)
    took = interleaved(
        {
            "bare": bare,
            "bare3": bare3,
            "loader": lambda: loader_epoch(loader),
            "sync": lambda: loader_epoch(sync),
            "every": lambda: loader_epoch(every),
            "dl": lambda: loader_epoch(dl),
        },
        repeats,
    )
    base = rate_row(
        wl, "bare torch.index_select(out=) over the mapped shard", n, took["bare"], size
    )
    naive = Row(
        wl,
        "naive per-sample DataLoader (same run, compile section)",
        naive_rate,
        naive_rate * size / 1e9,
    )
    threaded = rate_row(
        wl,
        "dlop Loader (logmel, label)",
        n,
        took["loader"],
        size,
        base,
        "bare index_select",
        first_batch_ms=first_ms,
        copier=loader.engine.kind,
        target=">=0.95x",
    )
    rows = [
        base,
        # A prefetching loader needs several output buffers, while one reused
        # buffer stays in cache: the bare gather runs over one buffer and over three.
        rate_row(
            wl,
            "bare torch.index_select(out=), 3 rotating output buffers",
            n,
            took["bare3"],
            size,
            base,
            "bare index_select",
        ),
        threaded,
        rate_row(
            wl,
            "dlop Loader, prefetch=0 (gathers on the training thread)",
            n,
            took["sync"],
            size,
            base,
            "bare index_select",
            target=">=0.95x",
        ),
        rate_row(
            wl,
            "dlop Loader, every field (key, category text too)",
            n,
            took["every"],
            size,
            base,
            "bare index_select",
            target=">=1.0x",
        ),
        rate_row(
            wl,
            "torch DataLoader(open_archive(...), batch_size=256, shuffle=True)",
            n,
            took["dl"],
            size,
            threaded,
            "dlop Loader",
            target=">=0.9x",
        ),
    ]
    for lo in (loader, sync, every):
        lo.close()
    rows.append(naive)
    from .peers import webdataset_rows

    rows += webdataset_rows(wl, archive, work, BATCH, threaded)
    recipe = build_recipe(
        {**DEMO_RECIPE, "source": str(corpus), "codec": "zstd", "shard_bytes": "4GiB"}
    )
    zpath = work / "esc-zstd"
    index = compile_corpus(recipe, zpath, workers=workers, progress=False, overwrite=True)
    # A block cache far smaller than the decoded features, so epochs decode rather than hit.
    zloader = Loader(
        Archive(zpath, fields=["logmel", "label"], block_cache_bytes=16 << 20), BATCH, seed=0
    )
    rows.append(
        rate_row(
            wl,
            "dlop Loader, zstd:3+shuffle archive, 16 MiB block cache",
            n,
            epoch_time(zloader, repeats),
            size,
            threaded,
            "dlop Loader",
            archive_ratio=round(n * size / sum(s.bytes for s in index.shards), 2),
        )
    )
    shutil.rmtree(zpath, ignore_errors=True)
    for row in rows:  # every dlop path against the pipeline it replaces
        if row.pipeline.startswith(("dlop", "torch DataLoader")):
            row.extra["vs_naive"] = (
                round(row.samples_per_s / naive_rate, 1) if row.samples_per_s else None
            )
    rows += ragged_rows(work, speech_utts, repeats)
    rows += memory_rows(work, memory_gib)
    return rows


def ragged_rows(work: Path, utts: int, repeats: int) -> list[Row]:
    rng = np.random.default_rng(1)
    lengths = rng.integers(100, 1601, utts)
    path = work / "speech"
    block = rng.normal(-20, 10, (1600, 80)).astype(np.float16)
    with ArchiveWriter(
        path, [Field("fbank", "f16", (None, 80))], shard_bytes=1 << 40, overwrite=True
    ) as w:
        for n in lengths:
            w.write({"fbank": block[:n]})
    ds = open_archive(path)
    values = ds.shards[0].values("fbank")
    dst = np.empty_like(values)
    dst.fill(0)  # first touch outside the timing
    valid = int(lengths.sum()) * 80 * 2
    size = valid / utts  # valid bytes per utterance, on average
    wl = f"runtime: ragged speech f16 [100..1600, 80] x {utts} ({valid / 2**20:.0f} MiB valid)"
    bucketed = Loader(ds, BATCH, seed=0, bucket_by="fbank")
    plain = Loader(ds, BATCH, seed=0)
    # DataLoader worker processes, as users' habits take them: bucketed batches
    # made in 2 workers, kept alive across epochs.
    iterable = IterableArchive(path, BATCH, seed=0, bucket_by="fbank")
    in_workers = [  # held in a list so it can be dropped after the timing
        DataLoader(
            iterable,
            batch_size=None,
            num_workers=2,
            persistent_workers=True,
        )
    ]
    took = interleaved(
        {
            "memcpy": lambda: np.copyto(dst, values),
            "bucketed": lambda: loader_epoch(bucketed),
            "plain": lambda: loader_epoch(plain),
            "workers": lambda: loader_epoch(in_workers[0]),
        },
        repeats,
    )
    # Batches the workers gathered into their reused shared-memory buffers, and into
    # fresh shared memory (every buffer still held by the main process).
    in_slots, fresh = iterable.buffer_counts()
    memcpy = rate_row(wl, "np.copyto of the values region (memcpy)", utts, took["memcpy"], size)
    loader_row = rate_row(
        wl,
        "dlop Loader, bucket_by",
        utts,
        took["bucketed"],
        size,
        memcpy,
        "memcpy",
        target=">=0.8x",
    )
    rows = [
        memcpy,
        loader_row,
        rate_row(wl, "dlop Loader, no bucketing", utts, took["plain"], size, memcpy, "memcpy"),
        rate_row(
            wl,
            "DataLoader(IterableArchive(bucket_by), num_workers=2, persistent_workers=True)",
            utts,
            took["workers"],
            size,
            loader_row,
            "dlop Loader, bucket_by",
            target=">=0.3x",
            batches_in_reused_buffers=in_slots,
            batches_in_fresh_memory=fresh,
        ),
    ]
    for lo in (bucketed, plain):
        lo.close()
    in_workers.clear()  # its worker processes end
    shutil.rmtree(path, ignore_errors=True)
    return rows


def memory_rows(work: Path, sizes_gib: list[float]) -> list[Row]:
    rows = []
    sample_bytes = FRAMES * MELS * 2
    block = synthetic_logmel(np.random.default_rng(2), 64)
    for gib in sizes_gib:
        n = int(gib * (1 << 30) // sample_bytes)
        path = work / f"mem-{gib:g}"
        with ArchiveWriter(
            path,
            [Field("logmel", "f16", (FRAMES, MELS)), Field("label", "i64", ())],
            shard_bytes=1 << 30,
            overwrite=True,
        ) as w:
            for i in range(n):
                w.write({"logmel": block[i % 64], "label": i})
        loader = Loader(path, BATCH, seed=0)
        loader.buffers()  # allocated before the baseline is read
        before = status_kib("RssAnon")
        peak = before
        t0 = time.perf_counter()
        count = 0
        for b in loader:
            count += len(b["label"])
            peak = max(peak, status_kib("RssAnon"))
        took = time.perf_counter() - t0
        rows.append(
            rate_row(
                f"runtime memory: {gib:g} GiB archive ({n} samples, {loader.archive.reader.num_shards} shards)",
                "dlop Loader epoch, anonymous RSS growth beyond its buffers",
                count,
                took,
                sample_bytes,
                growth_MiB=round((peak - before) / 1024, 1),
                target="growth < 64 MiB",
                rss_file_MiB=round(status_kib("RssFile") / 1024),
            )
        )
        loader.close()
        del loader  # unmap the shards before deleting them
        shutil.rmtree(path, ignore_errors=True)
    return rows

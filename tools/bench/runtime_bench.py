"""Loader and DataLoader throughput against the gather limit, ragged speech, and memory at scale."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import torch
from dlop.compiler.demo import DEMO_RECIPE
from dlop.compiler.pipeline import compile_corpus
from dlop.compiler.recipe import build_recipe
from dlop.formats import ArchiveWriter, Field
from dlop.runtime import Loader, open_archive
from dlop.runtime.gather import FixedRawGather
from torch.utils.data import DataLoader

from .common import Row, best_of
from .format_bench import FRAMES, MELS, synthetic_logmel
from .procmem import status_kib

BATCH = 256


def loader_epoch(loader: Loader) -> int:
    return sum(
        int(b["label"].shape[0]) if "label" in b else len(next(iter(b.values()))) for b in loader
    )


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
    sample_bytes = FRAMES * MELS * 2
    wl = f"runtime: ESC-50-shaped f16 [{FRAMES},{MELS}] x {n}, raw, page cache warm, shuffled batches of {BATCH}"
    gather = ds.gathers["logmel"]
    assert isinstance(gather, FixedRawGather) and len(gather.sources) == 1
    src = gather.sources[0]
    batches = [torch.from_numpy(b) for b in Loader(ds, BATCH, seed=0).batches(0)]
    buf = torch.empty((BATCH, FRAMES, MELS), dtype=src.dtype)
    buf.zero_()

    def bare() -> None:
        for b in batches:
            torch.index_select(src, 0, b, out=buf[: len(b)])

    bare()  # page cache and buffers warm
    t_bare = best_of(bare, repeats)
    rate_bare = n / t_bare
    rows = [
        Row(
            wl,
            "bare torch.index_select(out=) over the mapped shard",
            rate_bare,
            rate_bare * sample_bytes / 1e9,
        )
    ]
    # A prefetching loader needs several output buffers; a single reused one stays
    # in cache. The same bare gather over three rotating buffers shows that cost.
    ring = [torch.empty((BATCH, FRAMES, MELS), dtype=src.dtype) for _ in range(3)]
    for r in ring:
        r.zero_()

    def bare_ring() -> None:
        for j, b in enumerate(batches):
            torch.index_select(src, 0, b, out=ring[j % 3][: len(b)])

    t_ring = best_of(bare_ring, repeats)
    rows.append(
        Row(
            wl,
            "bare torch.index_select(out=), 3 rotating output buffers",
            n / t_ring,
            n / t_ring * sample_bytes / 1e9,
            t_bare / t_ring,
            "bare index_select",
        )
    )

    # What a training loop reads (features and labels); the bare gather covers the features.
    train = open_archive(archive, fields=["logmel", "label"])
    loader = Loader(train, BATCH, seed=0)
    t0 = time.perf_counter()
    it = iter(loader)
    next(it)
    first = time.perf_counter() - t0
    for _ in it:
        pass
    t_loader = best_of(lambda: loader_epoch(loader), repeats)
    rate = n / t_loader
    rows.append(
        Row(
            wl,
            "dlop Loader (logmel, label)",
            rate,
            rate * sample_bytes / 1e9,
            rate / rate_bare,
            "bare index_select",
            extra={
                "vs_naive": round(rate / naive_rate, 1),
                "first_batch_ms": round(first * 1000, 1),
            },
        )
    )
    sync = Loader(train, BATCH, seed=0, prefetch=0)
    t_sync = best_of(lambda: loader_epoch(sync), repeats)
    rows.append(
        Row(
            wl,
            "dlop Loader, prefetch=0 (gathers on the training thread)",
            n / t_sync,
            n / t_sync * sample_bytes / 1e9,
            (n / t_sync) / rate_bare,
            "bare index_select",
            extra={"vs_naive": round(n / t_sync / naive_rate, 1)},
        )
    )
    every = Loader(ds, BATCH, seed=0)
    t_every = best_of(lambda: loader_epoch(every), repeats)
    rows.append(
        Row(
            wl,
            "dlop Loader, every field (key, category text too)",
            n / t_every,
            n / t_every * sample_bytes / 1e9,
            (n / t_every) / rate,
            "dlop Loader",
        )
    )
    dl = DataLoader(train, batch_size=BATCH, shuffle=True)
    t_dl = best_of(lambda: sum(len(b["label"]) for b in dl), repeats)
    rows.append(
        Row(
            wl,
            "torch DataLoader(open_archive(...), batch_size=256, shuffle=True)",
            n / t_dl,
            n / t_dl * sample_bytes / 1e9,
            (n / t_dl) / rate,
            "dlop Loader",
            extra={"vs_naive": round(n / t_dl / naive_rate, 1)},
        )
    )
    rows.append(
        Row(
            wl,
            "naive per-sample DataLoader (same run, compile section)",
            naive_rate,
            naive_rate * sample_bytes / 1e9,
            naive_rate / rate,
            "dlop Loader",
        )
    )

    from .peers import webdataset_rows

    rows += webdataset_rows(wl, archive, work, BATCH, rate, sample_bytes)
    recipe = build_recipe(
        {**DEMO_RECIPE, "source": str(corpus), "codec": "zstd", "shard_bytes": "4GiB"}
    )
    zpath = work / "esc-zstd"
    index = compile_corpus(recipe, zpath, workers=workers, progress=False, overwrite=True)
    zloader = Loader(zpath, BATCH, seed=0, fields=["logmel", "label"])
    t_z = best_of(lambda: loader_epoch(zloader), repeats)
    zbytes = sum(s.bytes for s in index.shards)
    rows.append(
        Row(
            wl,
            "dlop Loader, zstd:3+shuffle archive",
            n / t_z,
            n / t_z * sample_bytes / 1e9,
            (n / t_z) / rate,
            "dlop Loader",
            extra={"archive_ratio": round(n * sample_bytes / zbytes, 2)},
        )
    )
    shutil.rmtree(zpath, ignore_errors=True)
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
    dst.fill(0)
    t_copy = best_of(lambda: np.copyto(dst, values), repeats)
    valid = int(lengths.sum()) * 80 * 2
    loader = Loader(ds, BATCH, seed=0, bucket_by="fbank")
    t_loader = best_of(lambda: sum(len(b["fbank_lengths"]) for b in loader), repeats)
    t_plain = best_of(
        lambda: sum(len(b["fbank_lengths"]) for b in Loader(ds, BATCH, seed=0)), repeats
    )
    wl = f"runtime: ragged speech f16 [100..1600, 80] x {utts} ({valid / 2**20:.0f} MiB valid)"
    rows = [
        Row(wl, "np.copyto of the values region (memcpy)", utts / t_copy, valid / t_copy / 1e9),
        Row(
            wl,
            "dlop Loader, bucket_by",
            utts / t_loader,
            valid / t_loader / 1e9,
            t_copy / t_loader,
            "memcpy",
        ),
        Row(
            wl,
            "dlop Loader, no bucketing",
            utts / t_plain,
            valid / t_plain / 1e9,
            t_copy / t_plain,
            "memcpy",
        ),
    ]
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
        loader._ring()
        before = status_kib("RssAnon")
        peak = before
        t0 = time.perf_counter()
        count = 0
        for b in loader:
            count += len(b["label"])
            peak = max(peak, status_kib("RssAnon"))
        took = time.perf_counter() - t0
        rows.append(
            Row(
                f"runtime memory: {gib:g} GiB archive ({n} samples, {loader.archive.reader.num_shards} shards)",
                "dlop Loader epoch, anonymous RSS growth beyond its buffers",
                count / took,
                count * sample_bytes / took / 1e9,
                extra={
                    "growth_MiB": round((peak - before) / 1024, 1),
                    "rss_file_MiB": round(status_kib("RssFile") / 1024),
                },
            )
        )
        loader.close()
        del loader  # unmap the shards before deleting them
        shutil.rmtree(path, ignore_errors=True)
    return rows

"""Format benchmarks: ShardReader against np.copyto, zstd decoding against bare zstandard."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import zstandard

from dlop.formats import (
    ArchiveReader,
    ArchiveWriter,
    BlockCache,
    Codec,
    Field,
    Raw,
    ShardReader,
    Zstd,
)

from .common import Row, best_of, rate_row

MELS, FRAMES = 128, 431  # ESC-50 5 s clip at 44.1 kHz, hop 512


def synthetic_logmel(rng: np.random.Generator, n: int) -> np.ndarray:
    """Spectrogram-like float16 [n, FRAMES, MELS]: smooth bands plus noise, in dB."""
    t = np.linspace(0, 1, FRAMES, dtype=np.float32)[None, :, None]
    f = np.linspace(0, 1, MELS, dtype=np.float32)[None, None, :]
    centre = rng.uniform(0.1, 0.9, (n, 1, 1)).astype(np.float32)
    sweep = rng.uniform(-0.5, 0.5, (n, 1, 1)).astype(np.float32)
    band = np.exp(-((f - centre - sweep * t) ** 2) / 0.01)
    noise = rng.normal(0, 3, (n, FRAMES, MELS)).astype(np.float32)
    return (-80 + 60 * band + noise).astype(np.float16)


def build(path: Path, n: int, codec: Codec, seed: int = 0, chunk: int = 256) -> ArchiveReader:
    shutil.rmtree(path, ignore_errors=True)
    field = Field("logmel", "f16", (FRAMES, MELS), codec=codec, units="dB")
    rng = np.random.default_rng(seed)
    with ArchiveWriter(path, [field], shard_bytes=1 << 40) as w:
        for start in range(0, n, chunk):
            for x in synthetic_logmel(rng, min(chunk, n - start)):
                w.write({"logmel": x})
    return ArchiveReader(path)


def run(
    workdir: Path, raw_gib: float = 1.0, zstd_samples: int = 2000, repeats: int = 3
) -> list[Row]:
    rows = raw_rows(workdir, raw_gib, repeats)
    for shuffle in (False, True):
        rows += zstd_rows(workdir, zstd_samples, shuffle, repeats)
    return rows


def raw_rows(workdir: Path, raw_gib: float, repeats: int) -> list[Row]:
    sample_bytes = FRAMES * MELS * 2
    n = max(1, int(raw_gib * (1 << 30) // sample_bytes))
    reader = build(workdir / "raw", n, Raw())
    shard = reader.shard(0)
    src = shard.array("logmel")
    nbytes = src.nbytes
    dst = np.empty_like(src)
    dst.fill(0)  # first touch outside the timing
    np.copyto(dst, src)  # warm the page cache

    def batched(batch: int = 256) -> None:
        for start in range(0, n, batch):
            stop = min(n, start + batch)
            shard.read_range("logmel", start, stop, out=dst[start:stop])

    def batched_1thread(batch: int = 256) -> None:
        view = shard.array("logmel")
        for start in range(0, n, batch):
            np.copyto(dst[start : start + batch], view[start : start + batch])

    def per_sample() -> None:
        for i in range(n):
            np.copyto(dst[i], shard.get("logmel", i))

    wl = f"format: raw f16 [{FRAMES},{MELS}] x {n} ({nbytes / 2**30:.2f} GiB)"
    size = nbytes / n
    base = rate_row(
        wl, "np.copyto of the mapped region", n, best_of(lambda: np.copyto(dst, src), repeats), size
    )
    rows = [base] + [
        rate_row(wl, name, n, best_of(fn, repeats), size, base, "np.copyto")
        for name, fn in (
            ("ShardReader.read_range, batches of 256", batched),
            ("ShardReader.array views, 1-thread copyto of 256", batched_1thread),
            ("ShardReader.get, every sample", per_sample),
        )
    ]
    reader.close()
    shutil.rmtree(workdir / "raw", ignore_errors=True)
    return rows


def zstd_rows(workdir: Path, n: int, shuffle: bool, repeats: int) -> list[Row]:
    path = workdir / f"zstd{int(shuffle)}"
    reader = build(path, n, Zstd(level=3, shuffle=shuffle))
    shard = reader.shard(0)
    blocks = shard.blocks("logmel")
    frames = [bytes(shard.compressed_block("logmel", k)) for k in range(len(blocks))]
    raw_total, comp_total = int(blocks[:, 3].sum()), int(blocks[:, 1].sum())
    dctx = zstandard.ZstdDecompressor()

    def bare() -> None:
        for frame in frames:
            dctx.decompress(frame)

    def dlop_blocks() -> None:
        for k in range(len(frames)):
            shard.decode_block("logmel", k, cached=False)  # every block decoded

    # A sequential reader with a one-block cache: each block is decoded once per pass
    # (the archive-wide cache would hold this whole corpus and measure cache hits).
    sequential = ShardReader(shard.path, block_cache=BlockCache(max_bytes=1))

    def dlop_samples() -> None:
        for i in range(n):
            sequential.get("logmel", i)

    wl = f"format: zstd:3{'+shuffle' if shuffle else ''} f16 x {n} (ratio {raw_total / comp_total:.2f}x)"
    size = raw_total / n
    base = rate_row(wl, "bare zstandard.decompress of the blocks", n, best_of(bare, repeats), size)
    rows = [base] + [
        rate_row(wl, name, n, best_of(fn, repeats), size, base, "bare zstandard")
        for name, fn in (
            ("ShardReader.decode_block, every block", dlop_blocks),
            ("ShardReader.get, every sample, in order", dlop_samples),
        )
    ]
    reader.close()
    shutil.rmtree(path, ignore_errors=True)
    return rows

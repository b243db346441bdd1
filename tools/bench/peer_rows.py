"""LitData and MosaicML Streaming over the same precomputed log-mels, beside the dlop Loader.

These peers are not dependencies of dlop: ``make bench-peers`` installs them
into their own environment (.venv-peers) and runs ``dlop-bench --only peers``.
A peer that does not import is reported as a row with the reason, not
skipped silently. FFCV builds only against system libraries (libturbojpeg,
OpenCV; ``make bench-peers`` installs them with apt-get where it can) and
stores float32, not float16, so its row reads float32 copies of the same
log-mels: twice the bytes per sample.
"""

from __future__ import annotations

import functools
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from dlop.formats import ArchiveReader, ArchiveWriter, Field
from dlop.runtime import Loader, open_archive

from .common import Row, best_of, first_batch_ms, interleaved, loader_epoch, rate_row
from .format_bench import FRAMES, MELS, synthetic_logmel
from .runtime_bench import bare_gather

BATCH = 256


def _sample(path: str, i: int) -> dict[str, Any]:
    """One sample as a peer's writer takes it (module level, so worker processes can pickle it)."""
    with ArchiveReader(path) as r:
        return {"logmel": np.array(r.get("logmel", i)), "label": int(r.get("label", i))}


def _timed(make: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Epochs of one loader object, as a training loop runs them, after a warm-up epoch;
    and the first batch's wait of that first epoch."""
    loader = make()
    first = first_batch_ms(loader)
    return best_of(lambda: loader_epoch(loader), repeats), first


def _litdata(
    archive: Path, work: Path, n: int, workers: int, repeats: int
) -> tuple[float, float, float, int]:
    import litdata as ld

    out = work / "litdata"
    t0 = time.perf_counter()
    ld.optimize(
        fn=functools.partial(_sample, str(archive)),
        inputs=list(range(n)),
        output_dir=str(out),
        chunk_bytes="64MB",
        num_workers=workers,
        verbose=False,
    )
    convert = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())

    def make() -> Any:
        ds = ld.StreamingDataset(str(out), shuffle=True, seed=0)
        return ld.StreamingDataLoader(
            ds, batch_size=BATCH, num_workers=workers, persistent_workers=True
        )

    return (*_timed(make, repeats), convert, size)


def _streaming(
    archive: Path, work: Path, n: int, workers: int, repeats: int
) -> tuple[float, float, float, int]:
    from streaming import MDSWriter, StreamingDataset
    from torch.utils.data import DataLoader

    out = work / "mds"
    t0 = time.perf_counter()
    columns = {"logmel": f"ndarray:float16:{FRAMES},{MELS}", "label": "int"}
    with (
        ArchiveReader(archive) as r,
        MDSWriter(out=str(out), columns=columns, size_limit="64mb") as w,
    ):
        for i in range(n):
            w.write({"logmel": np.array(r.get("logmel", i)), "label": int(r.get("label", i))})
    convert = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())

    def make() -> Any:
        ds = StreamingDataset(local=str(out), shuffle=True, batch_size=BATCH)
        return DataLoader(ds, batch_size=BATCH, num_workers=workers, persistent_workers=True)

    return (*_timed(make, repeats), convert, size)


class _Float32Samples:
    """(float32 log-mel, label) tuples for FFCV's writer, which takes an indexed dataset."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.reader: ArchiveReader | None = None
        with ArchiveReader(path) as r:
            self.n = r.num_samples

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        if self.reader is None:
            self.reader = ArchiveReader(self.path)
        logmel = np.asarray(self.reader.get("logmel", i), dtype=np.float32)
        return logmel, int(self.reader.get("label", i))


def _ffcv(
    archive: Path, work: Path, n: int, workers: int, repeats: int
) -> tuple[float, float, float, int]:
    from ffcv.fields import IntField, NDArrayField
    from ffcv.fields.decoders import IntDecoder, NDArrayDecoder
    from ffcv.loader import Loader as FFCVLoader
    from ffcv.loader import OrderOption
    from ffcv.writer import DatasetWriter

    out = work / "ffcv.beton"
    t0 = time.perf_counter()
    fields = {
        "logmel": NDArrayField(shape=(FRAMES, MELS), dtype=np.dtype("float32")),
        "label": IntField(),
    }
    DatasetWriter(str(out), fields, num_workers=workers).from_indexed_dataset(
        _Float32Samples(str(archive))
    )
    convert = time.perf_counter() - t0
    loader = FFCVLoader(
        str(out),
        batch_size=BATCH,
        num_workers=workers,
        order=OrderOption.RANDOM,
        os_cache=True,
        pipelines={"logmel": [NDArrayDecoder()], "label": [IntDecoder()]},
    )

    def epoch() -> int:
        return sum(len(label) for _, label in loader)

    first = first_batch_ms(loader)  # also compiles FFCV's pipeline and warms the page cache
    return best_of(epoch, repeats), first, convert, out.stat().st_size


def run(work: Path, samples: int, workers: int, repeats: int) -> list[Row]:
    # Peers hand torch read-only numpy arrays; the warning repeats in every worker.
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    os.environ["PYTHONWARNINGS"] = "ignore:The given NumPy array is not writable:UserWarning"
    work.mkdir(parents=True, exist_ok=True)
    path = work / "esc-f16"
    block = synthetic_logmel(np.random.default_rng(3), 64)
    with ArchiveWriter(
        path, [Field("logmel", "f16", (FRAMES, MELS)), Field("label", "i64", ())], overwrite=True
    ) as w:
        for i in range(samples):
            w.write({"logmel": block[i % 64], "label": i % 50})
    size = FRAMES * MELS * 2
    wl = (
        f"peers: ESC-50-shaped f16 [{FRAMES},{MELS}] x {samples} with labels, page cache warm, "
        f"shuffled batches of {BATCH}, {workers} DataLoader workers for the peers"
    )
    ds = open_archive(path)
    loader = Loader(ds, BATCH, seed=0)
    first = first_batch_ms(loader)
    took = interleaved({"bare": bare_gather(ds), "loader": lambda: loader_epoch(loader)}, repeats)
    loader.close()
    base = rate_row(
        wl, "bare torch.index_select(out=) over the mapped shard", samples, took["bare"], size
    )
    dlop = rate_row(
        wl,
        "dlop Loader",
        samples,
        took["loader"],
        size,
        base,
        "bare index_select",
        first_batch_ms=first,
    )
    rows = [base, dlop]
    for name, fn in (
        ("LitData 0.2 optimize + StreamingDataset/StreamingDataLoader", _litdata),
        ("MosaicML Streaming MDSWriter + StreamingDataset + DataLoader", _streaming),
        ("FFCV 1.0 DatasetWriter + Loader (float32 copies: 2x the bytes)", _ffcv),
    ):
        try:
            took_s, first_ms, convert, stored = fn(path, work, samples, workers, repeats)
        except ImportError as e:
            rows.append(Row(wl, f"{name}: not run ({e}; install with make bench-peers)"))
            continue
        rows.append(
            rate_row(
                wl,
                name,
                samples,
                took_s,
                size * (2 if fn is _ffcv else 1),
                dlop,
                "dlop Loader",
                first_batch_ms=first_ms,
                convert_s=round(convert, 1),
                stored_MiB=round(stored / 2**20),
            )
        )
    shutil.rmtree(work, ignore_errors=True)
    return rows

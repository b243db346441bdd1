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
import gc
import multiprocessing
import os
import shutil
import statistics
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


def _stored(out: Path) -> int:
    return sum(f.stat().st_size for f in out.rglob("*") if f.is_file())


def _litdata_write(archive: Path, out: Path, n: int, workers: int) -> float:
    """LitData's chunks of the archive's samples in ``out``; returns the seconds taken.

    ``optimize`` sets the process's multiprocessing start method to spawn; it is
    put back after, so the DataLoader workers of later rows start as they would
    in a training script (fork on Linux), not with a fresh interpreter each.
    """
    import litdata as ld

    start_method = multiprocessing.get_start_method(allow_none=True)
    t0 = time.perf_counter()
    try:
        ld.optimize(
            fn=functools.partial(_sample, str(archive)),
            inputs=list(range(n)),
            output_dir=str(out),
            chunk_bytes="64MB",
            num_workers=workers,
            verbose=False,
        )
    finally:
        multiprocessing.set_start_method(start_method, force=True)
    return time.perf_counter() - t0


def _streaming_write(archive: Path, out: Path, n: int) -> float:
    """MosaicML Streaming's MDS shards of the archive's samples in ``out``; returns the
    seconds taken."""
    from streaming import MDSWriter

    t0 = time.perf_counter()
    columns = {"logmel": f"ndarray:float16:{FRAMES},{MELS}", "label": "int"}
    with (
        ArchiveReader(archive) as r,
        MDSWriter(out=str(out), columns=columns, size_limit="64mb") as w,
    ):
        for i in range(n):
            w.write({"logmel": np.array(r.get("logmel", i)), "label": int(r.get("label", i))})
    return time.perf_counter() - t0


def _litdata(
    archive: Path, work: Path, n: int, workers: int, repeats: int
) -> tuple[float, float, float, int]:
    import litdata as ld

    out = work / "litdata"
    convert = _litdata_write(archive, out, n, workers)
    size = _stored(out)

    def make() -> Any:
        ds = ld.StreamingDataset(str(out), shuffle=True, seed=0)
        return ld.StreamingDataLoader(
            ds, batch_size=BATCH, num_workers=workers, persistent_workers=True
        )

    return (*_timed(make, repeats), convert, size)


def _streaming(
    archive: Path, work: Path, n: int, workers: int, repeats: int
) -> tuple[float, float, float, int]:
    from streaming import StreamingDataset
    from torch.utils.data import DataLoader

    out = work / "mds"
    convert = _streaming_write(archive, out, n)
    size = _stored(out)

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


S3_BUCKET = "dlop-peers"
S3_CACHE_BYTES = 8 << 30  # every cache holds the whole dataset: warm epochs fetch nothing
STREAMING_S3 = "MosaicML Streaming StreamingDataset(remote=s3://, local=cache) + DataLoader"


def s3_epochs(make: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Seconds of a loader's first epoch from an empty cache (cold: every shard or chunk
    fetched; opening included) and the median of later ones (warm)."""
    cold, loader = first_epoch(make)
    warm = best_of(lambda: loader_epoch(loader), repeats)
    finish(loader)
    return cold, warm


def first_epoch(make: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds from making a loader to the end of its first epoch, and the loader."""
    t0 = time.perf_counter()
    loader = make()
    loader_epoch(loader)
    return time.perf_counter() - t0, loader


def finish(loader: Any) -> None:
    """Ends a loader timed here: the dlop Loader's threads (``close``); the peers'
    DataLoader workers end with their loader."""
    if isinstance(loader, Loader):
        loader.close()


def dlop_s3(url: str, cache: Path, workers: int) -> Any:
    """The dlop Loader over ``url`` through a cache folder that holds it all."""
    return Loader(url, BATCH, seed=0, cache_dir=cache, cache_bytes=S3_CACHE_BYTES)


def litdata_allow_http(worker_id: int = 0) -> None:
    """Lets LitData's obstore client fetch from an ``http://`` endpoint (the loopback
    server): LitData builds obstore's client with options of its own that leave out
    ``allow_http`` (AWS_ALLOW_HTTP in the environment does not reach it). Run in the
    loader's process and, as ``worker_init_fn``, in each worker: after ``optimize``
    the workers are spawned, not forked, and import LitData afresh."""
    from litdata.streaming import downloader as fetching

    name = "_OBSTORE_CLIENT_OPTIONS"  # LitData's own, read each time it builds a client
    options = getattr(fetching, name, None)
    if isinstance(options, dict) and os.environ.get("AWS_ENDPOINT_URL", "").startswith("http:"):
        setattr(fetching, name, {**options, "allow_http": True})


def litdata_s3(url: str, cache: Path, workers: int) -> Any:
    """LitData streaming ``url`` (its boto3 client reads AWS_ENDPOINT_URL) into ``cache``."""
    import litdata as ld

    litdata_allow_http()
    ds = ld.StreamingDataset(
        url, cache_dir=str(cache), shuffle=True, seed=0, max_cache_size=S3_CACHE_BYTES
    )
    return ld.StreamingDataLoader(
        ds,
        batch_size=BATCH,
        num_workers=workers,
        persistent_workers=True,
        worker_init_fn=litdata_allow_http,
    )


def streaming_s3(url: str, cache: Path, workers: int) -> Any:
    """MosaicML Streaming streaming ``url`` (its boto3 client reads S3_ENDPOINT_URL)
    into ``cache``."""
    from streaming import StreamingDataset
    from torch.utils.data import DataLoader

    ds = StreamingDataset(
        remote=url, local=str(cache), shuffle=True, batch_size=BATCH, cache_limit=S3_CACHE_BYTES
    )
    return DataLoader(ds, batch_size=BATCH, num_workers=workers, persistent_workers=True)


COLD_ROUNDS = 3  # interleaved cold first epochs of dlop and Streaming (at least)


def cold_epochs(makers: list[Callable[[Path], Any]], work: Path, rounds: int) -> list[list[float]]:
    """Seconds of each loader's first epoch from an empty cache of its own (opening
    included), ``rounds`` times, in interleaved rounds that take the loaders in turn,
    the turn reversed every other round: a drift of the machine or the server falls on
    all of them alike."""
    took: list[list[float]] = [[] for _ in makers]
    for r in range(rounds):
        turn = list(range(len(makers)))
        for i in turn if r % 2 == 0 else turn[::-1]:
            cache = work / f"cold-{i}-{r}"
            shutil.rmtree(cache, ignore_errors=True)
            _settled()
            seconds, loader = first_epoch(functools.partial(makers[i], cache))
            took[i].append(seconds)
            finish(loader)
            del loader
            shutil.rmtree(cache, ignore_errors=True)
    return took


def _settled(limit_s: float = 10.0) -> None:
    """Waits (up to ``limit_s``) until the loaders timed before are gone, their worker
    processes included: a DataLoader's persistent workers end with their iterator, and
    workers still exiting would slow whichever loader is timed next."""
    gc.collect()
    deadline = time.monotonic() + limit_s
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)


def s3_rows(archive: Path, work: Path, n: int, workers: int, repeats: int) -> list[Row]:
    """dlop, LitData and MosaicML Streaming streaming the same samples from one local S3
    server (moto on loopback), each through its own cache: warm and cold epochs. dlop's
    and Streaming's cold first epochs are timed again in interleaved rounds (at least
    ``COLD_ROUNDS``), each from an empty cache; their rows give the medians, and
    Streaming's the median of the rounds' ratios."""
    from . import remote_bench

    size = FRAMES * MELS * 2
    wl = (
        f"peers over S3: ESC-50-shaped f16 [{FRAMES},{MELS}] x {n} with labels, moto S3 on "
        f"loopback, each cache holds all, shuffled batches of {BATCH}, {workers} DataLoader "
        "workers for the peers"
    )
    with remote_bench.moto_s3() as endpoint:
        if endpoint is None:
            return [Row(wl, "all: not run (moto is not installed; make bench-peers installs it)")]
        url = remote_bench.upload(archive, S3_BUCKET)  # not timed, as the peers' uploads
        ours = functools.partial(dlop_s3, url, workers=0)
        cold, warm = s3_epochs(lambda: ours(work / "dlop-cache"), repeats)
        base = rate_row(wl, "dlop Loader over s3://, warm cache", n, warm, size)
        colds: dict[str, list[float]] = {"dlop": [cold]}
        timed: list[tuple[str, float, float]] = []  # each peer's name, cold and warm
        rows = [base]
        peers: list[tuple[str, Callable[[Path], float], Callable[[str, Path, int], Any]]] = [
            (
                "LitData 0.2 StreamingDataset(s3://) + StreamingDataLoader",
                lambda out: _litdata_write(archive, out, n, workers),
                litdata_s3,
            ),
            (
                STREAMING_S3,
                lambda out: _streaming_write(archive, out, n),
                streaming_s3,
            ),
        ]
        streaming_url = None
        for i, (name, write, make) in enumerate(peers):
            out = work / f"s3-peer-{i}"
            try:
                write(out)
                peer_url = remote_bench.upload(out, S3_BUCKET)
                opened = functools.partial(make, peer_url, work / f"s3-cache-{i}", workers)
                cold, warm = s3_epochs(opened, repeats)
            except ImportError as e:
                rows.append(Row(wl, f"{name}: not run ({e}; install with make bench-peers)"))
                continue
            except Exception as e:  # a peer that cannot read from the server: the row says why
                rows.append(Row(wl, f"{name}: failed ({type(e).__name__}: {e})"[:400]))
                continue
            rows.append(rate_row(wl, f"{name}, warm cache", n, warm, size, base))
            timed.append((name, cold, warm))
            if name == STREAMING_S3:
                streaming_url = peer_url
        extra: dict[str, Any] = {}
        if streaming_url is not None:
            theirs = functools.partial(streaming_s3, streaming_url, workers=workers)
            rounds = cold_epochs([ours, theirs], work, max(COLD_ROUNDS, repeats))
            colds = {"dlop": rounds[0], STREAMING_S3: rounds[1]}
            ratios = [s / d for d, s in zip(rounds[0], rounds[1], strict=True)]
            extra = {
                "dlop_over_streaming": {
                    "median": round(statistics.median(ratios), 3),
                    "range": [round(min(ratios), 3), round(max(ratios), 3)],
                    "each": [round(x, 3) for x in ratios],
                },
                "seconds": {k: [round(t, 3) for t in v] for k, v in colds.items()},
            }
        name = "dlop Loader over s3://, cold first epoch"
        base_cold = rate_row(wl, name, n, statistics.median(colds["dlop"]), size)
        rows.insert(1, base_cold)
        for name, cold, _ in timed:
            took = statistics.median(colds.get(name, [cold]))
            more = extra if name == STREAMING_S3 else {}
            rows.append(rate_row(wl, f"{name}, cold first epoch", n, took, size, base_cold, **more))
    return rows


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
    rows = [base, dlop, *s3_rows(path, work, samples, workers, repeats)]
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

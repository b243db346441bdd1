"""Training from object storage: the Loader over an archive served by a local S3 server
(moto on loopback) through the node-local shard cache, against the same archive on
local disk; the first epoch with an empty cache (cold) and later ones (warm).

Loopback has no network latency or bandwidth limit to speak of: the cold rows
measure dlop's fetch, check and cache path plus moto's own serving, not a
real network.

Also, without moto: the same zstd archive on local disk read as it is (zstd
blocks decoded per batch) against the Loader given a ``cache_dir``, which
decodes each shard once into the shard cache and maps the raw copy (warm
epochs, and the cold first epoch that decodes).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from dlop.formats import ArchiveWriter, Field, Raw, Zstd
from dlop.formats.urls import filesystem
from dlop.runtime import Loader
from dlop.runtime.storage.cache import CacheDir, is_shard

from .common import Row, interleaved, loader_epoch, rate_row
from .format_bench import FRAMES, MELS, synthetic_logmel

BATCH = 256
SHARDS = 16
WINDOW_SHARDS = 4
BUCKET = "dlop-bench"
CACHE_BYTES = 8 << 30


RAW_NAME = "raw"  # the folder of the uncompressed archive, whose warm row has the target


def write(path: Path, n: int, zstd: bool) -> Path:
    """An ESC-50-shaped archive in about ``SHARDS`` shards: logmel f16 [FRAMES, MELS], label."""
    codec = Zstd(level=3) if zstd else Raw()
    fields = [Field("logmel", "f16", (FRAMES, MELS), codec=codec), Field("label", "i64", ())]
    block = synthetic_logmel(np.random.default_rng(0), 64)
    shard_bytes = max(1, n * FRAMES * MELS * 2 // SHARDS)
    with ArchiveWriter(path, fields, shard_bytes=shard_bytes, overwrite=True) as w:
        for i in range(n):
            w.write({"logmel": block[i % 64], "label": i % 50})
    return path


def moto_environ(endpoint: str) -> dict[str, str]:
    """The environment that points S3 clients at ``endpoint``: boto3, s3fs and dlop
    (AWS_*), MosaicML Streaming (S3_ENDPOINT_URL) and obstore, LitData's (AWS_ALLOW_HTTP)."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "S3_ENDPOINT_URL": endpoint,
        "AWS_ALLOW_HTTP": "true",  # obstore refuses an http:// endpoint otherwise
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
    }


_MOTO = """
import logging, sys, threading
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False).start()
print("serving", flush=True)
threading.Event().wait()
"""


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 in a process of its own, started empty, with
    ``moto_environ`` set in this process for the ``with`` block; yields its endpoint.
    Its own process: a server in the bench's process would share its interpreter lock
    with the in-process reader measured (the dlop Loader) and not with readers whose
    DataLoader workers are processes of their own (the peers'). ImportError without
    moto."""
    import moto.server  # noqa: F401  (ImportError here, not in the child)

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-c", _MOTO, str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        if server.stdout is None or server.stdout.readline().strip() != "serving":
            raise RuntimeError(f"the moto server did not start (exit status {server.wait()})")
        endpoint = f"http://127.0.0.1:{port}"
        request = urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")
        urllib.request.urlopen(request, timeout=60).read()
        env = moto_environ(endpoint)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield endpoint
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    finally:
        server.kill()
        server.wait()


@contextlib.contextmanager
def moto_s3() -> Iterator[str | None]:
    """``moto_server``'s endpoint, or None when moto is not installed."""
    try:
        import moto.server  # noqa: F401
    except ImportError:
        yield None
        return
    with moto_server() as endpoint:
        yield endpoint


def upload(local: Path, bucket: str = BUCKET) -> str:
    """The folder ``local`` copied to ``bucket``; returns its URL."""
    fs, _ = filesystem(f"s3://{bucket}")
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    fs.put(str(local), f"{bucket}/{local.name}", recursive=True)
    return f"s3://{bucket}/{local.name}"


def loader(archive: Path | str, cache: Path | None = None) -> Loader:
    """The Loader of every row; ``cache`` (a URL's cache folder) holds the whole archive."""
    return Loader(
        archive,
        BATCH,
        seed=0,
        order="window",
        window_shards=WINDOW_SHARDS,
        cache_dir=cache,
        cache_bytes=None if cache is None else CACHE_BYTES,
    )


def cold_epoch_s(url: str, work: Path, rounds: int) -> float:
    """Median seconds of a first epoch from an empty cache (open and index fetch included);
    ``url`` may be a local path read through a cache_dir."""
    times = []
    for r in range(max(1, rounds)):
        cache = work / f"cold-cache-{r}"
        t0 = time.perf_counter()
        first = loader(url, cache)
        loader_epoch(first)
        times.append(time.perf_counter() - t0)
        first.close()
        shutil.rmtree(cache, ignore_errors=True)
    return float(np.median(times))


def local_zstd_rows(local: Path, work: Path, n: int, repeats: int) -> list[Row]:
    """The local zstd archive read as it is against the same through a cache_dir."""
    size = FRAMES * MELS * 2
    cold = cold_epoch_s(str(local), work, repeats)
    plain, cached = loader(local), loader(local, work / "cache-local-zstd")
    took = interleaved(
        {"plain": lambda: loader_epoch(plain), "cached": lambda: loader_epoch(cached)}, repeats
    )
    plain.close()
    cached.close()
    wl = (
        f"local zstd: ESC-50-shaped f16 [{FRAMES},{MELS}] x {n}, zstd level 3, {SHARDS} "
        f"shards on local disk, window order ({WINDOW_SHARDS} shards), batches of {BATCH}"
    )
    base = rate_row(
        wl, "dlop Loader, local zstd archive (blocks decoded per batch)", n, took["plain"], size
    )
    return [
        base,
        rate_row(
            wl,
            "dlop Loader, local zstd archive, cache_dir warm (decoded once, mapped raw)",
            n,
            took["cached"],
            size,
            base,
        ),
        rate_row(
            wl,
            "dlop Loader, local zstd archive, cache_dir cold first epoch (decodes)",
            n,
            cold,
            size,
            base,
        ),
    ]


def rows_for(name: str, local: Path, url: str, work: Path, n: int, repeats: int) -> list[Row]:
    """The local, warm and cold rows of one archive (raw or zstd)."""
    size = FRAMES * MELS * 2
    cold = cold_epoch_s(url, work, repeats)
    near, far = loader(local), loader(url, work / f"cache-{name}")
    epochs: dict[str, Callable[[], int]] = {
        "local": lambda: loader_epoch(near),
        "warm": lambda: loader_epoch(far),
    }
    took = interleaved(epochs, repeats)
    near.close()
    far.close()
    wl = (
        f"remote: ESC-50-shaped f16 [{FRAMES},{MELS}] x {n}, {name}, {SHARDS} shards, "
        f"moto S3 on loopback, window order ({WINDOW_SHARDS} shards), batches of {BATCH}"
    )
    base = rate_row(wl, f"dlop Loader, local {name} archive", n, took["local"], size)
    # The raw archive's warm row carries the target; a compressed one is cached decoded.
    primary = Path(local).name == RAW_NAME
    return [
        base,
        rate_row(
            wl,
            f"dlop Loader, s3:// {name} archive, warm cache" + ("" if primary else " (cached raw)"),
            n,
            took["warm"],
            size,
            base,
            **({"target": ">=0.8x"} if primary else {}),
        ),
        rate_row(wl, f"dlop Loader, s3:// {name} archive, cold first epoch", n, cold, size, base),
    ]


def cached_shard_bytes(cache: Path) -> int:
    """Bytes of the shards a cache folder holds (what was downloaded into it)."""
    if not cache.exists():
        return 0
    return sum(st.st_size for p, st in CacheDir(cache, CACHE_BYTES).files() if is_shard(p.name))


def node_download_rows(url: str, local: Path, work: Path, n: int) -> list[Row]:
    """Bytes each node downloads from ``url`` in its first and second epoch, for 1, 2 and
    4 nodes of one rank each (simulated one after another, each node its own cache
    folder, the default node_share="keep"), as fractions of the archive's shard bytes."""
    total = sum(f.stat().st_size for f in local.iterdir() if f.name != "index.json")
    wl = (
        f"remote: ESC-50-shaped f16 [{FRAMES},{MELS}] x {n}, raw, {SHARDS} shards, moto S3 "
        f"on loopback, window order ({WINDOW_SHARDS} shards), shards dealt to nodes"
    )
    rows = []
    for nodes in (1, 2, 4):
        first, second = [], []
        for node in range(nodes):
            cache = work / f"nodes-{nodes}-{node}"
            reader = Loader(
                url,
                BATCH,
                seed=0,
                order="window",
                window_shards=WINDOW_SHARDS,
                rank=node,
                world_size=nodes,
                nodes=nodes,
                cache_dir=cache,
                cache_bytes=CACHE_BYTES,
            )
            loader_epoch(reader)
            first.append(cached_shard_bytes(cache))
            loader_epoch(reader)  # the next pass is the next epoch
            second.append(cached_shard_bytes(cache) - first[-1])
            reader.close()
            shutil.rmtree(cache, ignore_errors=True)
        rows.append(
            Row(
                wl,
                f"{nodes} node{'s' if nodes > 1 else ''} of one rank: bytes each node downloads",
                extra={
                    "first_epoch_of_archive": round(float(np.mean(first)) / total, 3),
                    "first_epoch_max_of_archive": round(max(first) / total, 3),
                    "second_epoch_of_archive": round(max(second) / total, 3),
                    "archive_MiB": round(total / 2**20, 1),
                },
            )
        )
    return rows


def run(work: Path, args: argparse.Namespace) -> list[Row]:
    n = max(args.clips, 2 * BATCH)
    zstd = write(work / "zstd", n, zstd=True)
    rows = local_zstd_rows(zstd, work, n, args.repeats)
    with moto_s3() as endpoint:
        if endpoint is None:
            print(
                "remote: moto is not installed (pip install 'moto[server]'): s3 rows not run",
                file=sys.stderr,
            )
            return rows
        raw = write(work / RAW_NAME, n, zstd=False)
        for local in (raw, zstd):
            rows += rows_for(local.name, local, upload(local), work, n, args.repeats)
        return rows + node_download_rows(f"s3://{BUCKET}/{raw.name}", raw, work, n)

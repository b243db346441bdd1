"""Peers that read the same precomputed tensors: webdataset (installed with dlop).

LitData, MosaicML Streaming and FFCV are not dependencies of dlop.
"""

from __future__ import annotations

import io
import tarfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from dlop.formats import ArchiveReader

from .common import Row, rate_row


def write_webdataset(archive: Path, out: Path, samples_per_tar: int = 500) -> list[str]:
    """The archive's log-mels and labels as tar shards of per-sample .npy and .cls members."""
    out.mkdir(parents=True, exist_ok=True)
    reader = ArchiveReader(archive)
    urls = []
    for first in range(0, len(reader), samples_per_tar):
        urls.append(str(out / f"train-{first // samples_per_tar:04d}.tar"))
        with tarfile.open(urls[-1], "w") as tf:
            for i in range(first, min(len(reader), first + samples_per_tar)):
                buf = io.BytesIO()
                np.save(buf, reader.get("logmel", i))
                label = str(int(reader.get("label", i))).encode()
                for ext, data in (("npy", buf.getvalue()), ("cls", label)):
                    info = tarfile.TarInfo(f"{i:07d}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
    return urls


def webdataset_rows(workload: str, archive: Path, work: Path, batch: int, dlop: Row) -> list[Row]:
    """One epoch each, in process and through WebLoader, against the dlop Loader row."""
    import webdataset as wds

    t0 = time.perf_counter()
    urls = write_webdataset(archive, work / "wds")
    convert_s = round(time.perf_counter() - t0, 1)
    sample_bytes = (dlop.gb_per_s or 0) * 1e9 / (dlop.samples_per_s or 1)

    def pipeline() -> Any:
        return (
            wds.WebDataset(urls, shardshuffle=False, empty_check=False)
            .shuffle(1000)
            .decode()
            .to_tuple("npy", "cls")
            .batched(batch)
        )

    def epoch(source: Any) -> int:
        return sum(len(b[1]) for b in source)

    rows = []
    for name, make in (
        ("webdataset, in process", pipeline),
        (
            "webdataset WebLoader, 2 workers",
            lambda: wds.WebLoader(pipeline(), batch_size=None, num_workers=2),
        ),
    ):
        epoch(make())  # page cache warm
        t0 = time.perf_counter()
        count = epoch(make())
        rows.append(
            rate_row(
                workload,
                f"{name} (same log-mels as .npy in tars, shuffle 1000, batched {batch})",
                count,
                time.perf_counter() - t0,
                sample_bytes,
                dlop,
                "dlop Loader",
                convert_s=convert_s,
            )
        )
    return rows

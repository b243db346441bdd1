"""Corpus fixtures written by the tests themselves (soundfile and PyAV encoders)."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import soundfile as sf

from .signals import make_signal


def write_audio(path: Path, x: np.ndarray, rate: int, subtype: str | None = None) -> Path:
    """WAV/FLAC/OGG/MP3 through soundfile; M4A (AAC) through PyAV."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".m4a":
        write_aac(path, x, rate)
    else:
        sf.write(path, x, rate, subtype=subtype)
    return path


def write_aac(path: Path, x: np.ndarray, rate: int) -> None:
    import av

    x = np.atleast_2d(x.T if x.ndim == 2 else x).astype(np.float32)  # [channels, samples]
    with av.open(str(path), "w", format="mp4") as out:
        stream = out.add_stream("aac", rate=rate, layout="stereo" if x.shape[0] == 2 else "mono")
        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(x), format="fltp", layout="stereo" if x.shape[0] == 2 else "mono"
        )
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)


def esc50_row(name: str, n: int) -> dict[str, object]:
    """The esc50.csv row of clip ``name``, the n-th of a generated corpus (3 classes, 5 folds)."""
    return {
        "filename": name,
        "fold": 1 + n % 5,
        "target": n % 3,
        "category": f"class{n % 3}",
        "esc10": "False",
        "src_file": 1000 + n,
        "take": "A",
    }


def esc50_corpus(root: Path, specs: list[tuple[str, int, int]], seconds: float = 1.0) -> Path:
    """specs: (extension, sample rate, channels) per clip; targets cycle over 3 classes."""
    rows = []
    for n, (ext, rate, channels) in enumerate(specs):
        name = f"{1 + n % 5}-{1000 + n}-A-{n % 3}.{ext}"
        write_audio(
            root / "audio" / name, make_signal(rate, seconds, seed=n, channels=channels), rate
        )
        rows.append(esc50_row(name, n))
    write_esc50_csv(root, rows)
    return root


def write_esc50_csv(root: Path, rows: list[dict]) -> None:
    (root / "meta").mkdir(parents=True, exist_ok=True)
    with open(root / "meta" / "esc50.csv", "w", newline="") as fh:
        w = csv.DictWriter(
            fh, fieldnames=["filename", "fold", "target", "category", "esc10", "src_file", "take"]
        )
        w.writeheader()
        w.writerows(rows)


def librispeech_corpus(root: Path) -> Path:
    for spk, chap, n in ((19, 198, 3), (26, 495, 2)):
        d = root / "dev-clean" / str(spk) / str(chap)
        lines = []
        for u in range(n):
            utt = f"{spk}-{chap}-{u:04d}"
            write_audio(d / f"{utt}.flac", make_signal(16000, 0.5 + 0.3 * u, seed=spk + u), 16000)
            lines.append(f"{utt} WORDS OF UTTERANCE {u}")
        (d / f"{spk}-{chap}.trans.txt").write_text("\n".join(lines) + "\n")
    return root


def manifest_corpus(root: Path) -> Path:
    write_audio(root / "wav" / "long.wav", make_signal(16000, 3.0, seed=5), 16000)
    write_audio(root / "wav" / "b.flac", make_signal(8000, 1.0, seed=6), 8000)
    lines = [
        {
            "audio_filepath": "wav/long.wav",
            "duration": 1.0,
            "offset": 0.5,
            "text": "first part",
            "label": "yes",
        },
        {
            "audio_filepath": "wav/long.wav",
            "duration": 0.8,
            "offset": 2.0,
            "text": "second part",
            "label": "no",
        },
        {"audio_filepath": "wav/b.flac", "duration": 1.0, "text": "other", "label": "yes"},
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root / "train.jsonl"


def webdataset_corpus(root: Path, shards: int = 2, per_shard: int = 3) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        with tarfile.open(root / f"train-{s:03d}.tar", "w") as tf:
            for i in range(per_shard):
                key = f"s{s}_{i:03d}"
                buf = io.BytesIO()
                sf.write(buf, make_signal(16000, 0.6, seed=10 * s + i), 16000, format="FLAC")
                for ext, data in (
                    ("flac", buf.getvalue()),
                    ("cls", str(i % 2).encode()),
                    ("txt", f"text {s} {i}".encode()),
                ):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
    return root


@contextlib.contextmanager
def dask_cluster(workers: int = 1) -> Iterator[str]:
    """The address of a LocalCluster of ``workers`` processes on loopback, for several
    compiles to share (``--dask ADDRESS``): one start instead of one per compile. Its
    workers take the environment as it is when the cluster starts."""
    import logging

    import distributed

    with distributed.LocalCluster(
        n_workers=workers,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address="127.0.0.1:0",  # a free port: test processes run side by side
        silence_logs=logging.ERROR,
    ) as cluster:
        yield str(cluster.scheduler_address)

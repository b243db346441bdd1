"""Compile inputs/s for the same audio from three forms of one corpus, in one run.

The same FLAC utterances as plain files (a NeMo manifest naming them), as
Hugging Face Parquet with the bytes embedded (``--layout hf``), and as People's
Speech tar shards with their JSON-lines manifest (``--layout peoples-speech``).
Every form is compiled with one recipe (kaldi fbank, 80 bins) in rounds that
take each form in turn, so a drift of the machine falls on all of them alike;
each row is the median over the rounds, with its ratio to the plain files.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tarfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf

from dlop.compiler.recipe import build_recipe
from dlop.compiler.run.pipeline import compile_corpus

from .common import Row, rate_row

SAMPLE_RATE = 16000
PER_TAR = 64  # utterances per tar shard and per Parquet row group


def _utterances(root: Path, count: int) -> list[tuple[str, str, int]]:
    """``count`` FLAC files of 1-6 s of noise-shaped tones: (name, transcript, milliseconds)."""
    rng = np.random.default_rng(0)
    made = []
    for i in range(count):
        seconds = float(rng.uniform(1.0, 6.0))
        t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
        x = 0.3 * np.sin(2 * np.pi * (200 + 40 * (i % 7)) * t) + 0.05 * rng.standard_normal(len(t))
        name = f"doc{i // PER_TAR:04d}/doc{i // PER_TAR:04d}_{i:06d}.flac"
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        sf.write(root / name, x.astype(np.float32), SAMPLE_RATE)
        made.append((name, f"utterance number {i}", round(seconds * 1000)))
    return made


def _folder(root: Path, utts: list[tuple[str, str, int]]) -> Path:
    lines = [json.dumps({"audio_filepath": n, "text": t}) + "\n" for n, t, _ in utts]
    (root / "plain.jsonl").write_text("".join(lines))
    return root / "plain.jsonl"


def _parquet(root: Path, files: Path, utts: list[tuple[str, str, int]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    features = {
        "id": {"dtype": "string", "_type": "Value"},
        "audio": {"sampling_rate": SAMPLE_RATE, "_type": "Audio"},
        "text": {"dtype": "string", "_type": "Value"},
    }
    cells = [{"bytes": (files / n).read_bytes(), "path": Path(n).name} for n, _, _ in utts]
    table = pa.table(
        {
            "id": [n for n, _, _ in utts],
            "audio": pa.array(cells, pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
            "text": [t for _, t, _ in utts],
        }
    )
    meta = json.dumps({"info": {"features": features}}).encode()
    table = table.replace_schema_metadata({b"huggingface": meta})
    (root / "data").mkdir(parents=True, exist_ok=True)
    pq.write_table(table, root / "data" / "train-00000-of-00001.parquet", row_group_size=PER_TAR)
    return root


def _tars(root: Path, files: Path, utts: list[tuple[str, str, int]]) -> Path:
    docs: dict[str, list[tuple[str, str, int]]] = {}
    for u in utts:
        docs.setdefault(u[0].split("/")[0], []).append(u)
    lines = []
    for d, (doc, segs) in enumerate(docs.items()):
        (root / "train" / "clean").mkdir(parents=True, exist_ok=True)
        with tarfile.open(root / "train" / "clean" / f"clean_{d:06d}.tar", "w") as tf:
            for name, _, _ in segs:
                data = (files / name).read_bytes()
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
        training = {
            "duration_ms": [ms for _, _, ms in segs],
            "label": [t for _, t, _ in segs],
            "name": [n for n, _, _ in segs],
        }
        lines.append(json.dumps({"audio_document_id": doc, "training_data": training}) + "\n")
    (root / "train" / "clean.json").write_text("".join(lines))
    return root / "train"


def run(work: Path, args: argparse.Namespace) -> list[Row]:
    """Rows: compile inputs/s from plain files, Parquet with embedded bytes, and tar shards."""
    count = max(16, args.clips // 10)
    files = work / "files"
    utts = _utterances(files, count)
    sources = {
        "folder of FLAC files (manifest)": (str(_folder(files, utts)), "manifest"),
        "Parquet, embedded bytes (hf)": (str(_parquet(work / "hf", files, utts)), "hf"),
        "tar shards + manifest (peoples-speech)": (
            str(_tars(work / "ps", files, utts)),
            "peoples-speech",
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in sources}
    for _ in range(max(1, args.repeats)):
        for name, (source, layout) in sources.items():
            recipe = build_recipe(
                {"source": source, "layout": layout, "preset": "kaldi", "n_mels": 80}
            )
            t0 = time.perf_counter()
            index = compile_corpus(
                recipe, work / "out", workers=args.workers, progress=False, overwrite=True
            )
            times[name].append(time.perf_counter() - t0)
            if index.num_samples != count:
                raise RuntimeError(f"{name}: compiled {index.num_samples} of {count} inputs")
    workload = (
        f"compile sources: {count} FLAC utterances (1-6 s), kaldi fbank 80, {args.workers} workers"
    )
    base: Row | None = None
    rows = []
    for name, took in times.items():
        row = rate_row(workload, name, count, statistics.median(took), base=base, rounds=len(took))
        base = base or row
        rows.append(row)
    return rows

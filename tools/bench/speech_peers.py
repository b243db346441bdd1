"""Speech peers: Lhotse and Hugging Face ``datasets`` beside dlop on one speech corpus.

One generated corpus in the LibriSpeech layout (16 kHz FLAC of 0.5-30 s with
``*.trans.txt`` transcripts) is compiled to 80-bin Kaldi fbank by each, on its
documented fast path, with the same number of worker processes:

- dlop: ``dlop-compile`` with the kaldi preset (80 bins, float16), read by
  the Loader with ``bucket_by``;
- Lhotse: ``prepare_librispeech``, ``CutSet.compute_and_store_features`` with
  its torch ``Fbank`` into a ``LilcomChunkyWriter``, read by a DataLoader over
  ``K2SpeechRecognitionDataset`` with a ``DynamicBucketingSampler``;
- datasets: ``Dataset.map(batched=True, num_proc=N)`` with transformers'
  Kaldi-fbank feature extractor (``Speech2TextFeatureExtractor``) into an
  ``Array2D`` column, ``save_to_disk``, read through ``with_format("torch")``
  in a DataLoader, in random batches and length-grouped
  (transformers' ``LengthGroupedSampler``).

A second corpus of short utterances (short_corpus: mostly one-second WAV clips, as
command and call-centre corpora are) is compiled by the three in interleaved
rounds and timed as a user waits for it: the whole process, interpreter start,
imports and exit included, where the cost per input and the start-up weigh most.

Each compile runs in a child process, timed from after its imports (dlop's by its
own summary line) and as a whole, with one
math thread per worker process (OMP_NUM_THREADS=1) and the peak RSS of that
process and its workers read from /proc. The peers are not
dependencies of dlop: they are imported only here, inside the functions that
use them (``make bench-peers`` installs them).
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .common import Row, interleaved
from .procmem import PeakSampler, tree_rss_kib

SAMPLE_RATE = 16000
N_MELS = 80
BATCH = 32  # utterances per batch (Lhotse: the same on average, by duration)
SUBSET = "dev-clean"  # the subset name Lhotse's LibriSpeech recipe looks for
# Kaldi's fbank on int16-scaled samples (dlop's kaldi preset) against [-1, 1] samples (Lhotse)
INPUT_SCALE_OFFSET = 2 * math.log(32768.0)


def speech_corpus(root: Path, utts: int, seed: int = 0) -> tuple[Path, float]:
    """``utts`` mono 16 kHz FLAC utterances of 0.5-30 s (uniform) in the LibriSpeech layout
    ``<subset>/<spk>/<chap>/<spk>-<chap>-<utt>.flac`` with ``<spk>-<chap>.trans.txt``;
    returns (root, seconds of audio). Signals are voiced formant sweeps cut from a few
    30 s sources at random offsets and gains, plus fresh noise."""
    import soundfile as sf

    from dlop.compiler.demo import synth

    rng = np.random.default_rng(seed)
    sources = [synth("formant_sweep", SAMPLE_RATE, 30.0, rng) for _ in range(4)]
    transcripts: dict[Path, list[str]] = {}
    total = 0
    for u in range(utts):
        spk, chap = 100 + u % 7, 10 + u % 3
        folder = root / SUBSET / str(spk) / str(chap)
        folder.mkdir(parents=True, exist_ok=True)
        n = int(rng.uniform(0.5, 30.0) * SAMPLE_RATE)
        src = sources[u % len(sources)]
        start = int(rng.integers(0, len(src) - n + 1))
        x = src[start : start + n] * rng.uniform(0.3, 1.0)
        x = x + 0.003 * rng.standard_normal(n)
        uid = f"{spk}-{chap}-{u:04d}"
        sf.write(folder / f"{uid}.flac", x.astype(np.float32), SAMPLE_RATE, subtype="PCM_16")
        transcripts.setdefault(folder / f"{spk}-{chap}.trans.txt", []).append(
            f"{uid} UTTERANCE NUMBER {u} OF A SYNTHETIC SPEAKER"
        )
        total += n
    for path, lines in transcripts.items():
        path.write_text("\n".join(lines) + "\n")
    return root, total / SAMPLE_RATE


def short_corpus(root: Path, utts: int, seed: int = 0) -> tuple[Path, float]:
    """``utts`` mono 16 kHz 16-bit WAV utterances shaped like a command or call-centre corpus:
    two in five are one-second clips (0.8-1.0 s, Speech Commands' mass), the rest log-uniform
    from 0.5 to 8 s (median about 1 s in all), listed with transcripts in a NeMo manifest
    ``root/manifest.jsonl``; returns (the manifest, seconds of audio). Signals as speech_corpus's."""
    import soundfile as sf

    from dlop.compiler.demo import synth

    rng = np.random.default_rng(seed)
    sources = [synth("formant_sweep", SAMPLE_RATE, 8.0, rng) for _ in range(4)]
    (root / "wav").mkdir(parents=True, exist_ok=True)
    lines, total = [], 0
    for u in range(utts):
        if rng.random() < 0.4:
            seconds = rng.uniform(0.8, 1.0)
        else:
            seconds = math.exp(rng.uniform(math.log(0.5), math.log(8.0)))
        n = int(seconds * SAMPLE_RATE)
        src = sources[u % len(sources)]
        start = int(rng.integers(0, len(src) - n + 1))
        x = src[start : start + n] * rng.uniform(0.3, 1.0) + 0.003 * rng.standard_normal(n)
        name = f"wav/utt{u:06d}.wav"
        sf.write(root / name, x.astype(np.float32), SAMPLE_RATE, subtype="PCM_16")
        text = f"UTTERANCE NUMBER {u} OF A SYNTHETIC SPEAKER"
        lines.append(
            json.dumps({"audio_filepath": name, "duration": n / SAMPLE_RATE, "text": text})
        )
        total += n
    manifest = root / "manifest.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest, total / SAMPLE_RATE


def utterances(corpus: Path) -> list[tuple[str, str, str]]:
    """(id, audio path, transcript) of every utterance, sorted by id: ``corpus`` is a
    LibriSpeech-layout folder (speech_corpus) or a manifest (short_corpus)."""
    rows = []
    if corpus.is_file():
        for line in corpus.read_text().splitlines():
            entry = json.loads(line)
            path = corpus.parent / entry["audio_filepath"]
            rows.append((path.stem, str(path), entry["text"]))
        return sorted(rows)
    for trans in sorted(corpus.rglob("*.trans.txt")):
        for line in trans.read_text().splitlines():
            uid, _, text = line.partition(" ")
            rows.append((uid, str(trans.parent / f"{uid}.flac"), text))
    return sorted(rows)


def lhotse_fbank(snip_edges: bool = False) -> Any:
    """Lhotse's torch Fbank (no torchaudio) set to Kaldi's conventions where it allows:
    mel range 20 Hz to Nyquist, 80 bins, no dither. Its input stays at [-1, 1] (no
    option), so its values sit INPUT_SCALE_OFFSET below Kaldi's. Lhotse's manifests
    require round(duration / frame_shift) frames, so features it stores keep
    ``snip_edges=False`` (2 frames more than Kaldi's 1 + (n - 400) // 160, centred
    differently)."""
    from lhotse import Fbank, FbankConfig

    return Fbank(
        FbankConfig(
            num_filters=N_MELS, snip_edges=snip_edges, low_freq=20.0, high_freq=0.0, dither=0.0
        )
    )


def hf_extractor() -> Any:
    """transformers' Kaldi fbank (numpy; it uses torchaudio only where that imports),
    80 bins, without its per-utterance mean/variance normalisation."""
    from transformers import Speech2TextFeatureExtractor

    return Speech2TextFeatureExtractor(
        feature_size=N_MELS, num_mel_bins=N_MELS, do_ceptral_normalize=False
    )


# ---- compiles, each run in a child process (python -m dlop.tools.bench.speech_peers ...)


def dlop_command(corpus: Path, out: Path, workers: int) -> list[str]:
    """dlop-compile as a user runs it for this corpus (the kaldi preset, 80 bins)."""
    layout = "manifest" if corpus.is_file() else "librispeech"
    return [
        *(sys.executable, "-m", "dlop.tools.compile_cli", str(corpus), "-o", str(out)),
        *("--layout", layout, "--preset", "kaldi", "--n-mels", str(N_MELS)),
        *("--workers", str(workers), "--overwrite"),
    ]


def summary_seconds(stdout: str) -> float:
    """The compile's own seconds, from its summary line's inputs and inputs/s (more
    digits than its rounded seconds)."""
    found = re.search(r"([0-9.]+) s, ([0-9]+) inputs/s", stdout)
    inputs = re.search(r"wrote .*?: ([0-9]+) samples", stdout)
    if found is None or inputs is None:
        raise RuntimeError(f"no summary line in dlop-compile's output: {stdout[-300:]!r}")
    rate = float(found.group(2))
    return int(inputs.group(1)) / rate if rate else float(found.group(1))


def _lhotse_manifests(corpus: Path, workers: int) -> tuple[Any, Any]:
    """(recordings, supervisions): Lhotse's LibriSpeech recipe for a folder; for a manifest,
    RecordingSet.from_dir over its WAV folder and a supervision per line."""
    from lhotse import RecordingSet, SupervisionSegment, SupervisionSet
    from lhotse.recipes import prepare_librispeech

    if not corpus.is_file():
        made = prepare_librispeech(corpus, dataset_parts=[SUBSET], num_jobs=workers)[SUBSET]
        return made["recordings"], made["supervisions"]
    recordings = RecordingSet.from_dir(corpus.parent / "wav", "*.wav", num_jobs=workers)
    supervisions = SupervisionSet.from_segments(
        SupervisionSegment(uid, uid, 0.0, recordings[uid].duration, text=text)
        for uid, _, text in utterances(corpus)
    )
    return recordings, supervisions


def _compile_lhotse(corpus: Path, out: Path, workers: int) -> None:
    import torch
    from lhotse import CutSet, LilcomChunkyWriter

    torch.set_num_threads(1)  # as icefall's compute_fbank scripts do, one per job
    recordings, supervisions = _lhotse_manifests(corpus, workers)
    cuts = CutSet.from_manifests(recordings=recordings, supervisions=supervisions)
    cuts = cuts.compute_and_store_features(
        extractor=lhotse_fbank(),
        storage_path=out / "feats",
        num_jobs=workers,
        storage_type=LilcomChunkyWriter,
        progress_bar=False,
    )
    cuts.to_file(out / "cuts.jsonl.gz")


def _featurize_batch(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
    import soundfile as sf

    waves = [
        sf.read(io.BytesIO(a["bytes"]) if a["bytes"] else a["path"], dtype="float32")[0]
        for a in batch["audio"]
    ]
    feats = hf_extractor()(waves, sampling_rate=SAMPLE_RATE, return_attention_mask=False)
    # unpadded, the extractor returns an object array of (frames, bins) arrays
    out = list(feats["input_features"])
    return {"input_features": out, "num_frames": [len(f) for f in out]}


def _compile_datasets(corpus: Path, out: Path, workers: int) -> None:
    import pyarrow as pa
    from datasets import Array2D, Audio, Dataset, DatasetInfo, Features, Value

    utts = utterances(corpus)
    # datasets 5 encodes and decodes Audio through torchcodec (absent here): the Audio
    # column is built as the Arrow struct it stores, {bytes, path}, and the map decodes
    # the file with soundfile
    audio = pa.array(
        [{"bytes": None, "path": p} for _, p, _ in utts],
        pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
    )
    table = pa.table(
        {
            "id": pa.array([u for u, _, _ in utts], pa.string()),
            "audio": audio,
            "text": pa.array([t for _, _, t in utts], pa.string()),
        }
    )
    features = Features(
        {"id": Value("string"), "audio": Audio(decode=False), "text": Value("string")}
    )
    ds = Dataset(table, info=DatasetInfo(features=features))
    ds = ds.map(
        _featurize_batch,
        batched=True,
        num_proc=workers,
        remove_columns=["audio"],
        features=Features(
            {
                "id": Value("string"),
                "text": Value("string"),
                "input_features": Array2D((None, N_MELS), "float32"),
                "num_frames": Value("int64"),
            }
        ),
    )
    ds.save_to_disk(str(out))


COMPILES: dict[str, Callable[[Path, Path, int], None]] = {
    "lhotse": _compile_lhotse,
    "datasets": _compile_datasets,
}


# What each compile imports, loaded before its clock starts: a compile is timed from
# after its imports (torch alone takes seconds to import, as much as a small compile).
IMPORTS: dict[str, tuple[str, ...]] = {
    "lhotse": ("torch", "lhotse", "lhotse.recipes"),
    "datasets": ("pyarrow", "datasets", "transformers", "soundfile"),
}


def _child(argv: list[str]) -> None:
    import importlib

    peer, corpus, out, workers = argv[0], Path(argv[1]), Path(argv[2]), int(argv[3])
    out.mkdir(parents=True, exist_ok=True)
    for module in IMPORTS[peer]:
        importlib.import_module(module)
    t0 = time.perf_counter()
    COMPILES[peer](corpus, out, workers)
    print(json.dumps({"seconds": time.perf_counter() - t0}))


@dataclass
class Compiled:
    """One peer's compile in a fresh process: seconds from after its imports, seconds of the
    whole process (interpreter start, imports and exit included), peak RSS in KiB of the
    compile and its workers, bytes on disk."""

    seconds: float
    wall: float
    peak_kib: int
    size: int


def whole_process_row(wl: str, name: str, runs: list[Compiled], inputs: int, seconds: float) -> Row:
    """A row of compiles timed as whole processes: inputs/s, seconds of audio per second,
    wall and own seconds (medians over ``runs``), peak RSS (the largest)."""
    median = statistics.median
    return Row(
        wl,
        name,
        median(inputs / m.wall for m in runs),
        extra={
            "audio_s_per_s": round(median(seconds / m.wall for m in runs)),
            "wall_s": round(median(m.wall for m in runs), 2),
            "own_s": round(median(m.seconds for m in runs), 2),
            "peak_rss_MiB": round(max(m.peak_kib for m in runs) / 1024),
        },
    )


def timed_compile(peer: str, corpus: Path, out: Path, workers: int) -> Compiled:
    """One peer's compile of ``corpus`` into ``out`` in a fresh process (Compiled): dlop's
    by its command (its seconds from its summary line), a peer's by a script of its
    documented calls (its seconds from after its imports)."""
    if peer == "dlop":
        cmd = dlop_command(corpus, out, workers)
    else:
        cmd = [sys.executable, "-m", __name__, peer, str(corpus), str(out), str(workers)]
    # one math thread per worker process for every peer, as dlop's workers run: Lhotse's
    # spawned feature workers and the numpy inside datasets' map workers would otherwise
    # each start a thread per core and contend for the cores the other workers use
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "TQDM_DISABLE": "1",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    }
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    with PeakSampler(lambda: tree_rss_kib(proc.pid), 0.1) as peak:
        stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode:
        last = stderr.strip().splitlines()[-1:] or ["no message"]
        raise RuntimeError(
            f"{peer} compile of {corpus} failed with exit status {proc.returncode}: {last[0]}"
        )
    if peer == "dlop":
        seconds = summary_seconds(stdout)
    else:
        seconds = float(json.loads(stdout.strip().splitlines()[-1])["seconds"])
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return Compiled(seconds, wall, peak.peak, size)


# ---- reads, in this process


def pad_collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    from torch.nn.utils.rnn import pad_sequence

    feats = [it["input_features"] for it in items]
    return {
        "input_features": pad_sequence(feats, batch_first=True),
        "num_frames": [len(f) for f in feats],
        "text": [it["text"] for it in items],
    }


def _dlop_loader(out: Path) -> tuple[Any, Callable[[Any], int]]:
    from dlop.runtime import Loader

    loader = Loader(out, BATCH, seed=0, bucket_by="fbank", fields=["fbank", "text"])
    return loader, lambda b: len(b["text"])


def _lhotse_loader(out: Path, workers: int) -> tuple[Any, Callable[[Any], int]]:
    from lhotse import CutSet
    from lhotse.dataset import DynamicBucketingSampler, K2SpeechRecognitionDataset
    from torch.utils.data import DataLoader

    cuts = CutSet.from_file(out / "cuts.jsonl.gz").to_eager()
    mean_s = sum(c.duration for c in cuts) / len(cuts)
    sampler = DynamicBucketingSampler(
        cuts,
        max_duration=BATCH * mean_s,
        num_buckets=min(10, len(cuts)),  # its default, or fewer for a toy corpus
        shuffle=True,
        seed=0,
    )
    loader = DataLoader(
        K2SpeechRecognitionDataset(),
        sampler=sampler,
        batch_size=None,
        num_workers=workers,
        persistent_workers=True,
    )
    return _Epochs(loader, sampler), lambda b: len(b["supervisions"]["text"])


class _Epochs:
    """A DataLoader over a Lhotse sampler, which needs set_epoch for a new order each epoch."""

    def __init__(self, loader: Any, sampler: Any) -> None:
        self.loader, self.sampler, self.epoch = loader, sampler, 0

    def __iter__(self) -> Any:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)


def datasets_loader(out: Path, workers: int, grouped: bool) -> tuple[Any, Callable[[Any], int]]:
    import torch
    from datasets import load_from_disk
    from torch.utils.data import DataLoader

    ds = load_from_disk(str(out)).with_format("torch", columns=["input_features", "text"])
    if grouped:
        from transformers.trainer_pt_utils import LengthGroupedSampler

        lengths = load_from_disk(str(out))["num_frames"]
        sampler = LengthGroupedSampler(
            BATCH, lengths=list(lengths), generator=torch.Generator().manual_seed(0)
        )
        kw: dict[str, Any] = {"sampler": sampler}
    else:
        kw = {"shuffle": True, "generator": torch.Generator().manual_seed(0)}
    loader = DataLoader(
        ds,
        batch_size=BATCH,
        num_workers=workers,
        persistent_workers=True,
        collate_fn=pad_collate,
        **kw,
    )
    return loader, lambda b: len(b["text"])


def _epoch_fn(made: tuple[Any, Callable[[Any], int]], expect: int, name: str) -> Callable[[], None]:
    loader, count = made

    def epoch() -> None:
        seen = sum(count(b) for b in loader)
        if seen != expect:
            raise RuntimeError(f"{name}: an epoch held {seen} utterances, expected {expect}")

    return epoch


def _max_diff(
    out: dict[str, Path], utts: list[tuple[str, str, str]], check: int = 4
) -> dict[str, str]:
    """Largest |difference| from dlop's stored fbank over the first utterances, per peer."""
    from dlop.runtime import open_archive

    ds = open_archive(out["dlop"])
    keys = {str(ds[i]["key"]).rsplit("/", 1)[-1].split(".")[0]: i for i in range(len(ds))}
    ids = [u for u, _, _ in utts[:check]]
    ref = {u: np.asarray(ds[keys[u]]["fbank"], dtype=np.float32) for u in ids}
    notes = {}
    if "lhotse" in out:
        import soundfile as sf

        # its stored features are snip_edges=False (frames centred differently), so the
        # same extractor is checked with snip_edges=True on the same audio
        extractor = lhotse_fbank(snip_edges=True)
        worst, clamped = 0.0, 0
        for u, path, _ in utts[:check]:
            wave = sf.read(path, dtype="float32")[0]
            d = np.abs(extractor.extract(wave, SAMPLE_RATE) + INPUT_SCALE_OFFSET - ref[u])
            clamped += int((d > 0.05).sum())
            worst = max(worst, float(np.median(d)))
        notes["lhotse"] = (
            f"Lhotse Fbank(snip_edges=True)+{INPUT_SCALE_OFFSET:.2f} vs dlop: median |d| "
            f"{worst:.4f}, {clamped} values off by >0.05 (where its floor clamps at [-1, 1] scale)"
        )
    if "datasets" in out:
        from datasets import load_from_disk

        hf = load_from_disk(str(out["datasets"])).with_format("numpy")
        row = {u: i for i, u in enumerate(hf["id"])}
        worst = max(float(np.abs(hf[row[u]]["input_features"] - ref[u]).max()) for u in ids)
        notes["datasets"] = f"datasets vs dlop: max |d| {worst:.3f} (dlop stores float16)"
    return notes


def run(work: Path, utts: int, workers: int, repeats: int, short_utts: int = 0) -> list[Row]:
    # the peers warn about their own settings and APIs (Lhotse on snip_edges, torch on read-only
    # arrays) in this process and in their DataLoader workers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = _run(work / "long", utts, workers, repeats)
        if short_utts:
            rows += short_rows(work / "short", short_utts, workers, repeats)
        shutil.rmtree(work, ignore_errors=True)
        return rows


PEER_NAMES = {
    "dlop": "dlop-compile, kaldi preset (float16)",
    "lhotse": "Lhotse 1.33 compute_and_store_features(Fbank) -> LilcomChunkyWriter",
    "datasets": "datasets 5.2 map(batched, num_proc) + save_to_disk (float32 Array2D)",
}


def short_rows(work: Path, utts: int, workers: int, repeats: int) -> list[Row]:
    """The short-utterance corpus compiled by dlop, Lhotse and datasets in interleaved
    rounds, each timed as a whole process; each ratio is the median of its rounds'."""
    work.mkdir(parents=True, exist_ok=True)
    manifest, seconds = short_corpus(work / "corpus", utts)
    wl = (
        f"speech peers, short utterances: {utts} 16 kHz WAV of 0.5-8 s, two in five about 1 s "
        f"({seconds / 3600:.2f} h, NeMo manifest) -> 80-bin Kaldi fbank, {workers} worker "
        "processes each, whole process timed (start-up and exit included)"
    )
    made: dict[str, list[Compiled]] = {}
    failed: dict[str, str] = {}
    for _ in range(max(1, repeats)):
        for peer in PEER_NAMES:
            if peer in failed:
                continue
            out = work / f"out-{peer}"
            shutil.rmtree(out, ignore_errors=True)
            try:
                made.setdefault(peer, []).append(timed_compile(peer, manifest, out, workers))
            except RuntimeError as e:
                failed[peer] = str(e)
            shutil.rmtree(out, ignore_errors=True)
    rows = []
    for peer, name in PEER_NAMES.items():
        if peer in failed:
            rows.append(Row(wl, f"{name}: not run ({failed[peer]}; install with make bench-peers)"))
            continue
        runs = made[peer]
        row = whole_process_row(wl, name, runs, utts, seconds)
        if peer != "dlop" and "dlop" in made:
            ratios = [m.wall / d.wall for m, d in zip(runs, made["dlop"], strict=False)]
            row.extra["dlop_over_this"] = f"{statistics.median(ratios):.2f}x (target >=3x)"
            row.extra["dlop_over_this_rounds"] = sorted(round(r, 2) for r in ratios)
        rows.append(row)
    return rows


def _run(work: Path, utts: int, workers: int, repeats: int) -> list[Row]:
    work.mkdir(parents=True, exist_ok=True)
    corpus, seconds = speech_corpus(work / "corpus", utts)
    listed = utterances(corpus)
    wl_compile = (
        f"speech peers, compile: {utts} utterances, 0.5-30 s 16 kHz FLAC ({seconds / 3600:.2f} h, "
        f"LibriSpeech layout) -> 80-bin Kaldi fbank, {workers} worker processes each"
    )
    wl_read = (
        f"speech peers, read: epochs of shuffled batches of ~{BATCH} utterances "
        f"(fbank + text), page cache warm, {workers} DataLoader workers for the peers"
    )
    compile_rows: dict[str, Row] = {}
    outs: dict[str, Path] = {}
    rows: list[Row] = []
    for peer in ("dlop", "lhotse", "datasets"):
        out = work / f"out-{peer}"
        try:
            made = timed_compile(peer, corpus, out, workers)
            took, peak, size = made.seconds, made.peak_kib, made.size
        except RuntimeError as e:
            rows.append(
                Row(wl_compile, f"{PEER_NAMES[peer]}: not run ({e}; install with make bench-peers)")
            )
            continue
        outs[peer] = out
        row = Row(
            wl_compile,
            PEER_NAMES[peer],
            utts / took,
            extra={
                "audio_s_per_s": round(seconds / took),
                "seconds": round(took, 1),
                "disk_MiB": round(size / 2**20, 1),
                "peak_rss_MiB": round(peak / 1024),
            },
        )
        compile_rows[peer] = row
        rows.append(row)
    dlop_c = compile_rows.get("dlop")
    for peer, row in compile_rows.items():
        if peer != "dlop" and dlop_c and dlop_c.samples_per_s and row.samples_per_s:
            row.extra["dlop_over_this"] = (
                f"{dlop_c.samples_per_s / row.samples_per_s:.2f}x (target >=3x)"
            )

    if "dlop" in outs and len(outs) > 1:
        notes = _max_diff(outs, listed)
        rows.append(Row(wl_compile, "same features? (first 4 utterances)", extra=notes))
    rows.append(
        Row(
            wl_compile,
            "conventions",
            extra={
                "Lhotse": "80 bins, 20 Hz-Nyquist, dither 0 set as Kaldi; input scale [-1,1] "
                f"has no option (values {INPUT_SCALE_OFFSET:.2f} lower); snip_edges=False kept "
                "(its manifests require round(duration/shift) frames: 2 more, centred "
                "differently); lilcom is lossy",
                "datasets": "Speech2TextFeatureExtractor (numpy Kaldi fbank: torchaudio does not "
                "import here), normalisation off; Audio(decode=False) decoded with soundfile "
                "in the map (datasets 5 decodes through torchcodec)",
            },
        )
    )

    # reads: every loader made once, then epochs interleaved in rounds
    n = len(listed)
    loaders: dict[str, tuple[Any, Callable[[Any], int]]] = {}
    if "dlop" in outs:
        loaders["dlop Loader, bucket_by (in process)"] = _dlop_loader(outs["dlop"])
    if "lhotse" in outs:
        loaders["Lhotse DynamicBucketingSampler + K2SpeechRecognitionDataset, DataLoader"] = (
            _lhotse_loader(outs["lhotse"], workers)
        )
    if "datasets" in outs:
        loaders['datasets with_format("torch"), DataLoader, random batches'] = datasets_loader(
            outs["datasets"], workers, grouped=False
        )
        loaders['datasets with_format("torch"), DataLoader, LengthGroupedSampler'] = (
            datasets_loader(outs["datasets"], workers, grouped=True)
        )
    took_read = interleaved({k: _epoch_fn(v, n, k) for k, v in loaders.items()}, repeats)
    frames = {p: _frames_of(p, outs[p]) for p in outs}
    read_rows = {}
    for name, took in took_read.items():
        peer = "dlop" if name.startswith("dlop") else name.split()[0].lower()
        read_rows[name] = Row(
            wl_read,
            name,
            n / took,
            extra={"frames_per_s": round(frames[peer] / took)},
        )
    dlop_r = next((r for k, r in read_rows.items() if k.startswith("dlop")), None)
    for row in read_rows.values():
        if dlop_r is not None and row is not dlop_r and row.samples_per_s and dlop_r.samples_per_s:
            row.extra["dlop_over_this"] = (
                f"{dlop_r.samples_per_s / row.samples_per_s:.1f}x (target >=20x)"
            )
        rows.append(row)
    for loader, _ in loaders.values():
        close = getattr(loader, "close", None)
        if close is not None:
            close()
    del loaders  # peers' worker processes end
    return rows


def _frames_of(peer: str, out: Path) -> int:
    """Total fbank frames a peer stored (one epoch reads each once)."""
    if peer == "dlop":
        from dlop.runtime import open_archive

        return int(sum(open_archive(out).lengths("fbank")))
    if peer == "lhotse":
        from lhotse import CutSet

        return sum(c.num_frames for c in CutSet.from_file(out / "cuts.jsonl.gz"))
    from datasets import load_from_disk

    return int(sum(load_from_disk(str(out))["num_frames"]))


if __name__ == "__main__":
    _child(sys.argv[1:])

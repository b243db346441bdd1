"""Batches by duration: dlop's budget batches against Lhotse's DynamicBucketingSampler.

Two generated archives of 80-bin float16 features at 100 frames a second
(written directly: this section measures reading, not compiling):

- wide: utterances of 0.5-30 s (log-normal, median 4 s), read in batches of
  at most 200 s of speech (20,000 frames) in 10 buckets, by dlop's Loader
  (``max_frames``) and by Lhotse's ``DynamicBucketingSampler(max_duration=200,
  num_buckets=10)`` with ``K2SpeechRecognitionDataset`` reading the same features
  (stored by Lhotse's ``NumpyFilesWriter``) in a DataLoader with N workers. Per
  epoch: the padded share (padding frames / all frames of the padded batches),
  batches, the largest batch's padded size and sum against the budget, and
  samples/s; dlop over Lhotse per round.
- short: utterances of 0.5-8 s (median 1.5 s) in bucketed batches of 32, by count
  (``bucket_by``) and by budget (``max_frames`` of 32 mean utterances): the
  Loader against a bare padded gather of the same batches (numpy, each
  sample's frames copied into one reused buffer, the rest zeroed), in rounds
  of their own of ``EPOCHS`` epochs a timing; and with text against Lhotse
  (same budget) and Hugging Face ``datasets`` (random batches of 32, a
  DataLoader with N workers) reading the same features.

Every timing is taken in interleaved rounds; each ratio is the median of its
rounds' ratios, with their range. Lhotse and datasets are imported only here.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dlop.formats import ArchiveWriter, Field
from dlop.runtime import Loader

from .common import Row
from .small_bench import ratio, rounds_of
from .speech_peers import BATCH as SHORT_BATCH
from .speech_peers import datasets_loader

FPS = 100  # frames a second (10 ms hop)
N_MELS = 80
BUDGET_S = 200  # seconds of speech a batch holds in the wide workload
BUCKETS = 10  # Lhotse's default
EPOCHS = 8  # epochs a timing of the Loader or the bare gather holds (short workload)


def durations(n: int, median_s: float, sigma: float, lo: float, hi: float, seed: int) -> np.ndarray:
    """Utterance lengths in frames: log-normal seconds, clipped."""
    gen = np.random.default_rng(seed)
    seconds = np.clip(gen.lognormal(np.log(median_s), sigma, n), lo, hi)
    return np.round(seconds * FPS).astype(np.int64)


def features(i: int, frames: int) -> np.ndarray:
    return np.full((frames, N_MELS), (i % 97) / 97, np.float16)


def write_dlop(path: Path, frames: np.ndarray) -> Path:
    fields = [Field("fbank", "f16", (None, N_MELS)), Field.str_("text")]
    with ArchiveWriter(path, fields, shard_bytes=32 << 20) as w:
        for i, n in enumerate(frames.tolist()):
            w.write({"fbank": features(i, n), "text": f"utterance {i}"})
    return path


def write_lhotse(folder: Path, frames: np.ndarray) -> Any:
    """The same features as a Lhotse CutSet (one supervision per cut), NumpyFilesWriter."""
    from lhotse import CutSet, Features, MonoCut, SupervisionSegment
    from lhotse.features.io import NumpyFilesWriter

    cuts = []
    with NumpyFilesWriter(folder) as w:
        for i, n in enumerate(frames.tolist()):
            key = w.write(f"u{i}", features(i, n))
            seconds = n / FPS
            feats = Features(
                type="fbank",
                num_frames=n,
                num_features=N_MELS,
                frame_shift=1 / FPS,
                sampling_rate=16000,
                start=0,
                duration=seconds,
                storage_type=w.name,
                storage_path=str(w.storage_path),
                storage_key=key,
                recording_id=f"r{i}",
                channels=0,
            )
            sup = SupervisionSegment(
                id=f"s{i}", recording_id=f"r{i}", start=0, duration=seconds, text=f"utterance {i}"
            )
            cut = MonoCut(f"u{i}", 0, seconds, 0, features=feats, supervisions=[sup])
            cuts.append(cut)
    return CutSet.from_cuts(cuts)


def write_datasets(folder: Path, frames: np.ndarray) -> Path:
    """The same features as a Hugging Face dataset (Array2D float16), saved to disk."""
    from datasets import Array2D, Dataset, Features, Value

    def rows() -> Iterator[dict[str, Any]]:
        for i, n in enumerate(frames.tolist()):
            yield {"input_features": features(i, n), "text": f"utterance {i}"}

    schema = Features(
        {"input_features": Array2D(shape=(None, N_MELS), dtype="float16"), "text": Value("string")}
    )
    Dataset.from_generator(rows, features=schema).save_to_disk(str(folder))
    return folder


def shape_stats(batches: list[np.ndarray], budget: int | None = None) -> dict[str, Any]:
    """Padded share, batch count and the largest batch against ``budget`` of one epoch's
    batches (each an array of lengths)."""
    padded = sum(int(b.max()) * len(b) for b in batches)
    real = sum(int(b.sum()) for b in batches)
    out: dict[str, Any] = {
        "padded_share": round(1 - real / padded, 4),
        "batches": len(batches),
        "mean_batch": round(sum(len(b) for b in batches) / len(batches), 1),
    }
    if budget:
        out["largest_padded_over_budget"] = round(
            max(int(b.max()) * len(b) for b in batches) / budget, 3
        )
        out["largest_sum_over_budget"] = round(max(int(b.sum()) for b in batches) / budget, 3)
    return out


def lhotse_epochs(cuts: Any, max_duration: float, workers: int) -> tuple[Any, Any]:
    """(sampler, DataLoader) of Lhotse's bucketing sampler over ``cuts``."""
    from lhotse.dataset import DynamicBucketingSampler, K2SpeechRecognitionDataset
    from torch.utils.data import DataLoader

    sampler = DynamicBucketingSampler(
        cuts, max_duration=max_duration, num_buckets=BUCKETS, shuffle=True, seed=0
    )
    loader = DataLoader(
        K2SpeechRecognitionDataset(),
        sampler=sampler,
        batch_size=None,
        num_workers=workers,
        persistent_workers=workers > 0,
    )
    return sampler, loader


def lhotse_shapes(sampler: Any, epoch: int) -> list[np.ndarray]:
    """The lengths of each batch Lhotse's sampler makes in ``epoch``."""
    sampler.set_epoch(epoch)
    return [np.array([c.num_frames for c in batch], np.int64) for batch in sampler]


def counted(
    name: str, it: Callable[[], Any], count: Callable[[Any], int], n: int
) -> Callable[[], int]:
    """One epoch of ``it()``, checked to hold ``n`` samples."""

    def epoch() -> int:
        seen = sum(count(b) for b in it())
        if seen != n:
            raise RuntimeError(f"{name}: an epoch held {seen} samples, expected {n}")
        return seen

    return epoch


def every_epoch(loader: Any, sampler: Any = None) -> Callable[[], Any]:
    """A fresh epoch of ``loader`` each call (its sampler's epoch moved on)."""
    state = {"epoch": 0}

    def fresh() -> Any:
        state["epoch"] += 1
        if sampler is not None:
            sampler.set_epoch(state["epoch"])
        return loader

    return fresh


def bare_padded(path: Path, batches: list[np.ndarray]) -> Callable[[], int]:
    """An epoch of ``batches`` as a bare padded gather: every sample's frames copied from
    one in-memory array of all values into one reused buffer, the rest of its row zeroed."""
    from dlop.runtime import open_archive

    ds = open_archive(path, fields=["fbank"])
    lengths = ds.lengths("fbank")
    values = np.concatenate([ds[i]["fbank"].numpy() for i in range(len(ds))])
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    most = max(int(lengths[b].max()) * len(b) for b in batches)
    buffer = np.empty(most * N_MELS, np.float16)

    def epoch() -> int:
        held = 0
        for b in batches:
            longest = int(lengths[b].max())
            out = buffer[: len(b) * longest * N_MELS].reshape(len(b), longest, N_MELS)
            for row, i in enumerate(b.tolist()):
                n, s = int(lengths[i]), int(starts[i])
                out[row, :n] = values[s : s + n]
                out[row, n:] = 0
            held += len(b)
        return held

    return epoch


def repeated(epoch: Callable[[], int], times: int) -> Callable[[], int]:
    """``epoch`` run ``times`` times as one timing: the samples of all of them."""
    return lambda: sum(epoch() for _ in range(times))


def loader_epoch_of(loader: Loader) -> Callable[[], int]:
    def epoch() -> int:
        return sum(len(b["fbank_lengths"]) for b in loader)

    return epoch


def run(work: Path, args: argparse.Namespace) -> list[Row]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the peers warn about their own settings
        try:
            return wide_rows(work / "wide", args) + short_rows(work / "short", args)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def wide_rows(work: Path, args: argparse.Namespace) -> list[Row]:
    work.mkdir(parents=True, exist_ok=True)
    frames = durations(max(1, args.budget_utts * 3 // 5), 4.0, 0.9, 0.5, 30.0, seed=1)
    n, rounds, workers = len(frames), max(1, args.repeats), args.workers
    budget = BUDGET_S * FPS
    path = write_dlop(work / "wide.dlop", frames)
    cuts = write_lhotse(work / "lhotse", frames)
    wl = (
        f"budget batches: {n} utterances of 0.5-30 s (median 4 s, {frames.sum() / FPS / 3600:.2f} h), "
        f"80-bin f16 at {FPS} frames/s, at most {BUDGET_S} s ({budget} frames) a batch, "
        f"{BUCKETS} buckets"
    )
    loader = Loader(path, None, bucket_by="fbank", max_frames=budget, num_buckets=BUCKETS, seed=0)
    sampler, lhotse = lhotse_epochs(cuts, BUDGET_S, workers)
    epochs = range(3)
    mine = [shape_stats([frames[b] for b in loader.batches(e)], budget) for e in epochs]
    theirs = [shape_stats(lhotse_shapes(sampler, e), budget) for e in epochs]
    took = rounds_of(
        {
            "dlop": loader_epoch_of(loader),
            "lhotse": counted(
                "Lhotse", every_epoch(lhotse, sampler), lambda b: len(b["supervisions"]["text"]), n
            ),
        },
        rounds,
    )
    loader.close()
    del lhotse  # its worker processes end

    def summary(stats: list[dict[str, Any]]) -> dict[str, Any]:
        keys = stats[0].keys()
        return {k: statistics.median(s[k] for s in stats) for k in keys}

    share = [m["padded_share"] / t["padded_share"] for m, t in zip(mine, theirs, strict=True)]
    dlop_row = Row(
        wl,
        f"dlop Loader(max_frames={budget}, num_buckets={BUCKETS}), fbank + text, in process",
        n / statistics.median(took["dlop"]),
        extra={**summary(mine), "epochs": len(mine)},
    )
    dlop_row.extra["padded_share_over_lhotse"] = {
        "median": round(statistics.median(share), 3),
        "range": [round(min(share), 3), round(max(share), 3)],
        "target": "<= 1",
    }
    lhotse_row = Row(
        wl,
        f"Lhotse DynamicBucketingSampler(max_duration={BUDGET_S}, num_buckets={BUCKETS}) + "
        f"K2SpeechRecognitionDataset (NumpyFilesWriter features), DataLoader({workers} workers)",
        n / statistics.median(took["lhotse"]),
        extra={**summary(theirs), "epochs": len(theirs)},
    )
    lhotse_row.extra["dlop_over_this"] = {**ratio(took["lhotse"], took["dlop"]), "target": ">= 20x"}
    return [dlop_row, lhotse_row]


def short_loader(path: Path, kind: str, fields: list[str], budget: int) -> Loader:
    """The Loader of the short workload: bucketed batches by count, or by ``budget``."""
    if kind == "count":
        return Loader(path, SHORT_BATCH, bucket_by="fbank", seed=0, fields=fields)
    return Loader(
        path, None, bucket_by="fbank", seed=0, fields=fields, max_frames=budget,
        num_buckets=BUCKETS,
    )  # fmt: skip


def short_rows(work: Path, args: argparse.Namespace) -> list[Row]:
    work.mkdir(parents=True, exist_ok=True)
    frames = durations(args.budget_utts, 1.5, 0.6, 0.5, 8.0, seed=2)
    n, rounds, workers = len(frames), max(1, args.repeats), args.workers
    budget = SHORT_BATCH * int(frames.mean())
    path = write_dlop(work / "short.dlop", frames)
    wl = (
        f"short ragged utterances: {n} of 0.5-8 s (median {np.median(frames) / FPS:.1f} s), "
        f"80-bin f16, bucketed batches of {SHORT_BATCH} (count) or of {budget} frames "
        f"({SHORT_BATCH} mean utterances, {BUCKETS} buckets)"
    )
    # the features alone against the bare gather; features and text against the peers
    kinds = ("count", "budget")
    loaders = {
        f"{kind}{tail}": short_loader(path, kind, fields, budget)
        for kind in kinds
        for tail, fields in (("", ["fbank"]), (" text", ["fbank", "text"]))
    }
    # The Loader against the bare gather in rounds of their own, each timing EPOCHS epochs:
    # a peer's worker processes still exiting after its epoch would slow whichever
    # pipeline is timed next, and one epoch of these batches is a few milliseconds.
    bare_fns: dict[str, Callable[[], int]] = {}
    for kind in kinds:
        bare_fns[kind] = repeated(loader_epoch_of(loaders[kind]), EPOCHS)
        bare_fns[f"bare {kind}"] = repeated(bare_padded(path, loaders[kind].batches(0)), EPOCHS)
    took = rounds_of(bare_fns, rounds)
    fns: dict[str, Callable[[], int]] = {}
    for kind in kinds:
        fns[f"{kind} text"] = loader_epoch_of(loaders[f"{kind} text"])

    def lhotse() -> tuple[str, Any, Callable[[], int]]:
        sampler, made = lhotse_epochs(write_lhotse(work / "lhotse", frames), budget / FPS, workers)
        name = (
            f"Lhotse DynamicBucketingSampler(max_duration={budget / FPS:.1f}) + "
            f"K2SpeechRecognitionDataset, DataLoader({workers} workers)"
        )
        count = counted(
            "Lhotse", every_epoch(made, sampler), lambda b: len(b["supervisions"]["text"]), n
        )
        return name, made, count

    def hf() -> tuple[str, Any, Callable[[], int]]:
        made, _ = datasets_loader(write_datasets(work / "datasets", frames), workers, grouped=False)
        name = (
            f'datasets with_format("torch"), random batches of {SHORT_BATCH}, '
            f"DataLoader({workers} workers)"
        )
        return name, made, counted("datasets", every_epoch(made), lambda b: len(b["text"]), n)

    peers: dict[str, tuple[str, Any]] = {}
    for key, make in (("Lhotse", lhotse), ("datasets", hf)):
        try:
            name, made, epoch = make()
        except ImportError as e:  # the peer is not installed here
            peers[key] = (f"{key}: not run ({e})", None)
            continue
        fns[key], peers[key] = epoch, (name, made)
    took |= rounds_of(fns, rounds)
    for loader in loaders.values():
        loader.close()
    rows = []
    for kind in ("count", "budget"):
        bare = Row(
            wl,
            f"bare padded gather (numpy into one reused buffer), the Loader's {kind} batches",
            EPOCHS * n / statistics.median(took[f"bare {kind}"]),
        )
        row = Row(
            wl,
            f"dlop Loader, bucketed batches by {kind}, fbank",
            EPOCHS * n / statistics.median(took[kind]),
            vs_baseline=statistics.median(
                a / b for a, b in zip(took[f"bare {kind}"], took[kind], strict=True)
            ),
            baseline=bare.pipeline,
            extra={"over_bare": {**ratio(took[f"bare {kind}"], took[kind]), "target": ">= 0.8x"}},
        )
        with_text = Row(
            wl,
            f"dlop Loader, bucketed batches by {kind}, fbank + text",
            n / statistics.median(took[f"{kind} text"]),
        )
        rows += [bare, row, with_text]
    for peer, (name, made) in peers.items():
        if made is None:
            rows.append(Row(wl, name))
            continue
        row = Row(wl, name, n / statistics.median(took[peer]))
        for kind in ("count", "budget"):
            row.extra[f"dlop_{kind}_over_this"] = {
                **ratio(took[peer], took[f"{kind} text"]),
                "target": ">= 20x",
            }
        rows.append(row)
    return rows

"""Your own preprocessing: one user function compiled by dlop's compile_map, by LitData's
``optimize`` (same function, same worker count) and written by MosaicML's ``MDSWriter``
in a loop; then each result read back (dlop's Loader, LitData's StreamingDataLoader,
Streaming's StreamingDataset under a DataLoader).

Two functions: a constant-Q transform of ESC-50-shaped clips (5 s at 44.1 kHz, librosa:
the function's own work dominates) and a cheap numpy function of the input's index (a
64 x 64 float32 array and a label: what remains is each tool's cost per item). The
compiles run in interleaved rounds (dlop, LitData, MDS, dlop, ...), each in a fresh
interpreter (the call timed, not the interpreter's start), medians reported.
LitData and Streaming are not dlop dependencies: ``make bench-peers`` installs them;
without them their rows say so.

Goals (issue figures): with the cheap function, dlop >= 2x LitData's items/s; with the
CQT, >= 1.0x; reading, dlop >= 20x both.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .common import Row, best_of, loader_epoch, rate_row

BATCH = 256
CLIP_RATE, CLIP_SECONDS = 44100, 5.0


def cheap(i: int) -> dict[str, Any]:
    """A 64 x 64 float32 array and a label from the index: microseconds of numpy."""
    x = np.arange(4096, dtype=np.float32).reshape(64, 64)
    np.sin(x * np.float32((i % 97 + 1) / 4096), out=x)
    return {"x": x, "label": i % 50}


def cqt(path: str) -> dict[str, Any]:
    """A clip's constant-Q spectrogram in dB, [frames, 84] float32, and its label."""
    import librosa
    import soundfile as sf

    wave, rate = sf.read(path, dtype="float32")
    spec = np.abs(librosa.cqt(wave, sr=rate, n_bins=84, hop_length=512))
    label = int(Path(path).stem.rsplit("-", 1)[-1])
    return {"cqt": librosa.amplitude_to_db(spec, ref=np.max).T.astype(np.float32), "label": label}


def _clips(folder: Path, count: int) -> list[str]:
    import soundfile as sf

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for n in range(count):
        path = folder / f"{n // 400 + 1}-{100000 + n}-A-{n % 50}.wav"
        if not path.exists():
            rng = np.random.default_rng(n)
            t = np.arange(int(CLIP_RATE * CLIP_SECONDS)) / CLIP_RATE
            tone = 0.3 * np.sin(2 * np.pi * (110 + 7 * (n % 50)) * t)
            wave = (tone + rng.normal(0, 0.05, t.size)).astype(np.float32)
            sf.write(path, wave, CLIP_RATE)
        paths.append(str(path))
    return paths


def _dlop(fn: Callable[[Any], Any], inputs: list[Any], out: Path, workers: int) -> float:
    from dlop.compiler import compile_map

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    compile_map(fn, inputs, out, workers=workers, progress=False)
    return time.perf_counter() - t0


def _litdata(fn: Callable[[Any], Any], inputs: list[Any], out: Path, workers: int) -> float:
    import litdata as ld

    shutil.rmtree(out, ignore_errors=True)
    start_method = multiprocessing.get_start_method(allow_none=True)
    t0 = time.perf_counter()
    try:
        ld.optimize(
            fn=fn, inputs=inputs, output_dir=str(out), chunk_bytes="64MB", num_workers=workers,
            verbose=False,
        )  # fmt: skip
    finally:  # optimize sets spawn for the whole process; later rows start as usual
        multiprocessing.set_start_method(start_method, force=True)
    return time.perf_counter() - t0


def _mds(fn: Callable[[Any], Any], inputs: list[Any], out: Path, workers: int) -> float:
    from streaming import MDSWriter

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()  # the first item's call too, as the others' first call counts
    first = fn(inputs[0])
    columns = {
        name: f"ndarray:{value.dtype.name}" if isinstance(value, np.ndarray) else "int"
        for name, value in first.items()
    }
    with MDSWriter(out=str(out), columns=columns, size_limit="64mb") as w:
        w.write(first)
        for x in inputs[1:]:
            w.write(fn(x))
    return time.perf_counter() - t0


def _available(module: str) -> str | None:
    try:
        __import__(module)
    except Exception as e:  # any failure to import is the row's reason
        return f"{type(e).__name__}: {e}"[:200]
    return None


WRITERS = {
    "dlop compile_map": ("dlop", _dlop),
    "LitData optimize": ("litdata", _litdata),
    "MDSWriter loop (one process)": ("streaming", _mds),
}
FUNCTIONS = {"cheap": cheap, "cqt": cqt}


def _in_fresh_process(writer: str, fn: str, inputs: list[Any], out: Path, workers: int) -> float:
    """Seconds one writer's call takes, in a fresh interpreter (as a compile script runs
    it: no threads or imports left by an earlier row, each tool's start-up its own)."""
    listed = out.with_suffix(".inputs.json")
    listed.write_text(json.dumps(inputs))
    code = (
        "import sys, json; from dlop.tools.bench import custom_bench as b; "
        "print(b.WRITERS[sys.argv[1]][1](b.FUNCTIONS[sys.argv[2]], "
        "json.loads(open(sys.argv[3]).read()), b.Path(sys.argv[4]), int(sys.argv[5])))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, writer, fn, str(listed), str(out), str(workers)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{writer} failed: {done.stderr[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def _compiles(
    workload: str, fn: str, inputs: list[Any], work: Path, workers: int, rounds: int
) -> tuple[list[Row], dict[str, Path]]:
    """Each writer in turn, ``rounds`` times, each call in a fresh interpreter; rows of
    median items/s against dlop's."""
    work.mkdir(parents=True, exist_ok=True)
    chosen = [name for name, (module, _) in WRITERS.items() if _available(module) is None]
    outs = {name: work / name.split()[0].lower() for name in WRITERS}
    times: dict[str, list[float]] = {name: [] for name in chosen}
    for _ in range(max(1, rounds)):
        for name in chosen:
            print(f"   {workload}: {name}", file=sys.stderr, flush=True)
            times[name].append(_in_fresh_process(name, fn, inputs, outs[name], workers))
    rows: list[Row] = []
    dlop = None
    for name in WRITERS:
        module = WRITERS[name][0]
        missing = _available(module)
        if missing is not None:
            rows.append(Row(workload, f"{name}: not run ({missing}; make bench-peers)"))
            continue
        took = statistics.median(times[name])
        label = name if "one process" in name else f"{name}, {workers} workers"
        spread = [round(len(inputs) / t, 1) for t in sorted(times[name], reverse=True)]
        row = rate_row(workload, label, len(inputs), took, None, dlop, "dlop compile_map",
                       items_per_s_range=spread)  # fmt: skip
        if dlop is None:
            dlop = row
        rows.append(row)
    return rows, {n: outs[n] for n in chosen}


def _reads(workload: str, outs: dict[str, Path], workers: int, repeats: int) -> list[Row]:
    """One epoch of each written result, batches of BATCH, after a warm-up epoch."""
    readers: dict[str, Callable[[], Any]] = {}
    if "dlop compile_map" in outs:
        from dlop.runtime import Loader

        path = outs["dlop compile_map"]
        readers["dlop Loader"] = lambda: Loader(path, batch_size=BATCH, shuffle=True, seed=0)
    if "LitData optimize" in outs:
        import litdata as ld

        lit = str(outs["LitData optimize"])
        readers[f"LitData StreamingDataLoader, {workers} workers"] = lambda: ld.StreamingDataLoader(
            ld.StreamingDataset(lit, shuffle=True, seed=0), batch_size=BATCH,
            num_workers=workers, persistent_workers=True,
        )  # fmt: skip
    if "MDSWriter loop (one process)" in outs:
        from streaming import StreamingDataset
        from torch.utils.data import DataLoader

        mds = str(outs["MDSWriter loop (one process)"])
        readers[f"MDS StreamingDataset + DataLoader, {workers} workers"] = lambda: DataLoader(
            StreamingDataset(local=mds, shuffle=True, batch_size=BATCH), batch_size=BATCH,
            num_workers=workers, persistent_workers=True,
        )  # fmt: skip
    rows: list[Row] = []
    base = None
    for name, make in readers.items():
        loader = make()
        count = loader_epoch(loader)  # warm: workers started, pages cached
        took = best_of(functools.partial(loader_epoch, loader), repeats)
        row = rate_row(workload, f"read: {name}", count, took, None, base, "dlop Loader")
        base = base or row
        rows.append(row)
    return rows


def run(work: Path, args: argparse.Namespace) -> list[Row]:
    print("== custom (your own preprocessing)", file=sys.stderr, flush=True)
    workers, rounds = args.workers, args.repeats
    rows: list[Row] = []
    items = list(range(args.custom_items))
    workload = f"your own preprocessing: cheap numpy fn, {len(items)} items"
    written, outs = _compiles(workload, "cheap", items, work / "cheap", workers, rounds)
    rows += written + _reads(workload, outs, workers, rounds)
    if args.custom_clips <= 0:
        return rows
    clips = _clips(work / "clips", args.custom_clips)
    workload = f"your own preprocessing: librosa CQT of {len(clips)} 5 s clips"
    written, _ = _compiles(workload, "cqt", clips, work / "cqt", workers, rounds)
    rows += written
    return rows

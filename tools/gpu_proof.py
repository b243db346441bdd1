"""``make gpu-proof``: the GPU path measured on a CUDA machine, in one report.

Sections, each a part of ``report.json`` and ``report.md`` in ``--out``:

- ``environment``: torch, CUDA, the device, the CPU count, dlop's compiled parts.
- ``cuda_tests``: the test suite's ``gpu``-marked tests, run by pytest.
- ``bandwidth``: host-to-device bytes/s of a bare pinned ``copy_`` against the
  Loader's batches reaching the device (same batch shapes), and the Loader's
  gather into its pinned buffers alone; interleaved rounds, medians.
- ``timeline``: CUDA events around each batch's copy on the Loader's copy
  stream and around each training step on the compute stream, for 50 steps:
  how much of the copying ran while a step computed, and which copies ran
  inside step k.
- ``augmentations``: every augmentation on the device against its CPU result
  for the same seed; all are exact (runtime.transforms.base says why).
- ``train``: ResNet18 on ESC-50-shaped log-mels (``dlop-bench --train``): a
  naive DataLoader against dlop's Loader, samples/s and the share of the run
  spent waiting for data, channels-last and bf16 autocast.

``--dry-run`` runs every section on the CPU with tiny sizes (the test suite does,
so the script cannot rot); figures from it mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from dlop.runtime import Loader
from dlop.runtime.batch import Batch
from dlop.runtime.gather.engine import CopyEngine, default_threads
from dlop.runtime.transforms.audio import Mixup, RandomTimeCrop, SpecAugment
from dlop.runtime.transforms.vision import (
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    RandomTemporalCrop,
)

from .bench.train import FIELDS, ResNet18, dlop_source, prepare, sources, train_rows, workload

# The figures the GPU path must reach (docs/gpu-proof.md).
LOADER_OF_BARE_GOAL = 0.8
TRAIN_GOAL = 11_060  # samples/s: the seed's throughput on 8 A100s
WAIT_GOAL = 0.05


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- environment and tests ------------------------------------------------------------


def environment(device: torch.device) -> dict[str, Any]:
    from dlop.formats import crc
    from dlop.runtime.gather import engine

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "copy_threads": default_threads(),
        "compiled_copier": engine.built(),
        "crc32": crc.crc32.__module__,
        "device": str(device),
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env |= {
            "gpu": p.name,
            "gpu_memory_gib": round(p.total_memory / 2**30, 1),
            "multiprocessors": p.multi_processor_count,
            "capability": f"{p.major}.{p.minor}",
        }
    return env


def cuda_tests(root: Path, timeout: float) -> dict[str, Any]:
    """The ``gpu``-marked tests, in a pytest of their own."""
    files = sorted(
        str(f.relative_to(root))
        for f in (root / "tests").rglob("test_*.py")
        if "pytest.mark.gpu" in f.read_text()
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files]
    started = time.perf_counter()
    try:
        done = subprocess.run(
            cmd, cwd=root, capture_output=True, text=True, timeout=timeout, check=False
        )
        out, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        partial = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        out, code = f"{partial}\ntimed out after {timeout} s", -1
    counts = {
        word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|error)", out[-400:])
    }
    return {
        "files": files,
        "returncode": code,
        "counts": counts,
        "seconds": round(time.perf_counter() - started, 1),
        "tail": out[-3000:],
    }


# -- bandwidth --------------------------------------------------------------------------


def _batch_shapes(archive: Path, batch: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    loader = Loader(archive, batch, fields=FIELDS, shuffle=False, prefetch=0)
    try:
        first = next(iter(loader))
        return {k: (tuple(v.shape), v.dtype) for k, v in first.items()}
    finally:
        loader.close()


def _bare_copy(
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device, copies: int
) -> float:
    """Bytes/s of pinned host tensors copied into device tensors, ``copies`` times."""
    pin = device.type == "cuda"
    src = {k: torch.ones(s, dtype=d, pin_memory=pin) for k, (s, d) in shapes.items()}
    dst = {k: torch.empty(s, dtype=d, device=device) for k, (s, d) in shapes.items()}
    nbytes = sum(t.numel() * t.element_size() for t in src.values())
    for k in src:  # warm-up
        dst[k].copy_(src[k], non_blocking=True)
    _sync(device)
    started = time.perf_counter()
    for _ in range(copies):
        for k in src:
            dst[k].copy_(src[k], non_blocking=True)
    _sync(device)
    return nbytes * copies / (time.perf_counter() - started)


def _loader_rate(loader: Loader, batches: int, device: torch.device) -> float:
    """Bytes/s of ``batches`` batches reaching ``device`` (after an untimed epoch)."""
    for _ in loader:
        pass
    _sync(device)
    done = nbytes = 0
    epoch = 1
    started = time.perf_counter()
    while done < batches:
        loader.set_epoch(epoch)
        for b in loader:
            nbytes += sum(v.numel() * v.element_size() for v in b.values())
            done += 1
            if done == batches:
                break
        epoch += 1
    _sync(device)
    return nbytes / (time.perf_counter() - started)


def bandwidth(
    archive: Path, batch: int, device: torch.device, batches: int, rounds: int
) -> dict[str, Any]:
    shapes = _batch_shapes(archive, batch)
    cuda = device.type == "cuda"
    threads = sorted({default_threads(), min(os.cpu_count() or 1, 2 * default_threads())})

    def loader(to: torch.device | None, copy_threads: int) -> Loader:
        made = Loader(archive, batch, seed=0, drop_last=True, fields=FIELDS, device=to)
        if copy_threads != default_threads():
            made.engine.close()
            made.engine = CopyEngine(streaming=True, threads=copy_threads)
        return made

    ways: dict[str, Callable[[], float]] = {
        "bare pinned copy_": lambda: _bare_copy(shapes, device, batches)
    }
    for n in threads:
        ways[f"Loader to {device.type}, {n} copy threads"] = _measured(
            loader, device if cuda else None, n, batches, device
        )
        if cuda:
            ways[f"Loader gather only (pinned, host), {n} copy threads"] = _measured(
                loader, None, n, batches, torch.device("cpu")
            )
    runs: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(rounds):  # interleaved: A B C A B C ...
        for name, way in ways.items():
            runs[name].append(way())
    bare = statistics.median(runs["bare pinned copy_"])
    rows: list[dict[str, Any]] = []
    for name, rates in runs.items():
        rows.append(
            {
                "name": name,
                "gb_per_s": round(statistics.median(rates) / 1e9, 2),
                "range": [round(min(rates) / 1e9, 2), round(max(rates) / 1e9, 2)],
                "of_bare": round(statistics.median(rates) / bare, 3),
            }
        )
    default = f"Loader to {device.type}, {default_threads()} copy threads"
    of_bare = float(next(r["of_bare"] for r in rows if r["name"] == default))
    return {
        "batch_shapes": {k: [list(s), str(d)] for k, (s, d) in shapes.items()},
        "batch_bytes": sum(
            torch.Size(s).numel() * torch.empty(0, dtype=d).element_size()
            for s, d in shapes.values()
        ),
        "batches_per_round": batches,
        "rounds": rounds,
        "rows": rows,
        "loader_of_bare": of_bare,
        "goal": LOADER_OF_BARE_GOAL,
        "met": of_bare >= LOADER_OF_BARE_GOAL,
    }


def _measured(
    make: Callable[[torch.device | None, int], Loader],
    to: torch.device | None,
    threads: int,
    batches: int,
    device: torch.device,
) -> Callable[[], float]:
    def run() -> float:
        made = make(to, threads)
        try:
            return _loader_rate(made, batches, device)
        finally:
            made.close()

    return run


# -- timeline ---------------------------------------------------------------------------


class _Timed:
    """Wraps a Loader's device stage: timing events around each batch's copies."""

    def __init__(self, loader: Loader) -> None:
        self.stage = loader.to_device
        self.original = self.stage.copy
        self.copies: list[tuple[Any, Any]] = []
        self.stage.copy = self.copy  # type: ignore[method-assign]

    def copy(self, batch: Batch) -> tuple[Batch, Any]:
        stream = self.stage.stream()
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record(stream)
        moved, event = self.original(batch)
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end.record(stream)
        self.copies.append((start, end))
        return moved, event


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def timeline(archive: Path, batch: int, device: torch.device, steps: int) -> dict[str, Any]:
    """Copy-stream intervals against compute-stream intervals over ``steps`` training steps."""
    if device.type != "cuda":
        return {"skipped": "needs CUDA (the copy stream exists only there)"}
    torch.backends.cudnn.benchmark = True
    model = ResNet18(5).to(device).to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = Loader(archive, batch, seed=0, drop_last=True, fields=FIELDS, device=device)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        x = x.float().unsqueeze(1).contiguous(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        opt.step()

    for b in loader:  # warm-up: cuDNN's choices, the page cache
        step(b["logmel"], b["label"])
    _sync(device)
    timed = _Timed(loader)
    compute: list[tuple[Any, Any]] = []
    origin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    origin.record()
    epoch = 1
    try:
        while len(compute) < steps:
            loader.set_epoch(epoch)
            for b in loader:
                start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                start.record()
                step(b["logmel"], b["label"])
                end.record()
                compute.append((start, end))
                if len(compute) == steps:
                    break
            epoch += 1
        _sync(device)
    finally:
        loader.close()

    def ms(pair: tuple[Any, Any]) -> tuple[float, float]:
        return float(origin.elapsed_time(pair[0])), float(origin.elapsed_time(pair[1]))

    steps_ms = [ms(p) for p in compute]
    # The copies of the batches the timed steps trained on, and those made ahead.
    copies_ms = [ms(p) for p in timed.copies]
    first, last = steps_ms[0][0], steps_ms[-1][1]
    inside = [c for c in copies_ms if c[0] >= first and c[1] <= last]
    copy_time = sum(c[1] - c[0] for c in inside)
    overlapped = sum(max((_overlap(c, s) for s in steps_ms), default=0.0) for c in inside)
    per_step = []
    for k, s in enumerate(steps_ms):
        ran = [i for i, c in enumerate(copies_ms) if _overlap(c, s) > 0]
        per_step.append({"step": k, "ms": [round(s[0], 3), round(s[1], 3)], "copies_inside": ran})
    busy_steps = sum(1 for p in per_step[:-1] if p["copies_inside"])
    return {
        "steps": steps,
        "copies_timed": len(inside),
        "copy_ms_median": round(statistics.median(c[1] - c[0] for c in inside), 3)
        if inside
        else None,
        "step_ms_median": round(statistics.median(s[1] - s[0] for s in steps_ms), 3),
        "copy_time_overlapping_compute": round(overlapped / copy_time, 3) if copy_time else None,
        "steps_with_a_copy_inside": busy_steps,
        "of_steps": len(per_step) - 1,
        "met": bool(copy_time) and overlapped / copy_time >= 0.9,
        "per_step": per_step,
        "copies_ms": [[round(a, 3), round(b, 3)] for a, b in copies_ms],
    }


# -- augmentations ----------------------------------------------------------------------


def _audio_batch(b: int = 16, frames: int = 120, bins: int = 64) -> Batch:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(b, frames, bins, generator=g).to(torch.float16)
    return Batch(
        logmel=x,
        logmel_lengths=torch.randint(1, frames + 1, (b,), generator=g),
        label=torch.randint(0, 7, (b,), generator=g),
    )


def _image_batch(b: int = 8, h: int = 60, w: int = 80) -> Batch:
    g = torch.Generator().manual_seed(12)
    image = torch.randint(0, 256, (b, h, w, 3), generator=g, dtype=torch.uint8)
    mask = torch.randint(0, 6, (b, h, w), generator=g, dtype=torch.uint8)
    lengths = torch.stack(
        [
            torch.randint(h // 2, h + 1, (b,), generator=g),
            torch.randint(w // 2, w + 1, (b,), generator=g),
        ],
        dim=1,
    )
    return Batch(image=image, image_lengths=lengths, mask=mask, mask_lengths=lengths.clone())


def _clip_batch(b: int = 4, t: int = 12) -> Batch:
    g = torch.Generator().manual_seed(13)
    frames = torch.randint(0, 256, (b, t, 24, 32, 3), generator=g, dtype=torch.uint8)
    return Batch(frames=frames, frames_lengths=torch.randint(3, t + 1, (b,), generator=g))


CHECKS: dict[str, tuple[Callable[[], Batch], Any]] = {
    "SpecAugment": (_audio_batch, SpecAugment("logmel", freq_width=12, time_width=30)),
    "RandomTimeCrop": (_audio_batch, RandomTimeCrop("logmel", frames=80, reverse=0.5)),
    "Mixup": (_audio_batch, Mixup(alpha=0.4, num_classes=7)),
    "RandomResizedCrop bilinear": (
        _image_batch,
        RandomResizedCrop(48, masks=("mask",), scale=(0.2, 1.0)),
    ),
    "RandomResizedCrop nearest": (
        _image_batch,
        RandomResizedCrop((40, 56), masks=("mask",), interpolation="nearest"),
    ),
    "RandomResizedCrop clip": (_clip_batch, RandomResizedCrop(20, fields=("frames",))),
    "RandomHorizontalFlip": (_image_batch, RandomHorizontalFlip(masks=("mask",))),
    "RandomTemporalCrop": (_clip_batch, RandomTemporalCrop(frames=6, reverse=0.5)),
    "Normalize": (_image_batch, Normalize()),
}


def augmentation_checks(device: str | torch.device, seeds: int = 3) -> list[dict[str, Any]]:
    """Each augmentation on ``device`` against the CPU, same batch and seed: every
    output field bit for bit (max_abs_diff 0)."""
    dev = torch.device(device)
    rows = []
    for name, (make, transform) in CHECKS.items():
        worst = 0.0
        same_keys = True
        waits = _waits_for_device(make, transform, dev)
        for seed in range(seeds):
            cpu = transform(make(), torch.Generator().manual_seed(seed))
            moved = Batch({k: v.to(dev) for k, v in make().items()})
            on_dev = transform(moved, torch.Generator().manual_seed(seed))
            same_keys &= set(cpu) == set(on_dev)
            for k, v in cpu.items():
                w = on_dev[k].cpu()
                if w.shape != v.shape or w.dtype != v.dtype:
                    worst = float("inf")
                    continue
                diff = (w.double() - v.double()).abs().max().item() if v.numel() else 0.0
                worst = max(worst, diff)
        rows.append(
            {
                "name": name,
                "device": str(dev),
                "seeds": seeds,
                "max_abs_diff": worst,
                "waits_for_device": waits,
                "ok": same_keys and worst == 0.0 and not waits,
            }
        )
    return rows


def _waits_for_device(make: Callable[[], Batch], transform: Any, device: torch.device) -> bool:
    """Whether the transform makes the host wait for the device (torch's sync debug
    mode turns every such wait into an error); always False on the CPU."""
    if device.type != "cuda":
        return False
    batch = Batch({k: v.to(device) for k, v in make().items()})
    torch.cuda.synchronize(device)
    with warnings.catch_warnings():  # "a prototype feature"
        warnings.simplefilter("ignore", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        transform(batch, torch.Generator().manual_seed(0))
        return False
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode("default")


# -- the run ----------------------------------------------------------------------------


def train(
    corpus: Path,
    archive: Path,
    device: torch.device,
    batch: int,
    steps: int,
    workers: int,
    warmup: int = 10,
) -> dict[str, Any]:
    """The naive DataLoader and dlop's Loader feeding one ResNet18 at ``batch``, then
    dlop's Loader alone at twice the batch (the model, not the data, sets the pace
    when the data wait is small: a larger batch shows what the GPU does with it)."""
    dev = str(device)
    made = train_rows(
        workload(batch, dev), sources(corpus, archive, batch, workers, dev), steps, dev, 5, warmup
    )
    made += train_rows(
        workload(2 * batch, dev),
        {"dlop Loader": dlop_source(archive, 2 * batch, dev)},
        steps,
        dev,
        5,
        warmup,
    )
    rows = [asdict(r) for r in made]
    naive = rows[0]
    ours = rows[1:]
    best = max(
        (r for r in ours if r["extra"]["data_wait_share"] < WAIT_GOAL),
        key=lambda r: r["samples_per_s"],
        default=None,
    )
    return {
        "rows": rows,
        "naive_samples_per_s": round(naive["samples_per_s"], 1),
        "naive_data_wait_share": naive["extra"]["data_wait_share"],
        "dlop_samples_per_s": round(ours[0]["samples_per_s"], 1),
        "dlop_data_wait_share": ours[0]["extra"]["data_wait_share"],
        "dlop_vs_naive": round(ours[0]["samples_per_s"] / naive["samples_per_s"], 2),
        "goal_samples_per_s": TRAIN_GOAL,
        "goal_data_wait_share": WAIT_GOAL,
        "met_at_batch": None if best is None else best["extra"]["batch_size"],
        "met": best is not None and best["samples_per_s"] >= TRAIN_GOAL,
    }


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        "# dlop GPU proof",
        "",
        f"{env.get('gpu', env['device'])}, torch {env['torch']} (CUDA {env['cuda']}), "
        f"{env['cpus']} CPUs, {report['date']}; {report['seconds']} s"
        + (" (DRY RUN on the CPU: figures mean nothing)" if report["dry_run"] else ""),
        "",
    ]
    t = report.get("cuda_tests", {})
    if "counts" in t:
        lines += [f"**CUDA-marked tests**: {t['counts']} (exit {t['returncode']})", ""]
    bw = report["bandwidth"]
    lines += ["## Host to device", "", "| way | GB/s | range | of bare |", "|---|---|---|---|"]
    lines += [
        f"| {r['name']} | {r['gb_per_s']} | {r['range'][0]}-{r['range'][1]} | {r['of_bare']} |"
        for r in bw["rows"]
    ]
    lines += [
        "",
        f"Loader of bare: {bw['loader_of_bare']} (goal {bw['goal']}, met: {bw['met']})",
        "",
    ]
    tl = report["timeline"]
    lines += ["## Copy and compute", ""]
    if "skipped" in tl:
        lines += [f"skipped: {tl['skipped']}", ""]
    else:
        lines += [
            f"{tl['steps']} steps, median step {tl['step_ms_median']} ms, median copy "
            f"{tl['copy_ms_median']} ms; share of copy time inside a step: "
            f"{tl['copy_time_overlapping_compute']}; steps with a copy inside: "
            f"{tl['steps_with_a_copy_inside']} of {tl['of_steps']} (met: {tl['met']})",
            "",
        ]
    lines += ["## Augmentations, device against CPU", ""]
    lines += ["| augmentation | max abs diff | waits for the device | ok |", "|---|---|---|---|"]
    lines += [
        f"| {r['name']} | {r['max_abs_diff']} | {r['waits_for_device']} | {r['ok']} |"
        for r in report["augmentations"]
    ]
    tr = report["train"]
    lines += ["", "## Training", "", "| source | batch | samples/s | data wait |"]
    lines += ["|---|---|---|---|"]
    lines += [
        f"| {r['pipeline']} | {r['extra']['batch_size']} | {r['samples_per_s']:.0f} | "
        f"{r['extra']['data_wait_share']:.1%} |"
        for r in tr["rows"]
    ]
    lines += [
        "",
        f"goal: dlop >= {tr['goal_samples_per_s']} samples/s with data wait under "
        f"{tr['goal_data_wait_share']:.0%}; met: {tr['met']}",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dlop-gpu-proof", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu-proof-out"))
    p.add_argument("--dry-run", action="store_true", help="the CPU, tiny sizes: checks the script")
    p.add_argument("--clips", type=int, default=2048, help="ESC-50-shaped clips compiled")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--train-steps", type=int, default=100)
    p.add_argument("--copies", type=int, default=60, help="batches per bandwidth round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--no-tests", action="store_true", help="skip the CUDA-marked tests")
    p.add_argument("--workdir", type=Path, help="scratch space (default: a temp dir)")
    args = p.parse_args(argv)
    if args.dry_run:
        device = torch.device("cpu")
        args.clips, args.batch, args.train_steps = 24, 4, 1
        args.copies, args.rounds, args.workers = 4, 1, 1
    elif not torch.cuda.is_available():
        p.error("no CUDA device: run on a CUDA machine, or --dry-run to check the script")
    else:
        device = torch.device("cuda")
    started = time.time()
    root = Path(__file__).resolve().parent.parent
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "dry_run": args.dry_run,
        "command": "dlop-gpu-proof " + " ".join(argv if argv is not None else sys.argv[1:]),
        "environment": environment(device),
    }

    args.out.mkdir(parents=True, exist_ok=True)

    def say(what: str) -> None:
        # what is measured so far survives a section that fails
        (args.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        print(f"== {what} ({time.time() - started:.0f} s)", file=sys.stderr, flush=True)

    if not (args.dry_run or args.no_tests):
        say("CUDA-marked tests")
        report["cuda_tests"] = cuda_tests(root, timeout=240)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        say(f"corpus and archive ({args.clips} clips)")
        corpus, archive = prepare(work, args.clips, args.workers)
        say("augmentations")
        report["augmentations"] = augmentation_checks(device)
        say("bandwidth")
        report["bandwidth"] = bandwidth(archive, args.batch, device, args.copies, args.rounds)
        say("timeline")
        report["timeline"] = timeline(archive, args.batch, device, steps=50)
        say("train")
        # a dry run checks the script: one untimed step, not the ten that settle a GPU
        warmup = 1 if args.dry_run else 10
        report["train"] = train(
            corpus, archive, device, args.batch, args.train_steps, args.workers, warmup
        )
    report["seconds"] = round(time.time() - started, 1)
    (args.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "report.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

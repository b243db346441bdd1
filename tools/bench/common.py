"""Timing and reporting helpers shared by the benchmark sections."""

from __future__ import annotations

import contextlib
import gc
import json
import math
import platform
import resource
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dlop.compiler.corpus.listing import collector_paused


@dataclass
class Row:
    """One measured pipeline in one workload."""

    workload: str
    pipeline: str
    samples_per_s: float | None = None
    gb_per_s: float | None = None
    vs_baseline: float | None = None  # ratio to the row named in `baseline`
    baseline: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def rate_row(
    workload: str,
    pipeline: str,
    samples: int,
    took_s: float,
    sample_bytes: float | None = None,
    base: Row | None = None,
    base_name: str = "",
    **extra: Any,
) -> Row:
    """A row from one timing: samples/s, GB/s when the bytes per sample are known,
    and the ratio to a baseline row measured in the same run."""
    rate = samples / took_s
    return Row(
        workload,
        pipeline,
        rate,
        rate * sample_bytes / 1e9 if sample_bytes else None,
        rate / base.samples_per_s if base is not None and base.samples_per_s else None,
        (base_name or base.pipeline) if base is not None else "",
        extra,
    )


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """Timings inside run with the garbage collector off, after one collection before
    them: a collection costs what the whole heap holds (seconds in a process that has
    run much else, a test run), not what the timed code does."""
    gc.collect()
    with collector_paused():
        yield


def best_of(fn: Callable[[], Any], repeats: int = 3) -> float:
    """Median wall time of fn() over repeats (seconds), the collector off."""
    times = []
    with no_collection():
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def loader_epoch(loader: Iterable[Any]) -> int:
    """Runs one epoch of dict batches; returns the samples it held."""
    return sum(len(b["label"] if "label" in b else next(iter(b.values()))) for b in loader)


def first_batch_ms(loader: Iterable[Any]) -> float:
    """Time from a fresh iteration of ``loader`` to its first batch (buffers, threads
    or worker processes starting included); the rest of that epoch is then drained."""
    t0 = time.perf_counter()
    it = iter(loader)
    next(it)
    took = (time.perf_counter() - t0) * 1000
    for _ in it:
        pass
    return round(took, 1)


def interleaved(
    fns: dict[str, Callable[[], Any]], rounds: int, min_run_s: float = 0.25
) -> dict[str, float]:
    """Median seconds per call of each fn, timed in rounds that take each fn in turn.

    Each fn is called once untimed (caches, buffers, threads warm) and given
    enough calls per timed run to last ``min_run_s``: single epochs of a small
    archive last milliseconds, less than this machine's moment-to-moment
    jitter. Running every fn once per round, ``rounds`` times, makes a slow
    drift of the machine (a busy neighbour) fall on all of them alike, so
    ratios between them hold even when absolute rates move.
    """
    calls = {}
    for name, fn in fns.items():
        fn()
        t0 = time.perf_counter()
        fn()
        once = max(time.perf_counter() - t0, 1e-6)
        calls[name] = max(1, math.ceil(min_run_s / once))
    per_call: dict[str, list[float]] = {name: [] for name in fns}
    with no_collection():
        for _ in range(max(1, rounds)):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                for _ in range(calls[name]):
                    fn()
                per_call[name].append((time.perf_counter() - t0) / calls[name])
    return {name: statistics.median(times) for name, times in per_call.items()}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine() -> dict[str, Any]:
    import os

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


def fmt(v: float | None, digits: int = 3) -> str:
    if v is None:
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}g}"


def print_table(rows: list[Row]) -> None:
    header = ["workload", "pipeline", "samples/s", "GB/s", "ratio", "vs", "notes"]
    lines = [header]
    for r in rows:
        notes = ", ".join(
            f"{k}={fmt(v) if isinstance(v, float) else v}" for k, v in r.extra.items()
        )
        lines.append(
            [
                r.workload,
                r.pipeline,
                fmt(r.samples_per_s),
                fmt(r.gb_per_s),
                f"{r.vs_baseline:.2f}x" if r.vs_baseline is not None else "-",
                r.baseline,
                notes,
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for n, line in enumerate(lines):
        print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


def write_json(rows: list[Row], path: Path, meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The printed table as Markdown, grouped by workload (rows as stored in results.json)."""
    lines = []
    current = None
    for r in rows:
        if r["workload"] != current:
            current = r["workload"]
            lines += [
                "",
                f"**{current}**",
                "",
                "| pipeline | samples/s | GB/s | ratio | notes |",
                "|---|---:|---:|---:|---|",
            ]
        ratio = (
            f"{r['vs_baseline']:.2f}x vs {r['baseline']}" if r["vs_baseline"] is not None else ""
        )
        notes = ", ".join(f"{k} {v}" for k, v in r["extra"].items())
        lines.append(
            f"| {r['pipeline']} | {fmt(r['samples_per_s'])} | {fmt(r['gb_per_s'])} | {ratio} | {notes} |"
        )
    return "\n".join(lines).strip() + "\n"

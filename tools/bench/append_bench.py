"""Growing an archive: what appending 1% of a corpus costs against compiling all of it.

Two ESC-50-shaped corpora of 5 s clips (ESC-50's length): ``--append-clips`` generated
clips (2,000 is ESC-50's size), and the same clips listed ``--append-times`` times over
(hard links to them, under names of their own). For each, an archive of its first 99% is
compiled once (untimed). Then, in interleaved rounds, with the same recipe and workers:

- ``whole``: a compile of the whole corpus into an empty folder;
- ``append``: ``--append`` of the whole corpus into a copy of the 99% archive (the copy
  made before the clock starts), which compiles the 1% it does not hold;
- ``fresh``: a compile of the appended 1% alone (a corpus of those clips only) into an
  empty folder: what those inputs cost with no archive to add to;
- ``listing``: the same ``--append`` once more, when the archive holds every input: what
  an append costs before it compiles anything.

The append and the fresh compile take a fraction of a second, and vary by more than that
from one try to the next on a shared machine: each round times them TRIES times each,
alternated, and takes their medians. ``append_vs_whole`` is the append's time over the
whole compile's, the median of the rounds' ratios with their range; 0.01 would be an
append that costs exactly its share of inputs. What is left above that is what every
compile pays whatever it compiles: starting and ending its worker processes and writing
its index, about a tenth of a second, which is most of an ESC-50-sized compile's 1%;
``append_vs_fresh`` (the append over the compile of its 1% alone) shows what an append
pays beyond it. An append lists only the CSV rows after those the archive listed
(docs/compile.md, "What it costs"): what it pays before it compiles anything
(``listing_vs_whole``) grows with the corpus only by hashing the CSV's earlier bytes
(to match the archive's record of them) and reading the archive's input identities (16
bytes an input). The larger corpus shows what is left once the fixed cost is small
beside the 1%.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import statistics
import time
from pathlib import Path

from dlop.compiler import compile_corpus
from dlop.compiler.recipe import build_recipe

from .common import Row
from .corpus import _write_csv, esc50_wavs, replicate, subset

SHARE = 0.01  # of the corpus appended
TRIES = 3  # appends (and fresh compiles) a round, its time their median
SECONDS = 5.0  # each clip's length


def _listing(corpus: Path) -> list[tuple[str, str, str, str]]:
    lines = (corpus / "meta" / "esc50.csv").read_text().splitlines()[1:]
    return [tuple(line.split(",")[:4]) for line in lines]  # type: ignore[misc]


def run(work: Path, args: argparse.Namespace) -> list[Row]:
    clips, times = args.append_clips, max(1, args.append_times)
    corpus = work / "corpus"
    if not (corpus / "meta" / "esc50.csv").exists():
        esc50_wavs(corpus, clips, seconds=SECONDS)
    rows = _scale(work / "x1", corpus, "", args)
    if times > 1:
        larger = work / f"corpus-x{times}"
        if not (larger / "meta" / "esc50.csv").exists():
            replicate(corpus, larger, times)
        rows += _scale(work / f"x{times}", larger, f" ({clips} listed {times} times)", args)
    return rows


def _scale(work: Path, corpus: Path, note: str, args: argparse.Namespace) -> list[Row]:
    """The rows of one corpus: its whole compile, and the append of its last 1%."""
    rounds, workers = max(3, args.repeats), args.workers
    work.mkdir(parents=True, exist_ok=True)
    rows = _listing(corpus)
    recipe = build_recipe({"source": str(corpus), "duration": SECONDS})
    kept = len(rows) - max(1, round(len(rows) * SHARE))
    options = {"workers": workers, "progress": False, "overwrite": True}
    new = subset(corpus, work / "new", rows[kept:])  # the appended clips alone
    fresh = build_recipe({"source": str(new), "duration": SECONDS})
    _write_csv(corpus, rows[:kept])
    try:
        compile_corpus(recipe, work / "part", **options)
    finally:
        _write_csv(corpus, rows)
    took: dict[str, list[float]] = {"whole": [], "append": [], "listing": [], "fresh": []}

    # each timed step starts with no writes of the setup before it pending (os.sync): the
    # copy of the archive an append adds to is as large as the archive (4 GB at 80,000
    # clips), and its write-back is the bench's setup, not the append's cost
    def appended() -> float:
        shutil.rmtree(work / "grown", ignore_errors=True)
        shutil.copytree(work / "part", work / "grown")
        os.sync()
        t0 = time.perf_counter()
        compile_corpus(recipe, work / "grown", workers=workers, progress=False, append=True)
        return time.perf_counter() - t0

    def compiled_fresh() -> float:
        shutil.rmtree(work / "fresh", ignore_errors=True)
        os.sync()
        t0 = time.perf_counter()
        compile_corpus(fresh, work / "fresh", **options)
        return time.perf_counter() - t0

    for r in range(rounds):
        shutil.rmtree(work / "whole", ignore_errors=True)
        os.sync()
        t0 = time.perf_counter()
        compile_corpus(recipe, work / "whole", **options)
        took["whole"].append(time.perf_counter() - t0)
        # the append and the fresh compile a few times each, alternated (which goes first
        # alternating by round): a fraction of a second each, they vary by more than their
        # difference from one try to the next on a shared machine
        tries: dict[str, list[float]] = {"append": [], "fresh": []}
        for k in range(2 * TRIES):
            what = ("append", "fresh")[(k + r) % 2]
            tries[what].append(appended() if what == "append" else compiled_fresh())
        for what, times in tries.items():
            took[what].append(statistics.median(times))
        t0 = time.perf_counter()  # again: every input held, nothing compiled or written
        with contextlib.redirect_stderr(io.StringIO()):
            compile_corpus(recipe, work / "grown", workers=workers, progress=False, append=True)
        took["listing"].append(time.perf_counter() - t0)
    ratios = [a / w for a, w in zip(took["append"], took["whole"], strict=True)]
    by_fresh = [a / f for a, f in zip(took["append"], took["fresh"], strict=True)]
    workload = (
        f"grow an archive: {len(rows)} ESC-50-shaped clips of {SECONDS:g} s{note}, "
        f"{workers} workers"
    )
    whole = Row(
        workload, "compile of the whole corpus", len(rows) / statistics.median(took["whole"])
    )
    added = len(rows) - kept
    append = Row(
        workload,
        f"--append of the last {added} clip{'s' * (added != 1)} ({SHARE:.0%}) to the archive "
        "of the rest",
        added / statistics.median(took["append"]),
    )
    append.extra = {
        "append_vs_whole": {
            "median": round(statistics.median(ratios), 4),
            "range": [round(min(ratios), 4), round(max(ratios), 4)],
        },
        "inputs_share": round(added / len(rows), 4),
        # the append over a compile of its inputs alone: what adding to an archive costs
        # beyond compiling what is added (listing the corpus, reading the archive)
        "append_vs_fresh": {
            "median": round(statistics.median(by_fresh), 3),
            "range": [round(min(by_fresh), 3), round(max(by_fresh), 3)],
        },
        # what an append pays before it compiles anything (listing the corpus, reading the
        # archive's identities), over the whole compile: the part of append_vs_whole that
        # grows with the corpus, not with what is appended
        "listing_vs_whole": round(
            statistics.median(a / w for a, w in zip(took["listing"], took["whole"], strict=True)),
            4,
        ),
        "seconds": {k: [round(t, 3) for t in v] for k, v in took.items()},
    }
    return [whole, append]

"""dlop-bench: every figure measured in the run that prints it."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from dlop.formats.extras import MissingExtraError

from .common import Row, machine, markdown_table, peak_rss_mib, print_table, write_json

if TYPE_CHECKING:
    from .compile_bench import Made


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _train(work: Path, args: argparse.Namespace) -> list[Row]:
    from .train import prepare, sources, train_rows, workload

    print("== train", file=sys.stderr, flush=True)
    corpus, archive = prepare(work, max(args.train_batch * 8, 200), args.workers)
    return train_rows(
        workload(args.train_batch, args.device),
        sources(corpus, archive, args.train_batch, args.workers, args.device),
        args.train_steps,
        args.device,
        num_classes=5,
        warmup=args.train_warmup,
    )


class _Run:
    """One dlop-bench run: its scratch folder, its arguments, and the compile
    section's output, which the runtime section reads."""

    def __init__(self, work: Path, args: argparse.Namespace) -> None:
        self.work = work
        self.args = args
        self._compiled: tuple[list[Row], Made] | None = None

    def compiled(self) -> tuple[list[Row], Made]:
        if self._compiled is None:
            from . import compile_bench

            a = self.args
            self._compiled = compile_bench.run(
                self.work / "compile", a.clips, a.scale, a.workers, a.repeats
            )
        return self._compiled


def _format(run: _Run) -> list[Row]:
    from . import format_bench

    a = run.args
    return format_bench.run(run.work / "format", a.raw_gib, a.zstd_samples, a.repeats)


def _compile(run: _Run) -> list[Row]:
    return run.compiled()[0]


def _runtime(run: _Run) -> list[Row]:
    from . import runtime_bench

    made = run.compiled()[1]
    a = run.args
    return runtime_bench.run(
        run.work / "runtime",
        made.archive,
        made.corpus,
        made.naive_rate,
        a.workers,
        a.repeats,
        a.speech_utts,
        [float(x) for x in a.memory_gib.split(",") if x],
    )


def _vision(run: _Run) -> list[Row]:
    from . import vision_bench

    a = run.args
    return vision_bench.run(
        run.work / "vision", a.videos, a.images, a.workers, a.repeats, a.vision_mib
    )


def _module(name: str) -> Callable[[_Run], list[Row]]:
    """The section whose module ``<name>_bench`` has ``run(work, args) -> list[Row]``."""

    def section(run: _Run) -> list[Row]:
        module = importlib.import_module(f"{__package__}.{name}_bench")
        rows: list[Row] = module.run(run.work / name, run.args)
        return rows

    return section


def _peers(run: _Run) -> list[Row]:
    from . import budget_bench, peer_rows, shuffle_bench, speech_peers

    a = run.args
    rows = peer_rows.run(run.work / "peers", a.peer_samples, a.workers, a.repeats)
    rows += speech_peers.run(
        run.work / "speech-peers", a.peer_utts, a.workers, a.repeats, a.short_utts
    )
    rows += budget_bench.run(run.work / "budget-peers", a)
    return rows + shuffle_bench.rows(with_streaming=True)


# Every section, in the order a run takes them; `--only` chooses among these names.
SECTIONS: dict[str, Callable[[_Run], list[Row]]] = {
    "format": _format,
    "compile": _compile,
    "runtime": _runtime,
    "vision": _vision,
    "select": _module("select"),
    "sources": _module("sources"),
    "remote": _module("remote"),
    "scaling": _module("scaling"),
    "startup": _module("startup"),
    "custom": _module("custom"),
    "short": _module("short"),
    "small": _module("small"),
    "append": _module("append"),
    "fields": _module("fields"),
    "resume": _module("resume"),
    "budget": _module("budget"),
    "shuffle": _module("shuffle"),
    "peers": _peers,
}
# peers needs LitData, MosaicML Streaming, Lhotse and datasets, which only `make bench-peers` installs
DEFAULT_SECTIONS = tuple(name for name in SECTIONS if name != "peers")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dlop-bench", description=__doc__)
    p.add_argument(
        "--only",
        nargs="*",
        choices=list(SECTIONS),
        help=f"run only these sections (default: {' '.join(DEFAULT_SECTIONS)})",
    )
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="where results.json goes")
    p.add_argument(
        "--workdir", type=Path, help="scratch space for generated archives (default: a temp dir)"
    )
    p.add_argument("--raw-gib", type=float, default=1.0, help="size of the raw format archive")
    p.add_argument("--zstd-samples", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--clips", type=int, default=2000, help="ESC-50-shaped clips to compile and load"
    )
    p.add_argument(
        "--scale", type=int, default=10, help="compile-memory corpus, as a multiple of --clips"
    )
    p.add_argument("--speech-utts", type=int, default=4000, help="ragged speech utterances")
    p.add_argument("--memory-gib", default="1,10", help="archive sizes for the Loader memory check")
    p.add_argument(
        "--peer-samples", type=int, default=2000, help="ESC-50-shaped samples in the peers section"
    )
    p.add_argument(
        "--peer-utts",
        type=int,
        default=400,
        help="speech utterances (0.5-30 s) for Lhotse and datasets in the peers section",
    )
    p.add_argument(
        "--short-utts",
        type=int,
        default=3000,
        help="short speech utterances (0.5-8 s, mostly 1 s) in the short and peers sections",
    )
    p.add_argument(
        "--small-samples",
        type=int,
        default=1_000_000,
        help="16-byte samples in the small section's archives (about 1,000 shards and 10)",
    )
    p.add_argument(
        "--append-clips",
        type=int,
        default=2000,
        help="5 s clips of the append section's corpus (1%% of them appended)",
    )
    p.add_argument(
        "--append-times",
        type=int,
        default=10,
        help="the append section's larger corpus: its clips listed this many times over",
    )
    p.add_argument(
        "--budget-utts",
        type=int,
        default=2472,
        help="short utterances in the budget section (its wide archive holds 3 in 5 as many)",
    )
    p.add_argument(
        "--resume-samples",
        type=int,
        default=1_000_000,
        help="small samples in the resume section's archive (a state moved to another world)",
    )
    p.add_argument(
        "--listing-lines",
        type=int,
        action="append",
        help="manifest lines the scaling section lists (repeatable; default: 1 and 10 million)",
    )
    p.add_argument("--videos", type=int, default=96, help="H.264 clips in the video workload")
    p.add_argument("--images", type=int, default=128, help="JPEG + 2 masks in the image workload")
    p.add_argument(
        "--vision-mib", type=int, default=512, help="archive size the video/image Loader rows read"
    )
    p.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="worker processes (default: cores)"
    )
    p.add_argument(
        "--train",
        action="store_true",
        help="instead: train a ResNet18-style CNN fed naively and by dlop; report samples/s and data wait",
    )
    p.add_argument(
        "--custom-items", type=int, default=20000, help="inputs of the cheap user function"
    )
    p.add_argument(
        "--custom-clips", type=int, default=120, help="5 s clips for the CQT function (0: none)"
    )
    p.add_argument("--train-steps", type=int, default=8, help="timed training steps per source")
    p.add_argument("--train-warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--train-batch", type=int, default=32)
    p.add_argument("--device", default="cuda" if _cuda() else "cpu")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # every section writes, decodes or draws media: a missing module is told before any runs
    for module in ("soundfile", "av", "PIL", "matplotlib"):
        if importlib.util.find_spec(module) is None:
            parser.error(str(MissingExtraError("benchmarking", module, "compile")))
    if args.workdir is not None:  # made, as --out is
        try:
            args.workdir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            parser.error(f"--workdir {args.workdir}: {e.strerror or e}")
    rows: list[Row] = []
    started = time.time()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        run = _Run(Path(tmp), args)
        if args.train:
            rows += _train(run.work, args)
        else:
            chosen = set(args.only or DEFAULT_SECTIONS)
            for name, section in SECTIONS.items():
                if name in chosen:
                    print(f"== {name}", file=sys.stderr, flush=True)
                    rows += section(run)
    print_table(rows)
    meta = {
        **machine(),
        "date": time.strftime("%Y-%m-%d"),
        "seconds": round(time.time() - started, 1),
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "command": "dlop-bench " + " ".join(argv or sys.argv[1:]),
    }
    write_json(rows, args.out / "results.json", meta)
    (args.out / "results.md").write_text(markdown_table([asdict(r) for r in rows]))
    from .chart import draw

    draw(
        [asdict(r) for r in rows],
        args.out / "results.png",
        f"dlop-bench, {meta['date']}, {meta['cpus']} CPUs ({meta['platform']})",
    )
    print(
        f"\nmachine: {meta['platform']}, {meta['cpus']} CPUs; {meta['seconds']} s; results in {args.out / 'results.json'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

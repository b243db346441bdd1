"""dlop-bench: every figure measured in the run that prints it."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from .common import Row, machine, markdown_table, peak_rss_mib, print_table, write_json

SECTIONS = ("format", "compile", "runtime", "vision", "peers")
# peers needs LitData and MosaicML Streaming, which only `make bench-peers` installs
DEFAULT_SECTIONS = ("format", "compile", "runtime", "vision")


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _train(work: Path, args: argparse.Namespace) -> list[Row]:
    from dlop.compiler.demo import DEMO_RECIPE
    from dlop.compiler.pipeline import compile_corpus
    from dlop.compiler.recipe import build_recipe
    from dlop.runtime import Loader

    from .corpus import esc50_wavs
    from .naive import naive_loader
    from .train import train_rows

    print("== train", file=sys.stderr, flush=True)
    clips = max(args.train_batch * (args.train_steps + 1), 200)
    corpus = esc50_wavs(work / "esc", clips)
    recipe = build_recipe({**DEMO_RECIPE, "source": str(corpus)})
    compile_corpus(recipe, work / "archive", workers=args.workers, progress=False)
    sources = {
        f"naive DataLoader ({args.workers} workers)": lambda: naive_loader(
            corpus, args.train_batch, args.workers
        ),
        "dlop Loader": lambda: Loader(
            work / "archive",
            args.train_batch,
            seed=0,
            fields=["logmel", "label"],
            device=args.device if args.device.startswith("cuda") else None,
        ),
    }
    workload = (
        f"train: ResNet18-style CNN on [431, 128] log-mels, batch {args.train_batch}, {args.device}"
        f"{' (channels-last, bf16 autocast)' if args.device.startswith('cuda') else ''}"
    )
    return train_rows(workload, sources, args.train_steps, args.device, num_classes=5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dlop-bench", description=__doc__)
    p.add_argument(
        "--only",
        nargs="*",
        choices=SECTIONS,
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
    p.add_argument("--train-steps", type=int, default=8)
    p.add_argument("--train-batch", type=int, default=32)
    p.add_argument("--device", default="cuda" if _cuda() else "cpu")
    args = p.parse_args(argv)
    sections = args.only or list(DEFAULT_SECTIONS)
    rows: list[Row] = []
    started = time.time()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        if args.train:
            rows += _train(work, args)
            sections = []
        if "format" in sections:
            from . import format_bench

            print("== format", file=sys.stderr, flush=True)
            rows += format_bench.run(work / "format", args.raw_gib, args.zstd_samples, args.repeats)
        if "compile" in sections or "runtime" in sections:
            from . import compile_bench

            print("== compile", file=sys.stderr, flush=True)
            compile_rows, made = compile_bench.run(
                work / "compile", args.clips, args.scale, args.workers
            )
            if "compile" in sections:
                rows += compile_rows
            if "runtime" in sections:
                from . import runtime_bench

                print("== runtime", file=sys.stderr, flush=True)
                rows += runtime_bench.run(
                    work / "runtime",
                    made["archive"],
                    made["corpus"],
                    made["naive_rate"],
                    args.workers,
                    args.repeats,
                    args.speech_utts,
                    [float(x) for x in args.memory_gib.split(",") if x],
                )
        if "vision" in sections:
            from . import vision_bench

            print("== vision", file=sys.stderr, flush=True)
            rows += vision_bench.run(
                work / "vision",
                args.videos,
                args.images,
                args.workers,
                args.repeats,
                args.vision_mib,
            )
        if "peers" in sections:
            from . import peer_rows

            print("== peers", file=sys.stderr, flush=True)
            rows += peer_rows.run(work / "peers", args.peer_samples, args.workers, args.repeats)
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

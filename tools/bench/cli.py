"""dlop-bench: every figure measured in the run that prints it."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from .common import Row, machine, peak_rss_mib, print_table, write_json

SECTIONS = ("format",)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dlop-bench", description=__doc__)
    p.add_argument("--only", nargs="*", choices=SECTIONS, help="run only these sections")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="where results.json goes")
    p.add_argument(
        "--workdir", type=Path, help="scratch space for generated archives (default: a temp dir)"
    )
    p.add_argument("--raw-gib", type=float, default=1.0, help="size of the raw format archive")
    p.add_argument("--zstd-samples", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    sections = args.only or list(SECTIONS)
    rows: list[Row] = []
    started = time.time()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        if "format" in sections:
            from . import format_bench

            print("== format", file=sys.stderr, flush=True)
            rows += format_bench.run(work / "format", args.raw_gib, args.zstd_samples, args.repeats)
    print_table(rows)
    meta = {
        **machine(),
        "date": time.strftime("%Y-%m-%d"),
        "seconds": round(time.time() - started, 1),
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "command": "dlop-bench " + " ".join(argv or sys.argv[1:]),
    }
    write_json(rows, args.out / "results.json", meta)
    print(
        f"\nmachine: {meta['platform']}, {meta['cpus']} CPUs; {meta['seconds']} s; results in {args.out / 'results.json'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

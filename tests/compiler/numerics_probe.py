"""Compiles archives as a test asks and prints each one's shard bytes digest (JSON).

Run in a subprocess per simulated CPU code path (MKL_CBWR, ATEN_CPU_CAPABILITY set
in its environment): ``python -m tests.compiler.numerics_probe PLAN.json``, PLAN
a list of ``{"name": ..., "args": [dlop-compile arguments]}``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from dlop.tools.compile_cli import main as compile_main


def shard_digest(out: Path) -> str:
    h = hashlib.sha256()
    shards = sorted(out.glob("*.dlop"))
    assert shards, f"{out}: no shards"
    for p in shards:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def run(plan: list[dict[str, object]]) -> dict[str, str]:
    digests = {}
    for entry in plan:
        args = [str(a) for a in entry["args"]]  # type: ignore[attr-defined]
        if compile_main([*args, "-q"]) != 0:
            raise SystemExit(f"{entry['name']}: dlop-compile {' '.join(args)} failed")
        digests[str(entry["name"])] = shard_digest(Path(args[args.index("-o") + 1]))
    return digests


if __name__ == "__main__":
    print(json.dumps(run(json.loads(Path(sys.argv[1]).read_text()))))

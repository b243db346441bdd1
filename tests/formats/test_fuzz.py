"""Property test: structurally mutated archives open cleanly or raise a DlopError.

The hypothesis run (fuzz_archive.py) happens in a child process with a capped
address space and a timeout, so a hang or a runaway allocation fails the test
rather than the machine. Mutants are read through dlop.formats, dlop-inspect's
summary and the runtime's open_archive (samples and batches); mutations reach
index.json, shard headers, region contents and errors.jsonl. ``make fuzz`` runs
many more examples (DLOP_FUZZ_EXAMPLES).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("fuzz_archive.py")
EXAMPLES = int(os.environ.get("DLOP_FUZZ_EXAMPLES", "300"))
# A generous bound (examples take milliseconds each): a hang shows up as a timeout.
TIMEOUT_S = max(120, EXAMPLES)


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_mutated_archives_fail_only_with_dlop_errors() -> None:
    examples, timeout = EXAMPLES, TIMEOUT_S
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "DLOP_FUZZ_EXAMPLES": str(examples)},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("FUZZ "))
    counts = json.loads(line[len("FUZZ ") :])
    assert counts["ok"] + counts["dlop"] >= 1, counts
    # The runtime read whole batches of some mutants; region and errors.jsonl edits were tried.
    assert min(counts["runtime_batches"], counts["region_edits"], counts["errors_edits"]) >= 1, (
        counts
    )

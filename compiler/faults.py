"""Fault-injection points, for the test suite only: each is an environment variable a
test sets to interrupt a compile at an exact moment. Unset (as always outside the
tests), every point is a dictionary lookup that does nothing.

- ``DLOP_TEST_KILL_AT=start|input:N|shard:N|unit:N|index|tidy|tidying|group published``:
  the compile (or add_fields) sends itself ``DLOP_TEST_SIGNAL`` (KILL, or e.g. STOP,
  INT) at that moment (``fault_at``), so the resume tests kill it between any two steps
  (docs/compile.md).
- ``DLOP_TEST_UNIT_DELAY="UNIT:SECONDS,..."``: those units start late (``unit_delay``).
- ``DLOP_TEST_KILL_WORKER="UNIT:INPUT:MARKER"``: the process running that unit kills
  itself after its INPUT-th input, once: whoever creates the MARKER file first
  (``worker_dies``).
"""

from __future__ import annotations

import os
import signal
import time

KILL_AT = "DLOP_TEST_KILL_AT"
SIGNAL = "DLOP_TEST_SIGNAL"
UNIT_DELAY = "DLOP_TEST_UNIT_DELAY"
KILL_WORKER = "DLOP_TEST_KILL_WORKER"


def fault_at(moment: str) -> None:
    """Signals this process when KILL_AT names this moment."""
    if os.environ.get(KILL_AT) == moment:
        os.kill(os.getpid(), getattr(signal, "SIG" + os.environ.get(SIGNAL, "KILL")))


def unit_delay(unit: int) -> None:
    """Sleeps as long as UNIT_DELAY asks for this unit."""
    for part in os.environ.get(UNIT_DELAY, "").split(","):
        if part.partition(":")[0] == str(unit):
            time.sleep(float(part.partition(":")[2]))


def worker_dies(unit: int, n: int) -> None:
    """Kills this process after input ``n`` of ``unit`` when KILL_WORKER names them, once."""
    spec = os.environ.get(KILL_WORKER, "").split(":", 2)
    if len(spec) == 3 and spec[:2] == [str(unit), str(n)]:
        try:
            os.close(os.open(spec[2], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # killed once already: the retried unit runs through
        os.kill(os.getpid(), signal.SIGKILL)

"""Memory readings from /proc (Linux)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path


def status_kib(field: str, pid: int | str = "self") -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def descendants(root: int) -> list[int]:
    """The pids of every process below ``root`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, stack = [], list(children.get(root, []))
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack += children.get(pid, [])
    return found


def tree_rss_kib(root: int) -> int:
    """VmRSS summed over a process and all its descendants."""
    return sum(status_kib("VmRSS", pid) for pid in [root, *descendants(root)])


class PeakSampler:
    """Polls a reading in a thread and keeps its maximum."""

    def __init__(self, read: Callable[[], int], interval: float = 0.05) -> None:
        self.read = read
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.read())
            time.sleep(self.interval)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.read())

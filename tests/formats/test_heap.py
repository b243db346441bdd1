"""A process that turns memory over in large blocks keeps what it frees (formats/heap.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dlop.formats.heap import is_glibc

GLIBC = is_glibc()

# A compile's turnover in one process: 40 blocks of 1 MiB (a group's decoded clips)
# written, all freed, and again; the page faults of the second and third rounds.
_TURNOVER = """
import ctypes, json, resource, sys
# 4 KiB pages only, so that faults count pages whatever the host's transparent huge pages
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
import numpy as np
from dlop.formats import heap
first = heap.keep_freed_memory() if sys.argv[1] == "keep" else False
again = heap.keep_freed_memory() if sys.argv[1] == "keep" else False
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [np.ones(1 << 18, np.float32) for _ in range(40)]
    del blocks
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": [first, again], "faults": faults[1:]}))
"""

PAGES = 40 * (1 << 20) // 4096  # what one round touches


def turnover(mode: str, env: dict[str, str]) -> dict[str, list[int]]:
    """_TURNOVER in a fresh process with environment ``env``."""
    out = subprocess.run(
        [sys.executable, "-c", _TURNOVER, mode], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, list[int]] = json.loads(out.stdout)
    return result


@pytest.mark.skipif(not GLIBC, reason="malloc's thresholds are glibc's")
@pytest.mark.parametrize("tunables", ["", "glibc.malloc.tcache_count=0"])
def test_freed_memory_is_reused_without_page_faults(
    malloc_env: dict[str, str], tunables: str
) -> None:
    env = {**malloc_env, "GLIBC_TUNABLES": tunables}  # tunables of other things: still kept
    plain = turnover("plain", env)
    kept = turnover("keep", env)
    assert kept["kept"] == [True, True]
    # glibc's adaptive thresholds give each round's 40 MiB back and fault it in again
    assert all(f >= PAGES // 2 for f in plain["faults"]), plain
    assert all(f < PAGES // 20 for f in kept["faults"]), kept


@pytest.mark.skipif(not GLIBC, reason="malloc's thresholds are glibc's")
@pytest.mark.parametrize(
    "env",
    [
        {"DLOP_MALLOC_TUNING": "0"},
        {"MALLOC_TRIM_THRESHOLD_": "131072"},
        {"MALLOC_MMAP_THRESHOLD_": "131072"},
        {"MALLOC_TOP_PAD_": "0"},
        {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0:glibc.malloc.trim_threshold=131072"},
        {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"},
    ],
)
def test_malloc_is_left_alone_when_the_environment_says_so(
    malloc_env: dict[str, str], env: dict[str, str]
) -> None:
    result = turnover("keep", {**malloc_env, **env})
    assert result["kept"] == [False, False]
    assert all(f >= PAGES // 2 for f in result["faults"]), result


_NO_PROGRAMS = """
import ctypes.util, subprocess, sys
def refused(*args, **kwargs):
    raise AssertionError(f"a program was run: {args!r}")
subprocess.Popen = refused  # what ctypes.util.find_library runs (ldconfig, gcc)
ctypes.util.find_library = refused
from dlop.formats import heap, writer
assert heap.libc() is not None and heap.libc().mallopt and heap.libc().madvise
print(writer._start_writeback is not None)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="sync_file_range is Linux's")
def test_the_c_library_is_found_without_running_a_program() -> None:
    """Each compile worker asks for the C library as it starts; finding it by name runs
    ``ldconfig -p``, a program start in every worker."""
    out = subprocess.run([sys.executable, "-c", _NO_PROGRAMS], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["True"], out.stderr

"""A pool worker's answer for a chunk reaches the driver in one atomic pipe write: a worker
killed while it answers (the OOM killer, say) leaves a whole answer or none, never half of
one that the pool's thread would wait on forever. Answers too long for that travel in the
chunk's file, and read back exactly; what a chunk raises is raised in the driver."""

from __future__ import annotations

import select
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dlop.compiler.run import pipeline

# A compile of samples whose arrays all stay in the answer itself (4,000 bytes each, under
# the size a worker spills to its chunk file: a chunk's answer is tens of KiB), in a
# process of its own (its workers fork from it, with the kill below), where any answer
# longer than PIPE_BUF, which the kernel may write in parts, is cut in half by a kill of
# the worker sending it.
TORN = """
import os, select, signal, struct, sys
import multiprocessing.queues
from multiprocessing.reduction import ForkingPickler

import numpy as np

from dlop.compiler import compile_map
from dlop.runtime import open_archive

def many_small(x):
    return {f"part{k}": np.full(1000, x * 10 + k, np.float32) for k in range(4)}

driver, put = os.getpid(), multiprocessing.queues.SimpleQueue.put

def torn(self, obj):  # what a pool worker answers through
    if os.getpid() != driver:
        data = bytes(ForkingPickler.dumps(obj))
        with open(sys.argv[2], "a") as f:
            f.write(f"{len(data)}\\n")
        if len(data) > select.PIPE_BUF:
            self._writer._send(struct.pack("!i", len(data)) + data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
    put(self, obj)

multiprocessing.queues.SimpleQueue.put = torn
compile_map(many_small, list(range(48)), sys.argv[1], workers=2, progress=False)
archive = open_archive(sys.argv[1])
for n in range(len(archive)):
    sample = archive[n]
    x = int(sample["part0"][0]) // 10
    for k in range(4):
        assert sample[f"part{k}"].numpy().tolist() == many_small(x)[f"part{k}"].tolist()
print(len(archive), "samples")
"""


def test_a_worker_killed_while_it_answers_never_stalls_the_compile(tmp_path: Path) -> None:
    """On answers longer than one atomic write, the compile (or its exit) waited forever."""
    script, sizes = tmp_path / "torn.py", tmp_path / "sizes"
    script.write_text(TORN)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out"), str(sizes)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["48", "samples"]
    written = [int(n) for n in sizes.read_text().split()]
    assert written and max(written) <= select.PIPE_BUF


class Unpicklable(Exception):
    def __reduce__(self) -> Any:
        raise TypeError("not this one")


class Unrebuilt(Exception):
    """Pickles, but its pickle cannot make it again (its __init__ takes two arguments)."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path}: {why}")


class Wordless(Exception):
    def __str__(self) -> str:
        raise ValueError("no words")


class Exits(Exception):
    def __reduce__(self) -> Any:
        raise SystemExit(3)


def _sent(error: BaseException, limit: int | None) -> bytes:
    try:
        raise error
    except BaseException as e:
        return pipeline._pickled_error(e, limit)


@pytest.mark.parametrize("limit", [None, pipeline.INLINE_ANSWER_BYTES])
@pytest.mark.parametrize(
    ("error", "kinds", "words"),
    [  # kinds: (what the driver raises with no limit, and within INLINE_ANSWER_BYTES)
        (OSError(28, "No space left on device", "/" + "x" * 9000), (OSError,) * 2, "No space"),
        (OSError(28, "No space left", "/" + "\U0001f600" * 3000), (OSError,) * 2, "No space"),
        (Unpicklable("why"), (RuntimeError,) * 2, "Unpicklable: why"),
        (Unrebuilt("a.wav", "bad"), (RuntimeError,) * 2, "Unrebuilt: a.wav: bad"),
        (Wordless(), (Wordless, Wordless), "Wordless"),
        (Exits(), (RuntimeError,) * 2, "could not send"),
        (ValueError("v" * 100_000), (ValueError, RuntimeError), "ValueError: vvv"),
    ],
)
def test_what_a_chunk_raised_reaches_the_driver_within_its_bound(
    tmp_path: Path, error: BaseException, kinds: tuple[type, type], words: str, limit: int | None
) -> None:
    blob = _sent(error, limit)
    if limit is not None:
        assert len(blob) <= limit
    with pytest.raises(BaseException) as raised:
        pipeline._received(pipeline.Answer(blob, None, -1, True), tmp_path)
    got = raised.value
    assert type(got) is kinds[limit is not None]
    assert words in pipeline._words(got)
    if words != "could not send":
        assert isinstance(got.__cause__, pipeline.RemoteTraceback)
        if limit is None:  # the worker's traceback (else its last lines)
            assert "raise error" in str(got.__cause__)


def test_an_error_kept_whole_where_there_is_room(tmp_path: Path) -> None:
    long = OSError(28, "No space left on device", "/" + "x" * 9000)
    with pytest.raises(OSError) as raised:
        pipeline._received(pipeline.Answer(_sent(long, None), None, -1, True), tmp_path)
    assert raised.value.filename == long.filename

"""The format layer's CRC-32 by carry-less multiplication gives zlib.crc32's values."""

from __future__ import annotations

import importlib
import threading
import zlib

import numpy as np
import pytest

from dlop.formats import crc

try:
    folding = importlib.import_module("dlop.formats._crc32")
except ImportError:
    folding = None

needs_folding = pytest.mark.skipif(
    folding is None or not folding.accelerated,
    reason="the compiled CRC-32 was not built, or this CPU has no PCLMULQDQ",
)

# every length around the folding's steps: under one 64-byte fold, whole folds, 16-byte
# tails, byte tails, and large buffers
LENGTHS = [*range(0, 200), 255, 256, 1023, 4095, 4096, 4097, 110_250, (1 << 20) + 13]


@needs_folding
def test_the_format_layer_uses_the_folding_where_the_cpu_has_it() -> None:
    assert folding is not None and crc.crc32 is folding.crc32


@needs_folding
def test_folding_matches_zlib_for_every_length_start_and_alignment() -> None:
    assert folding is not None
    rng = np.random.default_rng(3)
    data = rng.bytes(max(LENGTHS) + 16)
    view = memoryview(data)
    for n in LENGTHS:
        for shift in (0, 1, 7) if n < 4096 else (0, 3):  # unaligned starts
            part = view[shift : shift + n]
            for start in (0, 1, 0xFFFFFFFF, 0x1234ABCD):
                assert folding.crc32(part, start) == zlib.crc32(part, start), (n, shift, start)
    assert folding.crc32(b"") == 0 and folding.crc32(b"", 77) == 77
    # in pieces, each continuing the last: the same as the whole
    whole = view[:100_003]
    running = 0
    for a in range(0, len(whole), 777):
        running = folding.crc32(whole[a : a + 777], running)
    assert running == zlib.crc32(whole)


@needs_folding
def test_folding_takes_what_zlib_takes_and_refuses_what_it_refuses() -> None:
    assert folding is not None
    values = np.random.default_rng(1).standard_normal((300, 7)).astype(np.float16)
    assert folding.crc32(values.data) == zlib.crc32(values.data)
    assert folding.crc32(bytearray(b"abc")) == zlib.crc32(b"abc") == 0x352441C2
    strided = values[:, ::2]
    with pytest.raises(BufferError):
        zlib.crc32(strided.data)
    with pytest.raises(BufferError):
        folding.crc32(strided.data)
    with pytest.raises(TypeError):
        folding.crc32("text")  # type: ignore[arg-type]
    # a start value wraps to 32 bits, as zlib's does
    assert folding.crc32(b"x", -1) == zlib.crc32(b"x", -1) == folding.crc32(b"x", 0xFFFFFFFF)


@needs_folding
def test_folding_runs_in_threads_at_once() -> None:
    assert folding is not None
    rng = np.random.default_rng(5)
    buffers = [rng.bytes(1 << 20) for _ in range(4)]
    want = [zlib.crc32(b) for b in buffers]
    got: list[list[int]] = [[] for _ in buffers]

    def run(i: int) -> None:
        for _ in range(20):
            got[i].append(folding.crc32(buffers[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(buffers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [[w] * 20 for w in want]

"""CRC-32 (zlib's), fast where the CPU allows, and its composition.

``crc32`` is zlib.crc32 (the same values), by carry-less multiplication where
the format layer's compiled module was built and the CPU has PCLMULQDQ (about
3.5x zlib 1.2's speed on 110 KB payloads), else zlib's own (zlib-ng's folds
already).

``crc32_combine`` gives the CRC of A+B from crc(A), crc(B) and len(B). It lets
a writer checksum a whole shard from the checksums of its parts without
reading the parts again. The method is the GF(2) operator squaring of
zlib's crc32_combine: appending n zero bits to a message multiplies its CRC
register by a fixed 32x32 bit matrix, raised to the n-th power by squaring.
"""

from __future__ import annotations

import functools
import importlib
import zlib
from types import ModuleType
from typing import Protocol


class _Crc32(Protocol):
    def __call__(self, data: bytes | bytearray | memoryview, crc: int = 0, /) -> int: ...


_folding: ModuleType | None
try:
    _folding = importlib.import_module("._crc32", __package__)
except ImportError:  # built without a C compiler
    _folding = None

# zlib-ng (some distributions' zlib) folds with carry-less multiplication itself
_ZLIB_FOLDS = "ng" in zlib.ZLIB_RUNTIME_VERSION
crc32: _Crc32 = (
    _folding.crc32
    if _folding is not None and _folding.accelerated and not _ZLIB_FOLDS
    else zlib.crc32
)
"""``crc32(data, crc)``: zlib.crc32's value, by the fastest way this machine has."""

_POLY = 0xEDB88320  # reflected CRC-32 polynomial (SPEC.md section 5)


def _times(matrix: list[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _square(matrix: list[int]) -> list[int]:
    return [_times(matrix, matrix[n]) for n in range(32)]


@functools.cache
def _byte_powers() -> tuple[list[int], ...]:
    """Operator k appends 2**k zero bytes to a message (k < 64), made once."""
    odd = [_POLY] + [1 << (n - 1) for n in range(1, 32)]  # one zero bit
    m = _square(_square(_square(odd)))  # eight zero bits: one byte
    powers = [m]
    for _ in range(63):
        powers.append(_square(powers[-1]))
    return tuple(powers)


def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """zlib.crc32(a + b) given zlib.crc32(a), zlib.crc32(b) and len(b)."""
    if len_b <= 0:
        return crc_a
    powers = _byte_powers()
    k = 0
    while len_b:
        if len_b & 1:
            crc_a = _times(powers[k], crc_a)
        len_b >>= 1
        k += 1
    return crc_a ^ crc_b


def crc32_zeros(n: int) -> int:
    """zlib.crc32(bytes(n)) for padding, without allocating large buffers."""
    return (
        zlib.crc32(bytes(min(n, 1 << 16)))
        if n <= 1 << 16
        else crc32_combine(crc32_zeros(n - (1 << 16)), zlib.crc32(bytes(1 << 16)), 1 << 16)
    )

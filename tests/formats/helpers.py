"""Shared fixtures for format tests: a small mixed-schema shard and header surgery."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from dlop.formats import Field, ShardWriter, Zstd
from dlop.formats.constants import ALIGNMENT, PREAMBLE

MIXED_FIELDS = [
    Field("feat", "f16", (3, 5)),
    Field("label", "i64", ()),
    Field("rag", "f32", (None, 2)),
    Field("zfix", "i16", (4,), codec=Zstd(block_bytes=40)),
    Field("zrag", "f32", (None,), codec=Zstd(block_bytes=64, shuffle=True)),
    Field.str_("text"),
    Field.bytes_("blob", codec=Zstd(block_bytes=16)),
]


def mixed_sample(i: int) -> dict[str, Any]:
    return {
        "feat": np.arange(15, dtype=np.float16).reshape(3, 5) + i,
        "label": i,
        "rag": np.arange(2 * (i % 4), dtype=np.float32).reshape(-1, 2) * (i + 1),
        "zfix": np.arange(4, dtype=np.int16) * i,
        "zrag": np.linspace(0, i, i % 5, dtype=np.float32),
        "text": f"sample {i} ✓",
        "blob": bytes(range(i % 7)),
    }


def write_mixed(path: Path, n: int = 12) -> list[dict[str, Any]]:
    samples = [mixed_sample(i) for i in range(n)]
    with ShardWriter(path, MIXED_FIELDS) as w:
        w.write_many(samples)
    return samples


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    data = path.read_bytes()
    _, _, _, hlen = PREAMBLE.unpack_from(data)
    return json.loads(data[24 : 24 + hlen]), hlen


def rewrite_header(path: Path, header: dict[str, Any], *, fix_crc: bool = True) -> None:
    """Replaces the JSON header in place (it must still fit before the first region)."""
    data = bytearray(path.read_bytes())
    _, _, _, hlen = PREAMBLE.unpack_from(data)
    body = json.dumps(header, separators=(",", ":")).encode()
    first_region = -(-(24 + hlen) // ALIGNMENT) * ALIGNMENT
    assert 24 + len(body) <= first_region, "edited header no longer fits"
    data[24:first_region] = body + bytes(first_region - 24 - len(body))
    crc = zlib.crc32(body) if fix_crc else 0
    struct.pack_into("<IQ", data, 12, crc, len(body))
    path.write_bytes(bytes(data))


def assert_value_equal(got: Any, want: Any, field: Field) -> None:
    if field.kind == "str":
        assert got == want
    elif field.kind == "bytes":
        assert got == bytes(want)
    else:
        want_arr = np.asarray(want)
        if field.dtype != "bf16":
            want_arr = want_arr.astype(field.np_dtype)
        assert got.shape == want_arr.shape
        assert got.dtype == field.np_dtype
        assert got.tobytes() == want_arr.tobytes()

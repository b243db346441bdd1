"""The shard writer takes values already in their stored form without re-encoding them,
and writes the same bytes as for values it has to convert."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlop.formats import Field, SchemaError, ShardReader, ShardWriter, Zstd
from dlop.formats import writer as writer_module

FIELDS = [
    Field.str_("key"),
    Field("feat", "f16", (3, 4)),
    Field("label", "i64", ()),
    Field("code", "i32", ()),
    Field("wave", "f32", (None,)),
    Field("blob", "f32", (2, 2), codec=Zstd(level=1, block_bytes=16)),
    Field.bytes_("raw"),
]


def stored(i: int) -> dict[str, Any]:
    """Values in exactly their stored dtype and shape."""
    rng = np.random.default_rng(i)
    return {
        "key": f"clip-{i}-é",
        "feat": rng.standard_normal((3, 4)).astype(np.float16),
        "label": i - 2,
        "code": np.int32(i),
        "wave": rng.standard_normal(i + 1).astype(np.float32),
        "blob": rng.integers(-8, 8, (2, 2)).astype(np.float32),  # exact in f16 too
        "raw": bytes([i]) * i,
    }


def converted(i: int) -> dict[str, Any]:
    """The same values in forms the writer has to convert."""
    s = stored(i)
    return {
        **s,
        "feat": np.asfortranarray(s["feat"]),  # not C-contiguous
        "label": np.int64(s["label"]),
        "blob": s["blob"].astype(np.float16),  # cast up to f32
        "wave": s["wave"].tolist(),
        # every other byte of twice the bytes: a strided view, not C-contiguous
        "raw": memoryview(np.frombuffer(bytes([i]) * (2 * i), np.uint8)[::2]),
    }


def test_stored_values_skip_encode_value_and_write_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with ShardWriter(tmp_path / "slow.dlop", FIELDS) as w:
        for i in range(5):
            w.write(converted(i))
    real = writer_module.encode_value
    calls: list[str] = []

    def counting(f: Field, value: Any, index: int) -> tuple[bytes, tuple[int, ...]]:
        calls.append(f.name)
        return real(f, value, index)

    monkeypatch.setattr(writer_module, "encode_value", counting)
    with ShardWriter(tmp_path / "fast.dlop", FIELDS) as w:
        for i in range(5):
            w.write(stored(i))
    # Only the fields whose values are not already raw bytes of their stored form:
    # i32 scalars from numpy scalars, ragged arrays and bytes.
    assert set(calls) == {"code", "wave", "raw"}
    assert (tmp_path / "fast.dlop").read_bytes() == (tmp_path / "slow.dlop").read_bytes()
    with ShardReader(tmp_path / "fast.dlop") as r:
        assert r.get("key", 3) == "clip-3-é"
        assert int(r.get("label", 0)) == -2


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("label", "3", "field 'label': cannot store <U1 values as i64"),
        ("label", 2.5, "field 'label': cannot store float64 values as i64"),
        ("feat", np.zeros((4, 3), np.float16), "field 'feat': shape [4, 3] does not fit [3, 4]"),
        ("key", b"bytes", "field 'key': expected str, got bytes"),
    ],
)
def test_values_off_the_fast_path_keep_their_errors(
    tmp_path: Path, name: str, value: Any, message: str
) -> None:
    sample = {**stored(1), name: value}
    with ShardWriter(tmp_path / "s.dlop", FIELDS) as w:
        with pytest.raises(SchemaError, match=re.escape(message)):
            w.write(sample)
        w.write(stored(1))  # a refused sample leaves nothing half-written
        assert w.num_samples == 1

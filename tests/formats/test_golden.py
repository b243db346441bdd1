"""The committed golden v1 archive keeps reading, and the writer still produces its bytes.

Regenerate only with a format version bump: ``python -m tests.formats.test_golden``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from dlop.formats import ArchiveReader, ArchiveWriter, Field, ShardWriter, Zstd

GOLDEN = Path(__file__).parent / "golden_v1"

# Frozen: the golden archive was written from exactly these definitions.
GOLDEN_FIELDS = [
    Field("logmel", "f16", (4, 6), meaning="log-mel", units="dB"),
    Field("label", "i64", ()),
    Field("frames", "f32", (None, 3), codec=Zstd(level=3, block_bytes=48, shuffle=True)),
    Field("clip", "u8", (2, None, None, 3)),
    Field("mask", "bool", (2, 2), codec=Zstd(level=1, block_bytes=8)),
    Field("w", "bf16", (2,)),
    Field.str_("text"),
    Field.bytes_("raw", codec=Zstd(level=5, block_bytes=10)),
]


def golden_sample(i: int) -> dict[str, Any]:
    return {
        "logmel": (np.arange(24, dtype=np.float32).reshape(4, 6) * 0.5 - i).astype(np.float16),
        "label": i * 7 - 3,
        "frames": np.sin(np.arange(3 * (i % 5), dtype=np.float32)).reshape(-1, 3),
        "clip": (np.arange(2 * (i % 3) * 2 * 3) % 251).astype(np.uint8).reshape(2, i % 3, 2, 3),
        "mask": np.array([[i % 2, 1], [0, (i + 1) % 2]], dtype=bool),
        "w": np.array([0x3F80 + i, 0xBF80], np.uint16),
        "text": f"golden {i} — ünïcode",
        "raw": bytes((i * 13 + j) % 256 for j in range(i % 6)),
    }


N = 9


def write_golden(path: Path) -> None:
    with ArchiveWriter(
        path,
        GOLDEN_FIELDS,
        shard_bytes=600,
        recipe={"golden": True},
        provenance={"source": {"kind": "golden-v1"}},
    ) as w:
        for i in range(N):
            w.write(golden_sample(i))


def test_golden_archive_reads(tmp_path: Path) -> None:
    r = ArchiveReader(GOLDEN)
    assert len(r) == N and r.num_shards >= 2
    assert tuple(r.fields.values()) == tuple(GOLDEN_FIELDS)
    for i in range(N):
        want = golden_sample(i)
        got = r.sample(i)
        for f in GOLDEN_FIELDS:
            if f.kind == "array":
                assert (
                    got[f.name].tobytes() == np.asarray(want[f.name]).astype(f.np_dtype).tobytes()
                )
                assert got[f.name].shape == np.asarray(want[f.name]).shape
            else:
                assert got[f.name] == want[f.name]
    assert r.verify() == []


def test_writer_reproduces_golden_shard_bytes(tmp_path: Path) -> None:
    r = ArchiveReader(GOLDEN)
    first = r.index.shards[0]
    with ShardWriter(tmp_path / first.file, GOLDEN_FIELDS) as w:
        for i in range(first.num_samples):
            w.write(golden_sample(i))
    assert (tmp_path / first.file).read_bytes() == (GOLDEN / first.file).read_bytes()


if __name__ == "__main__":
    import shutil

    if GOLDEN.exists() and "--force" not in sys.argv:
        sys.exit(
            f"{GOLDEN} exists; the golden archive changes only with a format version bump (--force)"
        )
    shutil.rmtree(GOLDEN, ignore_errors=True)
    write_golden(GOLDEN)
    print(f"wrote {GOLDEN}")

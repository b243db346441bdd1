"""CRC pieces of raw data (SPEC.md §4 ``crcs``): written for data longer than one
piece, checked on open, named by verification, and refused when malformed."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest

from dlop.formats import ChecksumError, Field, FormatError, ShardReader, ShardWriter, Zstd
from dlop.formats.constants import CRC_PIECE_BYTES

from .helpers import read_header, rewrite_header

FIELDS = [
    Field("wave", "f32", (8192,)),  # 32 KiB a sample: 40 of them fill more than one piece
    Field("label", "i64", ()),
    Field("rag", "u8", (None,)),
    Field("z", "f32", (8192,), codec=Zstd()),
]


def write(path: Path, n: int = 40, in_place: bool = False) -> list[dict[str, object]]:
    rng = np.random.default_rng(5)
    samples = [
        {
            "wave": rng.standard_normal(8192).astype(np.float32),
            "label": i,
            "rag": rng.integers(0, 256, 70_000 + i, dtype=np.uint8),
            "z": np.zeros(8192, np.float32) + i,
        }
        for i in range(n)
    ]
    with ShardWriter(path, FIELDS, in_place=in_place) as w:
        w.write_many(samples)
    return samples


@pytest.mark.parametrize("in_place", [False, True])
def test_long_raw_data_carries_a_crc_per_piece(tmp_path: Path, in_place: bool) -> None:
    path = tmp_path / "s.dlop"
    samples = write(path, in_place=in_place)
    data = path.read_bytes()
    header, _ = read_header(path)
    fields = {f["name"]: f for f in header["fields"]}
    for name in ("wave", "rag"):
        f = fields[name]
        assert f["crc_piece_bytes"] == CRC_PIECE_BYTES
        region = f["regions"]["data"]
        values = data[region["offset"] : region["offset"] + region["length"]]
        crcs = f["regions"]["crcs"]
        got = np.frombuffer(data, "<u4", crcs["length"] // 4, crcs["offset"])
        want = [
            zlib.crc32(values[i : i + CRC_PIECE_BYTES])
            for i in range(0, len(values), CRC_PIECE_BYTES)
        ]
        assert got.tolist() == want and len(want) >= 2
        assert crcs["crc32"] == zlib.crc32(got.tobytes())
        assert region["crc32"] == zlib.crc32(values)
    # One piece or less, and block-coded values, carry none.
    for name in ("label", "z"):
        assert "crcs" not in fields[name]["regions"] and "crc_piece_bytes" not in fields[name]
    with ShardReader(path, verify=True) as r:
        size, crcs = r.piece_crcs("wave") or (0, None)
        assert size == CRC_PIECE_BYTES and crcs is not None
        assert r.piece_crcs("label") is None
        assert np.array_equal(r.get("wave", 39), samples[39]["wave"])


def flip(path: Path, region: str, at: int, mask: int = 0x10) -> dict[str, int]:
    """Flips bits of byte ``at`` of field wave's ``region``; returns that region's entry."""
    header, _ = read_header(path)
    entry = next(f for f in header["fields"] if f["name"] == "wave")["regions"][region]
    data = bytearray(path.read_bytes())
    data[entry["offset"] + at] ^= mask
    path.write_bytes(bytes(data))
    return dict(entry)


def test_verification_names_the_corrupt_piece(tmp_path: Path) -> None:
    path = tmp_path / "s.dlop"
    write(path)
    wave = flip(path, "data", CRC_PIECE_BYTES + 77)  # in the second piece
    with ShardReader(path) as r:
        problems = [str(p) for p in r.verify()]
    lo, hi = wave["offset"] + CRC_PIECE_BYTES, wave["offset"] + wave["length"]  # the last, short
    assert len(problems) == 1 and f"data bytes {lo}..{hi} (CRC piece 1)" in problems[0]


def test_a_corrupt_crcs_region_is_refused_on_open(tmp_path: Path) -> None:
    path = tmp_path / "s.dlop"
    write(path)
    flip(path, "crcs", 1, 1)
    with pytest.raises(ChecksumError, match=r"region 'crcs'.*CRC-32 mismatch"):
        ShardReader(path)


def edited(path: Path, change: object) -> None:
    header, _ = read_header(path)
    wave = next(f for f in header["fields"] if f["name"] == "wave")
    change(wave)  # type: ignore[operator]
    rewrite_header(path, header)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda f: f.pop("crc_piece_bytes"), "come together"),
        (lambda f: f["regions"].pop("crcs"), "come together"),
        (lambda f: f.update(crc_piece_bytes=100), "outside 4096"),
        (lambda f: f.update(crc_piece_bytes=1 << 40), "outside 4096"),
        (lambda f: f.update(crc_piece_bytes=CRC_PIECE_BYTES // 2), "region 'crcs': length"),
        (lambda f: f["regions"]["crcs"].update(offset=4096), "overlaps|not a multiple"),
        (lambda f: f["regions"]["crcs"].update(offset=1 << 40), "run past the end"),
        (lambda f: f.update(crc_piece_bytes="1"), "crc_piece_bytes"),
    ],
)
def test_malformed_pieces_are_format_errors(tmp_path: Path, change: object, message: str) -> None:
    path = tmp_path / "s.dlop"
    write(path)
    edited(path, change)
    with pytest.raises(FormatError, match=message):
        ShardReader(path)


def test_a_shard_without_pieces_reads_as_before(tmp_path: Path) -> None:
    """A shard written before pieces (no ``crcs``, no key) opens and verifies."""
    path = tmp_path / "s.dlop"
    samples = write(path)
    edited(path, lambda f: (f.pop("crc_piece_bytes"), f["regions"].pop("crcs")))
    with ShardReader(path, verify=True) as r:
        assert r.piece_crcs("wave") is None
        assert np.array_equal(r.get("wave", 3), samples[3]["wave"])

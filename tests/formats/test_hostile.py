"""Hostile shards must raise a dlop FormatError naming the file and the problem."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from dlop.formats import ChecksumError, FormatError, ShardReader
from dlop.formats.constants import OFFSET_DTYPE

from .helpers import MIXED_FIELDS, assert_value_equal, read_header, rewrite_header, write_mixed


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    path = tmp_path / "s.dlop"
    write_mixed(path)
    return path


def region_boundaries(path: Path) -> list[int]:
    header, hlen = read_header(path)
    points = {0, 8, 23, 24, 24 + hlen // 2, 24 + hlen}
    for f in header["fields"]:
        for r in f["regions"].values():
            points |= {r["offset"], r["offset"] + r["length"] // 2, r["offset"] + r["length"]}
    size = path.stat().st_size
    return sorted(p for p in points if p < size)


def open_fails(path: Path, match: str) -> FormatError:
    with pytest.raises(FormatError, match=match) as info:
        ShardReader(path, verify=True)
    assert str(path) in str(info.value)
    return info.value


def test_truncated_at_every_region_boundary(shard: Path) -> None:
    data = shard.read_bytes()
    cuts = region_boundaries(shard)
    assert len(cuts) > 20
    for cut in cuts:
        shard.write_bytes(data[:cut])
        open_fails(shard, "truncated|shorter|past the end")


def test_absurd_header_length(shard: Path) -> None:
    data = bytearray(shard.read_bytes())
    struct.pack_into("<Q", data, 16, 1 << 62)
    shard.write_bytes(bytes(data))
    open_fails(shard, "header length")


def test_bad_magic_and_unknown_preamble_version(shard: Path) -> None:
    data = shard.read_bytes()
    shard.write_bytes(b"NOTADLOP" + data[8:])
    open_fails(shard, "magic")
    shard.write_bytes(data[:8] + struct.pack("<I", 7) + data[12:])
    open_fails(shard, "version 7 .*upgrade dlop")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda h: h.update(version=2), "version"),
        (lambda h: h.update(format="other"), "format"),
        (lambda h: h.update(checksum="md5"), "checksum"),
        (lambda h: h["fields"][0].update(dtype="f128"), "dtype"),
        (lambda h: h["fields"][3]["codec"].update(name="lz4"), "codec"),
        (lambda h: h["fields"][0].update(kind="tensor"), "kind"),
        (lambda h: h["fields"][0].update(shape="3x5"), "shape"),
        (lambda h: h["fields"][1].update(name=h["fields"][0]["name"]), "twice"),
        (lambda h: h["fields"][0]["regions"]["data"].update(offset=1 << 40), "past the end"),
        (lambda h: h["fields"][0]["regions"]["data"].update(offset=4097), "multiple of 4096"),
        (lambda h: h["fields"][0]["regions"]["data"].update(length=8), "length"),
        (
            lambda h: h["fields"][1]["regions"]["data"].update(
                offset=h["fields"][0]["regions"]["data"]["offset"]
            ),
            "overlaps",
        ),
        (
            lambda h: h["fields"][2].update(value_count=h["fields"][2]["value_count"] + 1),
            "length|offsets",
        ),
        (lambda h: h["fields"][3].update(num_blocks=h["fields"][3]["num_blocks"] + 1), "blocks"),
        (lambda h: h.update(num_samples=h["num_samples"] + 1), "length|blocks"),
        (lambda h: h.update(file_bytes=h["file_bytes"] - 4096), "file has"),
        (lambda h: h["fields"][0]["regions"].pop("data"), "missing"),
        (lambda h: h.update(fields={}), "fields"),
        (lambda h: h["fields"][0]["regions"]["data"].update(crc32=-1), "64-bit"),
    ],
)
def test_header_edits_are_rejected(shard: Path, edit, match: str) -> None:
    header, _ = read_header(shard)
    edit(header)
    rewrite_header(shard, header)
    open_fails(shard, match)


def test_malformed_json_and_wrong_header_crc(shard: Path) -> None:
    data = bytearray(shard.read_bytes())
    data[30] ^= 0x55
    shard.write_bytes(bytes(data))
    assert isinstance(open_fails(shard, "header CRC"), ChecksumError)
    shard.unlink()
    write_mixed(shard)
    header, _ = read_header(shard)
    rewrite_header(shard, header)
    raw = bytearray(shard.read_bytes())
    raw[24:30] = b"{nope,"
    import zlib

    _, _, _, hlen = struct.unpack_from("<8sIIQ", raw)
    struct.pack_into("<I", raw, 12, zlib.crc32(bytes(raw[24 : 24 + hlen])))
    shard.write_bytes(bytes(raw))
    open_fails(shard, "JSON")


def test_corrupt_offsets_with_matching_crc_is_rejected(shard: Path) -> None:
    import zlib

    header, _ = read_header(shard)
    region = header["fields"][2]["regions"]["offsets"]
    data = bytearray(shard.read_bytes())
    offsets = np.frombuffer(
        bytes(data[region["offset"] : region["offset"] + region["length"]]), OFFSET_DTYPE
    ).copy()
    offsets[3], offsets[4] = offsets[4] + 1, offsets[3]
    data[region["offset"] : region["offset"] + region["length"]] = offsets.tobytes()
    shard.write_bytes(bytes(data))
    region["crc32"] = zlib.crc32(offsets.tobytes())
    rewrite_header(shard, header)
    open_fails(shard, "offsets|shape")


def test_wrong_data_checksum_names_field_and_block(shard: Path) -> None:
    header, _ = read_header(shard)
    data = bytearray(shard.read_bytes())
    zfix = header["fields"][3]["regions"]["data"]
    data[zfix["offset"] + zfix["length"] - 3] ^= 0xFF  # last block's frame
    feat = header["fields"][0]["regions"]["data"]
    data[feat["offset"] + 1] ^= 0x01
    shard.write_bytes(bytes(data))
    with ShardReader(shard) as r:  # structure is intact, so it opens...
        problems = r.verify()  # ...and verification localizes both faults
    where = {(p.field, p.block) for p in problems}
    assert ("feat", None) in where
    assert ("zfix", header["fields"][3]["num_blocks"] - 1) in where
    open_fails(shard, "CRC")


def test_fuzzed_bytes_raise_format_errors_or_read_correctly(tmp_path: Path) -> None:
    path = tmp_path / "f.dlop"
    samples = write_mixed(path, 10)
    original = path.read_bytes()
    rng = np.random.default_rng(1234)
    outcomes = {"rejected": 0, "intact": 0}
    for trial in range(400):
        data = bytearray(original)
        if trial % 10 == 0:  # random truncation
            data = data[: int(rng.integers(0, len(data)))]
        else:
            for _ in range(int(rng.integers(1, 5))):
                # half the mutations hit the header page, where parsing is most fragile
                hi = 4096 if rng.random() < 0.5 else len(data)
                data[int(rng.integers(0, hi))] = int(rng.integers(0, 256))
        path.write_bytes(bytes(data))
        try:
            with ShardReader(path, verify=True) as r:
                for i, sample in enumerate(samples):
                    for f in MIXED_FIELDS:
                        assert_value_equal(r.get(f.name, i), sample[f.name], f)
            outcomes["intact"] += 1
        except FormatError as e:
            assert str(path) in str(e)
            outcomes["rejected"] += 1
    # Many mutations land in alignment padding, which is never read; both outcomes must occur.
    assert outcomes["rejected"] >= 100 and outcomes["intact"] >= 10, outcomes

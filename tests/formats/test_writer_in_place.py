"""The largest plain field's values go straight into the shard file at their final offset.

They are not spooled and copied at close; the kernel is asked to start their
writeback as they arrive; the header fits the room reserved for it whatever
the schema, and a shard with room left over reads and verifies like any other.
"""

from __future__ import annotations

import itertools
import zlib
from pathlib import Path

import numpy as np
import pytest

from dlop.formats import ArchiveReader, ArchiveWriter, Field, ShardReader, ShardWriter, Zstd
from dlop.formats import writer as writer_module
from dlop.formats.header import required_regions


def sample(i: int) -> dict[str, object]:
    return {
        "feat": np.full((64, 32), i, np.float16),
        "label": i,
        "key": f"k{i}",
    }


FIELDS = [Field("feat", "f16", (64, 32)), Field("label", "i64", ()), Field.str_("key")]


def test_the_first_fixed_raw_field_is_written_in_place(tmp_path: Path) -> None:
    path = tmp_path / "s.dlop"
    w = ShardWriter(path, FIELDS, in_place=True)
    count = writer_module.SPOOL_BUFFER // (64 * 32 * 2) + 5  # more than a spool's buffer holds
    for i in range(count):
        w.write(sample(i))
    tmp = path.with_name(f".{path.name}.tmp")
    spools = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".spool"))
    assert not (tmp_path / f".{path.name}.f0.spool").exists()  # no spool for the first field
    assert spools == [f".{path.name}.f1.spool", f".{path.name}.f2.spool"]
    base = writer_module.reserved_header_end(FIELDS)
    # its values, past the header, as they come (all but what the buffer holds)
    assert base < tmp.stat().st_size <= base + count * 64 * 32 * 2
    info = w.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.dlop"]
    r = ShardReader(path)
    assert r.layout.fields[0].regions["data"].offset == base
    assert not r.verify()
    assert info.crc32 == zlib.crc32(path.read_bytes()) and info.bytes == path.stat().st_size
    for i in range(5):
        got = r.sample(i)
        assert np.array_equal(got["feat"], sample(i)["feat"]) and got["key"] == f"k{i}"


@pytest.mark.parametrize(
    "first",
    [Field("wave", "f32", (None,)), Field("z", "f16", (64, 32), codec=Zstd(level=1))],
    ids=["ragged", "zstd"],
)
def test_a_field_with_more_regions_is_spooled(tmp_path: Path, first: Field) -> None:
    assert required_regions(first) != ("data",)
    w = ShardWriter(tmp_path / "s.dlop", [first, Field("label", "i64", ())], in_place=True)
    value = np.ones(7, np.float32) if first.ragged else np.ones((64, 32), np.float16)
    w.write({first.name: value, "label": 1})
    assert (tmp_path / ".s.dlop.f0.spool").exists()
    w.close()
    assert not ShardReader(tmp_path / "s.dlop").verify()


def test_a_header_shorter_than_its_room_leaves_zero_pages(tmp_path: Path) -> None:
    """A schema whose largest possible header passes a page boundary that the real one
    does not: the values start at the reserved end, the gap is zeros, and the shard reads."""
    for n in range(1, 400):
        fields = [Field("feat", "u8", (3,))] + [Field(f"extra_{k:03d}", "u8", ()) for k in range(n)]
        reserved = writer_module.reserved_header_end(fields)
        with ShardWriter(tmp_path / "s.dlop", fields, in_place=True) as w:
            w.write(
                {f.name: np.arange(3, dtype=np.uint8) if f.shape else np.uint8(1) for f in fields}
            )
        r = ShardReader(tmp_path / "s.dlop")
        if r.layout.header_end < reserved:
            break
        (tmp_path / "s.dlop").unlink()
    else:
        pytest.fail("no schema left room between its header and its reserved end")
    data = r.layout.fields[0].regions["data"]
    assert data.offset == reserved
    raw = (tmp_path / "s.dlop").read_bytes()
    assert raw[r.layout.header_end : reserved] == bytes(reserved - r.layout.header_end)
    assert not r.verify()
    assert list(r.sample(0)["feat"]) == [0, 1, 2]


def test_writeback_is_started_for_each_stretch_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(writer_module, "WRITEBACK_BYTES", 10_000)
    monkeypatch.setattr(
        writer_module,
        "_start_writeback",
        lambda fd, offset, nbytes, flags: calls.append((offset, nbytes, flags)) or 0,
    )
    w = ShardWriter(tmp_path / "s.dlop", FIELDS, in_place=True)
    for i in range(20):  # 4096 bytes each
        w.write(sample(i))
    base = writer_module.reserved_header_end(FIELDS)
    assert calls and all(flags == 2 for _, _, flags in calls)
    assert calls[0][0] == base
    for (o1, n1, _), (o2, _, _) in itertools.pairwise(calls):
        assert o2 == o1 + n1  # contiguous stretches, each requested once
    assert calls[-1][0] + calls[-1][1] <= base + 20 * 4096
    assert all(n >= 10_000 for _, n, _ in calls)
    w.close()
    assert not ShardReader(tmp_path / "s.dlop").verify()


def test_an_aborted_shard_leaves_nothing(tmp_path: Path) -> None:
    w = ShardWriter(tmp_path / "s.dlop", FIELDS, in_place=True)
    w.write(sample(0))
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_the_largest_plain_field_comes_first_in_the_file(tmp_path: Path) -> None:
    """A string key first in the schema (as compiled archives have it): the features,
    the largest plain field, are written in place and lie first; the rest follow."""
    fields = [Field.str_("key"), Field("label", "i64", ()), Field("feat", "f16", (64, 32))]
    with ShardWriter(tmp_path / "s.dlop", fields, in_place=True) as w:
        for i in range(3):
            w.write({"key": f"k{i}", "label": i, "feat": np.full((64, 32), i, np.float16)})
        assert not (tmp_path / ".s.dlop.f2.spool").exists()
    r = ShardReader(tmp_path / "s.dlop")
    base = writer_module.reserved_header_end(fields)
    offsets = {f.field.name: min(x.offset for x in f.regions.values()) for f in r.layout.fields}
    assert offsets["feat"] == base < offsets["key"] < offsets["label"]
    assert [f.field.name for f in r.layout.fields] == ["key", "label", "feat"]  # schema order
    assert not r.verify()
    assert [r.sample(i)["key"] for i in range(3)] == ["k0", "k1", "k2"]
    assert float(r.sample(2)["feat"][5, 5]) == 2.0


@pytest.mark.parametrize("shard_bytes", [1 << 10, writer_module.IN_PLACE_SHARD_BYTES])
def test_archives_write_in_place_only_in_large_shards(tmp_path: Path, shard_bytes: int) -> None:
    """Small shards spool every field and keep the compact layout (the header's own
    page, regions in schema order); large ones write their largest plain field in place."""
    with ArchiveWriter(tmp_path / "a", FIELDS, shard_bytes=shard_bytes) as w:
        for i in range(3):
            w.write(sample(i))
    with ArchiveReader(tmp_path / "a") as r:
        assert [r.sample(i)["key"] for i in range(3)] == ["k0", "k1", "k2"]
    shard = ShardReader(next((tmp_path / "a").glob("*.dlop")))
    first = min(shard.layout.fields, key=lambda f: f.regions["data"].offset)
    large = shard_bytes >= writer_module.IN_PLACE_SHARD_BYTES
    assert first.field.name == "feat"  # first in FIELDS too
    want = writer_module.reserved_header_end(FIELDS) if large else shard.layout.header_end
    assert first.regions["data"].offset == want


def test_a_shard_writer_spools_every_field_unless_asked(tmp_path: Path) -> None:
    fields = [Field.str_("key"), Field("feat", "f16", (64, 32))]
    w = ShardWriter(tmp_path / "s.dlop", fields)
    w.write({"key": "k", "feat": np.zeros((64, 32), np.float16)})
    assert (tmp_path / ".s.dlop.f1.spool").exists()
    w.close()
    r = ShardReader(tmp_path / "s.dlop")
    key, feat = r.layout.fields
    assert key.regions["data"].offset < feat.regions["data"].offset  # schema order

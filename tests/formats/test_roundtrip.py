"""Round-trip property tests: whatever is written reads back bit-identical."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlop.formats import ArchiveReader, ArchiveWriter, Field, Raw, ShardReader, ShardWriter, Zstd
from dlop.formats.constants import DTYPES

from .helpers import MIXED_FIELDS, assert_value_equal, write_mixed

CODECS = st.one_of(
    st.just(Raw()),
    st.builds(
        Zstd, level=st.integers(1, 5), block_bytes=st.integers(1, 300), shuffle=st.booleans()
    ),
)


@st.composite
def schemas(draw: st.DrawFn) -> list[Field]:
    n_fields = draw(st.integers(1, 5))
    fields = []
    for i in range(n_fields):
        kind = draw(st.sampled_from(["array", "array", "bytes", "str"]))
        codec = draw(CODECS)
        if kind != "array":
            fields.append(Field(f"f{i}", "u8", (None,), kind, codec))
            continue
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.one_of(st.none(), st.integers(0, 4))) for _ in range(ndim))
        fields.append(Field(f"f{i}", draw(st.sampled_from(sorted(DTYPES))), shape, "array", codec))
    return fields


def random_value(draw: st.DrawFn, f: Field) -> Any:
    if f.kind == "str":
        return draw(st.text(max_size=12))
    if f.kind == "bytes":
        return draw(st.binary(max_size=12))
    shape = tuple(d if d is not None else draw(st.integers(0, 4)) for d in f.shape)
    count = int(np.prod(shape, dtype=np.int64))
    raw = draw(st.binary(min_size=count * f.itemsize, max_size=count * f.itemsize))
    arr = np.frombuffer(raw, dtype=f.np_dtype).reshape(shape)
    if f.dtype == "bool":
        arr = arr.view(np.uint8) & 1
        arr = arr.astype(bool)
    return arr.copy()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_schema_round_trips(tmp_path: Path, data: st.DataObject) -> None:
    fields = data.draw(schemas())
    n = data.draw(st.integers(0, 9))
    samples = [{f.name: random_value(data.draw, f) for f in fields} for _ in range(n)]
    path = tmp_path / f"s{data.draw(st.integers(0, 10**9))}.dlop"
    with ShardWriter(path, fields) as w:
        w.write_many(samples)
    with ShardReader(path, verify=True) as r:
        assert r.num_samples == n
        for i, sample in enumerate(samples):
            for f in fields:
                assert_value_equal(r.get(f.name, i), sample[f.name], f)
        assert r.verify() == []


def test_mixed_shard_round_trips(tmp_path: Path) -> None:
    samples = write_mixed(tmp_path / "m.dlop", 30)
    with ShardReader(tmp_path / "m.dlop", verify=True) as r:
        # read backwards too, so block caching is exercised out of order
        for i in [*range(30), *reversed(range(30))]:
            for f in MIXED_FIELDS:
                assert_value_equal(r.get(f.name, i), samples[i][f.name], f)


def test_empty_shard_and_zero_length_items(tmp_path: Path) -> None:
    fields = [
        Field("r", "f32", (None, 3), codec=Zstd()),
        Field("x", "u8", (None,)),
        Field.str_("t"),
    ]
    with ShardWriter(tmp_path / "empty.dlop", fields):
        pass
    with ShardReader(tmp_path / "empty.dlop", verify=True) as r:
        assert r.num_samples == 0
    with ShardWriter(tmp_path / "zero.dlop", fields) as w:
        for _ in range(3):
            w.write({"r": np.zeros((0, 3), np.float32), "x": np.zeros(0, np.uint8), "t": ""})
    with ShardReader(tmp_path / "zero.dlop", verify=True) as r:
        assert r.get("r", 2).shape == (0, 3)
        assert r.get("x", 1).shape == (0,)
        assert r.get("t", 0) == ""


def test_archive_rotates_shards_and_reads_globally(tmp_path: Path) -> None:
    fields = [Field("x", "i32", (8,)), Field.str_("key")]
    with ArchiveWriter(tmp_path / "a", fields, shard_bytes=100) as w:
        for i in range(50):
            w.write({"x": np.full(8, i, np.int32), "key": f"k{i}"})
    r = ArchiveReader(tmp_path / "a")
    assert r.num_shards > 5 and len(r) == 50
    for i in range(50):
        assert r.get("key", i) == f"k{i}"
        assert int(r.get("x", i)[0]) == i
    assert r.verify() == []
    with pytest.raises(IndexError):
        r.get("x", 50)


def test_bf16_is_carried_as_bits(tmp_path: Path) -> None:
    bits = np.array([0x3F80, 0xC000, 0x7FC0], np.uint16)  # 1.0, -2.0, nan
    with ShardWriter(tmp_path / "b.dlop", [Field("w", "bf16", (3,))]) as w:
        w.write({"w": bits})
    with ShardReader(tmp_path / "b.dlop") as r:
        assert r.get("w", 0).dtype == np.uint16
        assert r.get("w", 0).tolist() == bits.tolist()


@pytest.mark.parametrize("itemsize", [1, 2, 3, 4, 8])
def test_byte_shuffle_inverts(itemsize: int) -> None:
    from dlop.formats.codecs import shuffle_bytes, unshuffle_bytes

    data = np.random.default_rng(itemsize).integers(0, 256, itemsize * 513, dtype=np.uint8)
    shuffled = shuffle_bytes(data, itemsize)
    if itemsize > 1:
        assert not np.array_equal(shuffled, data)
    assert np.array_equal(unshuffle_bytes(shuffled, itemsize), data)


@pytest.mark.parametrize("codec", [Raw(), Zstd(block_bytes=1000, shuffle=True)])
def test_read_range_matches_get(tmp_path: Path, codec: Any) -> None:
    # big enough that the raw path splits the copy across threads
    fields = [Field("x", "f32", (64, 1024), codec=codec)]
    with ShardWriter(tmp_path / "r.dlop", fields) as w:
        for i in range(40):
            w.write({"x": np.full((64, 1024), i, np.float32) + np.arange(1024, dtype=np.float32)})
    with ShardReader(tmp_path / "r.dlop") as r:
        got = r.read_range("x", 3, 37)
        assert got.shape == (34, 64, 1024)
        for i in range(3, 37):
            assert np.array_equal(got[i - 3], r.get("x", i))
        with pytest.raises(IndexError):
            r.read_range("x", 30, 41)


def test_zstd_read_range_spanning_blocks_of_several_samples(tmp_path: Path) -> None:
    fields = [Field("y", "i16", (7,), codec=Zstd(block_bytes=100, shuffle=True))]
    rows = np.arange(60 * 7, dtype=np.int16).reshape(60, 7)
    with ShardWriter(tmp_path / "z.dlop", fields) as w:
        for row in rows:
            w.write({"y": row})
    with ShardReader(tmp_path / "z.dlop") as r:
        assert len(r.blocks("y")) > 5  # several samples per block, several blocks
        for a, b in [(0, 0), (0, 60), (5, 23), (13, 14), (59, 60), (7, 7)]:
            np.testing.assert_array_equal(r.read_range("y", a, b), rows[a:b])


def test_crc32_combine_matches_zlib() -> None:
    import zlib

    from dlop.formats.crc import crc32_combine, crc32_zeros

    rng = np.random.default_rng(7)
    for la, lb in [(0, 0), (1, 0), (0, 5), (13, 7), (4096, 100_000), (3, 1 << 20)]:
        a, b = rng.bytes(la), rng.bytes(lb)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), lb) == zlib.crc32(a + b)
    for n in (0, 1, 4095, 70_000):
        assert crc32_zeros(n) == zlib.crc32(bytes(n))


def test_block_cache_is_bounded_shared_and_thread_safe(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    fields = [Field("x", "f32", (256,), codec=Zstd(block_bytes=4096, shuffle=True))]
    rng = np.random.default_rng(0)
    values = rng.normal(size=(120, 256)).astype(np.float32)
    values[:, 0] = np.arange(120)
    with ArchiveWriter(tmp_path / "a", fields, shard_bytes=40_000) as w:
        for v in values:
            w.write({"x": v})
    reader = ArchiveReader(tmp_path / "a", block_cache_bytes=3 * 4096)
    assert reader.num_shards > 1

    def check(i: int) -> bool:
        return bool(np.array_equal(reader.get("x", i), values[i]))

    with ThreadPoolExecutor(4) as pool:  # one decompression context per thread
        assert all(pool.map(check, [*range(120), *reversed(range(120))] * 3))
    assert reader.block_cache.bytes <= 3 * 4096
    # two readers sharing a cache never see each other's blocks
    other = ShardReader(
        tmp_path / "a" / reader.index.shards[1].file, block_cache=reader.block_cache
    )
    first = reader.shard(0)
    assert first.decode_block("x", 0)[0] == 0 and other.decode_block("x", 0)[0] != 0
    assert np.array_equal(first.decode_block("x", 1, cached=False), first.decode_block("x", 1))

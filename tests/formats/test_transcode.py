"""A zstd shard rewritten raw: the same samples, every field mappable."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dlop.formats import ArchiveReader, ArchiveWriter, Field, FormatError, ShardReader, Zstd
from dlop.formats.transcode import (
    header_span,
    needs_transcode,
    raw_fields,
    raw_size_bound,
    transcode_raw,
)
from tests.runtime.helpers import make_archive


def test_transcode_keeps_every_sample(tmp_path: Path) -> None:
    archive = make_archive(tmp_path / "z", zstd=True)
    reader = ArchiveReader(archive)
    assert needs_transcode(reader.index.fields)
    assert not needs_transcode(raw_fields(reader.index.fields))
    src = archive / reader.index.shards[0].file
    transcode_raw(src, tmp_path / "raw.dlop")
    with ShardReader(src) as z, ShardReader(tmp_path / "raw.dlop") as raw:
        assert all(f.codec.mappable for f in raw.fields.values())
        assert raw.num_samples == z.num_samples
        for i in range(z.num_samples):
            a, b = z.sample(i), raw.sample(i)
            for name in a:
                if isinstance(a[name], np.ndarray):
                    assert np.array_equal(a[name], b[name])
                else:
                    assert a[name] == b[name]
        assert raw.array("logmel").shape == (z.num_samples, 5, 4)  # zero-copy view
        assert not raw.verify()


def test_raw_size_bound_from_the_header_alone(tmp_path: Path) -> None:
    zeros = tmp_path / "zeros"
    fields = [Field("x", "f32", (16384,), codec=Zstd()), Field("y", "u8", (None,), codec=Zstd())]
    with ArchiveWriter(zeros, fields, shard_bytes=600_000) as w:
        for i in range(12):
            w.write({"x": np.zeros(16384, np.float32), "y": np.zeros(i * 100, np.uint8)})
    # Fields over one CRC piece raw: their raw copies carry crcs regions too.
    pieced = tmp_path / "pieced"
    wide = [Field(n, "f32", (16384,), codec=Zstd()) for n in "abc"]
    with ArchiveWriter(pieced, wide, shard_bytes=64 << 20) as w:
        for _ in range(64):
            w.write({n: np.zeros(16384, np.float32) for n in "abc"})
    ratios = []
    for archive in (make_archive(tmp_path / "z", zstd=True), zeros, pieced):
        for info in ArchiveReader(archive).index.shards:
            data = (archive / info.file).read_bytes()
            head = data[: header_span(data[:24], info.file, len(data))]
            bound = raw_size_bound(head, info.file, len(data))
            transcode_raw(archive / info.file, tmp_path / "raw.dlop")
            raw = (tmp_path / "raw.dlop").stat().st_size
            assert raw <= bound <= raw + 8192
            ratios.append(bound / len(data))
    assert max(ratios) > 10  # zeros: the raw copy is many times the compressed shard
    with pytest.raises(FormatError, match="need the first"):
        raw_size_bound(head[:-1], info.file, len(data))

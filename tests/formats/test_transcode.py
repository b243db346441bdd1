"""A zstd shard rewritten raw: the same samples, every field mappable."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dlop.formats import ArchiveReader, ShardReader
from dlop.formats.transcode import needs_transcode, raw_fields, transcode_raw
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

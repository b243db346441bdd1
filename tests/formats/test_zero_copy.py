"""A raw fixed-shape field is a view of the mapped file: no byte is copied."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from dlop.formats import Field, ShardReader, ShardWriter


def test_raw_fixed_field_is_a_view_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "z.dlop"
    with ShardWriter(path, [Field("x", "f32", (256,))]) as w:
        for i in range(64):
            w.write({"x": np.full(256, i, np.float32)})
    with ShardReader(path) as r:
        arr = r.array("x")
        one = r.get("x", 10)
        assert not arr.flags.owndata and not one.flags.owndata
        assert np.shares_memory(arr, one)
        # Write new bytes into the file behind the reader's back: a copy would
        # not see them, a view of the shared mapping does.
        offset = r.layout_of("x").regions["data"].offset + 10 * 256 * 4
        fd = os.open(path, os.O_RDWR)
        try:
            os.pwrite(fd, np.full(256, -7, np.float32).tobytes(), offset)
        finally:
            os.close(fd)
        assert np.all(one == -7)
        assert np.all(arr[10] == -7)
        assert np.all(arr[11] == 11)
        del arr, one

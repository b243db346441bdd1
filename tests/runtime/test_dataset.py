"""open_archive: zero-copy items, vectorized batches in order, padding and lengths, DataLoader paths."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from dlop.formats.heap import is_glibc
from dlop.runtime import Batch, IterableArchive, open_archive

from .helpers import feature, make_archive, speech


@pytest.fixture(scope="module", params=[False, True], ids=["raw", "zstd"])
def archive(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_archive(tmp_path_factory.mktemp("a") / "a", zstd=request.param)


GLIBC = is_glibc()


def test_item_is_zero_copy_for_raw_fields(tmp_path: Path) -> None:
    ds = open_archive(make_archive(tmp_path / "a"))
    item = ds[3]
    shard = ds.shards[ds.reader.locate(3)[0]]
    mapped = shard.array("logmel")
    assert np.shares_memory(item["logmel"].numpy(), mapped)
    assert torch.equal(item["logmel"], torch.from_numpy(feature(3)))
    assert item["key"] == "k003" and item["text"] == "ttt"
    assert ds.fields["speech"].shape == (None, 3)


def test_getitems_matches_items_in_given_order(archive: Path) -> None:
    ds = open_archive(archive)
    assert ds.reader.num_shards > 3
    idx = [30, 2, 2, 17, 36, 0, 9]
    b = ds.__getitems__(idx)
    assert isinstance(b, Batch)
    assert b["key"] == [f"k{i:03d}" for i in idx]
    assert b["label"].tolist() == idx
    assert torch.equal(b["logmel"], torch.stack([torch.from_numpy(feature(i)) for i in idx]))
    lengths = b["speech_lengths"].tolist()
    assert lengths == [speech(i).shape[0] for i in idx]
    for row, i in enumerate(idx):
        assert torch.equal(
            b["speech"][row, : lengths[row]], torch.from_numpy(speech(i))
        )  # exact round trip
        assert bool((b["speech"][row, lengths[row] :] == 0).all())  # documented pad value
        h, w = b["image_lengths"][row].tolist()
        assert (h, w) == (1 + i % 3, 2 + i % 2)
        assert (
            bool((b["image"][row, :h, :w] == i % 256).all())
            and int(b["image"][row].sum()) == (i % 256) * h * w * 2
        )
    assert b["text"] == ["t" * (i % 4) for i in idx]


def test_empty_and_out_of_range(archive: Path) -> None:
    ds = open_archive(archive)
    assert ds.__getitems__([])["logmel"].shape == (0, 5, 4)
    with pytest.raises(IndexError):
        ds.__getitems__([0, 37])


def test_default_dataloader_takes_the_batch_as_is(archive: Path) -> None:
    ds = open_archive(archive)
    seen = []
    for b in DataLoader(ds, batch_size=8, shuffle=True):
        assert isinstance(b, Batch) and b["logmel"].shape[1:] == (5, 4)
        seen += b["label"].tolist()
    assert sorted(seen) == list(range(37))


@pytest.mark.slow
def test_dataloader_workers_map_style_and_iterable(archive: Path) -> None:
    ds = open_archive(archive)
    seen = []
    for b in DataLoader(
        ds, batch_size=5, shuffle=True, num_workers=2, multiprocessing_context="spawn"
    ):
        seen += b["label"].tolist()
    assert sorted(seen) == list(range(37))
    it = IterableArchive(archive, batch_size=4, seed=3)
    seen = []
    for b in DataLoader(it, batch_size=None, num_workers=2, multiprocessing_context="spawn"):
        seen += b["label"].tolist()
    # the workers share out the Loader's batches: every sample exactly once
    assert sorted(seen) == list(range(37))


def test_ragged_span_plan_agrees_with_a_row_gather(tmp_path: Path) -> None:
    from dlop.formats import ArchiveWriter, Field
    from dlop.runtime.gather.spans import SpanGather

    with ArchiveWriter(tmp_path / "s", [Field("f", "f16", (None, 80))], shard_bytes=300_000) as w:
        for i in range(40):
            w.write({"f": np.full((100 + 37 * i, 80), i % 50, np.float16)})
    ds = open_archive(tmp_path / "s")
    assert ds.reader.num_shards > 1
    idx = torch.tensor([1, 5, 17, 18, 33, 39])
    gather = ds.gathers["f"]
    assert isinstance(gather, SpanGather)
    spans = ds.gather(idx)
    # The same batch row by row: index_select of each sample's valid rows, zeros after.
    rows = torch.zeros_like(spans["f"])
    for j, i in enumerate(idx.tolist()):
        k, local = ds.reader.locate(i)
        values = torch.from_numpy(ds.shards[k].values("f").reshape(-1, 80))
        first = int(ds.shards[k].offsets("f")[local]) // 80
        n = int(spans["f_lengths"][j])
        torch.index_select(values, 0, torch.arange(first, first + n), out=rows[j, :n])
    assert torch.equal(spans["f"], rows)
    assert spans["f_lengths"].tolist() == [100 + 37 * i for i in idx.tolist()]
    for j, i in enumerate(idx.tolist()):
        n = 100 + 37 * i
        assert bool((spans["f"][j, :n] == i % 50).all()) and bool((spans["f"][j, n:] == 0).all())


def test_a_batch_read_keeps_freed_memory_for_the_next(
    tmp_path: Path, malloc_env: dict[str, str]
) -> None:
    from dlop.formats import ArchiveWriter, Field

    with ArchiveWriter(tmp_path / "a", [Field("x", "f32", (4,))]) as w:
        for i in range(8):
            w.write({"x": np.full(4, i, np.float32)})
    code = (
        "import sys\n"
        "from dlop.formats import heap\n"
        "from dlop.runtime import Archive\n"
        "a = Archive(sys.argv[1])\n"
        "before = heap.keep_freed_memory.cache_info().currsize\n"
        "a.__getitems__([3, 1])\n"
        "print(before, heap.keep_freed_memory.cache_info().currsize, heap.keep_freed_memory())\n"
    )
    for tuning, kept in (("1", GLIBC), ("0", False)):
        out = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / "a")],
            capture_output=True,
            text=True,
            env={**malloc_env, "DLOP_MALLOC_TUNING": tuning},
        )
        assert out.stdout.split() == ["0", "1", str(kept)], out.stderr


def test_padding_of_several_varying_dimensions(tmp_path: Path) -> None:
    from dlop.formats import ArchiveWriter, Field

    rng = np.random.default_rng(5)
    shapes = [(3, 5), (6, 2), (1, 1), (6, 5), (0, 4), (2, 0)]
    values = [rng.normal(size=s).astype(np.float32) for s in shapes]
    with ArchiveWriter(tmp_path / "a", [Field("grid", "f32", (None, None))]) as w:
        for v in values:
            w.write({"grid": v})
    for pad in (0.0, -7.5):
        ds = open_archive(tmp_path / "a", pad_value=pad)
        for _ in range(2):  # fresh outputs hold whatever memory held: every cell is written
            batch = ds.__getitems__([3, 0, 1, 2, 4, 5])
            grid, lengths = batch["grid"], batch["grid_lengths"]
            assert grid.shape == (6, 6, 5)
            for row, i in enumerate([3, 0, 1, 2, 4, 5]):
                expect = np.full((6, 5), pad, np.float32)
                expect[: shapes[i][0], : shapes[i][1]] = values[i]
                np.testing.assert_array_equal(grid[row].numpy(), expect)
                assert lengths[row].tolist() == list(shapes[i])

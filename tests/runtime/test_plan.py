"""Gather plans, checked without threads: fixed rows against torch.index_select, ragged and
multi-dimensional padding against padding by hand, and steps that would write outside
their destination refused when made."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dlop.formats import ArchiveWriter, ChecksumError, Field, FormatError, Zstd
from dlop.runtime import Archive, open_archive
from dlop.runtime.errors import UsageError
from dlop.runtime.gather import spans
from dlop.runtime.gather.engine import CopyEngine, run_share
from dlop.runtime.gather.plan import CopyPlan, Rows, RowTable, Runs
from dlop.runtime.gather.spans import piece_runs

from .helpers import make_archive


def execute(plan: CopyPlan) -> None:
    """Runs a plan's steps on the calling thread, in order: no engine threads."""
    run_share(plan.steps, streaming=False)


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_archive(tmp_path_factory.mktemp("p") / "a", n=37)


def test_fixed_rows_plan_matches_index_select(archive: Path) -> None:
    ds = open_archive(archive, fields=["logmel", "label"])
    assert ds.reader.num_shards > 3
    idx = torch.tensor([0, 3, 3, 8, 20, 21, 36])
    out = {"logmel": torch.full((7 * 20,), 7.0, dtype=torch.float16)}
    batch, plan = ds.plan(idx, out)
    assert [type(s) for s in plan.steps] == [Rows, Rows]  # one per field, whatever the shards
    assert batch["logmel"].data_ptr() == out["logmel"].data_ptr()  # a view of the buffer
    execute(plan)
    whole = torch.cat(
        [torch.from_numpy(s.array("logmel").copy()) for s in ds.shards]
    )  # every sample, in order
    expected = torch.index_select(whole, 0, idx)
    assert torch.equal(batch["logmel"], expected)
    assert batch["label"].tolist() == idx.tolist()


@pytest.mark.parametrize("pad", [0.0, 7.0])
def test_ragged_plan_matches_padding_by_hand(archive: Path, pad: float) -> None:
    ds = open_archive(archive, fields=["speech", "image"], pad_value=pad)
    idx = torch.tensor([1, 2, 9, 10, 30])
    batch, plan = ds.plan(idx)
    garbage = [s.dst for s in plan.steps]
    for dst in garbage:  # fresh outputs hold anything: every byte must be written
        dst.fill_(0xAB)
    execute(plan)
    for name in ("speech", "image"):
        values = [np.asarray(ds[i][name]) for i in idx.tolist()]
        shape = tuple(max(v.shape[a] for v in values) for a in range(values[0].ndim))
        expected = np.full((len(values), *shape), pad, values[0].dtype)
        for j, v in enumerate(values):
            expected[(j, *(slice(0, n) for n in v.shape))] = v
        np.testing.assert_array_equal(batch[name].numpy(), expected)
    assert batch["speech_lengths"].tolist() == [len(ds[i]["speech"]) for i in idx.tolist()]
    assert batch["image_lengths"].tolist() == [list(ds[i]["image"].shape[:2]) for i in idx.tolist()]


def test_a_pad_value_the_field_cannot_hold_is_refused(archive: Path) -> None:
    # image (u8) varies in several dimensions: refused on open, as every padded field
    with pytest.raises(UsageError, match=r"field 'image' \(u8\) is padded with pad_value=-3.5"):
        open_archive(archive, fields=["image"], pad_value=-3.5)


def test_zstd_plan_holds_the_decoded_values(tmp_path: Path) -> None:
    ds = open_archive(make_archive(tmp_path / "z", n=30, zstd=True), fields=["logmel", "speech"])
    idx = torch.tensor([2, 3, 17, 29])
    batch, plan = ds.plan(idx)
    runs = [s for s in plan.steps if isinstance(s, Runs)]
    assert runs and all(s.keep for s in runs)  # the decoded arrays travel with the plan
    execute(plan)
    for j, i in enumerate(idx.tolist()):
        assert torch.equal(batch["logmel"][j], ds[i]["logmel"])
        n = int(batch["speech_lengths"][j])
        assert torch.equal(batch["speech"][j, :n], ds[i]["speech"])


def test_piece_runs_cover_each_sample_once() -> None:
    # (shapes of a batch, the last axis that may pad): every byte of every sample lands
    # once, inside its own padded region, in the sample's own order
    for shapes, last in [
        ([(2, 3, 4), (5, 1, 4)], 1),
        ([(2, 3, 4), (2, 6, 4)], 1),
        ([(1, 1, 2), (3, 4, 2), (0, 2, 2)], 1),
        ([(3, 2), (1, 5)], 1),
        ([(4, 3), (2, 3)], 0),
        ([(2, 3), (2, 3)], -1),
    ]:
        table = np.array(shapes, np.int64)
        padded = tuple(int(m) for m in table.max(axis=0))
        region = int(np.prod(padded)) * 2
        owner, dst, within, sizes = piece_runs(table, padded, last, 2)
        assert np.all(np.diff(dst) > 0) or len(dst) < 2  # ascending
        out = np.full(region * len(shapes), -1, np.int64)
        for j, shape in enumerate(shapes):
            own = owner == j
            sample = np.arange(int(np.prod(shape)) * 2)  # the sample's bytes, numbered
            runs = zip(dst[own].tolist(), within[own].tolist(), sizes[own].tolist(), strict=True)
            for d, w, n in runs:
                assert j * region <= d and d + n <= (j + 1) * region
                assert (out[d : d + n] == -1).all()
                out[d : d + n] = sample[w : w + n]
            # the sample as numpy pads it: its own bytes at the front of each padded row
            ref = np.full((*padded, 2), -1, np.int64)
            ref[tuple(slice(0, s) for s in shape)] = sample.reshape(*shape, 2)
            assert np.array_equal(out[j * region : (j + 1) * region], ref.reshape(-1))


def test_steps_outside_their_destination_are_refused() -> None:
    dst = torch.zeros(100, dtype=torch.uint8)
    src = np.zeros(200, np.uint8)
    addr = np.array([src.ctypes.data], np.int64)
    for offset, size in [(90, 20), (-1, 5)]:
        with pytest.raises(ValueError, match="outside its destination"):
            Runs(dst, np.array([offset], np.int64), addr, np.array([size], np.int64), (src,))
    with pytest.raises(ValueError, match="exactly len"):
        Rows(dst, RowTable([torch.zeros(4, 30, dtype=torch.uint8)], 30), None, np.arange(2))


def test_a_plan_runs_the_same_inline_and_on_helpers(archive: Path) -> None:
    ds = open_archive(archive)
    idx = torch.arange(0, 37, 2)
    batch, plan = ds.plan(idx)
    execute(plan)
    inline = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    engine = CopyEngine(threads=2)
    try:
        again, plan = ds.plan(idx)
        engine.start(plan).wait()
    finally:
        engine.close()
    for k, v in inline.items():
        assert torch.equal(again[k], v) if isinstance(v, torch.Tensor) else again[k] == v


def test_a_bf16_field_is_copied_bit_for_bit(tmp_path: Path) -> None:
    with ArchiveWriter(tmp_path / "b", [Field("x", "bf16", (3,), codec=Zstd())]) as w:
        for i in range(5):
            w.write({"x": np.arange(3, dtype=np.uint16) + 1000 * i})
    ds = open_archive(tmp_path / "b")
    batch = ds.__getitems__([4, 0])
    assert batch["x"].dtype == torch.bfloat16
    assert batch["x"].view(torch.int16).tolist() == [[4000, 4001, 4002], [0, 1, 2]]


def forging(real: Any, place: str, value: int, both: bool) -> Any:
    """``copied_tables`` whose sample 1 of shard 0 starts at ``value`` (``place`` "first"),
    has ``value`` as its length (``both``: in both varying dimensions, a product of two
    negatives passing for positive), or ``value`` then 0 ("zero": a product of a
    negative and 0, -0.0, passing for empty)."""

    def forged(shard: Any, field: str, keep: bool) -> Any:
        offsets, shapes = (t.copy() for t in real(shard, field, keep))
        if shard.path.name != "shard-00000.dlop":
            return offsets, shapes
        if place == "first":
            offsets[1] = value
        elif place == "zero":
            shapes[1, :2] = [value, 0]
        else:
            shapes[1, : 2 if both else 1] = value
        return offsets, shapes

    return forged


def test_spans_outside_their_values_are_refused_before_a_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tables are copies checked by CRC-32 when made, and a gather still bounds every
    sample's span by the values it lies in: forged tables (here as copied) are an error
    naming the shard and sample when the gather is made, never a read outside them."""
    path = make_archive(tmp_path / "z", zstd=True)
    real = spans.copied_tables
    # zstd with its first dimension varying, raw with two varying
    for name in ("speech", "image"):
        cases = [("first", 10**9), ("first", -5), ("size", -1), ("size", 10**6)]
        for place, value in cases + ([("zero", -2)] if name == "image" else []):
            forged = forging(real, place, value, both=name == "image")
            monkeypatch.setattr(spans, "copied_tables", forged)
            shard = sorted(p.name for p in path.glob("shard-*"))[0]
            named = f"{shard}: field '{name}' sample 1: its offsets or shape point outside"
            with pytest.raises(FormatError, match=named):
                open_archive(path, [name, "label"])
    monkeypatch.setattr(spans, "copied_tables", real)
    for name in ("speech", "image"):
        assert isinstance(open_archive(path, [name]).gathers[name], spans.SpanGather)


def test_slotted_spans_outside_their_values_are_refused_when_a_shard_is_put(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node cache's per-shard entries (spans.SlottedSpans) bound every sample's
    span as a gather over all shards does, when each shard is put, and keep nothing of
    a shard refused."""
    path = make_archive(tmp_path / "a")  # raw: what the node cache serves
    ds = open_archive(path)
    real = spans.copied_tables
    for name in ("speech", "image"):
        field = ds.fields[name]
        cases = [("first", 10**9), ("first", -5), ("size", -1), ("size", 10**6)]
        for place, value in cases + ([("zero", -2)] if name == "image" else []):
            slotted = spans.SlottedSpans(field, ds.starts, len(ds), 0.0)
            monkeypatch.setattr(
                spans, "copied_tables", forging(real, place, value, name == "image")
            )
            named = f"shard-00000.dlop: field '{name}' sample 1: its offsets or shape point"
            with pytest.raises(FormatError, match=named):
                slotted.prepared(0, ds.shards[0])
            assert slotted.bases[0] == 0 and slotted.values[0] is slotted.empty
            monkeypatch.setattr(spans, "copied_tables", real)
            slotted.put(0, slotted.prepared(0, ds.shards[0]))  # the real tables: taken
            assert slotted.bases[0] != 0


def test_tables_changed_in_place_since_open_are_refused(tmp_path: Path) -> None:
    """A gather made after its shards opened (a new reading, another epoch of a node
    cache) copies their tables and compares each copy's CRC-32 with the header's."""
    path = make_archive(tmp_path / "z", zstd=True)
    ds = open_archive(path)
    shard = ds.shards[0]
    for region in ("offsets", "shapes"):
        r = shard.layout_of("speech").regions[region]
        with open(shard.path, "r+b") as f:  # one byte flipped in place, the size kept
            f.seek(r.offset)
            byte = f.read(1)
            f.seek(r.offset)
            f.write(bytes([byte[0] ^ 1]))
        with pytest.raises(ChecksumError, match=f"region '{region}'.*changed in place"):
            Archive.over(ds.supply, ["speech"])
        with open(shard.path, "r+b") as f:
            f.seek(r.offset)
            f.write(byte)
    assert len(Archive.over(ds.supply, ["speech"]).__getitems__([0, 1])["speech"]) == 2


@pytest.mark.parametrize("pad", [0.0, 7.0])
def test_batches_planned_as_one_are_the_batches_planned_alone(tmp_path: Path, pad: float) -> None:
    # a ragged field (with empty samples), a fixed one and text over several shards,
    # batches of any size and order: one plan of them all into a buffer per field gives
    # each batch as it is gathered alone, each beginning on a whole 64-byte line
    fields = [Field("x", "f16", (None, 3)), Field("y", "i32", (2,)), Field.str_("t")]
    gen = np.random.default_rng(0)
    lengths = gen.integers(0, 9, 120)
    lengths[[3, 50]] = 0
    with ArchiveWriter(tmp_path / "a", fields, shard_bytes=1024) as w:
        for i, n in enumerate(lengths.tolist()):
            x = np.arange(n * 3, dtype=np.float16).reshape(n, 3) + i
            w.write({"x": x, "y": np.array([i, -i], np.int32), "t": f"s{i}"})
    ds = open_archive(tmp_path / "a", pad_value=pad)
    assert ds.reader.num_shards > 3
    batches = [gen.permutation(120)[:k] for k in (5, 1, 17, 3, 9)]
    batches[1] = np.array([3])  # a batch of one empty sample
    out = {
        "x": torch.full((4096,), 99.0, dtype=torch.float16),
        "y": torch.full((512,), 99, dtype=torch.int32),
    }
    cuts = np.cumsum([0, *map(len, batches)]).tolist()
    got = ds.plan_packed(torch.from_numpy(np.concatenate(batches)), cuts, out)
    assert got is not None
    made, plan = got
    assert len([s for s in plan.steps if isinstance(s, Runs)]) == 1  # x: one step for all
    execute(plan)
    ends = {"x": 0, "y": 0}
    for batch, idx in zip(made, batches, strict=True):
        alone = ds.gather(torch.from_numpy(idx))
        assert batch.keys() == alone.keys()
        for name in ("x", "x_lengths", "y"):
            assert batch[name].dtype == alone[name].dtype and batch[name].equal(alone[name])
        assert batch["t"] == alone["t"]
        for name in ("x", "y"):
            if not batch[name].numel():
                continue
            at = batch[name].data_ptr() - out[name].data_ptr()
            assert at % 64 == 0 and at >= ends[name]  # after the batch before
            ends[name] = at + batch[name].numel() * batch[name].element_size()


def test_batches_planned_as_one_need_cuts_that_tile_the_indices(archive: Path) -> None:
    ds = open_archive(archive, fields=["speech"])
    out = {"speech": torch.zeros(4096, dtype=torch.float32)}
    idx = torch.tensor([1, 2, 9, 10, 30])
    bad: list[Any] = [[0, 3, 2, 5], [1, 5], [0, 4], [0], [0, 2, 6], [0, 2.5, 5], [[0, 5]]]
    for cuts in bad:
        with pytest.raises(ValueError, match="cuts must be whole numbers that begin at 0"):
            ds.plan_packed(idx, cuts, out)
    got = ds.plan_packed(idx, [0, 0, 2, 5], out)  # an empty batch is one
    assert got is not None and [len(b["speech"]) for b in got[0]] == [0, 2, 3]


def test_batches_planned_as_one_into_buffers_of_another_type(archive: Path) -> None:
    # a buffer is memory: one of another element type holds the batches as one of the
    # field's own does (as Archive.plan takes it); one too short is refused, not overrun
    ds = open_archive(archive, fields=["speech"], pad_value=3.0)
    idx = torch.tensor([1, 2, 9, 10, 30, 31])
    cuts = [0, 2, 6]
    for dtype in (torch.float64, torch.uint8, torch.int16):
        out = {
            "speech": torch.zeros(16384 // torch.empty(0, dtype=dtype).element_size(), dtype=dtype)
        }
        got = ds.plan_packed(idx, cuts, out)
        assert got is not None
        execute(got[1])
        for batch, (a, b) in zip(got[0], [(0, 2), (2, 6)], strict=True):
            alone = ds.gather(idx[a:b])
            assert batch["speech"].equal(alone["speech"])
            assert batch["speech_lengths"].equal(alone["speech_lengths"])
    short = {"speech": torch.zeros(8, dtype=torch.float32)}
    with pytest.raises((ValueError, RuntimeError)):
        ds.plan_packed(idx, cuts, short)


@pytest.mark.parametrize("zstd", [False, True])
def test_the_most_a_field_buffer_needs_over_batches_is_each_batchs_most(
    tmp_path: Path, zstd: bool
) -> None:
    """most_numel (a continued epoch sizes its ring by it, all batches at once) equals the
    largest buffer_numel of the batches one by one, for every kind of field; empty
    batches and no batch included."""
    path = make_archive(tmp_path / "a", n=60, zstd=zstd)
    archive = open_archive(path)
    draw = np.random.default_rng(4)
    for name, gather in archive.gathers.items():
        for _ in range(20):
            batches = [
                np.sort(draw.choice(60, size=int(draw.integers(0, 9)), replace=False))
                for _ in range(int(draw.integers(0, 12)))
            ]
            want = max((gather.buffer_numel(len(b), b) or 0 for b in batches), default=0)
            assert gather.most_numel(batches) == want, (name, [len(b) for b in batches])

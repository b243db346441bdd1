"""What a batch costs does not grow with the shards it touches, and small batches share
their fixed costs: fixed fields are one copy step per batch over every shard, archives
whose fields all plan by arrays are checked once an epoch instead of per batch, and
small batches of fixed fields are made in groups. Each is checked against what the
same reading gives without it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dlop.formats import ArchiveWriter, Field, Zstd
from dlop.runtime import Archive, Loader, LoaderError, Source, open_archive
from dlop.runtime.gather import engine as engine_module
from dlop.runtime.gather.plan import Rows, Runs
from dlop.runtime.pipeline import packing
from dlop.runtime.storage.cached import open_cached

from .helpers import make_archive, not_utf8_in_copies

N = 1000


def write_small(path: Path, n: int = N, first: int = 0) -> Path:
    """Small fixed-size samples in many shards; ``label`` is the sample's number (plus
    ``first``), and the other fields follow from it."""
    fields = [Field("x", "u8", (8,)), Field("label", "i64", ()), Field("emb", "f32", (3,))]
    with ArchiveWriter(path, fields, shard_bytes=700) as w:
        for i in range(first, first + n):
            w.write({"x": np.full(8, i % 251, np.uint8), "label": i, "emb": emb(i)})
    return path


def emb(i: int) -> np.ndarray:
    return np.array([i, -i, i / 2], np.float32)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_small(tmp_path_factory.mktemp("s") / "a")


def consistent(batch: dict[str, Any]) -> list[int]:
    """The batch's labels, after checking every field agrees with them."""
    labels = batch["label"].tolist()
    assert batch["x"].tolist() == [[i % 251] * 8 for i in labels]
    np.testing.assert_array_equal(batch["emb"].numpy(), np.stack([emb(i) for i in labels]))
    return labels


def snapshot(loader: Loader, stop: int | None = None) -> list[dict[str, Any]]:
    out = []
    for j, b in enumerate(loader):
        if j == stop:
            break
        out.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()})
    return out


def one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packing, "GROUP_BATCHES", 1)


def test_the_archive_has_many_shards_and_small_batches_are_grouped(
    small: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loader = Loader(small, 8, seed=0)
    assert len(loader.archive.shards) >= 40
    assert loader.group_size == packing.GROUP_BATCHES  # 8 x 28 bytes a batch
    assert Loader(make_archive(small.parent / "ragged"), 8).group_size == 1  # ragged, text
    monkeypatch.setattr(packing, "GROUP_BYTES", 64 * 28)  # a group: 64 samples
    assert Loader(small, 8).group_size == 8
    assert Loader(small, 64).group_size == Loader(small, 100).group_size == 1
    loader = Loader(small, 8, seed=0, prefetch=2)
    assert all(b["x"].numel() == 8 * 8 * 8 for b in loader.buffers())  # 8 batches a slot


@pytest.mark.parametrize("order", ["window", "global"])
@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize(("batch_size", "drop_last"), [(7, False), (32, True), (32, False)])
def test_grouped_batches_are_the_orders_batches(
    small: Path, order: str, prefetch: int, batch_size: int, drop_last: bool
) -> None:
    loader = Loader(small, batch_size, seed=3, order=order, prefetch=prefetch, drop_last=drop_last)
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        got = [consistent(b) for b in loader]
        assert got == [b.tolist() for b in loader.batches()]
    loader.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_grouped_equals_one_by_one_across_ranks_mixtures_selections_transforms(
    small: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefetch: int
) -> None:
    other = write_small(tmp_path / "b", n=300, first=N)

    def shift(batch: dict[str, Any], generator: torch.Generator) -> dict[str, Any]:
        return {**batch, "emb": batch["emb"] + torch.rand(1, generator=generator)}

    def epochs() -> list[list[dict[str, Any]]]:
        made = []
        for rank in (0, 1):
            mixture = {"a": Source(small, weight=1.0), "b": Source(other, weight=2.0)}
            for source, chosen in (
                (small, {}),
                (mixture, {"samples_per_epoch": 900}),
                (small, {"indices": np.arange(0, N, 3)}),  # a selection
            ):
                loader = Loader(
                    source,
                    16,
                    seed=5,
                    rank=rank,
                    world_size=2,
                    prefetch=prefetch,
                    transforms=(shift,),
                    **chosen,
                )
                made.append(snapshot(loader))
                loader.close()
        return made

    grouped = epochs()
    one_by_one(monkeypatch)
    alone = epochs()
    assert len(grouped) == len(alone) == 6
    for a, b in zip(grouped, alone, strict=True):
        assert len(a) == len(b) > 10
        for x, y in zip(a, b, strict=True):
            assert x.keys() == y.keys()
            for k in x:
                assert torch.equal(x[k], y[k]), k
    assert any("source" in batches[0] for batches in grouped)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_resume_inside_a_group_continues_exactly(small: Path, prefetch: int) -> None:
    whole = [b.tolist() for b in Loader(small, 8, seed=1).batches()]
    loader = Loader(small, 8, seed=1, prefetch=prefetch)
    assert loader.group_size > 5
    it = iter(loader)
    for _ in range(5):  # inside the first group
        next(it)
    state = loader.state_dict()
    loader.close()
    again = Loader(small, 8, seed=1, prefetch=prefetch)
    again.load_state_dict(state)
    assert [consistent(b) for b in again] == whole[5:]


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("how", ["close", "new iter"])
def test_the_rest_of_a_group_is_not_handed_out_once_stopped(
    small: Path, prefetch: int, how: str
) -> None:
    loader = Loader(small, 8, seed=1, prefetch=prefetch)
    it = iter(loader)
    next(it)
    next(it)
    if how == "close":
        loader.close()
    else:
        iter(loader)
    with pytest.raises(LoaderError, match="this Loader iterator was stopped"):
        next(it)
    loader.close()


def test_a_batch_stays_valid_until_the_next_is_asked_for(small: Path) -> None:
    loader = Loader(small, 8, seed=2, prefetch=2)
    seen = []
    for b in loader:
        labels = b["label"].tolist()
        seen.append(labels)
        assert consistent(b) == labels  # unchanged while the loop holds it
    assert sorted(i for batch in seen for i in batch) == list(range(N))


class CountingChecks:
    """A supply that counts its ``check`` calls and the shards they cover."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def check(self, shards: Any) -> None:
        self.calls.append(len(np.unique(np.asarray(shards))))
        self.inner.check(shards)


def test_fields_planned_by_arrays_are_checked_once_an_epoch(
    small: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    supply = CountingChecks(open_archive(small).supply)
    ds = Archive.over(supply)
    shards = len(ds.shards)
    loader = Loader(ds, 8, seed=0)
    assert sum(1 for _ in loader) > 100
    assert supply.calls == [shards]  # every shard, once, as the epoch started
    monkeypatch.setenv("DLOP_NATIVE_COPY", "0")  # no compiled copier: each plan checked
    supply.calls.clear()
    assert [consistent(b) for b in loader] == [b.tolist() for b in loader.batches()]
    groups = -(-len(loader.batches()) // loader.group_size)
    assert len(supply.calls) == 1 + groups and supply.calls[0] == shards


def test_every_kind_of_field_is_checked_once_an_epoch(tmp_path: Path) -> None:
    """Text is sliced from copies the copier makes, zstd fields from blocks decoded from
    copied frames, arrays with several varying dimensions planned from copied tables:
    no batch checks its shards, and each reads what ``ds[i]`` reads."""
    path = make_archive(tmp_path / "a", n=37)
    zstd = make_archive(tmp_path / "z", n=37, zstd=True)
    words = tmp_path / "w"  # zstd text and bytes, several blocks to a shard
    coded = Zstd(block_bytes=16)
    fields = [Field.str_("t", codec=coded), Field.bytes_("b", codec=coded)]
    with ArchiveWriter(words, fields, shard_bytes=120) as w:
        for i in range(37):
            w.write({"t": f"w{i}é" * (i % 4), "b": bytes([i]) * (i % 5)})
    for archive, fields in (
        (path, ["key", "text", "label"]),
        (path, ["text", "image"]),
        (zstd, ["logmel", "text"]),
        (words, ["t", "b"]),
    ):
        ds = open_archive(archive, fields)
        supply = CountingChecks(ds.supply)
        loader = Loader(Archive.over(supply, fields), 6, seed=0)
        order = loader.batches()
        for batch, idx in zip(loader, order, strict=True):  # (buffers reused: check each now)
            for j, i in enumerate(idx.tolist()):
                for name in fields:
                    want, got = ds[i][name], batch[name][j]
                    if isinstance(want, torch.Tensor):  # padded: compare the sample's part
                        got = got[tuple(slice(0, n) for n in want.shape)]
                        assert torch.equal(got, want), (name, i)
                    else:
                        assert got == want, (name, i)
        assert len(supply.calls) == 1, fields  # the epoch's one check of every shard


def test_a_batch_over_every_shard_is_one_step_per_field(small: Path) -> None:
    ds = open_archive(small)
    idx = torch.arange(0, N, 3)  # every shard
    touched = len(np.unique(ds.shards_of(idx)))
    assert touched == len(ds.shards)
    batch, plan = ds.plan(idx)
    assert [type(s) for s in plan.steps] == [Rows, Rows, Rows]
    ds.own_engine().run(plan)
    assert consistent(batch) == idx.tolist()


@pytest.mark.parametrize("native", ["1", "0"])
def test_getitems_in_any_order_needs_no_sort(
    small: Path, monkeypatch: pytest.MonkeyPatch, native: str
) -> None:
    monkeypatch.setenv("DLOP_NATIVE_COPY", native)
    ds = open_archive(small)
    assert ds.planner.by_arrays
    idx = [999, 0, 512, 3, 3, 740, 1]
    assert consistent(ds.__getitems__(idx)) == idx
    monkeypatch.setattr(torch, "argsort", None)  # no sort on the way
    assert consistent(ds.__getitems__(torch.tensor(idx))) == idx


@pytest.fixture
def asks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many shards each RemoteSupply.ask asks for, in order."""
    from dlop.runtime.storage.remote_supply import RemoteSupply

    asked: list[int] = []
    ask = RemoteSupply.ask

    def counted(self: RemoteSupply, shards: Any) -> None:
        asked.append(len(shards))
        ask(self, shards)

    monkeypatch.setattr(RemoteSupply, "ask", counted)
    return asked


def test_a_warm_node_cache_holds_the_archive_for_the_epoch(
    small: Path, tmp_path: Path, asks: list[int]
) -> None:
    """Through the node cache (a RemoteSupply over the folder): the cold epoch holds
    shards batch by batch, one batch at a time; once every shard is cached and mapped,
    an epoch holds them all with one ask, plans and groups as over mapped shards, and
    lets go of them all when it ends or stops. Batches equal the local Loader's."""
    local = Loader(small, 16, seed=4)
    supply = open_cached(small, tmp_path / "c", 1 << 30, local=True)
    loader = Loader(Archive.over(supply), 16, seed=4)
    shards = len(local.archive.shards)
    for epoch in (0, 1, 2):
        local.set_epoch(epoch)
        loader.set_epoch(epoch)
        asks.clear()
        got = [consistent(b) for b in loader]
        assert got == [consistent(b) for b in local]
        assert supply.asked == 0  # every hold let go of
        if epoch == 0:  # cold: batch by batch
            assert len(asks) > len(got) and max(asks) < shards
            assert not loader.archive.planner.groups_batches
        else:  # warm: one hold of everything
            assert asks == [shards]
    stopped = Loader(Archive.over(supply), 2, seed=4)  # 500 batches: 8 groups of 64
    it = iter(stopped)
    next(it)
    assert supply.asked == shards and stopped.archive.planner.groups_batches
    stopped.close()
    assert supply.asked == 0
    loader.close()
    assert supply.asked == 0
    local.close()


def test_a_cache_too_small_for_the_archive_holds_batch_by_batch(
    small: Path, tmp_path: Path
) -> None:
    size = sum(p.stat().st_size for p in small.glob("*.dlop"))
    supply = open_cached(small, tmp_path / "c", size // 3, local=True)
    loader = Loader(Archive.over(supply), 16, seed=4, order="window", window_shards=2)
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        assert [consistent(b) for b in loader] == [b.tolist() for b in loader.batches()]
        assert not loader.archive.planner.groups_batches
    assert loader.archive.planner.hold_whole() is False  # not every shard is cached
    loader.close()


def test_an_iterable_archive_over_a_warm_cache_holds_it_for_the_pass(
    small: Path, tmp_path: Path, asks: list[int]
) -> None:
    from torch.utils.data import DataLoader

    from dlop.runtime import IterableArchive, batch_as_is

    supply = open_cached(small, tmp_path / "c", 1 << 30, local=True)
    ds = IterableArchive(Archive.over(supply), 16, seed=6)
    want = [b.tolist() for b in Loader(small, 16, seed=6).batches()]
    shards = len(open_archive(small).shards)
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        asks.clear()
        assert [consistent(b) for b in ds] == [b.tolist() for b in ds.batches(epoch)]
        assert supply.asked == 0  # every hold let go of
        if epoch == 0:  # cold: batch by batch
            assert len(asks) > 10 and max(asks) < shards
        else:  # warm: one hold of everything for the pass
            assert asks == [shards]
    ds.set_epoch(0)
    assert [consistent(b) for b in ds] == want
    cached = Archive.over(open_cached(small, tmp_path / "w", 1 << 30, local=True))
    iterable = IterableArchive(cached, 16, seed=6)
    workers = DataLoader(
        iterable, batch_size=None, num_workers=2, persistent_workers=True, collate_fn=batch_as_is
    )
    for epoch in (0, 1):  # cold, then warm in each worker
        iterable.set_epoch(epoch)
        assert [consistent(b) for b in workers] == [b.tolist() for b in iterable.batches(epoch)]


def test_a_sample_number_outside_the_archive_is_refused_not_wrapped(tmp_path: Path) -> None:
    ragged = open_archive(make_archive(tmp_path / "r", n=37), fields=["speech", "label"])
    fixed = open_archive(write_small(tmp_path / "f"))
    for ds, n in ((ragged, 37), (fixed, N)):
        for bad in (-1, -n, n, n + 5):
            with pytest.raises(IndexError, match=f"sample {bad} out of range 0..{n - 1}"):
                ds.gather(torch.tensor([0, bad]))


def test_a_failed_epoch_start_keeps_the_resume_position(
    small: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dlop.runtime.errors import ShardChangedError

    whole = [b.tolist() for b in Loader(small, 8, seed=1).batches()]
    loader = Loader(small, 8, seed=1)
    it = iter(loader)
    for _ in range(5):
        next(it)
    state = loader.state_dict()
    loader.close()
    again = Loader(small, 8, seed=1)
    again.load_state_dict(state)
    fails = [True]

    def check(shards: Any = None) -> None:
        if fails.pop() if fails else False:
            raise ShardChangedError("a shard shrank")

    monkeypatch.setattr(again.archive, "check_shards", check)
    with pytest.raises(LoaderError, match="a shard shrank"):
        iter(again)
    assert [consistent(b) for b in again] == whole[5:]  # the retry resumes where it was


def test_a_closed_synchronous_epoch_lets_go_of_a_warm_cache_at_once(
    small: Path, tmp_path: Path
) -> None:
    supply = open_cached(small, tmp_path / "c", 1 << 30, local=True)
    loader = Loader(Archive.over(supply), 2, seed=4, prefetch=0)
    assert sum(1 for _ in loader) == N // 2  # cold: every shard now cached
    it = iter(loader)
    next(it)
    assert supply.asked == len(open_archive(small).shards)  # held for the epoch
    loader.close()  # the iterator is still referenced: not collected
    assert supply.asked == 0
    del it


@pytest.mark.parametrize("prefetch", [0, 2])
def test_ragged_batches_share_a_slot_as_far_as_it_holds_them(
    tmp_path: Path, prefetch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the field kinds packed: fixed, ragged in one axis, text (ragged in two axes, fresh
    # tensors, is made one batch a slot)
    path = make_archive(tmp_path / "every", n=60)
    fields = ["key", "label", "logmel", "speech", "text"]
    loader = Loader(path, 4, seed=1, bucket_by="speech", prefetch=prefetch, fields=fields)
    ds = open_archive(path, fields=fields)
    made = {}
    for epoch in range(2):
        loader.set_epoch(epoch)
        made[epoch] = snapshot(loader)
        for batch, want in zip(made[epoch], loader.batches(epoch), strict=True):
            for name, value in ds.gather(torch.from_numpy(want)).items():
                got = batch[name]
                assert got.equal(value) if isinstance(value, torch.Tensor) else got == value
    # where each batch's ragged field begins: inside a ring slot, several batches a slot
    # (a slot holds the largest batch the order can make, room for several others)
    slots = [(b["speech"].data_ptr(), b["speech"].numel() * 4) for b in loader.buffers()]
    starts = set()
    for batch in loader:
        at = batch["speech"].data_ptr()
        assert any(lo <= at < lo + size for lo, size in slots)
        starts.add(at)
    assert len(starts) > len(slots)
    monkeypatch.setattr(packing, "GROUP_BATCHES", 1)  # one by one: the same batches
    alone = Loader(path, 4, seed=1, bucket_by="speech", prefetch=prefetch, fields=fields)
    for a, b in zip(snapshot(alone), made[0], strict=True):
        assert a["speech"].equal(b["speech"]) and a["text"] == b["text"]
    assert len({b["speech"].data_ptr() for b in alone}) <= len(slots)


def read_until_it_fails(loader: Loader, bad: int, said: str) -> None:
    """An epoch read until batch ``bad`` fails, its error going on with ``said`` (a
    pattern) after the batch and epoch: every batch before it is
    handed out, and the state counts them."""
    got = []
    with pytest.raises(LoaderError, match=f"batch {bad} of epoch 0{said}"):
        for batch in loader:
            got.append(batch["label"].tolist())
    assert got == [b.tolist() for b in loader.batches(0)[:bad]]
    assert loader.state_dict()["batches_done"] == bad


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_batch_failing_in_a_packed_group_is_the_one_named(
    tmp_path: Path, prefetch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make_archive(tmp_path / "a", n=60, shard_bytes=1 << 20)  # one shard
    fields = ["label", "speech", "text"]
    loader = Loader(path, 4, seed=1, fields=fields, prefetch=prefetch)
    bad = 4  # a text sample of the fifth batch is not UTF-8: the batches before it are read
    row = next(int(i) for i in loader.batches(0)[bad] if int(i) % 4)
    not_utf8_in_copies(monkeypatch, loader.archive.shards[0], "text", row)
    read_until_it_fails(loader, bad, ".*not UTF-8")


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("again", ["copy", "plan"])
def test_a_copy_failing_in_a_packed_group_names_its_batch(
    tmp_path: Path, prefetch: int, again: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a group's batches planned as one plan (one run per sample, whatever the batch), its
    # copy failing at a sample of the third batch: the batches before it are handed out.
    # Each batch is then planned again and copied alone; the third fails in its copy, or
    # in being planned again (a shard that changed meanwhile): the error names it either way
    path = make_archive(tmp_path / "a", n=60, shard_bytes=1 << 20)  # one shard
    loader = Loader(path, 4, seed=1, fields=["label", "speech"], prefetch=prefetch)
    bad = 2
    spans = loader.archive.gathers["speech"]
    row = int(loader.batches(0)[bad][1])
    address = int(spans.bases[0]) + int(spans.first[row]) * 4  # the sample's first value
    real, real_plan = engine_module.execute_step, Loader.plan
    steps = []
    failed = []

    def failing(step: Any, streaming: bool) -> None:
        steps.append(step)
        if isinstance(step, Runs) and address in step.src:
            failed.append(step)
            raise OSError("simulated copy failure")
        real(step, streaming)

    def planned_again(self: Loader, indices: Any, buffers: Any) -> Any:
        if again == "plan" and failed and row in indices.tolist():
            raise OSError("simulated failure planning again")
        return real_plan(self, indices, buffers)

    monkeypatch.setattr(engine_module, "execute_step", failing)
    monkeypatch.setattr(Loader, "plan", planned_again)
    read_until_it_fails(loader, bad, " failed: OSError")
    # the group was one plan: a step that copied samples of several batches at once
    firsts = {int(loader.batches(0)[j][0]) for j in range(bad + 1)}
    starts = [int(spans.bases[0]) + int(spans.first[i]) * 4 for i in firsts]
    assert any(sum(a in s.src for a in starts) > 1 for s in steps if isinstance(s, Runs))
    monkeypatch.setattr(engine_module, "execute_step", real)
    failed.clear()
    assert sum(len(b["label"]) for b in loader) == 60  # the next epoch reads cleanly
    loader.close()


def test_a_copy_failing_in_a_group_of_one_is_not_copied_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make_archive(tmp_path / "a", n=60, shard_bytes=1 << 20)
    monkeypatch.setattr(packing, "GROUP_BATCHES", 1)  # one batch a group
    loader = Loader(path, 4, seed=1, fields=["label", "speech"], prefetch=0)
    spans = loader.archive.gathers["speech"]
    row = int(loader.batches(0)[1][0])
    address = int(spans.bases[0]) + int(spans.first[row]) * 4
    real = engine_module.execute_step
    tries = []

    def failing(step: Any, streaming: bool) -> None:
        if isinstance(step, Runs) and address in step.src:
            tries.append(step)
            raise OSError("simulated copy failure")
        real(step, streaming)

    monkeypatch.setattr(engine_module, "execute_step", failing)
    with pytest.raises(LoaderError, match="batch 1 of epoch 0 failed: OSError"):
        for _ in loader:
            pass
    assert len(tries) == 1
    loader.close()


def test_fresh_tensor_fields_are_made_one_batch_a_slot(tmp_path: Path) -> None:
    # ragged in two axes: gathered into fresh tensors, whose memory packing would not bound
    path = make_archive(tmp_path / "a", n=60)
    loader = Loader(path, 4, seed=1, fields=["label", "image"], prefetch=0)
    pointers = {b["label"].data_ptr() for b in loader}
    assert len(pointers) == 1  # every batch at the front of the one slot


def test_a_continued_epoch_larger_than_this_worlds_grows_the_ring(tmp_path: Path) -> None:
    # a mixture's epoch is rounded to its world: smaller here than the batch size, so this
    # world's ring holds fewer samples than a batch the world of the state made (the
    # image field, gathered fresh, keeps the ring to one batch a slot)
    a, b = make_archive(tmp_path / "a", n=40), make_archive(tmp_path / "b", n=40)
    fields = ["label", "speech", "image"]
    options: dict[str, Any] = {"seed": 1, "samples_per_epoch": 5, "fields": fields}
    old = Loader({"a": a, "b": b}, 8, rank=0, world_size=4, prefetch=0, **options)
    state = old.state_dict()
    new = Loader({"a": a, "b": b}, 8, rank=0, world_size=1, prefetch=0, **options)
    new.load_state_dict(state)
    want = new.batches()
    assert max(len(x) for x in want) > 5  # more than this world's epoch
    ds = Archive([a, b], fields=fields, pad_value=0.0)
    for batch, indices in zip(new, want, strict=True):
        assert batch["speech"].equal(ds.gather(torch.from_numpy(indices))["speech"])


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_continued_epoch_of_fixed_fields_grows_a_slot_of_grouped_batches(
    tmp_path: Path, prefetch: int
) -> None:
    # small fixed-size batches share a slot (group_size at a time): the slot must hold a
    # group of the continued epoch's larger batches, not one of them
    a, b = make_archive(tmp_path / "a", n=40), make_archive(tmp_path / "b", n=40)
    options: dict[str, Any] = {"seed": 1, "samples_per_epoch": 5, "fields": ["label"]}
    old = Loader({"a": a, "b": b}, 64, rank=0, world_size=512, prefetch=prefetch, **options)
    new = Loader({"a": a, "b": b}, 64, rank=0, world_size=1, prefetch=prefetch, **options)
    assert new.group_size > 1
    new.load_state_dict(old.state_dict())
    want = new.batches()
    assert len(want) > 1 and max(len(x) for x in want) > 5
    assert [b["label"].tolist() for b in new] == [
        (np.asarray(x) - np.where(np.asarray(x) >= 40, 40, 0)).tolist() for x in want
    ]

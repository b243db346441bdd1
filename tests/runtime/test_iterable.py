"""IterableArchive in DataLoader worker processes: epochs reach persistent workers, every
sample once per epoch in a new order, bucketing, and exact resume."""

from __future__ import annotations

import gc
import mmap
import os
import pickle
import platform
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from dlop.formats import ArchiveWriter, Field
from dlop.runtime import IterableArchive, Loader, LoaderError, Source, batch_as_is, open_archive
from dlop.runtime.batch import Batch
from dlop.runtime.errors import UsageError, UsageTypeError
from dlop.runtime.gather import memory
from dlop.runtime.gather.memory import populate
from dlop.runtime.pipeline import shared_ring

from .helpers import make_archive


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_archive(tmp_path_factory.mktemp("it") / "a", n=40)


@pytest.fixture(scope="module")
def odd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_archive(tmp_path_factory.mktemp("it37") / "a", n=37)


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2000 labels only: N=2000, batch 256 leaves a tail that no worker count divides."""
    path = tmp_path_factory.mktemp("it2000") / "a"
    with ArchiveWriter(path, [Field("label", "i64", ())], shard_bytes=4000) as w:
        for i in range(2000):
            w.write({"label": i})
    return path


def labels(batches: list[dict[str, torch.Tensor]]) -> list[list[int]]:
    return [b["label"].tolist() for b in batches]


def workers_loader(ds: IterableArchive, workers: int) -> DataLoader[dict[str, torch.Tensor]]:
    return DataLoader(
        ds,
        batch_size=None,
        num_workers=workers,
        persistent_workers=workers > 0,
        multiprocessing_context="fork" if workers else None,
    )


def loader_labels(path: Path, **kw: object) -> list[list[int]]:
    loader = Loader(path, **kw)  # type: ignore[arg-type]
    loader.set_epoch(1)
    got = [b["label"].tolist() for b in loader]  # the Loader reuses its buffers
    loader.close()
    return got


@pytest.mark.slow
@pytest.mark.filterwarnings(
    "ignore:This DataLoader will create:UserWarning"
)  # 3 workers on 2 cores
@pytest.mark.parametrize("workers", [0, 2, 3])
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize(("which", "batch_size"), [("odd", 8), ("big", 256)])
def test_workers_yield_the_loaders_batches_exactly_once(
    which: str,
    batch_size: int,
    drop_last: bool,
    world: int,
    workers: int,
    request: pytest.FixtureRequest,
) -> None:
    path: Path = request.getfixturevalue(which)
    n = 37 if which == "odd" else 2000
    served: Counter[int] = Counter()
    for rank in range(world):
        kw = dict(batch_size=batch_size, seed=3, drop_last=drop_last, rank=rank, world_size=world)
        ds = IterableArchive(path, **kw)  # type: ignore[arg-type]
        ds.set_epoch(1)
        got = labels(list(workers_loader(ds, workers)))
        assert got == loader_labels(path, **kw)  # the Loader's batches, in its order
        assert len(got) == len(ds)
        served.update(x for b in got for x in b)
    if drop_last:
        assert max(served.values()) == 1
        per_rank = n // world
        assert sum(served.values()) == world * (per_rank - per_rank % batch_size)
    elif world == 1:
        assert served == Counter(range(n))  # every sample exactly once
    else:
        assert set(served) == set(range(n)) and sum(served.values()) - n < world


@pytest.mark.slow
@pytest.mark.filterwarnings(
    "ignore:This DataLoader will create:UserWarning"
)  # 3 workers on 2 cores
@pytest.mark.parametrize(("saved_with", "loaded_with"), [(2, 2), (2, 3), (0, 2), (3, 0)])
def test_resume_with_any_worker_count_then_set_epoch(
    odd: Path, saved_with: int, loaded_with: int
) -> None:
    ds = IterableArchive(odd, batch_size=4, seed=3, bucket_by="speech")
    ds.set_epoch(2)
    full = labels(list(workers_loader(ds, saved_with)))
    assert len(full) == 10
    ds.set_epoch(2)
    it = iter(workers_loader(ds, saved_with))
    taken = [next(it)["label"].tolist() for _ in range(3)]
    del it
    assert taken == full[:3]
    state = ds.state_dict(batches_done=3)
    fresh = IterableArchive(odd, batch_size=4, seed=3, bucket_by="speech")
    fresh.load_state_dict(state)
    fresh.set_epoch(state["epoch"])  # the usual loop: set_epoch after load_state_dict keeps it
    resumed = workers_loader(fresh, loaded_with)
    assert labels(list(resumed)) == full[3:]
    following = IterableArchive(odd, batch_size=4, seed=3, bucket_by="speech")
    following.set_epoch(3)
    # the iteration after, with no set_epoch, runs the next epoch
    assert labels(list(resumed)) == labels(list(workers_loader(following, 0)))
    fresh.load_state_dict(state)
    fresh.set_epoch(3)  # another epoch drops the resume
    assert len(list(workers_loader(fresh, loaded_with))) == 10


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_state_with_workers_comes_from_the_batch_taken(odd: Path) -> None:
    ds = IterableArchive(odd, batch_size=4, seed=3)
    full = labels(list(workers_loader(ds, 0)))
    ds.set_epoch(0)  # the same epoch again (a new pass alone would run the next)
    it = iter(workers_loader(ds, 2))
    taken = [next(it) for _ in range(7)]
    with pytest.raises(UsageError, match=r"after=batch"):
        ds.state_dict()  # the workers served the batches: this process counted none
    assert [b.position for b in taken] == list(range(7))
    state = ds.state_dict(after=taken[-1])
    del it
    assert state["batches_done"] == 7
    fresh = IterableArchive(odd, batch_size=4, seed=3)
    fresh.load_state_dict(state)
    it = iter(workers_loader(fresh, 2))
    resumed = next(it)
    assert resumed["label"].tolist() == full[7] and resumed.position == 7  # from the epoch start
    again = fresh.state_dict(after=resumed)
    del it
    assert again["batches_done"] == 8
    with pytest.raises(UsageError, match="no batches_done"):
        fresh.state_dict(3, after=resumed)


def test_state_settings_mismatch_is_refused(odd: Path) -> None:
    state = IterableArchive(odd, 4, seed=3).state_dict()
    changed = {
        "shuffle": {"shuffle": False},
        "drop_last": {"drop_last": True},
        "order": {"order": "window"},
        "window_shards": {"window_shards": 2},
        "bucket_by": {"bucket_by": "speech"},
        "bucket_window": {"bucket_window": 3},
    }
    for key, kw in changed.items():
        other = IterableArchive(odd, 4, seed=3, **kw)  # type: ignore[arg-type]
        with pytest.raises(UsageError, match=key):
            other.load_state_dict(state)
    rank1 = IterableArchive(odd, 4, seed=3, rank=1, world_size=2).state_dict(batches_done=2)
    rank0 = IterableArchive(odd, 4, seed=3, rank=0, world_size=2)
    rank0.load_state_dict(rank1)  # ranks step together: any rank's state serves each
    assert rank0.state_dict()["batches_done"] == 2
    with pytest.raises(UsageError, match="num_samples"):
        IterableArchive(odd, 4, seed=3).load_state_dict({**state, "num_samples": 40})
    with pytest.raises(UsageError, match="version"):
        IterableArchive(odd, 4, seed=3).load_state_dict({**state, "version": 1})
    with pytest.raises(UsageError, match="batches_done"):
        IterableArchive(odd, 4, seed=3).load_state_dict({**state, "batches_done": 11})


def test_a_state_holding_arrays_or_a_huge_epoch_is_refused_cleanly(odd: Path) -> None:
    # an array compared with a setting raised numpy's "truth value is ambiguous", and an
    # epoch past int64 overflowed the tensor shared with the workers
    for ds in (IterableArchive(odd, 4, seed=3), Loader(odd, 4, seed=3, prefetch=0)):
        state = ds.state_dict(0) if isinstance(ds, IterableArchive) else ds.state_dict()
        for key in ("seed", "archives", "rank", "version"):
            with pytest.raises(UsageError, match=key):
                ds.load_state_dict({**state, key: np.arange(3)})
        with pytest.raises((UsageError, UsageTypeError), match=r"format|takes the dict"):
            ds.load_state_dict({**state, "format": np.arange(3)})
        with pytest.raises(UsageError, match="epoch must be at most 9223372036854775807"):
            ds.load_state_dict({**state, "epoch": 2**63})
        with pytest.raises(UsageError, match="epoch must be at most"):
            ds.set_epoch(2**63)
        ds.load_state_dict({**state, "epoch": 2**63 - 1})
        assert ds.epoch == 2**63 - 1


def test_each_pass_counts_from_its_start(odd: Path) -> None:
    ds = IterableArchive(odd, batch_size=4, seed=3)
    assert sum(1 for _ in ds) == 10
    assert ds.state_dict()["batches_done"] == 10
    it = iter(ds)  # a second pass over the same epoch, no set_epoch
    for _ in range(2):
        next(it)
    state = ds.state_dict()
    assert state["batches_done"] == 2
    again = IterableArchive(odd, batch_size=4, seed=3)
    again.load_state_dict(state)
    assert sum(1 for _ in again) == 8
    with pytest.raises(UsageError, match="batches_done"):
        ds.state_dict(batches_done=11)


@pytest.mark.slow
def test_persistent_workers_see_each_epoch_and_resume_exactly(archive: Path) -> None:
    ds = IterableArchive(archive, batch_size=4, seed=7, drop_last=True)
    loader = DataLoader(
        ds, batch_size=None, num_workers=2, persistent_workers=True, multiprocessing_context="fork"
    )
    epochs = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        got = labels(list(loader))
        flat = [x for b in got for x in b]
        assert sorted(flat) == list(range(40))  # every sample exactly once
        epochs.append(got)
    assert len({str(e) for e in epochs}) == 3  # a new order each epoch
    # Resume: stop after 3 batches of epoch 1, save, continue in a fresh DataLoader.
    ds.set_epoch(1)
    it = iter(loader)
    taken = [next(it)["label"].tolist() for _ in range(3)]
    state = ds.state_dict(batches_done=3)
    del it
    assert taken == epochs[1][:3]
    fresh = IterableArchive(archive, batch_size=4, seed=7, drop_last=True)
    fresh.load_state_dict(state)
    resumed = DataLoader(
        fresh,
        batch_size=None,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context="fork",
    )
    assert labels(list(resumed)) == epochs[1][3:]
    assert labels(list(resumed)) == epochs[2]  # the iteration after runs the next epoch


def test_in_process_order_matches_the_loader_with_bucketing(archive: Path) -> None:
    ds = IterableArchive(archive, batch_size=5, seed=3, bucket_by="speech")
    ds.set_epoch(2)
    loader = Loader(archive, 5, seed=3, bucket_by="speech")
    loader.set_epoch(2)
    expected = [b["label"].tolist() for b in loader]
    got = labels(list(ds))
    assert got == expected
    first = IterableArchive(archive, batch_size=5, seed=3, bucket_by="speech")
    first.set_epoch(2)
    it = iter(first)
    for _ in range(4):
        next(it)
    state = first.state_dict()  # counted in process: no DataLoader workers
    assert state["batches_done"] == 4 and state["epoch"] == 2
    again = IterableArchive(archive, batch_size=5, seed=3, bucket_by="speech")
    again.load_state_dict(state)
    assert labels(list(again)) == expected[4:]
    loader.close()


def test_loader_resume_survives_set_epoch(archive: Path) -> None:
    first = Loader(archive, 4, seed=1)
    first.set_epoch(3)
    expected = [b["label"].tolist() for b in first]
    first.set_epoch(3)  # the same epoch again (a new pass alone would run the next)
    it = iter(first)
    for _ in range(3):
        next(it)
    state = first.state_dict()
    del it
    first.close()
    again = Loader(archive, 4, seed=1)
    again.load_state_dict(state)
    again.set_epoch(state["epoch"])
    assert [b["label"].tolist() for b in again] == expected[3:]
    assert len(list(again)) == len(expected)
    again.close()


def test_iterable_misuse_is_refused(archive: Path) -> None:
    with pytest.raises(UsageError, match="bucket_by must name a ragged field"):
        IterableArchive(archive, 4, bucket_by="label")
    ds = IterableArchive(archive, 4, seed=1)
    with pytest.raises(UsageError, match="seed"):
        ds.load_state_dict({**IterableArchive(archive, 4, seed=2).state_dict(), "epoch": 0})
    with pytest.raises(UsageError, match="epoch must be at least 0"):
        ds.set_epoch(-1)


# -- shared-memory slots in DataLoader workers --------------------------------------


def cloned(batch: dict[str, object]) -> dict[str, object]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def assert_same(got: dict[str, object], expected: dict[str, object]) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert isinstance(got[name], torch.Tensor) and torch.equal(got[name], value), name
        else:
            assert got[name] == value, name


def loader_batches(path: Path, **kw: object) -> list[dict[str, object]]:
    loader = Loader(path, **kw)  # type: ignore[arg-type]
    loader.set_epoch(1)
    got = [cloned(b) for b in loader]
    loader.close()
    return got


@pytest.fixture(scope="module", params=["raw", "zstd"])
def many(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every field kind, 90 samples: 30 batches of 3, many more than the workers' slots."""
    path = tmp_path_factory.mktemp(f"many-{request.param}") / "a"
    return make_archive(path, n=90, zstd=request.param == "zstd")


SLOTS_KW = dict(batch_size=3, seed=5, bucket_by="speech")


@pytest.mark.parametrize("workers", [0, 2])
def test_worker_batches_are_the_loaders_and_kept_ones_keep_their_values(
    many: Path, workers: int
) -> None:
    expected = loader_batches(many, **SLOTS_KW)
    ds = IterableArchive(many, **SLOTS_KW)  # type: ignore[arg-type]
    ds.set_epoch(1)
    kept: dict[str, object] = {}
    count = 0
    for j, batch in enumerate(workers_loader(ds, workers)):
        assert_same(batch, expected[j])
        if j == 1:
            kept["batch"] = batch  # a whole batch
        elif j == 2:
            kept["view"] = batch["speech"][1:]  # a view of one tensor, its batch dropped
        elif j == 3:
            kept["array"] = batch["logmel"].numpy()  # memory held through numpy
        count += 1
    assert count == len(expected) == 30
    assert_same(kept["batch"], expected[1])  # type: ignore[arg-type]
    assert torch.equal(kept["view"], expected[2]["speech"][1:])  # type: ignore[arg-type, index]
    assert (kept["array"] == expected[3]["logmel"].numpy()).all()  # type: ignore[attr-defined, index]
    in_slots, fresh = ds.buffer_counts()
    if workers:
        assert in_slots > 0 and in_slots + fresh == 30
    else:
        assert (in_slots, fresh) == (0, 0)  # made in this process: no DataLoader hand-over


def test_a_loop_that_drops_each_batch_reuses_the_slots(many: Path) -> None:
    ds = IterableArchive(many, **SLOTS_KW)  # type: ignore[arg-type]
    for _ in workers_loader(ds, 2):
        pass
    assert ds.buffer_counts() == (30, 0)  # prefetch_factor 2 and one batch in hand fit 4 slots


def test_batches_all_kept_get_fresh_memory_and_keep_their_values(many: Path) -> None:
    expected = loader_batches(many, **SLOTS_KW)
    ds = IterableArchive(many, **SLOTS_KW)  # type: ignore[arg-type]
    ds.set_epoch(1)
    got = list(workers_loader(ds, 2))  # every batch held: no slot is ever free again
    assert len(got) == len(expected)
    for batch, want in zip(got, expected, strict=True):
        assert_same(batch, want)
    assert ds.buffer_counts() == (8, 22)  # 4 slots in each of 2 workers, then fresh memory
    no_slots = IterableArchive(many, **SLOTS_KW, worker_buffers=0)  # type: ignore[arg-type]
    assert len(list(workers_loader(no_slots, 2))) == 30
    assert no_slots.buffer_counts() == (0, 30)


def test_batch_as_is_hands_on_the_loaders_batches_without_the_default_walk(
    many: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """collate_fn=batch_as_is: the same batches, text fields included, and torch's
    default_convert never called on them (the workers are forked after the patch)."""
    import torch.utils.data._utils.collate as collate

    def refuse(data: Any) -> Any:
        raise AssertionError("default_convert walked a batch")

    monkeypatch.setattr(collate, "default_convert", refuse)
    expected = loader_batches(many, **SLOTS_KW)
    ds = IterableArchive(many, **SLOTS_KW)  # type: ignore[arg-type]
    ds.set_epoch(1)
    loader = DataLoader(
        ds,
        batch_size=None,
        num_workers=2,
        multiprocessing_context="fork",
        collate_fn=batch_as_is,
    )
    got = 0
    for batch, want in zip(loader, expected, strict=True):
        assert_same(batch, want)
        got += 1
    assert got == len(expected) and ds.buffer_counts() == (len(expected), 0)
    assert pickle.loads(pickle.dumps(batch_as_is)) is batch_as_is  # spawn/forkserver workers


@pytest.mark.parametrize("by_proc", [True, False])
def test_slot_batches_travel_by_descriptor_number_or_by_torch(
    many: Path, by_proc: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where /proc serves (Linux), a slot batch carries its segment's pid, descriptor and
    inode and the main process maps it itself; elsewhere torch sends the descriptor.
    Either way the batches are the Loader's and the slots are reused."""
    assert shared_ring.proc_fds_open() == (platform.system() == "Linux")
    expected = loader_batches(many, **SLOTS_KW)
    if not by_proc:  # as where /proc does not serve: the table says so as it is made
        monkeypatch.setattr(shared_ring, "proc_fds_open", lambda: False)
    ds = IterableArchive(many, **SLOTS_KW)  # type: ignore[arg-type]
    ds.set_epoch(1)
    for batch, want in zip(workers_loader(ds, 2), expected, strict=True):
        assert_same(batch, want)
    assert ds.buffer_counts() == (30, 0)


@pytest.mark.parametrize("by_proc", [True, False])
def test_a_slot_batch_pickles_its_pieces_by_descriptor_number(by_proc: bool) -> None:
    if by_proc and not shared_ring.proc_fds_open():
        pytest.skip("no /proc/<pid>/fd here")
    table = shared_ring.ReleaseTable(12345, 1, 2)
    slot = shared_ring.new_slot(2 * shared_ring.ALIGN)
    assert slot is not None
    x = slot.allocate((2, 3), torch.float32).copy_(torch.arange(6.0).reshape(2, 3))
    big = slot.allocate((4 * shared_ring.ALIGN,), torch.uint8).fill_(7)  # fresh: overflow
    items = {"x": x[:, 1:], "big": big, "key": ["a", "b"]}  # a strided view, kept as one
    handle = shared_ring.segment_handle(slot.memory) if by_proc else None
    sent = shared_ring.SlotBatch(items, slot.memory[:1], shared_ring.Ticket(12345, 0, 1, 9), handle)
    how, args, _ = sent.__reduce__()
    assert how is (shared_ring.claim_by_proc if by_proc else shared_ring.claim)
    if by_proc:
        pieces = {name: piece for name, piece, _ in args[1]}
        assert pieces == {"x": True, "big": False, "key": False}
    got = pickle.loads(pickle.dumps(sent))  # unpickled here: this process is the "main" one
    assert list(got) == ["x", "big", "key"]
    assert torch.equal(got["x"], x[:, 1:]) and got["x"].stride() == x[:, 1:].stride()
    assert torch.equal(got["big"], big) and got["key"] == ["a", "b"]
    if by_proc:  # torch's way rebuilds a storage this process holds: not a hand-over
        assert int(table.tensor[0, 1]) == 0
        del got
        gc.collect()
        assert int(table.tensor[0, 1]) == 9  # its slot marked free once the batch is gone


def test_a_descriptor_that_is_not_the_segment_sent_is_refused(tmp_path: Path) -> None:
    if not shared_ring.proc_fds_open():
        pytest.skip("no /proc/<pid>/fd here")
    ticket = shared_ring.Ticket(0, 0, 0, 1)
    memory_ = torch.UntypedStorage._new_shared(4096)  # type: ignore[no-untyped-call]
    fd, nbytes = memory_._share_fd_cpu_()
    inode = os.fstat(fd).st_ino
    piece = [("x", True, (0, (4,), (1,), torch.float32))]
    batch = shared_ring.claim_by_proc((os.getpid(), fd, nbytes, inode), piece, ticket)
    assert batch["x"].shape == (4,) and batch["x"].dtype == torch.float32
    other = tmp_path / "other"
    other.write_bytes(bytes(8192))
    with (
        open(other, "rb") as f,
        pytest.raises(LoaderError, match=r"is not the 4096-byte batch memory"),
    ):
        shared_ring.claim_by_proc((os.getpid(), f.fileno(), nbytes, inode), piece, ticket)
    with pytest.raises(LoaderError, match=r"cannot open DataLoader worker .*worker_buffers=0"):
        shared_ring.claim_by_proc((os.getpid(), 10**6, nbytes, inode), piece, ticket)
    with pytest.raises(LoaderError, match=r"not the 1048576-byte batch memory"):
        shared_ring.claim_by_proc((os.getpid(), fd, 1 << 20, inode), piece, ticket)  # too short


def test_a_segment_stays_mapped_between_batches_each_released_on_its_own() -> None:
    """The main process maps a worker's slot once and gives every batch a storage of its
    own over it: the first batch's slot is marked free when that batch goes, while a
    later one over the same mapping lives on."""
    if not shared_ring.proc_fds_open():
        pytest.skip("no /proc/<pid>/fd here")
    table = shared_ring.ReleaseTable(54321, 1, 2)
    memory_ = torch.UntypedStorage._new_shared(4096)  # type: ignore[no-untyped-call]
    fd, nbytes = memory_._share_fd_cpu_()
    handle = (os.getpid(), fd, nbytes, os.fstat(fd).st_ino)
    torch.empty(0, dtype=torch.float32).set_(memory_, 0, (4,)).copy_(torch.arange(4.0))
    piece = [("x", True, (0, (4,), (1,), torch.float32))]
    first = shared_ring.claim_by_proc(handle, piece, shared_ring.Ticket(54321, 0, 0, 5))
    second = shared_ring.claim_by_proc(handle, piece, shared_ring.Ticket(54321, 0, 1, 6))
    assert first["x"].data_ptr() == second["x"].data_ptr()  # one mapping for both batches
    assert first["x"].tolist() == second["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert first["x"].untyped_storage() is not second["x"].untyped_storage()
    del first
    gc.collect()
    assert table.tensor[0, :2].tolist() == [5, 0]  # the first slot free, the second held
    del second
    gc.collect()
    assert table.tensor[0, :2].tolist() == [5, 6]


def test_a_mapping_is_let_go_once_its_worker_no_longer_holds_the_segment() -> None:
    if not shared_ring.proc_fds_open():
        pytest.skip("no /proc/<pid>/fd here")
    fd = os.memfd_create("dlop-test")
    os.pwrite(fd, bytes([7]) * 8192, 0)
    handle = (os.getpid(), fd, 8192, os.fstat(fd).st_ino)
    maps = shared_ring.SegmentMaps()
    held = torch.empty(0, dtype=torch.uint8).set_(maps.storage(handle)[0])
    assert maps.sweep() and len(maps.maps) == 1  # still held under that descriptor: kept
    os.close(fd)  # the worker let go of it (ended, or its slot grew)
    assert not maps.sweep() and not maps.maps
    assert int(held.sum()) == 7 * 8192  # a batch still over it reads its own memory
    deadline = time.monotonic() + 10  # the module's sweeper does the same by itself
    fd = os.memfd_create("dlop-test")
    os.ftruncate(fd, 4096)
    shared_ring.maps.storage((os.getpid(), fd, 4096, os.fstat(fd).st_ino))
    os.close(fd)
    while shared_ring.maps.maps and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not shared_ring.maps.maps


def test_an_array_taken_before_a_batch_is_handed_on_stays_readable() -> None:
    """Sending a batch to another process moves its storage's data into new shared memory;
    an array taken from it before still points at the worker's segment, which the batch
    keeps mapped until it is gone, whatever the kept mappings let go of meanwhile."""
    if not shared_ring.proc_fds_open():
        pytest.skip("no /proc/<pid>/fd here")
    fd = os.memfd_create("dlop-test")
    os.pwrite(fd, np.arange(1024, dtype=np.float32).tobytes(), 0)
    piece = [("x", True, (0, (1024,), (1,), torch.float32))]
    handle = (os.getpid(), fd, 4096, os.fstat(fd).st_ino)
    batch = shared_ring.claim_by_proc(handle, piece, shared_ring.Ticket(0, 0, 0, 1))
    before = batch["x"].numpy()
    batch["x"].share_memory_()  # what a torch.multiprocessing queue does as it sends it
    os.close(fd)  # the worker ended: the kept mapping is let go of
    shared_ring.maps.sweep()
    assert (os.getpid(), fd) not in shared_ring.maps.maps
    gc.collect()
    assert before.tolist() == list(range(1024))
    assert batch["x"].tolist() == list(range(1024))


def test_a_forked_child_keeps_none_of_the_parents_mappings() -> None:
    if not shared_ring.proc_fds_open():
        pytest.skip("no /proc/<pid>/fd here")
    fd = os.memfd_create("dlop-test")
    os.ftruncate(fd, 4096)
    kept = shared_ring.maps.storage((os.getpid(), fd, 4096, os.fstat(fd).st_ino))
    assert shared_ring.maps.maps
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 when it holds no mapping of the parent's
        os._exit(1 if shared_ring.maps.maps else 0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    os.close(fd)
    del kept


def worker_shared_memory(pids: list[int]) -> list[str]:
    """Shared-memory segments made by these worker processes that this process still maps,
    and their files left in /dev/shm (``file_system`` strategy)."""
    marks = tuple(f"torch_{pid}_" for pid in pids)
    maps = Path("/proc/self/maps").read_text().splitlines()
    files = [p.name for p in Path("/dev/shm").glob("torch_*")] if Path("/dev/shm").is_dir() else []
    return [line for line in maps + files if any(m in line for m in marks)]


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_nothing_of_the_workers_shared_memory_is_left(many: Path, strategy: str) -> None:
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy(strategy)
    try:
        pids = torch.zeros(2, dtype=torch.int64).share_memory_()
        ds = IterableArchive(many, **SLOTS_KW)  # type: ignore[arg-type]
        loader = DataLoader(
            ds,
            batch_size=None,
            num_workers=2,
            multiprocessing_context="fork",
            worker_init_fn=lambda w: pids.__setitem__(w, os.getpid()),
        )
        kept = list(loader)[:3]  # the workers end with the epoch
        assert ds.buffer_counts()[0] > 0
        assert worker_shared_memory(pids.tolist())  # the check sees what is held
        del kept, loader
        gc.collect()
        deadline = time.monotonic() + 10  # file_system: torch's shm manager unlinks after the exit
        while worker_shared_memory(pids.tolist()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker_shared_memory(pids.tolist()) == []
    finally:
        torch.multiprocessing.set_sharing_strategy(before)


@pytest.mark.slow  # forkserver workers import torch afresh
def test_slots_are_released_with_forkserver_workers(tmp_path: Path) -> None:
    """The dataset reaches forkserver workers by pickle (Python 3.14's default on Linux)."""
    path = make_archive(tmp_path / "a", n=90)
    expected = loader_batches(path, **SLOTS_KW)
    ds = IterableArchive(path, **SLOTS_KW)  # type: ignore[arg-type]
    ds.set_epoch(1)
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="forkserver")
    for batch, want in zip(loader, expected, strict=True):
        assert_same(batch, want)
    assert ds.buffer_counts() == (30, 0)


def test_worker_buffers_is_checked(archive: Path) -> None:
    with pytest.raises(UsageError, match=r"worker_buffers must be 0\.\.64, got 65"):
        IterableArchive(archive, 4, worker_buffers=65)
    with pytest.raises(UsageError, match=r"worker_buffers must be 0\.\.64, got -1"):
        IterableArchive(archive, 4, worker_buffers=-1)


def kernel_at_least(major: int, minor: int) -> bool:
    parts = platform.release().split(".")
    try:
        return (int(parts[0]), int(parts[1])) >= (major, minor)
    except (IndexError, ValueError):
        return False


@pytest.mark.skipif(not kernel_at_least(5, 14), reason="MADV_POPULATE_WRITE needs Linux 5.14")
def test_populate_reports_memory_the_system_cannot_back(tmp_path: Path) -> None:
    """A full /dev/shm fails the same way as a mapping past a file's end: populating
    says so, where writing would raise SIGBUS."""
    path = tmp_path / "f"
    path.write_bytes(bytes(3 * mmap.PAGESIZE))
    with path.open("r+b") as f:
        mapped = mmap.mmap(f.fileno(), 3 * mmap.PAGESIZE)
    os.truncate(path, mmap.PAGESIZE)  # pages 2 and 3 now lie past the end
    t = torch.frombuffer(mapped, dtype=torch.uint8)
    assert populate(t[: mmap.PAGESIZE])
    assert not populate(t)
    del t
    mapped.close()


def test_fresh_shared_memory_the_system_cannot_back_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    t = memory.shared_empty((3, 5), torch.float32)
    assert (
        t.shape == (3, 5)
        and t.is_shared()
        and memory.shared_empty((0, 2), torch.int64).numel() == 0
    )
    monkeypatch.setattr(memory, "populate", lambda t: False)  # /dev/shm full
    with pytest.raises(LoaderError, match=r"/dev/shm has no room .* 4000 bytes.*--shm-size"):
        memory.shared_empty((1000,), torch.float32)


def test_a_worker_without_room_for_slots_makes_fresh_batches(
    many: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shared_ring, "shared_buffer", lambda nbytes: None)  # /dev/shm full
    expected = loader_batches(many, **SLOTS_KW)
    ds = IterableArchive(many, **SLOTS_KW)  # type: ignore[arg-type]
    ds.set_epoch(1)
    got = list(workers_loader(ds, 2))
    for batch, want in zip(got, expected, strict=True):
        assert_same(batch, want)
    assert ds.buffer_counts() == (0, 30)


# -- what to train on: selections, archives read as one, mixtures, URLs -------------


@pytest.fixture(scope="module")
def folds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ESC-50-shaped archive of 60 clips over small shards: label i, fold 1 + i % 5."""
    path = tmp_path_factory.mktemp("folds") / "a"
    fields = [Field("label", "i64", ()), Field("fold", "i64", ()), Field("logmel", "f16", (4, 3))]
    with ArchiveWriter(path, fields, shard_bytes=600) as w:
        for i in range(60):
            w.write({"label": i, "fold": 1 + i % 5, "logmel": np.full((4, 3), i, np.float16)})
    return path


def epoch_labels(path: object, epoch: int, **kw: object) -> list[list[int]]:
    loader = Loader(path, **kw)  # type: ignore[arg-type]
    loader.set_epoch(epoch)
    got = [b["label"].tolist() for b in loader]
    loader.close()
    return got


def persistent(ds: IterableArchive) -> DataLoader[dict[str, torch.Tensor]]:
    return DataLoader(
        ds, batch_size=None, num_workers=2, persistent_workers=True, multiprocessing_context="fork"
    )


def test_five_fold_selections_through_workers_are_the_loaders_and_resume(folds: Path) -> None:
    for fold in range(1, 6):
        train = {"fold": [f for f in range(1, 6) if f != fold]}
        kw = dict(batch_size=5, seed=fold, where=train)
        ds = IterableArchive(folds, **kw)  # type: ignore[arg-type]
        workers = persistent(ds)
        epochs = []
        for epoch in range(3):
            ds.set_epoch(epoch)
            got = labels(list(workers))
            assert got == epoch_labels(folds, epoch, **kw)  # the Loader's batches, in its order
            assert sorted(x for b in got for x in b) == [i for i in range(60) if 1 + i % 5 != fold]
            epochs.append(got)
        assert len({str(e) for e in epochs}) == 3
        ds.set_epoch(1)
        it = iter(workers)
        taken = [next(it)["label"].tolist() for _ in range(3)]
        del it
        assert taken == epochs[1][:3]
        state = ds.state_dict(batches_done=3)
        fresh = IterableArchive(folds, **kw)  # type: ignore[arg-type]
        fresh.load_state_dict(state)
        fresh.set_epoch(1)
        resumed = persistent(fresh)
        assert labels(list(resumed)) == epochs[1][3:]
        fresh.set_epoch(2)
        assert labels(list(resumed)) == epochs[2]


def test_a_state_of_another_selection_is_refused(folds: Path) -> None:
    train = IterableArchive(folds, 4, seed=1, where={"fold": [1, 2, 3, 4]})
    other = IterableArchive(folds, 4, seed=1, where={"fold": [2, 3, 4, 5]})  # as many samples
    state = train.state_dict()
    assert state["selection"] is not None and state["mixture"] is None
    with pytest.raises(UsageError, match="iterable state was saved with selection="):
        other.load_state_dict(state)
    whole = IterableArchive(folds, 4, seed=1, indices=list(range(48)))
    with pytest.raises(UsageError, match="selection"):
        whole.load_state_dict({**state, "selection": None})
    IterableArchive(folds, 4, seed=1, where={"fold": [4, 3, 2, 1]}).load_state_dict(state)
    unselected = IterableArchive(folds, 4, seed=1).state_dict()
    legacy = {k: v for k, v in unselected.items() if k not in ("selection", "mixture")}
    IterableArchive(folds, 4, seed=1).load_state_dict(legacy)  # saved before selections


def test_archives_as_one_with_indices_are_the_loaders(folds: Path, odd: Path) -> None:
    kw = dict(batch_size=4, seed=2, fields=["label"], indices=[0, 5, 37, 40, 41, 50, 90, 96])
    ds = IterableArchive([odd, folds], **kw)  # type: ignore[arg-type]
    ds.set_epoch(1)
    got = labels(list(workers_loader(ds, 2)))
    assert got == epoch_labels([odd, folds], 1, **kw)
    assert sorted(x for b in got for x in b) == [0, 0, 3, 4, 5, 13, 53, 59]


def test_a_mixture_through_workers_is_the_loaders_with_its_sources(folds: Path, odd: Path) -> None:
    kw = dict(batch_size=6, seed=4, fields=["label"], samples_per_epoch=48)
    sources = {"a": Source(odd, weight=1), "b": Source(folds, weight=3)}
    loader = Loader(sources, **kw)  # type: ignore[arg-type]
    loader.set_epoch(2)
    want = [(b["label"].tolist(), b["source"].tolist()) for b in loader]
    loader.close()
    ds = IterableArchive(sources, **kw)  # type: ignore[arg-type]
    assert ds.sources == ("a", "b")
    ds.set_epoch(2)
    got = [(b["label"].tolist(), b["source"].tolist()) for b in workers_loader(ds, 2)]
    assert got == want and len(got) == 8
    assert Counter(s for _, src in got for s in src) == {0: 12, 1: 36}
    state = ds.state_dict(batches_done=5)
    assert state["mixture"]["weights"] == [0.25, 0.75]
    again = IterableArchive(sources, **kw)  # type: ignore[arg-type]
    again.load_state_dict(state)
    assert [b["label"].tolist() for b in again] == [x for x, _ in want[5:]]
    even = {"a": Source(odd, weight=1), "b": Source(folds, weight=1)}
    reweighted = IterableArchive(even, **kw)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="mixture"):
        reweighted.load_state_dict(state)
    with pytest.raises(UsageError, match="IterableArchive order='window' does not apply"):
        IterableArchive(sources, **kw, order="window")  # type: ignore[arg-type]


def test_a_url_through_workers_reads_the_cache(s3: Any, tmp_path: Path) -> None:
    local = make_archive(tmp_path / "site" / "a", n=37)
    s3.make_bucket("iter")
    s3.filesystem().put(str(local), "iter/a", recursive=True)
    kw = dict(batch_size=4, seed=6)
    cache = tmp_path / "cache"
    ds = IterableArchive("s3://iter/a", **kw, cache_dir=cache, cache_bytes=1 << 20)  # type: ignore[arg-type]
    ds.set_epoch(1)
    got = labels(list(workers_loader(ds, 2)))
    assert got == loader_labels(local, **kw)
    assert len(list(cache.rglob("shard-*.dlop"))) == len(open_archive(local).shards)


def test_urls_where_local_archives_are_needed_are_refused(folds: Path) -> None:
    with pytest.raises(UsageError, match="where= and indices= take local archives"):
        IterableArchive("s3://bucket/a", 4, where={"fold": 1})
    with pytest.raises(UsageError, match="mixture source 'b': s3://bucket/b is a URL"):
        IterableArchive({"a": folds, "b": "s3://bucket/b"}, 4)
    with pytest.raises(UsageError, match="list of archives: s3://bucket/b is a URL"):
        Loader([folds, "s3://bucket/b"], 4)


def test_uneven_shares_through_workers_are_the_loaders_and_resume(folds: Path) -> None:
    kw = dict(batch_size=4, seed=3, indices=range(50), world_size=3, even_shares=False)
    shares = []
    for rank in range(3):  # 17, 17 and 16 samples: 5, 5 and 4 batches
        ds = IterableArchive(folds, rank=rank, **kw)  # type: ignore[arg-type]
        ds.set_epoch(1)
        got = labels(list(workers_loader(ds, 2)))
        assert got == epoch_labels(folds, 1, rank=rank, **kw)
        shares.append(got)
    assert [len(s) for s in shares] == [5, 5, 4]
    assert sorted(x for s in shares for b in s for x in b) == list(range(50))
    ds = IterableArchive(folds, rank=2, **kw)  # type: ignore[arg-type]
    ds.set_epoch(2)
    full = labels(list(ds))
    state = ds.state_dict(batches_done=2)
    assert state["even_shares"] is False
    fresh = IterableArchive(folds, rank=2, **kw)  # type: ignore[arg-type]
    fresh.load_state_dict(state)
    fresh.set_epoch(2)
    assert labels(list(workers_loader(fresh, 2))) == full[2:]
    even = IterableArchive(folds, rank=2, **{**kw, "even_shares": True})  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="even_shares"):
        even.load_state_dict(state)


def test_a_slot_counts_an_overflowed_tensor_once() -> None:
    slot = shared_ring.new_slot(2 * shared_ring.ALIGN)
    assert slot is not None
    fits = slot.allocate((8,), torch.uint8)
    big = slot.allocate((4 * shared_ring.ALIGN,), torch.uint8)  # does not fit: fresh memory
    lengths = torch.arange(3, dtype=torch.int64)  # made outside the slot, fits in it
    batch = Batch({"fits": fits, "big": big, "lengths": lengths})
    slot.adopt(batch)
    assert batch["big"] is big and batch["lengths"].tolist() == [0, 1, 2]
    assert batch["lengths"].untyped_storage().data_ptr() == slot.memory.untyped_storage().data_ptr()
    expected = sum(shared_ring.align(n) for n in (8, 4 * shared_ring.ALIGN, 3 * 8))
    assert slot.wanted == expected  # what a slot that holds the batch needs, big counted once

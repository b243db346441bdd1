"""Closing lets go: a Loader over a URL that it opened itself releases its cached shards,
their descriptors and threads on close, so another process finds the room free at once
and a training script can make and close Loaders in a loop."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import signal
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from dlop.formats import ArchiveWriter, Field
from dlop.runtime import IterableArchive, Loader
from dlop.runtime.storage.cache import BUDGET_LOCK, holds_node_lock, locked
from tests.runtime.helpers import in_forked_child


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("site")
    fields = [Field("label", "i64", ()), Field("x", "f32", (256,))]
    with ArchiveWriter(root / "a", fields, shard_bytes=16 << 10) as w:
        for i in range(400):
            w.write({"label": i, "x": np.full(256, i, np.float32)})
    assert len(list((root / "a").glob("shard-*"))) >= 8
    return root


def held_by_anyone(cache: Path) -> list[str]:
    """Cached shards some process holds (a shared lock an exclusive one cannot take)."""
    out = []
    for p in cache.rglob("shard-*.dlop"):
        fd = os.open(p, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            out.append(p.name)
        finally:
            os.close(fd)
    return out


def open_fds() -> list[str]:
    """What this process's descriptors point at."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
    return out


def test_close_lets_go_of_every_shard(site: Path, tmp_path: Path) -> None:
    from tests.faultproxy import FaultProxy

    with FaultProxy(root=site) as proxy:
        loader = Loader(proxy.url + "/a", 16, seed=1, cache_dir=tmp_path / "c")
        labels = torch.cat([b["label"].clone() for b in loader])
        assert sorted(labels.tolist()) == list(range(400))
        assert held_by_anyone(tmp_path / "c")  # loose shards stay mapped for the next epoch
        loader.close()
        assert held_by_anyone(tmp_path / "c") == []  # another process has the room at once
        # read again after close: it takes up what it needs anew
        loader.set_epoch(0)
        again = torch.cat([b["label"].clone() for b in loader])
        assert torch.equal(again, labels)
        loader.close()
        assert held_by_anyone(tmp_path / "c") == []


def test_a_hundred_loaders_made_and_closed_in_a_loop(site: Path, tmp_path: Path) -> None:
    from tests.faultproxy import FaultProxy

    with FaultProxy(root=site) as proxy:
        url = proxy.url + "/a"
        first = Loader(url, 64, cache_dir=tmp_path / "c")
        next(iter(first))
        first.close()
        del first
        gc.collect()
        fds, threads = open_fds(), threading.active_count()
        for _ in range(100):
            loader = Loader(url, 64, cache_dir=tmp_path / "c")
            next(iter(loader))
            loader.close()
        assert held_by_anyone(tmp_path / "c") == []  # no hold kept: at close
        assert threading.active_count() <= threads + 2  # no thread kept: at close
        # no descriptor kept per Loader, and none of the last one's: counted without a
        # collection (an error kept for a batch that never came, the epoch stopped by
        # close, keeps no frame; test_a_kept_error_holds_nothing_its_frames_did)
        now = open_fds()
        kept = [f for f in now if f not in fds or now.count(f) > fds.count(f)]
        assert len(now) <= len(fds) + 2, kept


class Held:
    """Stands for a mapped shard reader."""


def plan(readers: list[Held]) -> dict[str, int]:
    # a comprehension: its function's closure holds ``readers`` even after its frame is
    # cleared (Python 3.11)
    return {str(i): int("x" if readers[i] else "0") for i in range(len(readers))}


def test_a_kept_error_holds_nothing_its_frames_did() -> None:
    from dlop.runtime.errors import kept

    held = Held()
    alive = weakref.ref(held)
    try:
        plan([held])
    except ValueError as e:
        error = kept(e)
    del held
    assert alive() is None  # freed by reference counting: no collection ran
    # where it was raised stays readable (it is no DlopError)
    assert "in plan" in "".join(error.__notes__) and error.__traceback__ is None
    try:  # raised again and kept again: one note
        raise error
    except ValueError as e:
        assert len(kept(e).__notes__) == 1


def test_dataloader_workers_let_go_when_they_end(site: Path, tmp_path: Path) -> None:
    from tests.faultproxy import FaultProxy

    with FaultProxy(root=site) as proxy:
        ds = IterableArchive(proxy.url + "/a", 16, cache_dir=tmp_path / "c")
        got = [b["label"].clone() for b in DataLoader(ds, batch_size=None, num_workers=2)]
        assert sorted(torch.cat(got).tolist()) == list(range(400))
        assert held_by_anyone(tmp_path / "c") == []  # the workers exited


HOLD_THE_FETCH_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


def test_a_peer_stopped_while_it_holds_a_fetch_lock_is_named_not_waited_for(
    site: Path, tmp_path: Path
) -> None:
    import signal
    import subprocess
    import sys

    from dlop.runtime import LoaderError, open_archive
    from dlop.runtime.storage.cache_folder import CacheError
    from tests.faultproxy import FaultProxy

    with FaultProxy(root=site) as proxy:
        archive = open_archive(proxy.url + "/a", cache_dir=tmp_path / "c")
        (folder,) = [p for p in (tmp_path / "c").iterdir() if p.is_dir()]
        lock = folder / "shard-00000.dlop.lock"
        peer = subprocess.Popen(
            [sys.executable, "-c", HOLD_THE_FETCH_LOCK, str(lock)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert peer.stdout is not None and peer.stdout.readline().strip() == "held"
            os.kill(peer.pid, signal.SIGSTOP)  # as a SLURM suspend does
            with pytest.raises((CacheError, LoaderError)) as caught:
                next(iter(Loader(archive, 4, shuffle=False, prefetch=0)))
            message = str(caught.value)
            assert f"process {peer.pid}" in message and "stopped" in message
            assert f"kill -CONT {peer.pid}" in message
            # resumed and gone, the next read takes the lock at once
            os.kill(peer.pid, signal.SIGCONT)
            peer.kill()
            peer.wait()
            batch = next(iter(Loader(archive, 4, shuffle=False, prefetch=0)))
            assert batch["label"].tolist() == [0, 1, 2, 3]
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(peer.pid, signal.SIGCONT)
                peer.kill()
            peer.wait()
            archive.close()


@pytest.mark.parametrize(
    ("order", "batch", "window", "prefetch", "bucket", "world"),
    [
        ("window", 8, 2, 2, False, 1),
        ("window", 3, 1, 0, False, 1),
        ("window", 16, 3, 4, False, 1),
        ("window", 8, 2, 2, True, 1),
        ("window", 5, 2, 1, False, 2),
        ("global", 4, 8, 2, False, 1),
        ("global", 2, 8, 3, True, 2),
        ("window", 4, 3, 0, True, 2),
    ],
)
def test_the_budget_check_at_open_covers_every_epoch(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    order: str,
    batch: int,
    window: int,
    prefetch: int,
    bucket: bool,
    world: int,
) -> None:
    from dlop.formats import Zstd
    from dlop.runtime.storage.remote_supply import RemoteSupply

    # a zstd archive read through the cache (a RemoteSupply over the local folder), shards
    # of uneven sizes (5 to 12 samples)
    path = tmp_path / "z"
    rng = np.random.default_rng(7)
    fields = [Field("label", "i64", ()), Field("x", "f32", (None,), codec=Zstd())]
    with ArchiveWriter(path, fields, shard_bytes=1) as w:  # a shard a group
        i = 0
        for size in rng.integers(5, 13, 30):
            group = [
                {"label": i + j, "x": np.full(1 + (i + j) % 7, i, np.float32)} for j in range(size)
            ]
            w.write_group(group)
            i += int(size)
    peak = [0]
    checked = RemoteSupply.check_in_flight

    def watch(self: RemoteSupply) -> None:
        peak[0] = max(peak[0], self.asked)
        checked(self)

    monkeypatch.setattr(RemoteSupply, "check_in_flight", watch)
    # the bound is on holds made batch by batch: an epoch over a cache that already holds
    # every shard holds them all at once instead (test_batch_cost)
    monkeypatch.setattr(RemoteSupply, "hold_all", lambda self: False)
    for rank in range(world):
        loader = Loader(
            path,
            batch,
            order=order,
            window_shards=window,
            prefetch=prefetch,
            bucket_by="x" if bucket else None,
            bucket_window=4,
            rank=rank,
            world_size=world,
            cache_dir=tmp_path / "c",
            cache_bytes=1 << 30,
        )
        bound = loader.spec.shards_in_flight(prefetch + 2, bucket, world)
        for epoch in range(6):
            loader.set_epoch(epoch)
            for _ in loader:
                pass
        loader.close()
        assert 0 < peak[0] <= bound, (peak[0], bound)


def test_dataloader_workers_are_counted_in_the_budget(tmp_path: Path) -> None:
    from dlop.formats import Zstd
    from dlop.runtime import UsageError, open_archive
    from dlop.runtime.storage.cache import STAMP_BYTES

    # a zstd archive read through the cache, 12 shards of 8 samples: in window order of
    # one shard, batches of 8, one reader holds up to 3 shards, two workers 4
    path = tmp_path / "z"
    fields = [Field("label", "i64", ()), Field("x", "f32", (2048,), codec=Zstd())]
    with ArchiveWriter(path, fields, shard_bytes=1) as w:
        for k in range(12):
            w.write_group(
                [{"label": 8 * k + j, "x": np.full(2048, k, np.float32)} for j in range(8)]
            )
    probe = open_archive(path, cache_dir=tmp_path / "probe", cache_bytes=1 << 30)
    raw = probe.supply.sizes.size(0) + STAMP_BYTES  # type: ignore[attr-defined]
    probe.close()
    kw: dict[str, Any] = {
        "order": "window",
        "window_shards": 1,
        "cache_dir": tmp_path / "c",
        "cache_bytes": 3 * raw + raw // 2,
    }
    single = DataLoader(IterableArchive(path, 8, **kw), batch_size=None, num_workers=0)
    assert sum(len(b["label"]) for b in single) == 96
    two = DataLoader(IterableArchive(path, 8, **kw), batch_size=None, num_workers=2)
    with pytest.raises(UsageError, match=r"2 DataLoader worker\(s\)"):
        next(iter(two))


def test_a_close_called_inside_a_close_returns(site: Path, tmp_path: Path) -> None:
    """The collector may free a Loader in the middle of its archive's close (at exit, the
    exit hook closes every source): the Loader's own close then closed the same source
    again and waited forever for the lock the first close held."""
    from dlop.runtime import open_archive
    from tests.faultproxy import FaultProxy

    with FaultProxy(root=site) as proxy:
        archive = open_archive(proxy.url + "/a", cache_dir=tmp_path / "c")
        source: Any = archive.supply
        then = source.next_generation

        def collected_meanwhile() -> None:
            source.close()  # as Loader.__del__ would
            then()

        source.next_generation = collected_meanwhile
        closing = threading.Thread(target=source.close, daemon=True)
        closing.start()
        closing.join(20)
        assert not closing.is_alive()
        assert held_by_anyone(tmp_path / "c") == []


def test_failures_raised_again_hold_nothing_once_forgotten(site: Path, tmp_path: Path) -> None:
    """A recorded fetch failure is raised again by each read of its shard, taking the
    reading frames each time; a new epoch (or close) forgets it and what it held, without
    waiting for Python's collector."""
    from dlop.runtime import open_archive
    from tests.faultproxy import FaultProxy

    with FaultProxy(root=site) as proxy:
        archive = open_archive(proxy.url + "/a", cache_dir=tmp_path / "c")
        source = archive.supply
        source.ahead_errors[0] = ValueError("shard 0: simulated failure")  # recorded

        def read_again(readers: list[Held]) -> None:  # a batch's read of the failed shard
            failed = source.ahead_errors[0]
            raise failed

        held = Held()
        alive = weakref.ref(held)
        with contextlib.suppress(ValueError):
            read_again([held])
        del held
        assert alive() is not None  # the failure's frames hold it, and the failure
        source.forget_failures()
        assert alive() is None
        archive.close()


def test_a_forked_child_keeps_the_read_order_it_is_given(site: Path, tmp_path: Path) -> None:
    """read_order is the first thing a DataLoader worker's epoch tells the source; in a
    forked child it must land in the child's own state, not the parent's (which the
    child's first ask throws away)."""
    from dlop.runtime import open_archive
    from tests.faultproxy import FaultProxy

    with FaultProxy(root=site) as proxy:
        archive = open_archive(proxy.url + "/a", cache_dir=tmp_path / "c")
        source = archive.supply

        def kept_order() -> bool:
            source.read_order([np.arange(40, dtype=np.int64)])
            source.mine()  # what its first ask does first
            return source.arrive.order is not None

        survived = in_forked_child(kept_order)
        archive.close()
    assert survived


def test_a_loader_collected_on_another_thread_never_waits_there(site: Path, tmp_path: Path) -> None:
    """A collection may finalize a dropped Loader on any thread, one of its own fetch
    threads among them, holding a lock its close waits for behind another: the close
    then runs on a thread of its own, and lets go of every shard once it can."""
    from tests.faultproxy import FaultProxy

    with FaultProxy(root=site) as proxy:
        dropped = Loader(proxy.url + "/a", 64, cache_dir=tmp_path / "c")
        next(iter(dropped))
        supply = dropped.archive.supply
        finalized = threading.Event()
        with supply.lock:  # as the thread a fetch thread's collection waits behind
            t = threading.Thread(target=lambda: (dropped.__del__(), finalized.set()))
            t.start()
            assert finalized.wait(10)  # returned while the lock was still held
            closer = [c for c in threading.enumerate() if c.name == "dlop-close"]
        for c in closer:
            c.join(30)
        assert closer and not any(c.is_alive() for c in closer)
        assert held_by_anyone(tmp_path / "c") == []


def _timed_out(*_: Any) -> None:
    raise TimeoutError("the close waited")


def test_a_loader_collected_inside_the_budget_lock_never_waits_there(
    site: Path, tmp_path: Path
) -> None:
    """The main thread closes a collected Loader at once, unless the collection came while
    it held the node's budget lock (reserving room for a shard, opening another archive):
    a fetch thread may hold the dropped Loader's supply lock while it waits for that lock
    to publish a shard, so the close runs on a thread of its own."""
    from tests.faultproxy import FaultProxy

    with FaultProxy(root=site) as proxy:
        dropped = Loader(proxy.url + "/a", 64, cache_dir=tmp_path / "c")
        next(iter(dropped))
        supply = dropped.archive.supply
        waiting = threading.Event()

        def lands() -> None:  # as a fetch thread publishing a shard
            with supply.lock:
                waiting.set()
                with locked(tmp_path / "c" / BUDGET_LOCK):
                    pass

        with locked(tmp_path / "c" / BUDGET_LOCK):
            fetch = threading.Thread(target=lands, daemon=True)
            fetch.start()
            # the supply's lock is held by a thread waiting for the budget's: this one, or
            # one of the Loader's own fetch threads that got there first
            for _ in range(1000):
                if waiting.wait(0.01) or supply.lock.locked():
                    break
            # a close that waited here would wait for ever: an alarm ends the wait
            # (the collector's call swallows what it raises), and the test fails
            before = signal.signal(signal.SIGALRM, _timed_out)
            signal.setitimer(signal.ITIMER_REAL, 10)
            try:
                dropped.__del__()  # on the main thread, inside the lock
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, before)
            closer = [c for c in threading.enumerate() if c.name == "dlop-close"]
        fetch.join(30)
        for c in closer:
            c.join(30)
        assert closer and not any(c.is_alive() for c in closer) and not fetch.is_alive()
        assert held_by_anyone(tmp_path / "c") == []


def test_a_lock_not_taken_is_not_counted_as_held(tmp_path: Path) -> None:
    """Only a held lock sends a collected Loader's close to a thread of its own: a try
    that found the lock taken (``wait=False``) holds nothing a close could wait behind."""
    lock = tmp_path / "x.lock"
    assert not holds_node_lock()
    with locked(lock) as got:
        assert got and holds_node_lock()
        seen: list[tuple[bool, bool]] = []
        other = threading.Thread(target=lambda: seen.append(_tried(lock)))
        other.start()
        other.join(10)
        assert seen == [(False, False)]  # not taken there, nor counted
    assert not holds_node_lock()


def _tried(lock: Path) -> tuple[bool, bool]:
    with locked(lock, wait=False) as got:
        return got, holds_node_lock()

"""Closing lets go: a Loader over a URL that it opened itself releases its cached shards,
their descriptors and threads on close, so another process finds the room free at once
and a training script can make and close Loaders in a loop."""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from dlop.formats import ArchiveWriter, Field
from dlop.runtime import IterableArchive, Loader


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


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


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
        fds, threads = open_fds(), threading.active_count()
        for _ in range(100):
            loader = Loader(url, 64, cache_dir=tmp_path / "c")
            next(iter(loader))
            loader.close()
        assert open_fds() <= fds + 2  # no descriptor kept per Loader
        assert threading.active_count() <= threads + 2
        assert held_by_anyone(tmp_path / "c") == []


def test_dataloader_workers_let_go_when_they_end(site: Path, tmp_path: Path) -> None:
    from tests.faultproxy import FaultProxy

    with FaultProxy(root=site) as proxy:
        ds = IterableArchive(proxy.url + "/a", 16, cache_dir=tmp_path / "c")
        got = [b["label"].clone() for b in DataLoader(ds, batch_size=None, num_workers=2)]
        assert sorted(torch.cat(got).tolist()) == list(range(400))
        assert held_by_anyone(tmp_path / "c") == []  # the workers exited

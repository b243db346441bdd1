"""One cache per node: ranks in separate processes and their DataLoader workers share
it and fetch each shard once; a writer killed with SIGKILL leaves nothing that breaks
the next run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlop.formats.storage import Retry
from dlop.runtime import Loader
from dlop.runtime.storage.cache import CacheDir
from tests.faultproxy import FaultProxy
from tests.runtime.helpers import make_archive, open_remote

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {"batch_size": 4, "seed": 1, "order": "window", "window_shards": 2}

RANK = """
import json, sys, torch
from dlop.runtime import Loader, open_archive
url, cache, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
ds = open_archive(url, cache_dir=cache)
keys = []
loader = Loader(ds, batch_size=4, seed=1, order="window", window_shards=2, rank=rank, world_size=2)
# the same settings as SETTINGS in the test
for b in loader:
    keys += b["key"]
mine = list(range(rank, len(ds), 2))
dl = torch.utils.data.DataLoader(ds, batch_size=None, sampler=mine, num_workers=2)
seen = [s["key"] for s in dl]
print(json.dumps({"loader": keys, "workers": seen}))
"""


@pytest.mark.slow
def test_ranks_and_workers_share_one_cache(tmp_path: Path) -> None:
    make_archive(tmp_path / "site" / "a")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with FaultProxy(root=tmp_path / "site") as proxy:
        url = proxy.url + "/a"
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", RANK, url, str(tmp_path / "cache"), str(r)],
                stdout=subprocess.PIPE,
                env=env,
                cwd=ROOT,
            )
            for r in range(2)
        ]
        outs = [json.loads(p.communicate(timeout=120)[0]) for p in ranks]
        assert all(p.returncode == 0 for p in ranks)
        shards = sorted(p.name for p in (tmp_path / "site" / "a").glob("shard-*"))
        assert [proxy.count(s) for s in shards] == [1] * len(shards)  # once per node
    for rank, out in enumerate(outs):
        local = Loader(tmp_path / "site" / "a", rank=rank, world_size=2, **SETTINGS)
        assert out["loader"] == [k for b in local for k in b["key"]]
    assert sorted(outs[0]["workers"] + outs[1]["workers"]) == [f"k{i:03d}" for i in range(37)]


HOLD_TMP = """
import sys, time
from pathlib import Path
from dlop.runtime import Loader
from dlop.runtime.storage.cache import CacheDir
cache = CacheDir(sys.argv[1], max_bytes=1 << 20)
cache.reserve(cache.archive_dir("0000000000000000000000aa") / "shard.dlop.tmp-dead", 1000)
print("ready", flush=True)
time.sleep(60)
"""


def test_killed_writer_leaves_nothing_behind(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD_TMP, str(tmp_path / "c")],
        stdout=subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
    tmp = tmp_path / "c" / "0000000000000000000000aa" / "shard.dlop.tmp-dead"
    assert tmp.exists()
    CacheDir(tmp_path / "c", max_bytes=1 << 20)
    assert tmp.exists()  # its writer is alive: kept
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    cache = CacheDir(tmp_path / "c", max_bytes=1 << 20)
    assert not tmp.exists() and cache.used_bytes() == 0


STALL = """
import sys
from dlop.runtime import open_archive
ds = open_archive(sys.argv[1], cache_dir=sys.argv[2])
print("opened", flush=True)
ds[0]
"""


def test_kill_9_mid_download_then_next_run(tmp_path: Path) -> None:
    make_archive(tmp_path / "site" / "a")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with FaultProxy(root=tmp_path / "site") as proxy:
        proxy.fail("shard-00000", "stall")
        url = proxy.url + "/a"
        child = subprocess.Popen(
            [sys.executable, "-c", STALL, url, str(tmp_path / "c")],
            stdout=subprocess.PIPE,
            env=env,
            cwd=ROOT,
        )
        assert child.stdout is not None and child.stdout.readline().strip() == b"opened"
        deadline = time.monotonic() + 30
        while proxy.count("shard-00000") == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        ds = open_remote(url, cache_dir=tmp_path / "c", retry=Retry(attempts=2))
        assert ds[0]["key"] == "k000" and ds[36]["key"] == "k036"
        assert proxy.count("shard-00000") == 2
    leftovers = [p.name for p in (tmp_path / "c").rglob("*.tmp-*")]
    assert leftovers == []

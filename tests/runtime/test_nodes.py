"""Shards dealt to nodes: each node reads about 1/nodes of the archive, keeps it across
epochs, and the orders stay exact (coverage, equal batch counts, resume), in one
process and as 2 nodes x 2 ranks under torchrun, each node with its own cache and its
own counting fault proxy."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dlop.formats import ArchiveReader, ArchiveWriter, Field
from dlop.runtime import IterableArchive, Loader, OrderSpec, rank_batches
from dlop.runtime.errors import UsageError
from dlop.runtime.order import distributed
from dlop.runtime.order.distributed import launcher_nodes, node_count
from tests.faultproxy import FaultProxy

ROOT = Path(__file__).resolve().parents[2]


def _sizes(shards: int, seed: int = 0) -> tuple[int, ...]:
    return tuple(np.random.default_rng(seed).integers(1, 30, shards).tolist())


def _spec(sizes: tuple[int, ...], rank: int, world: int, nodes: int, **kw: Any) -> OrderSpec:
    settings: dict[str, Any] = {"batch_size": 4, "seed": 7, "mode": "window", "window_shards": 2}
    settings.update(kw)
    return OrderSpec(
        sum(sizes), shard_sizes=sizes, rank=rank, world_size=world, nodes=nodes, **settings
    )


def _shard_of(sizes: tuple[int, ...]) -> np.ndarray:
    return np.repeat(np.arange(len(sizes)), sizes)


@pytest.mark.parametrize("nodes,local", [(2, 1), (2, 2), (3, 2), (4, 1)])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("mode", ["window", "global"])
@pytest.mark.parametrize("bucketed", [False, True])
def test_every_sample_once_and_equal_batch_counts(
    nodes: int, local: int, drop_last: bool, mode: str, bucketed: bool
) -> None:
    sizes = _sizes(11, seed=nodes * 10 + local)
    n, world = sum(sizes), nodes * local
    lengths = np.random.default_rng(1).integers(1, 100, n) if bucketed else None
    for epoch in range(3):
        per_rank = [
            rank_batches(
                _spec(sizes, r, world, nodes, mode=mode, drop_last=drop_last), epoch, lengths
            )
            for r in range(world)
        ]
        assert len({len(b) for b in per_rank}) == 1, "every rank has the same number of batches"
        seen = Counter(int(i) for batches in per_rank for b in batches for i in b)
        if drop_last:
            assert max(seen.values()) == 1  # never twice
            if not bucketed:
                share = n // world
                assert sum(seen.values()) == world * (share - share % 4)
        else:
            assert set(seen) == set(range(n))  # every sample, repeats only to even out
            if not bucketed:
                assert sum(seen.values()) == world * math.ceil(n / world)
                assert sum(seen.values()) - n < world


@pytest.mark.parametrize("nodes", [2, 3, 4])
def test_uneven_shares_read_every_sample_exactly_once(nodes: int) -> None:
    sizes = _sizes(9, seed=nodes)
    world = 2 * nodes
    per_rank = [
        rank_batches(_spec(sizes, r, world, nodes, even_shares=False), epoch=1)
        for r in range(world)
    ]
    seen = Counter(int(i) for batches in per_rank for b in batches for i in b)
    assert seen == Counter(range(sum(sizes)))


def _node_samples(sizes: tuple[int, ...], node: int, epoch: int, **kw: Any) -> set[int]:
    """What node ``node`` of 2 (2 ranks each) reads in ``epoch``."""
    ranks = (2 * node, 2 * node + 1)
    return {
        int(i) for r in ranks for b in rank_batches(_spec(sizes, r, 4, 2, **kw), epoch) for i in b
    }


def test_a_node_keeps_its_share_and_reads_about_half_the_shards() -> None:
    sizes = (50,) * 10
    shard_of = _shard_of(sizes)
    for node in (0, 1):
        shares = [_node_samples(sizes, node, epoch) for epoch in range(3)]
        assert shares[0] == shares[1] == shares[2]  # kept across epochs
        assert len(shares[0]) == 250
        assert len({int(shard_of[i]) for i in shares[0]}) <= 6  # its 5 shards, one split
    orders = [
        [i for b in rank_batches(_spec(sizes, 0, 4, 2), epoch) for i in b.tolist()]
        for epoch in range(2)
    ]
    assert orders[0] != orders[1]  # the order within the share is new every epoch


def test_redeal_gives_a_node_new_shards_each_epoch() -> None:
    sizes = (50,) * 10
    shares = [_node_samples(sizes, 0, epoch, node_share="redeal") for epoch in range(4)]
    assert len({frozenset(s) for s in shares}) > 1
    assert all(len(s) == 250 for s in shares)
    assert _node_samples(sizes, 0, 0, seed=7) != _node_samples(sizes, 0, 0, seed=8)


def test_batches_of_one_node_read_few_shards_each() -> None:
    sizes = (64,) * 16
    shard_of = _shard_of(sizes)
    batches = rank_batches(_spec(sizes, 1, 4, 2, batch_size=32), epoch=0)
    node = {int(shard_of[i]) for b in batches for i in b}
    assert len(node) <= 9
    assert max(len({int(shard_of[i]) for i in b}) for b in batches) <= 2  # a window's shards


def test_node_layout_checks() -> None:
    assert node_count(5, 8, 2, None) == 2
    assert node_count(5, 8, 2, 1) == 2
    assert node_count(5, 8, None, None) == 1  # no process group: one node
    with pytest.raises(UsageError, match="node_rank=0 disagrees with rank 5"):
        node_count(5, 8, 2, 0)
    with pytest.raises(UsageError, match="nodes=3 does not divide world_size=8"):
        node_count(5, 8, 3, None)
    with pytest.raises(UsageError, match="node_rank= needs nodes="):
        node_count(5, 8, None, 1)
    with pytest.raises(ValueError, match="not a whole number of nodes"):
        OrderSpec(10, 2, rank=0, world_size=4, nodes=3)
    with pytest.raises(ValueError, match="node_share"):
        OrderSpec(10, 2, node_share="sometimes")


def test_the_launchers_environment_gives_the_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "LOCAL_RANK": "1"}
    assert launcher_nodes(env) == (2, 1, 1)
    other = {"LOCAL_WORLD_SIZE": "2", "NODE_RANK": "1", "LOCAL_RANK": "0"}
    assert launcher_nodes(other) == (2, 1, 0)  # NODE_RANK where GROUP_RANK is not set
    assert launcher_nodes({"LOCAL_RANK": "0"}) is None
    with pytest.raises(UsageError, match="LOCAL_WORLD_SIZE='two' is not a whole number"):
        launcher_nodes({**env, "LOCAL_WORLD_SIZE": "two"})
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    assert node_count(3, 4, None, None, env=env) == 2
    with pytest.raises(UsageError, match="disagrees with rank 1 of world_size 4"):
        node_count(1, 4, None, None, env=env)
    assert node_count(3, 4, 4, None, env=env) == 4  # given, it wins
    # ranks numbered by the caller (data-parallel ranks under model parallelism, a
    # one-rank evaluation Loader) say nothing of nodes: the environment is not read
    wide = {"LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "0", "LOCAL_RANK": "5"}
    assert node_count(2, 4, None, None, env=wide, from_group=False) == 1
    with pytest.raises(UsageError, match="or nodes=1 to deal no shards"):
        node_count(2, 4, None, None, env=wide)


def test_a_loader_given_its_own_ranks_under_torchrun_deals_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _archive(tmp_path / "a", n=200, per_shard=20)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    for key, value in {"LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    for front in (Loader, IterableArchive):
        made = front(path, 4, **SETTINGS, rank=0, world_size=1)
        spec = made.batch_order().spec if isinstance(made, IterableArchive) else made.spec
        assert spec.nodes == 1  # before: refused, the environment's 4 ranks a node


def test_a_mixture_deals_no_shards(tmp_path: Path) -> None:
    a = _archive(tmp_path / "a", n=80, per_shard=20)
    b = _archive(tmp_path / "b", n=80, per_shard=20)
    loader = Loader({"a": a, "b": b}, 4, fields=["key"], rank=1, world_size=4, nodes=2)
    assert loader.spec.nodes == 1 and loader.state_dict()["nodes"] == 1
    loader.close()


def _archive(path: Path, n: int = 400, per_shard: int = 40) -> Path:
    """``n`` samples in shards of ``per_shard`` equal samples (keys k0000...): a shard
    closes once its payload reaches ``shard_bytes``, here per_shard features of 4 KiB
    (keys add less than one feature to a shard of fewer than 300 samples)."""
    fields = [Field.str_("key"), Field("x", "f32", (1024,))]
    with ArchiveWriter(path, fields, shard_bytes=per_shard * 4096) as w:
        for i in range(n):
            w.write({"key": f"k{i:04d}", "x": np.full(1024, i, np.float32)})
    sizes = [s.num_samples for s in ArchiveReader(path).index.shards]
    assert sizes == [per_shard] * (n // per_shard), sizes
    return path


SETTINGS: dict[str, Any] = {"seed": 1, "order": "window", "window_shards": 2, "fields": ["key"]}


def _keys(loader: Any) -> list[str]:
    return [k for b in loader for k in b["key"]]


def test_resume_mid_epoch_and_workers_give_the_loaders_batches(tmp_path: Path) -> None:
    path = _archive(tmp_path / "a", n=200, per_shard=20)
    for rank in (0, 3):
        kw = {**SETTINGS, "rank": rank, "world_size": 4, "nodes": 2}
        loader = Loader(path, 4, **kw)
        loader.set_epoch(1)
        whole = _keys(loader)
        loader.set_epoch(1)
        it = iter(loader)
        first = [k for _ in range(3) for k in next(it)["key"]]
        state = loader.state_dict()
        loader.close()
        again = Loader(path, 4, **kw)
        again.load_state_dict(state)
        assert first + _keys(again) == whole
        again.close()
        iterable = IterableArchive(path, 4, **kw)
        iterable.set_epoch(1)
        dl = torch.utils.data.DataLoader(iterable, batch_size=None, num_workers=2)
        assert _keys(dl) == whole  # the node's ranks' batches, however many processes


def test_a_state_from_another_world_continues_its_epoch(tmp_path: Path) -> None:
    path = _archive(tmp_path / "a", n=200, per_shard=20)
    old = [Loader(path, 4, **SETTINGS, rank=r, world_size=4, nodes=2) for r in range(4)]
    seen = Counter(k for loader in old for b in loader.batches()[:3] for k in b.tolist())
    state = {**old[0].state_dict(), "batches_done": 3}
    for loader in old:
        loader.close()
    for rank in range(6):  # three nodes of two ranks each
        new = Loader(path, 4, **SETTINGS, rank=rank, world_size=6, nodes=3)
        new.load_state_dict(state)
        seen.update(k for b in new.batches() for k in b.tolist())
        new.close()
    assert set(seen) == set(range(200)) and sum(seen.values()) - 200 < 6
    older = {k: v for k, v in state.items() if k not in ("nodes", "node_share")}
    flat = Loader(path, 4, **SETTINGS, rank=1, world_size=4)
    flat.load_state_dict(older)  # a state saved before nodes were recorded ran on one node
    assert flat.state_dict().get("earlier") is None
    flat.close()


def test_a_selection_is_dealt_too(tmp_path: Path) -> None:
    path = _archive(tmp_path / "a", n=200, per_shard=20)
    chosen = list(range(0, 200, 3))
    seen: Counter[str] = Counter()
    for rank in range(4):
        loader = Loader(path, 4, **SETTINGS, rank=rank, world_size=4, nodes=2, indices=chosen)
        seen.update(_keys(loader))
        loader.close()
    assert set(seen) == {f"k{i:04d}" for i in chosen}
    assert sum(seen.values()) - len(chosen) < 4


RANK = """
import json, os, sys, urllib.request
import torch.distributed as dist
from dlop.runtime import Loader
url, cache, budget, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo")
rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
settings = dict(seed=1, order="window", window_shards=2, fields=["key"], cache_dir=cache,
                cache_bytes=budget)
def sent():
    with urllib.request.urlopen(url.rsplit("/", 1)[0] + "/.faultproxy-sent") as r:
        return {k: v for k, v in json.load(r).items() if "shard-" in k}
loader = Loader(url, 4, **settings)  # ranks and nodes from torchrun's environment
report = {"rank": rank, "nodes": loader.spec.nodes, "epochs": [], "sent": []}
for epoch in range(2):
    loader.set_epoch(epoch)
    report["epochs"].append([k for b in loader for k in b["key"]])
    dist.barrier()
    report["sent"].append(sent() if local == 0 else None)
    dist.barrier()
loader.set_epoch(1)
it = iter(loader)
first = [k for _ in range(3) for k in next(it)["key"]]
state = loader.state_dict()
del it
loader.close()
again = Loader(url, 4, **settings)
again.load_state_dict(state)
report["resumed"] = first + [k for b in again for k in b["key"]]
again.close()
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_two_nodes_of_two_ranks_under_torchrun(tmp_path: Path) -> None:
    site = tmp_path / "site"
    path = _archive(site / "a")
    shard_bytes = sum(s.bytes for s in ArchiveReader(path).index.shards)
    budget = int(0.6 * shard_bytes)
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with FaultProxy(root=site) as clean, FaultProxy(root=site) as faulty:
        # node 1's network fails the first read of every shard, four ways in turn
        for k, kind in enumerate(["drop", "slowdown", "truncate", "corrupt"] * 3):
            faulty.fail(f"shard-{k:05d}", kind)
        nodes = []
        for node, proxy in enumerate([clean, faulty]):
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                "--nproc-per-node=2", f"--node-rank={node}", "--master-addr=127.0.0.1",
                f"--master-port={port}", str(script), proxy.url + "/a",
                str(tmp_path / f"cache{node}"), str(budget), str(tmp_path),
            ]  # fmt: skip
            nodes.append(subprocess.Popen(cmd, env=env, cwd=ROOT))
        for p in nodes:
            assert p.wait(timeout=300) == 0
        wasted = faulty.wasted  # bodies node 1 read under a fault (then read again)
        assert {p for p in clean.gets if "shard-" in p}.isdisjoint(p for p in faulty.gets)
    read = {p: n for p, n in faulty.gets.items() if "shard-" in p}
    assert len(read) == 5 and min(read.values()) >= 2  # its 5 shards, each through a fault
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["nodes"] for r in reports] == [2] * 4
    for node, lost in ((0, 0), (1, sum(wasted.values()))):
        first, second = (sum(sent.values()) for sent in reports[2 * node]["sent"])
        assert first - lost <= 0.6 * shard_bytes  # about half the archive per node
        assert second == first  # its share stayed cached: the second epoch downloads nothing
    for epoch in (0, 1):
        seen = Counter(k for r in reports for k in r["epochs"][epoch])
        assert seen == Counter(f"k{i:04d}" for i in range(400))  # every sample once
    for rank, report in enumerate(reports):
        local = Loader(path, 4, **SETTINGS, rank=rank, world_size=4, nodes=2)
        for epoch in (0, 1):
            local.set_epoch(epoch)
            assert report["epochs"][epoch] == _keys(local)  # faults or not, the same batches
        assert report["resumed"] == report["epochs"][1]
        local.close()


@pytest.mark.parametrize("front", [Loader, IterableArchive])
def test_a_bad_world_is_refused_before_the_nodes_are_worked_out(
    tmp_path: Path, front: type
) -> None:
    path = _archive(tmp_path / "a", n=40, per_shard=20)
    with pytest.raises(UsageError, match="world_size must be at least 1, got 0"):
        front(path, 4, rank=0, world_size=0, nodes=2, node_rank=0)  # was ZeroDivisionError
    with pytest.raises(UsageError, match=r"rank must be 0\.\.3, got 4"):
        front(path, 4, rank=4, world_size=4, nodes=2)

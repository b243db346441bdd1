"""Resuming an epoch in another world: other ranks, per-rank batch size or workers.

The samples the saved world handed out are computed from the state (never replayed);
the rest of the epoch, each sample once, is dealt over the new world with equal batch
counts per rank; the next epoch is a fresh run's."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch.utils.data import DataLoader

from dlop.runtime import IterableArchive, Loader, batch_as_is

from .helpers import make_archive

N = 157


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_archive(tmp_path_factory.mktemp("reshape") / "a", n=N, shard_bytes=1500)


def loaders(archive: Path, world: int, batch: int, nodes: int = 1, **settings: Any) -> list[Loader]:
    return [
        Loader(archive, batch, rank=r, world_size=world, nodes=nodes, prefetch=0, **settings)
        for r in range(world)
    ]


def taken(ls: list[Loader], epoch: int, k: int) -> list[int]:
    return [int(i) for loader in ls for b in loader.batches(epoch)[:k] for i in b]


def check_continuation(
    archive: Path,
    epoch: int,
    old: tuple[int, int, int],
    new: tuple[int, int, int],
    fraction: float,
    **settings: Any,
) -> None:
    """Stops world ``old`` (ranks, batch, nodes) after a ``fraction`` of its epoch, resumes
    in world ``new`` from rank 0's state, and checks the epoch over both parts."""
    before = loaders(archive, *old, **settings)
    for loader in before:
        loader.set_epoch(epoch)
    count = len(before[0].batches())
    k = round(fraction * count)
    state = {**before[0].state_dict(), "batches_done": k}
    first = taken(before, epoch, k)
    after = loaders(archive, *new, **settings)
    for loader in after:
        loader.load_state_dict(state)
        loader.set_epoch(epoch)  # the usual loop's call keeps the resume
    rest_batches = [loader.batches() for loader in after]
    if settings.get("even_shares", True):
        assert len({len(b) for b in rest_batches}) == 1, "equal batch counts per rank"
    rest = [int(i) for mine in rest_batches for b in mine for i in b]
    whole = set(taken(loaders(archive, 1, 1, **settings), epoch, 10**9))
    left = whole - set(first)
    world, batch, _ = new
    bucketing = settings.get("bucket_by") is not None
    if settings.get("drop_last"):
        assert set(rest) <= left and len(rest) == len(set(rest)), "no sample twice"
        windows = -(-len(left) // (batch * 64 * world)) if bucketing else 1
        assert len(left - set(rest)) < (windows + 1) * world * batch, "only the trim is dropped"
    else:
        assert set(rest) >= left, "every sample left is read"
        repeats = len(rest) - len(set(rest) & left)
        assert repeats < (world * batch if bucketing else world) or not left, "only padding repeats"
    # the next epoch is a fresh run's in the new world
    fresh = loaders(archive, *new, **settings)
    for a, b in zip(after, fresh, strict=True):
        assert all(
            np.array_equal(x, y)
            for x, y in zip(a.batches(epoch + 1), b.batches(epoch + 1), strict=True)
        )
        a.set_epoch(epoch + 1)
        b.set_epoch(epoch + 1)
        assert len(a.batches()) == len(b.batches())


SETTINGS: list[dict[str, Any]] = [
    {},
    {"order": "window", "window_shards": 2},
    {"bucket_by": "speech"},
    {"drop_last": True},
    {"bucket_by": "speech", "drop_last": True},
    {"shuffle": False},
    {"indices": list(range(3, N, 2))},
    {"order": "window", "indices": list(range(0, N, 3)), "bucket_by": "speech"},
    {"even_shares": False},
    {"node_share": "redeal", "order": "window", "window_shards": 3},
]


def _world(draw: random.Random, batches: list[int]) -> tuple[int, int, int]:
    """ranks 1-8 on 1-3 nodes (ranks a whole number per node), a batch size"""
    nodes = draw.choice([1, 1, 2, 3])
    return nodes * draw.randint(1, 8 // nodes), draw.choice(batches), nodes


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(s) or "default")
def test_an_epoch_continues_in_any_world(archive: Path, settings: dict[str, Any]) -> None:
    draw = random.Random(repr(sorted(settings)))
    for _ in range(8):
        old = _world(draw, [1, 2, 3, 5])
        new = _world(draw, [1, 2, 4, 7])
        fraction = draw.choice([0.0, 0.3, 0.5, 0.9, 1.0])
        check_continuation(archive, draw.randint(0, 5), old, new, fraction, seed=3, **settings)


def test_a_continued_epoch_continues_again(archive: Path) -> None:
    """A state saved mid-way through a continued epoch names the earlier world too."""
    first = loaders(archive, 4, 3, seed=1)
    state = {**first[0].state_dict(), "batches_done": 5}
    second = loaders(archive, 3, 2, seed=1)
    for loader in second:
        loader.load_state_dict(state)
    again = {**second[0].state_dict(), "batches_done": 4}
    assert again["earlier"] == [[4, 1, 3, 5]]
    third = loaders(archive, 2, 5, seed=1)
    for loader in third:
        loader.load_state_dict(again)
    read = (
        taken(first, 0, 5)
        + taken(second, 0, 4)
        + [int(i) for loader in third for b in loader.batches() for i in b]
    )
    assert set(read) == set(range(N))
    assert len(read) - N < 2 * 5  # padding of the last world only
    assert third[0].state_dict()["earlier"] == [[4, 1, 3, 5], [3, 1, 2, 4]]


def test_the_same_world_resumes_as_before(archive: Path) -> None:
    """A state loaded into the world it was saved in is today's exact resume, byte for byte."""
    a = Loader(archive, 4, seed=2, rank=1, world_size=3, prefetch=0)
    it = iter(a)
    for _ in range(3):
        next(it)
    state = a.state_dict()
    assert "earlier" not in state
    b = Loader(archive, 4, seed=2, rank=1, world_size=3, prefetch=0)
    b.load_state_dict(state)
    assert all(np.array_equal(x, y) for x, y in zip(b.batches(), a.batches(), strict=True))
    got = [batch["label"].tolist() for batch in b]
    want = [sorted(int(i) for i in x) for x in a.batches()[3:]]
    assert [sorted(g) for g in got] == want


def test_a_real_loop_stops_in_one_world_and_finishes_in_another(archive: Path) -> None:
    """Labels as read: world 3 x batch 4 stops after 5 steps, world 2 x batch 6 finishes."""
    old = loaders(archive, 3, 4, seed=7, bucket_by="speech")
    seen: list[int] = []
    for loader in old:
        it = iter(loader)
        seen += [x for _, b in zip(range(5), it, strict=False) for x in b["label"].tolist()]
    state = old[1].state_dict()  # any rank's: they step together
    assert state["batches_done"] == 5
    new = loaders(archive, 2, 6, seed=7, bucket_by="speech")
    counts = []
    whole = len(loaders(archive, 2, 6, seed=7, bucket_by="speech")[0].batches(0))
    for loader in new:
        loader.load_state_dict(state)
        # len is a whole epoch's in this world (what a trainer sizes later epochs by)
        assert len(loader) == whole > len(loader.batches())
        got = [x for b in loader for x in b["label"].tolist()]
        counts.append(len(got))
        seen += got
    assert set(seen) == set(range(N)) and len(seen) - N < 2 * 6
    assert new[0].epoch == 0 and new[0].state_dict()["batches_done"] == len(new[0].batches())
    for loader in new:  # the next pass is the next epoch, whole
        assert len([b for b in loader]) == len(
            loaders(archive, 2, 6, seed=7, bucket_by="speech")[0].batches(1)
        )


def test_iterable_archive_continues_in_another_world_and_worker_count(archive: Path) -> None:
    old = [IterableArchive(archive, 3, rank=r, world_size=2, seed=4) for r in range(2)]
    first = [int(i) for ds in old for b in ds.batches(0)[:6] for i in b]
    state = old[0].state_dict(batches_done=6)
    got: list[int] = []
    lengths = []
    for r in range(3):
        ds = IterableArchive(archive, 5, rank=r, world_size=3, seed=4)
        ds.load_state_dict(state)
        loader = DataLoader(ds, batch_size=None, num_workers=2, collate_fn=batch_as_is)
        batches = list(loader)
        lengths.append(len(batches))
        got += [x for b in batches for x in b["label"].tolist()]
        assert ds.state_dict(after=batches[-1])["earlier"] == [[2, 1, 3, 6]]
    assert len(set(lengths)) == 1
    assert set(first) | set(got) == set(range(N))
    repeats = len(got) - len(set(got) - set(first))
    assert repeats < 3, "only the new world's padding (fewer than one sample a rank) repeats"


@pytest.mark.parametrize("per_source", [False, True])
@pytest.mark.parametrize(("old", "new"), [((2, 4), (3, 5)), ((3, 3), (1, 8)), ((4, 2), (2, 2))])
def test_a_mixture_continues_the_draw_it_began_with(
    archive: Path, tmp_path_factory: pytest.TempPathFactory, per_source: bool,
    old: tuple[int, int], new: tuple[int, int],
) -> None:  # fmt: skip
    """A mixture's epoch is sized for its world; the rest of the old world's draw (its
    repeats of an upsampled source included) is read in the new one, then epochs of the
    new world's own size."""
    other = tmp_path_factory.mktemp("mix") / "b"
    if not other.exists():
        make_archive(other, n=20)
    mix = {"a": str(archive), "b": str(other)}
    kw: dict[str, Any] = {"seed": 6, "samples_per_epoch": 90, "batch_per_source": per_source}
    before = [
        Loader(mix, old[1], rank=r, world_size=old[0], prefetch=0, **kw) for r in range(old[0])
    ]
    draw = before[0].order.draw
    assert draw is not None
    drawn = Counter(int(i) for i in draw(1)[0])
    for loader in before:
        loader.set_epoch(1)
    k = len(before[0].batches()) // 2
    state = {**before[0].state_dict(), "batches_done": k}
    first = Counter(taken(before, 1, k))
    after = [
        Loader(mix, new[1], rank=r, world_size=new[0], prefetch=0, **kw) for r in range(new[0])
    ]
    for loader in after:
        loader.load_state_dict(state)
    assert len({len(loader.batches()) for loader in after}) == 1
    rest = Counter(int(i) for loader in after for b in loader.batches() for i in b)
    both = first + rest
    assert not drawn - both, "every draw of the epoch is read"
    extra = sum((both - drawn).values())
    assert extra < new[0] * new[1] * (2 if per_source else 1), "repeats: padding only"
    fresh = Loader(mix, new[1], rank=0, world_size=new[0], prefetch=0, **kw)
    assert all(
        np.array_equal(x, y) for x, y in zip(after[0].batches(2), fresh.batches(2), strict=True)
    )
    for loader in before + after + [fresh]:
        loader.close()


def test_hostile_earlier_worlds_are_refused(archive: Path) -> None:
    state = Loader(archive, 4, rank=0, world_size=2).state_dict()
    bad: list[Any] = [
        "x",
        [[0, 1, 4, 0]],
        [[2, 1, 4, 10**6]],
        [[3, 2, 4, 0]],
        [[2, 1, 0, 0]],
        [[2, 1, 4]],
        [[2, 1, 4, 0]] * 17,
        [[2**40, 1, 4, 0]],
        [[2, 1, 2**40, 0]],
    ]
    for earlier in bad:
        with pytest.raises((ValueError, TypeError)):
            Loader(archive, 4, rank=0, world_size=3).load_state_dict({**state, "earlier": earlier})


def _lockstep_worker(rank: int, port: int, archive: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        state = Loader(archive, 4, seed=1, prefetch=0).state_dict()  # rank 0's, world 2
        behind = {**state, "batches_done": 3 - rank}  # rank 1 one batch behind
        errors = []
        for make in (
            lambda: Loader(archive, 4, seed=1, prefetch=0),
            lambda: IterableArchive(archive, 4, seed=1),
        ):
            reader = make()
            try:
                reader.load_state_dict(
                    behind
                    if isinstance(reader, Loader)
                    else {**reader.state_dict(0), "batches_done": 3 - rank}
                )
                errors.append("")
            except ValueError as e:
                errors.append(str(e))
        same = make()
        same.load_state_dict({**same.state_dict(0), "batches_done": 2})  # agreeing states load
        # a rank whose own state is refused: its peers raise too, none waits on it
        wrong = {**state, "seed": 2} if rank == 1 else {**state, "batches_done": 2}
        try:
            Loader(archive, 4, seed=1, prefetch=0).load_state_dict(wrong)
            errors.append("")
        except ValueError as e:
            errors.append(str(e))
        # ranks given by hand (here swapped) are no group's: no collective, no wait
        mine = Loader(archive, 4, seed=1, rank=1 - rank, world_size=2, prefetch=0)
        mine.load_state_dict({**state, "rank": 1 - rank, "batches_done": 3 - rank})
        # even_shares=False: each rank's own end of epoch (they differ) loads
        own = Loader(archive, 4, seed=1, prefetch=0, even_shares=False)
        own.load_state_dict({**own.state_dict(), "batches_done": len(own.batches())})
        Path(out, f"{rank}.txt").write_text("\n".join(errors))
    finally:
        dist.destroy_process_group()


def test_ranks_loading_positions_that_disagree_are_refused(archive: Path, tmp_path: Path) -> None:
    import os
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_lockstep_worker, args=(port, str(archive), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        told = (tmp_path / f"{rank}.txt").read_text().splitlines()
        assert len(told) == 3
        for line in told[:2]:
            assert (
                "disagree (rank 0: epoch 0 after 3 batches; rank 1: epoch 0 after 2 batches)"
                in line
            )
    assert "rank(s) [1] refused theirs" in (tmp_path / "0.txt").read_text().splitlines()[2]
    assert "seed" in (tmp_path / "1.txt").read_text().splitlines()[2]


@pytest.mark.parametrize("settings", SETTINGS[:6], ids=lambda s: ",".join(s) or "default")
def test_what_a_world_took_is_its_ranks_first_batches(settings: dict[str, Any]) -> None:
    from dlop.runtime.order.epochs import OrderSpec, world_batches, world_taken

    lengths = np.random.default_rng(0).integers(1, 50, 500)
    bucket = lengths if settings.get("bucket_by") else None
    options = {k: v for k, v in settings.items() if k not in ("bucket_by", "order")}
    for world, batch in ((1, 7), (3, 5), (8, 2)):
        spec = OrderSpec(500, batch, world_size=world, mode=settings.get("order", "global"),
                         shard_sizes=(100,) * 5, seed=2, **options)  # fmt: skip
        per_rank = world_batches(spec, 1, range(world), bucket)
        for done in (0, 1, 4, len(per_rank[0])):
            want = sorted(int(i) for mine in per_rank for b in mine[:done] for i in b)
            assert sorted(world_taken(spec, 1, done, bucket).tolist()) == want


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ((4, 3, 2), (6, 2, 3)),
        ((4, 3, 2), (3, 5, 1)),
        ((3, 4, 1), (4, 4, 2)),
        ((4, 2, 2), (4, 2, 4)),
    ],
)
def test_shards_dealt_to_nodes_are_dealt_again(
    archive: Path, old: tuple[int, int, int], new: tuple[int, int, int]
) -> None:
    """On nodes, the rest is dealt to the new nodes in equal shares along the shard deal,
    each node reading whole runs of shards."""
    check_continuation(archive, 2, old, new, 0.5, seed=5, order="window", window_shards=2)
    check_continuation(archive, 2, old, new, 0.4, seed=5)


# One rank of a torchrun launch: reads its share of epoch 0 (from the checkpoint, if one
# is there), records the keys it took; the first launch saves rank 0's state after STEPS
# steps and is then killed, every rank at once.
ELASTIC = """
import json, os, signal, sys
import torch, torch.distributed as dist
from dlop.runtime import Loader
path, ckpt, out, launch = sys.argv[1:5]
dist.init_process_group("gloo")
rank = dist.get_rank()
loader = Loader(path, int(os.environ["BATCH"]), seed=3, order="window", window_shards=2,
                fields=["key"])  # ranks and nodes from torchrun's environment
if launch != "first":  # (the first launch's rank 0 writes ckpt while others start)
    loader.load_state_dict(torch.load(ckpt)["loader"])
keys = []
for step, batch in enumerate(loader):
    keys += list(batch["key"])
    if launch == "first" and step + 1 == 3:
        if rank == 0:
            torch.save({"loader": loader.state_dict()}, ckpt)
        break
record = {"rank": rank, "world": loader.spec.world_size, "nodes": loader.spec.nodes,
          "batches": len(loader.batches()), "keys": keys}
with open(os.path.join(out, f"{launch}-{rank}.json"), "w") as f:
    json.dump(record, f)
dist.barrier()
if launch == "first":
    os.kill(os.getpid(), signal.SIGKILL)  # preempted right after the checkpoint
dist.destroy_process_group()
"""


def _launch(script: Path, name: str, nodes: int, per_node: int, batch: int, args: list[str]) -> int:
    """Runs ``script`` under torchrun, ``nodes`` launches of ``per_node`` ranks on this
    machine; the largest exit code (their output in ``name``-node*.log beside the script)."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "BATCH": str(batch)}
    procs = []
    for node in range(nodes):
        command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}"]
        command += [f"--nproc-per-node={per_node}", f"--node-rank={node}", "--max-restarts=0"]
        command += ["--master-addr=127.0.0.1", f"--master-port={port}", str(script), *args, name]
        with open(script.parent / f"{name}-node{node}.log", "w") as log:
            procs.append(
                subprocess.Popen(
                    command, env=env, cwd=root, stdout=log, stderr=log, start_new_session=True
                )
            )
    try:
        return max(p.wait(timeout=240) for p in procs)
    finally:  # a launch that hung leaves nothing running behind the test
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.mark.slow
def test_torchrun_launches_of_other_shapes_finish_a_killed_epoch(tmp_path: Path) -> None:
    """2 nodes x 2 ranks (batch 4) checkpoint mid-epoch and are killed; 3 ranks on one node
    (batch 5), and in another try 2 nodes x 3 ranks (batch 3), finish the epoch from it."""
    from tests.runtime.test_nodes import _archive

    path = _archive(tmp_path / "a", n=200, per_shard=20)
    script = tmp_path / "rank.py"
    script.write_text(ELASTIC)
    ckpt = tmp_path / "ckpt.pt"
    assert _launch(script, "first", 2, 2, 4, [str(path), str(ckpt), str(tmp_path)]) != 0
    first = [json.loads((tmp_path / f"first-{r}.json").read_text()) for r in range(4)]
    assert [r["nodes"] for r in first] == [2] * 4 and ckpt.exists()
    before = [k for r in first for k in r["keys"]]
    assert len(before) == 4 * 3 * 4
    for name, (nodes, per_node, batch) in {"one": (1, 3, 5), "two": (2, 3, 3)}.items():
        assert (
            _launch(script, name, nodes, per_node, batch, [str(path), str(ckpt), str(tmp_path)])
            == 0
        )
        ranks = [
            json.loads((tmp_path / f"{name}-{r}.json").read_text()) for r in range(nodes * per_node)
        ]
        assert {r["nodes"] for r in ranks} == {nodes} and len({r["batches"] for r in ranks}) == 1
        seen = Counter(before + [k for r in ranks for k in r["keys"]])
        assert set(seen) == {f"k{i:04d}" for i in range(200)}, name  # every key read
        assert sum(seen.values()) - 200 < nodes * per_node, name  # repeats: padding only


def _foreign_shards(old_nodes: int, new_nodes: int, favour: bool) -> int:
    """Shards the new nodes read that the same node of the old world was not dealt (a
    node's cache holds its share): what a resume downloads again, in shards."""
    from dataclasses import replace

    from dlop.runtime.order.epochs import OrderSpec, node_shares, node_span, world_taken

    sizes = (50,) * 24
    old = OrderSpec(1200, 5, rank=0, world_size=2 * old_nodes, nodes=old_nodes, shard_sizes=sizes)
    new = replace(old, world_size=3 * new_nodes, nodes=new_nodes)
    everything = np.arange(1200)
    shares = node_shares(old, 0, everything)
    taken = []
    for node in range(old_nodes):
        from dlop.runtime.order.epochs import node_rest

        order = node_rest(old, 0, node, everything, shares)
        taken.append(world_taken(replace(old, rank=node * 2), 0, 10, None, order))
    rest = np.setdiff1d(everything, np.concatenate(taken))
    seq, _, mine = node_shares(new, 0, rest, old if favour else None)
    foreign = 0
    for node in range(new_nodes):
        shards = set((seq[mine[node]] // 50).tolist())
        held = {a // 50 for a, _ in node_span(old, 0, node)} if node < old_nodes else set()
        foreign += len(shards - held)
    return foreign


@pytest.mark.parametrize(("old", "new"), [(2, 2), (3, 3), (3, 2), (2, 3), (4, 3), (2, 4)])
def test_new_nodes_favour_the_shards_they_hold(old: int, new: int) -> None:
    """24 shards, a quarter of each node's share read before the move."""
    favoured, plain = _foreign_shards(old, new, True), _foreign_shards(old, new, False)
    if old == new:
        assert favoured == 0  # the same nodes read only what their caches hold
    else:
        assert favoured < plain


def test_set_epoch_after_a_continued_pass_reads_the_whole_epoch(archive: Path) -> None:
    state = {**Loader(archive, 4, rank=0, world_size=2, seed=2).state_dict(), "batches_done": 6}
    whole = Loader(archive, 5, rank=0, world_size=3, seed=2).batches(0)
    loader = Loader(archive, 5, rank=0, world_size=3, seed=2, prefetch=0)
    loader.load_state_dict(state)
    loader.set_epoch(0)  # kept: the resume
    assert len(list(loader)) < len(whole)
    loader.set_epoch(0)  # after the continued pass: epoch 0 from its beginning, whole
    got = [sorted(b["label"].tolist()) for b in loader]
    assert got == [sorted(int(i) for i in b) for b in whole]
    old = IterableArchive(archive, 4, rank=0, world_size=2, seed=2).state_dict(batches_done=6)
    for workers in (0, 2):
        ds = IterableArchive(archive, 5, rank=0, world_size=3, seed=2)
        ds.load_state_dict(old)
        ds.set_epoch(0)
        dl = DataLoader(ds, batch_size=None, num_workers=workers, collate_fn=batch_as_is)
        assert len(list(dl)) < len(whole)
        ds.set_epoch(0)
        assert [sorted(b["label"].tolist()) for b in dl] == got, workers


def test_an_even_shares_false_state_of_any_rank_loads(archive: Path) -> None:
    """Shares differ by a batch at the epoch's end: rank 0's state (the longest) loads on
    every rank, and each rank's own too."""
    ranks = [Loader(archive, 1, rank=r, world_size=2, even_shares=False) for r in range(2)]
    counts = [len(x.batches()) for x in ranks]
    assert counts[0] == counts[1] + 1
    end = {**ranks[0].state_dict(), "batches_done": counts[0]}
    ranks[1].load_state_dict(end)
    ranks[1].load_state_dict({**ranks[1].state_dict(), "batches_done": counts[1]})


def test_states_too_costly_to_continue_are_refused(archive: Path, tmp_path: Path) -> None:
    state = Loader(archive, 4, rank=0, world_size=2).state_dict()
    with pytest.raises(ValueError, match=r"nodes must be 1\.\.4096"):
        Loader(archive, 4, rank=0, world_size=3).load_state_dict(
            {**state, "world_size": 2**20, "nodes": 2**20}
        )
    other = make_archive(tmp_path / "b", n=20)
    mix = {"a": str(archive), "b": str(other)}
    kw: dict[str, Any] = {"samples_per_epoch": 90, "batch_per_source": True}
    saved = Loader(mix, 4, rank=0, world_size=2, **kw).state_dict()
    with pytest.raises(ValueError, match="times an epoch"):
        Loader(mix, 4, rank=0, world_size=3, **kw).load_state_dict({**saved, "batch_size": 2**24})


@pytest.mark.parametrize("mode", ["global", "window"])
def test_the_nodes_orders_made_side_by_side_are_those_made_one_by_one(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A continued epoch orders every node of the world before on threads at once
    (world_orders): the same orders, node for node, as made one after another."""
    from dlop.runtime.order import epochs

    sizes = tuple(int(x) for x in np.random.default_rng(2).integers(50, 400, 60))
    spec = epochs.OrderSpec(
        num_samples=sum(sizes), batch_size=8, seed=4, world_size=6, nodes=3,
        mode=mode, shard_sizes=sizes, window_shards=4,
    )  # fmt: skip
    content = epochs.Content(spec.num_samples, order=lambda: epochs.epoch_order(spec, 1))
    rest = np.flatnonzero(np.random.default_rng(3).random(spec.num_samples) < 0.6)
    before = epochs.Shape(4, 2, 8, 5).spec(spec)
    got = {}
    for threshold in (1 << 40, 0):  # one by one, then side by side
        monkeypatch.setattr(epochs, "PARALLEL_ORDER_SAMPLES", threshold)
        got[threshold] = epochs.world_orders(spec, 1, rest, content, None, before)
    assert len(got[0]) == 3
    for (a_spec, a), (b_spec, b) in zip(got[1 << 40], got[0], strict=True):
        assert a_spec == b_spec and np.array_equal(a, b)

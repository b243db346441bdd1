"""Loader: coverage, exact resume after any batch, errors from the gather thread, DDP over gloo."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from dlop.runtime import (
    Archive,
    Loader,
    LoaderError,
    Mixup,
    RandomTimeCrop,
    SpecAugment,
    open_archive,
)

from .helpers import fail_planning, make_archive


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_archive(tmp_path_factory.mktemp("l") / "a", n=41)


def snapshot(batch: dict[str, Any]) -> dict[str, Any]:
    """Copy what the batch holds: CPU batches are views of reused buffers."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else list(v) for k, v in batch.items()}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_every_sample_once_per_epoch(archive: Path, shuffle: bool, drop_last: bool) -> None:
    loader = Loader(archive, batch_size=6, shuffle=shuffle, drop_last=drop_last, seed=5)
    for epoch in range(2):
        loader.set_epoch(epoch)
        labels = [x for b in loader for x in snapshot(b)["label"].tolist()]
        assert len(labels) == (36 if drop_last else 41) and len(set(labels)) == len(labels)
        assert set(labels) <= set(range(41))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ranks_are_disjoint_and_equal(archive: Path, world: int) -> None:
    per_rank = []
    for r in range(world):
        per_rank.append(
            [
                x
                for b in Loader(archive, 4, seed=1, rank=r, world_size=world)
                for x in b["label"].tolist()
            ]
        )
    assert len({len(p) for p in per_rank}) == 1
    union = [x for p in per_rank for x in p]
    assert set(union) == set(range(41)) and len(union) - 41 < world


def run_epoch(loader: Loader) -> list[dict[str, Any]]:
    return [snapshot(b) for b in loader]


TRANSFORMS = (
    SpecAugment("speech", freq_masks=1, freq_width=2, time_masks=1, time_width=3),
    Mixup(0.4, fields=("logmel",), num_classes=41),
)


@pytest.mark.parametrize("world", [1, 2])
def test_resume_after_any_batch_repeats_the_rest_exactly(archive: Path, world: int) -> None:
    for rank in range(world):

        def make(rank: int = rank) -> Loader:
            return Loader(
                archive,
                5,
                seed=9,
                rank=rank,
                world_size=world,
                transforms=TRANSFORMS,
                bucket_by="speech",
            )

        full = make()
        full.set_epoch(3)
        reference = run_epoch(full)
        for k in range(len(reference) + 1):
            first = make()
            first.set_epoch(3)
            it = iter(first)
            for _ in range(k):
                next(it)
            state = first.state_dict()
            assert state["batches_done"] == k and "indices" not in str(state)
            first.close()
            resumed = make()
            resumed.load_state_dict(state)
            rest = run_epoch(resumed)
            assert len(rest) == len(reference) - k
            assert all(same(a, b) for a, b in zip(rest, reference[k:], strict=True))


def test_state_mismatch_is_refused(archive: Path) -> None:
    state = Loader(archive, 5).state_dict()
    with pytest.raises(ValueError, match="seed"):
        Loader(archive, 5, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle"):
        Loader(archive, 5, shuffle=False).load_state_dict(state)
    # a state of rank 0 serves rank 1 (the ranks step together)
    two = Loader(archive, 5, rank=0, world_size=2).state_dict()
    Loader(archive, 5, rank=1, world_size=2).load_state_dict({**two, "batches_done": 2})


def test_errors_in_the_gather_thread_reach_the_loop(tmp_path: Path) -> None:
    path = make_archive(tmp_path / "z", n=30, zstd=True)
    ds = open_archive(path)
    shard = ds.shards[1]
    data = shard.layout_of("logmel").regions["data"]
    raw = bytearray((path / shard.path.name).read_bytes())
    raw[data.offset + 20] ^= 0xFF  # corrupt a compressed block after opening
    (path / shard.path.name).write_bytes(bytes(raw))
    fresh = open_archive(path)
    with pytest.raises(
        LoaderError, match=r"gathering batch \d+ of epoch 0 failed: FormatError.*block"
    ) as info:
        for _ in Loader(fresh, 4, shuffle=False):
            pass
    assert "in the loader thread" in str(info.value)


def test_cpu_buffers_are_reused_and_transforms_apply(archive: Path) -> None:
    loader = Loader(
        archive, 8, seed=2, transforms=(RandomTimeCrop("speech", frames=4),), prefetch=2
    )
    ptrs = set()
    for b in loader:
        ptrs.add(b["logmel"].data_ptr())
        assert b["speech"].shape[1] == 4 and bool((b["speech_lengths"] <= 4).all())
    assert len(ptrs) <= 3  # prefetch + 1 ring slots, no fresh allocations


def _ddp_worker(rank: int, world: int, port: int, path: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        loader = Loader(path, 4, seed=11)  # rank and world size come from torch.distributed
        labels = [x for b in loader for x in b["label"].tolist()]
        gathered: list[Any] = [None] * world
        dist.all_gather_object(
            gathered, {"rank": loader.spec.rank, "labels": labels, "batches": len(loader)}
        )
        if rank == 0:
            torch.save(gathered, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_torch_distributed_gloo_two_processes(archive: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "gathered.pt"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_ddp_worker, args=(2, port, str(archive), str(out)), nprocs=2, join=True)
    results = torch.load(out)
    assert [r["rank"] for r in results] == [0, 1]
    a, b = results[0]["labels"], results[1]["labels"]
    assert len(a) == len(b) == 21 and results[0]["batches"] == results[1]["batches"]
    assert set(a) | set(b) == set(range(41)) and len(set(a) & set(b)) <= 1  # 41 padded to 42


@pytest.mark.gpu
def test_gpu_pinned_side_stream_and_augment(archive: Path) -> None:
    loader = Loader(archive, 8, seed=4, device="cuda", transforms=TRANSFORMS)
    cpu = Loader(archive, 8, seed=4)
    slots = loader.buffers()
    assert all(t.is_pinned() for s in slots for t in s.values())
    for g, c in zip(loader, cpu, strict=True):
        assert g["logmel"].is_cuda and g["label"].is_cuda
        assert torch.equal(g["label"].cpu(), c["label"])
        assert "mixup_lambda" in g and g["label_soft"].shape == (len(c["label"]), 41)
    torch.cuda.synchronize()


def test_augmentations_are_seeded_and_stay_in_bounds() -> None:
    x = torch.zeros(4, 50, 16) + 1.0
    lengths = torch.tensor([50, 20, 5, 0])
    gen = torch.Generator().manual_seed(0)
    b1 = SpecAugment("f", freq_masks=2, freq_width=5, time_masks=2, time_width=10)(
        {"f": x.clone(), "f_lengths": lengths}, gen
    )
    gen.manual_seed(0)
    b2 = SpecAugment("f", freq_masks=2, freq_width=5, time_masks=2, time_width=10)(
        {"f": x.clone(), "f_lengths": lengths}, gen
    )
    assert torch.equal(b1["f"], b2["f"])
    masked_time = (b1["f"] == 0).all(dim=2)
    for i, n in enumerate(lengths.tolist()):
        assert not bool(masked_time[i, n:].any())  # never masks padding-only frames beyond length
        assert int(masked_time[i].sum()) <= 20
    crop = RandomTimeCrop("f", frames=8)(
        {"f": torch.arange(4 * 50.0).view(4, 50, 1), "f_lengths": lengths},
        torch.Generator().manual_seed(1),
    )
    for i, n in enumerate(lengths.tolist()):
        row = crop["f"][i, :, 0]
        valid = min(n, 8)
        start = int(row[0]) - i * 50 if valid else 0
        assert torch.equal(
            row[:valid], torch.arange(i * 50 + start, i * 50 + start + valid, dtype=row.dtype)
        )
        assert bool((row[valid:] == 0).all()) and 0 <= start <= max(n - 8, 0)
    mixed = Mixup(1.0, fields=("f",), num_classes=3)(
        {"f": torch.eye(4).view(4, 4, 1), "label": torch.tensor([0, 1, 2, 0])},
        torch.Generator().manual_seed(2),
    )
    lam, perm = mixed["mixup_lambda"], mixed["mixup_index"]
    assert bool(((lam >= 0) & (lam <= 1)).all())
    expect = lam[:, None] * torch.eye(4) + (1 - lam[:, None]) * torch.eye(4)[perm]
    assert torch.allclose(mixed["f"][..., 0], expect)
    assert torch.allclose(mixed["label_soft"].sum(1), torch.ones(4))


def test_synchronous_loader_matches_the_threaded_one_and_resumes(archive: Path) -> None:
    def make(prefetch: int) -> Loader:
        return Loader(
            archive, 6, seed=3, prefetch=prefetch, transforms=TRANSFORMS, bucket_by="speech"
        )

    threaded, sync = make(2), make(0)
    threaded.set_epoch(1)
    sync.set_epoch(1)
    reference = run_epoch(threaded)
    got = run_epoch(sync)
    assert len(got) == len(reference) and all(
        same(a, b) for a, b in zip(got, reference, strict=True)
    )
    first = make(0)
    first.set_epoch(1)
    it = iter(first)
    for _ in range(3):
        next(it)
    resumed = make(0)
    resumed.load_state_dict(first.state_dict())
    rest = run_epoch(resumed)
    assert (
        all(same(a, b) for a, b in zip(rest, reference[3:], strict=True))
        and len(rest) == len(reference) - 3
    )


class RecordingSupply:
    """A source stage that records what it hears, around the archive's own."""

    hears_asks = True  # as a supply that fetches: the Loader asks it before each batch

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.log: list[tuple[str, tuple[int, ...]]] = []

    def __getattr__(self, name: str) -> Any:  # name, readers, fields, shards...
        return getattr(self.inner, name)

    def shard(self, k: int) -> Any:
        return self.inner.shard(k)

    def ask(self, shards: Any) -> None:
        self.log.append(("ask", tuple(shards)))

    def release(self, shards: Any) -> None:
        self.log.append(("release", tuple(shards)))

    def check(self, shards: Any) -> None:
        self.log.append(("read", tuple(int(k) for k in shards)))
        self.inner.check(shards)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_the_source_hears_of_shards_ahead_and_lets_go_after(archive: Path, prefetch: int) -> None:
    source = RecordingSupply(open_archive(archive).supply)
    ds = Archive.over(source)
    loader = Loader(ds, 6, seed=1, prefetch=prefetch)
    batches = loader.batches()
    assert sum(len(b["label"]) for b in loader) == 41
    checks = [shards for what, shards in source.log if what == "read"]
    assert checks == [tuple(range(len(ds.shards)))]  # every shard, once, as the epoch starts
    # each batch's shards, one per sample
    reads = [tuple(np.sort(ds.shards_of(torch.as_tensor(b))).tolist()) for b in batches]
    releases = [i for i, (what, _) in enumerate(source.log) if what == "release"]
    # each batch lets go of what it read, in order, having asked for it before
    assert [tuple(sorted(source.log[i][1])) for i in releases] == reads
    for j, at in enumerate(releases):
        asked = {k for what, s in source.log[:at] if what == "ask" for k in s}
        assert set(reads[j]) <= asked, f"batch {j} read shards {reads[j]} before asking"
    loader.close()


class CountingSupply(RecordingSupply):
    """Counts asks against releases per shard."""

    def outstanding(self) -> int:
        asked = sum(len(s) for what, s in self.log if what == "ask")
        return asked - sum(len(s) for what, s in self.log if what == "release")


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("end", ["full", "stop", "error"])
def test_every_ask_is_released_once(archive: Path, prefetch: int, end: str) -> None:
    source = CountingSupply(open_archive(archive).supply)
    ds = Archive.over(source)
    if end == "error":
        fail_planning(ds, 3)  # batch 2
    loader = Loader(ds, 4, seed=2, prefetch=prefetch)
    batches = loader.batches()
    if end == "error":
        with pytest.raises(LoaderError, match=r"batch 2 of epoch 0 failed: OSError"):
            list(loader)
    else:
        for i, _ in enumerate(loader):
            if end == "stop" and i == 2:
                break
    loader.close()
    asks = [s for what, s in source.log if what == "ask"]
    if end == "full":
        assert len(asks) == len(batches)  # each batch asked for once
    assert source.outstanding() == 0


HANGS = """
import sys, threading, time
from dlop.runtime import Loader, LoaderError, open_archive
path, prefetch, case = sys.argv[1], int(sys.argv[2]), sys.argv[3]
loader = Loader(path, 4, seed=0, prefetch=prefetch)
it = iter(loader)
next(it)
if case == "close":
    loader.close()
elif case == "new-iter":
    other = iter(loader)
    assert next(other)["label"].shape == (4,)
elif case == "close-from-another-thread":
    plan = loader.archive.planner.plan
    def slow(*args): time.sleep(0.5); return plan(*args)
    loader.archive.planner.plan = slow  # each batch's planning
    threading.Timer(0.2, loader.close).start()
try:
    while True:
        next(it)
except LoaderError as e:
    assert "iterator was stopped" in str(e), e
else:
    raise SystemExit("the stopped iterator went on to the end")
assert next(it, None) is None  # then it is over, at once
loader.close()
print("ok")
"""


# prefetch=0 makes batches on the training thread: no other thread to block on.
@pytest.mark.parametrize(
    ("prefetch", "case"),
    [
        (0, "close"),
        (0, "new-iter"),
        (2, "close"),
        (2, "new-iter"),
        (2, "close-from-another-thread"),
    ],
)
def test_a_stopped_iterator_raises_instead_of_hanging(
    archive: Path, prefetch: int, case: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", HANGS, str(archive), str(prefetch), case],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]

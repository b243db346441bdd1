"""Batches by a budget of frames: within budget, exact across ranks and nodes, resumable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from dlop.formats import ArchiveWriter, Field
from dlop.runtime import IterableArchive, Loader, UsageError, batch_as_is
from dlop.runtime.order.budget import Budget, budget_steps, equal_frame_edges, fit_steps, split_to
from dlop.runtime.pipeline import packing

BUDGET = 4000


def lengths_of(n: int, seed: int = 0) -> np.ndarray:
    """A wide spread of utterance lengths (frames), a few longer than the budget."""
    gen = np.random.default_rng(seed)
    lengths = np.clip(gen.lognormal(5, 0.8, n).astype(np.int64), 1, None)
    lengths[gen.choice(n, 3, replace=False)] = BUDGET + 500  # each gets a batch of its own
    return lengths


def speech_archive(path: Path, n: int = 600, seed: int = 0) -> tuple[Path, np.ndarray]:
    lengths = lengths_of(n, seed)
    fields = [
        Field("label", "i64", ()),
        Field("fbank", "f32", (None, 2)),
        Field("tokens", "i32", (None,)),
    ]
    with ArchiveWriter(path, fields, shard_bytes=40_000) as w:
        for i, n_frames in enumerate(lengths):
            w.write(
                {
                    "label": i,
                    "fbank": np.full((n_frames, 2), i, np.float32),
                    "tokens": np.full(1 + n_frames // 50, i, np.int32),
                }
            )
    return path, lengths


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    return speech_archive(tmp_path_factory.mktemp("budget") / "speech")


def cost(lengths: np.ndarray, padded: bool) -> int:
    return int(lengths.max() * len(lengths) if padded else lengths.sum())


def loaders(path: Path, world: int, batch_size: int | None = None, **options: Any) -> list[Loader]:
    return [Loader(path, batch_size, rank=r, world_size=world, **options) for r in range(world)]


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("cap", [None, 7])
def test_budget_holds_but_for_a_lone_long_sample(speech: Any, padded: bool, cap: Any) -> None:
    path, lengths = speech
    key = "max_padded_frames" if padded else "max_frames"
    (loader,) = loaders(path, 1, bucket_by="fbank", batch_size=cap, seed=2, **{key: BUDGET})
    lone = 0
    for batch in loader.batches(0):
        assert cap is None or len(batch) <= cap
        if cost(lengths[batch], padded) > BUDGET:
            assert len(batch) == 1
            lone += 1
    assert lone == 3
    # what is read is what the order says: every sample's own frames, padded with 0
    for number, batch in enumerate(loader):
        want = loader.batches(0)[number]
        assert batch["label"].tolist() == want.tolist()
        longest = int(lengths[want].max())
        assert batch["fbank"].shape == (len(want), longest, 2)
        for row, i in enumerate(want.tolist()):
            assert (batch["fbank"][row, : lengths[i]] == i).all()
            assert (batch["fbank"][row, lengths[i] :] == 0).all()
    loader.close()


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_exactly_once_equal_counts_one_bucket_per_step(speech: Any, world: int) -> None:
    path, lengths = speech
    ranks = loaders(path, world, bucket_by="fbank", max_frames=BUDGET, seed=5)
    edges = np.asarray(ranks[0].spec.budget.edges)
    per_rank = [r.batches(3) for r in ranks]
    assert len({len(b) for b in per_rank}) == 1
    assert all(len(r) == len(per_rank[0]) for r in ranks)  # len() before the epoch
    every = np.concatenate([x for batches in per_rank for x in batches])
    counts = np.bincount(every, minlength=len(lengths))
    assert counts.min() >= 1  # every sample read
    # repeats only where a bucket's last step had fewer samples than ranks
    assert (counts > 1).sum() <= (world - 1) * (len(edges) + 1)
    for step in zip(*per_rank, strict=True):
        buckets = {int(np.searchsorted(edges, lengths[b], side="right").max()) for b in step}
        lows = {int(np.searchsorted(edges, lengths[b], side="right").min()) for b in step}
        assert len(buckets) == 1 and buckets == lows  # the ranks of a step: one bucket
    for r in ranks:
        r.close()


def test_even_shares_false_reads_each_sample_once(speech: Any) -> None:
    path, lengths = speech
    ranks = loaders(path, 4, bucket_by="fbank", max_frames=BUDGET, even_shares=False)
    every = np.concatenate([x for r in ranks for x in r.batches(0)])
    assert sorted(every.tolist()) == list(range(len(lengths)))


def test_drop_last_repeats_nothing(speech: Any) -> None:
    path, _ = speech
    ranks = loaders(path, 3, bucket_by="fbank", max_frames=BUDGET, drop_last=True, seed=1)
    every = np.concatenate([x for r in ranks for x in r.batches(0)])
    assert len(set(every.tolist())) == len(every)
    assert len({len(r.batches(0)) for r in ranks}) == 1


@pytest.mark.parametrize(("world", "nodes"), [(2, 2), (4, 2), (6, 3), (8, 4)])
def test_nodes_get_equal_steps_and_every_sample(speech: Any, world: int, nodes: int) -> None:
    path, lengths = speech
    ranks = loaders(path, world, bucket_by="fbank", max_frames=BUDGET, nodes=nodes, seed=4)
    assert ranks[0].spec.dealt
    per_rank = [r.batches(1) for r in ranks]
    assert len({len(b) for b in per_rank}) == 1
    every = np.concatenate([x for batches in per_rank for x in batches])
    assert set(every.tolist()) == set(range(len(lengths)))
    for batches in per_rank:
        for b in batches:
            assert cost(lengths[b], False) <= BUDGET or len(b) == 1
    local = world // nodes  # a node's ranks read only its shards
    for node in range(nodes):
        mine = np.concatenate([x for r in range(local) for x in per_rank[node * local + r]])
        others = np.concatenate(
            [x for r in range(world) if r // local != node for x in per_rank[r]]
        )
        assert len(set(mine.tolist()) & set(others.tolist())) <= 2 * local


def test_next_epoch_differs_and_len_is_exact(speech: Any) -> None:
    path, _ = speech
    (loader,) = loaders(path, 1, bucket_by="fbank", max_frames=BUDGET)
    first, second = loader.batches(0), loader.batches(1)
    assert [b.tolist() for b in first] != [b.tolist() for b in second]
    assert len(loader) == sum(1 for _ in loader)
    loader.close()


@pytest.mark.parametrize("padded", [False, True])
def test_resume_mid_epoch_in_the_same_world(speech: Any, padded: bool) -> None:
    path, _ = speech
    key = "max_padded_frames" if padded else "max_frames"
    options = {"bucket_by": "fbank", key: BUDGET, "seed": 9, "prefetch": 0}
    whole = Loader(path, None, **options)
    whole.set_epoch(2)
    labels = [batch["label"].tolist() for batch in whole]
    partial = Loader(path, None, **options)
    partial.set_epoch(2)
    for k, batch in enumerate(partial):
        assert batch["label"].tolist() == labels[k]
        if k == 5:
            break
    state = partial.state_dict()
    resumed = Loader(path, None, **options)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)
    assert [batch["label"].tolist() for batch in resumed] == labels[6:]
    for loader in (whole, partial, resumed):
        loader.close()


@pytest.mark.parametrize(
    ("old", "new"),
    [((2, 1), (3, 1)), ((4, 1), (1, 1)), ((4, 2), (6, 3)), ((6, 3), (2, 1)), ((1, 1), (4, 2))],
)
def test_resume_in_another_world_reads_the_rest_once(speech: Any, old: Any, new: Any) -> None:
    path, lengths = speech
    options = {"bucket_by": "fbank", "max_frames": BUDGET, "seed": 3}
    before = loaders(path, old[0], nodes=old[1], **options)
    done = 4
    taken = [x for r in before for x in r.batches(0)[:done]]
    state = before[0].state_dict()
    state["batches_done"] = done
    after = loaders(path, new[0], nodes=new[1], **options)
    for r in after:
        r.load_state_dict(state)
    rest = [r.batches(0) for r in after]
    assert len({len(b) for b in rest}) == 1  # equal counts in the new world
    read = np.concatenate(taken + [x for batches in rest for x in batches])
    counts = np.bincount(read, minlength=len(lengths))
    assert counts.min() >= 1
    assert (counts > 1).sum() <= 4 * max(old[0], new[0]) * 10  # a bucket's last step's repeats
    for batches in rest:
        for b in batches:
            assert cost(lengths[b], False) <= BUDGET or len(b) == 1
    # the next epoch is a fresh one in the new world
    fresh = loaders(path, new[0], nodes=new[1], **options)
    for r, f in zip(after, fresh, strict=True):
        assert [b.tolist() for b in r.batches(1)] == [b.tolist() for b in f.batches(1)]


def test_dataloader_workers_give_the_loaders_batches(speech: Any) -> None:
    path, _ = speech
    options: dict[str, Any] = {"bucket_by": "fbank", "max_frames": BUDGET, "seed": 6}
    loader = Loader(path, None, prefetch=0, **options)
    loader.set_epoch(1)
    want = [(b["label"].tolist(), b["fbank"].shape) for b in loader]
    ds = IterableArchive(path, None, **options)
    ds.set_epoch(1)
    it = DataLoader(ds, batch_size=None, num_workers=2, collate_fn=batch_as_is)
    got = [(b["label"].tolist(), b["fbank"].shape) for b in it]
    assert got == want
    loader.close()


def test_a_state_under_another_budget_is_refused(speech: Any) -> None:
    path, _ = speech
    (a,) = loaders(path, 1, bucket_by="fbank", max_frames=BUDGET)
    (b,) = loaders(path, 1, bucket_by="fbank", max_frames=BUDGET // 2)
    with pytest.raises(UsageError, match="budget"):
        b.load_state_dict(a.state_dict())
    (c,) = loaders(path, 1, bucket_by="fbank", max_frames=BUDGET, bucket_edges=[100, 300])
    with pytest.raises(UsageError, match="budget"):
        c.load_state_dict(a.state_dict())


def test_bad_budget_settings_are_named(speech: Any) -> None:
    path, _ = speech
    with pytest.raises(UsageError, match="bucket_by"):
        Loader(path, None, max_frames=100)
    with pytest.raises(UsageError, match="not both"):
        Loader(path, None, bucket_by="fbank", max_frames=100, max_padded_frames=100)
    with pytest.raises(UsageError, match="increase"):
        Loader(path, None, bucket_by="fbank", max_frames=100, bucket_edges=[50, 50])
    with pytest.raises(UsageError, match="max_frames"):
        Loader(path, None, bucket_by="fbank", max_frames=0)
    with pytest.raises(TypeError, match="batch_size"):
        Loader(path, None, bucket_by="fbank")
    with pytest.raises(UsageError, match="num_buckets"):
        Loader(path, None, bucket_by="fbank", max_frames=100, num_buckets=0)
    with pytest.raises(UsageError, match="max_frames"):
        Loader(path, 8, bucket_by="fbank", max_frames=0)
    with pytest.raises(UsageError, match="max_frames"):
        Loader(path, None, bucket_by="fbank", max_frames=10**17)
    with pytest.raises(UsageError, match="bucket_edges"):
        Loader(path, None, bucket_by="fbank", max_frames=100, bucket_edges=np.array([[3, 4]]))
    with pytest.raises(UsageError, match="num_buckets= is for budget"):
        Loader(path, 8, bucket_by="fbank", num_buckets=4)
    for key, value in (("num_buckets", 4), ("bucket_edges", [10, 20])):  # no bucket_by either
        with pytest.raises(UsageError, match=f"{key}= is for budget"):
            Loader(path, 8, **{key: value})
    with pytest.raises(UsageError, match="drop_last"):
        Loader(
            path, None, bucket_by="fbank", max_frames=50, drop_last=True, rank=0, world_size=1024
        )


def test_a_mixture_by_budget_keeps_each_batch_to_one_source(tmp_path: Path) -> None:
    a, la = speech_archive(tmp_path / "a", 200, seed=1)
    b, lb = speech_archive(tmp_path / "b", 150, seed=2)
    loader = Loader(
        {"a": a, "b": b}, None, bucket_by="fbank", max_frames=BUDGET, batch_per_source=True
    )
    lengths = np.concatenate([la, lb])
    for batch in loader.batches(0):
        assert len(set((batch >= 200).tolist())) == 1
        assert cost(lengths[batch], False) <= BUDGET or len(batch) == 1
    seen = np.concatenate(loader.batches(0))
    assert set(seen.tolist()) == set(range(350))
    loader.close()


def test_buffers_hold_the_largest_batch_of_any_bucket(speech: Any) -> None:
    path, lengths = speech
    loader = Loader(path, None, bucket_by="fbank", max_padded_frames=BUDGET, prefetch=2)
    for epoch in range(2):
        loader.set_epoch(epoch)
        for batch, want in zip(loader, loader.batches(epoch), strict=True):
            assert batch["label"].tolist() == want.tolist()
            assert batch["tokens"].shape[0] == len(want)
    ring = loader.buffers()[0]["fbank"].numel()
    assert ring >= 2 * max(BUDGET, int(lengths.max()))
    loader.close()


def test_edges_split_frames_evenly_and_are_integers() -> None:
    lengths = np.arange(1, 1001, dtype=np.int64)
    edges = equal_frame_edges(lengths, 4)
    assert len(edges) == 3
    shares = [lengths[(lengths >= lo) & (lengths < hi)].sum() for lo, hi in
              zip((0, *edges), (*edges, 10**9), strict=True)]  # fmt: skip
    assert max(shares) / min(shares) < 1.05
    assert equal_frame_edges(np.full(50, 7, np.int64), 10) == ()  # one length: one bucket


def test_steps_split_to_any_count_without_passing_the_budget() -> None:
    gen = np.random.default_rng(0)
    lengths = gen.integers(1, 200, 500)
    budget = Budget(1000, False, (50, 100, 150), int(lengths.min()))
    by_bucket, tail = budget_steps(
        gen.permutation(500), lengths, None, budget, 64, 4, 64, True, False, gen
    )
    assert tail == [] and set(by_bucket) == {0, 1, 2, 3}
    steps = by_bucket[2]
    grown = fit_steps(steps, len(steps) + 9, 4)
    assert len(grown) == len(steps) + 9
    flat = np.concatenate([b for s in grown for b in s])
    assert sorted(flat.tolist()) == sorted(np.concatenate([b for s in steps for b in s]).tolist())
    for step in grown:
        assert len(step) == 4
        for batch in step:
            assert len(batch) >= 1 and lengths[batch].sum() <= 1000
    assert fit_steps(steps, len(steps) - 2, 4) == steps[:-2]


def test_split_to_halves_in_place_to_any_count() -> None:
    batch = np.arange(20_000)
    pieces = split_to([batch, np.arange(20_000, 20_003)], 16_384)
    assert len(pieces) == 16_384 and min(len(p) for p in pieces) >= 1
    assert np.concatenate(pieces).tolist() == list(range(20_003))  # each half where it was
    assert len(split_to([np.arange(3)], 10)) == 3  # no batch of one sample is split


@pytest.mark.parametrize("share", ["keep", "redeal"])
def test_drop_last_on_nodes_keeps_counts_equal_and_repeats_nothing(speech: Any, share: str) -> None:
    path, _ = speech
    for seed in range(4):
        ranks = loaders(
            path, 4, bucket_by="fbank", max_frames=BUDGET, nodes=2, node_share=share,
            drop_last=True, seed=seed,
        )  # fmt: skip
        for epoch in range(3):
            per_rank = [r.batches(epoch) for r in ranks]
            assert len({len(b) for b in per_rank}) == 1
            every = np.concatenate([x for b in per_rank for x in b] or [np.zeros(0, np.int64)])
            assert len(set(every.tolist())) == len(every)


@pytest.mark.parametrize(("world", "nodes"), [(2, 2), (4, 2), (8, 4)])
def test_the_whole_world_reads_one_bucket_a_step(speech: Any, world: int, nodes: int) -> None:
    path, lengths = speech
    ranks = loaders(path, world, bucket_by="fbank", max_frames=BUDGET, nodes=nodes, seed=1)
    edges = np.asarray(ranks[0].spec.budget.edges)
    for step in zip(*[r.batches(2) for r in ranks], strict=True):
        buckets = {int(k) for b in step for k in np.searchsorted(edges, lengths[b], side="right")}
        assert len(buckets) == 1


def test_buffers_follow_what_fits_not_the_shortest_sample(tmp_path: Path) -> None:
    lengths = np.concatenate([[1, 0], np.full(300, 400)])  # one utterance of 1 frame, one empty
    fields = [Field("fbank", "f32", (None, 2))]
    with ArchiveWriter(tmp_path / "a", fields, shard_bytes=1 << 20) as w:
        for n in lengths.tolist():
            w.write({"fbank": np.zeros((n, 2), np.float32)})
    for key in ("max_frames", "max_padded_frames"):
        loader = Loader(tmp_path / "a", None, bucket_by="fbank", prefetch=0, **{key: 4000})
        needed = max(int(lengths[b].max()) * len(b) for e in range(3) for b in loader.batches(e))
        ring = loader.buffers()[0]["fbank"].numel() // 2
        # the largest batch, or room for several (runtime.pipeline.packing): within 8 MiB
        assert needed <= ring <= max(2 * needed, packing.PACK_BYTES // 8)
        assert loader.spec.batch_size <= len(lengths)  # the cap, from what fits
        loader.close()


def test_a_state_saved_before_an_append_continues_its_epoch(tmp_path: Path) -> None:
    from dlop.compiler import compile_map

    def utterance(x: int) -> dict[str, Any]:
        return {"fbank": np.full((1 + (x * 37) % 300 + x // 2, 2), x, np.float32), "n": x}

    path = tmp_path / "grown.dlop"
    compile_map(utterance, list(range(200)), path, progress=False)
    options: dict[str, Any] = {"bucket_by": "fbank", "max_frames": 2000, "prefetch": 0}
    whole = [b["n"].tolist() for b in Loader(path, None, **options)]
    partial = Loader(path, None, **options)
    it = iter(partial)
    next(it), next(it)
    state = partial.state_dict()
    del it
    partial.close()
    compile_map(utterance, list(range(260)), path, append=True, progress=False)
    grown = Loader(path, None, **options)
    grown.load_state_dict(state)
    assert [b["n"].tolist() for b in grown] == whole[2:]
    fresh = Loader(path, None, **options)  # the next epoch reads all, as a fresh start does
    assert [b.tolist() for b in grown.batches(1)] == [b.tolist() for b in fresh.batches(1)]
    fresh.close()
    grown.close()


def test_torch_buffers_are_reused(speech: Any) -> None:
    path, _ = speech
    loader = Loader(path, None, bucket_by="fbank", max_frames=BUDGET, prefetch=0)
    pointers = {batch["fbank"].untyped_storage().data_ptr() for batch in loader}
    assert len(pointers) == 1
    assert isinstance(loader.buffers()[0]["fbank"], torch.Tensor)
    loader.close()

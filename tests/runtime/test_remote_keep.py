"""A remote supply keeps the shards it read mapped (loose) while they fit its share of
the budget, so warm epochs map nothing again; it lets them go when this process or
another one on the node needs the room."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dlop.formats.storage import Retry
from dlop.runtime import Loader, open_archive
from dlop.runtime.storage.cache import CacheDir
from tests.faultproxy import FaultProxy
from tests.runtime.helpers import in_forked_child, make_archive, open_remote

FAST = Retry(attempts=4, backoff_s=0.001, max_backoff_s=0.01)
SETTINGS: dict[str, Any] = {"batch_size": 4, "seed": 5, "order": "window", "window_shards": 2}


def keys(loader: Loader, epoch: int) -> list[str]:
    loader.set_epoch(epoch)
    return [k for b in loader for k in b["key"]]


@pytest.fixture
def site(tmp_path: Path) -> Path:
    make_archive(tmp_path / "site" / "a")  # 37 samples in 6 shards of 61440 bytes
    return tmp_path / "site"


def test_warm_epochs_map_no_shard_again(site: Path, tmp_path: Path) -> None:
    with FaultProxy(root=site) as proxy:
        remote = open_remote(
            proxy.url + "/a", cache_dir=tmp_path / "c", cache_bytes=1 << 20, retry=FAST
        )
        loader = Loader(remote, **SETTINGS)
        keys(loader, 0)
        assert sorted(remote.supply.open) == list(range(6))  # all loose, still mapped
        holds: list[Path] = []
        hold = remote.supply.cache.hold

        def counted(path: Path) -> Any:
            holds.append(path)
            return hold(path)

        remote.supply.cache.hold = counted  # type: ignore[method-assign]
        assert keys(loader, 1) == keys(Loader(site / "a", **SETTINGS), 1)
        assert holds == []  # nothing opened, locked or mapped again
        loader.close()
        remote.close()
        assert not remote.supply.open and not remote.planner.planners.kept


def test_loose_shards_stay_within_their_bytes(site: Path, tmp_path: Path) -> None:
    largest = max(p.stat().st_size for p in (site / "a").glob("shard-*"))
    with FaultProxy(root=site) as proxy:
        remote = open_remote(
            proxy.url + "/a", cache_dir=tmp_path / "c", cache_bytes=8 * largest, retry=FAST
        )
        loader = Loader(remote, **SETTINGS)
        assert keys(loader, 0) == keys(Loader(site / "a", **SETTINGS), 0)
        assert remote.supply.loose_bytes == 4 * largest  # half the budget by default
        assert 2 <= len(remote.supply.open) <= 4
        loader.close()
        remote.close()


def test_another_process_waiting_for_room_gets_the_loose_shards(site: Path, tmp_path: Path) -> None:
    with FaultProxy(root=site) as proxy:
        remote = open_remote(
            proxy.url + "/a", cache_dir=tmp_path / "c", cache_bytes=1 << 20, retry=FAST
        )
        keys(Loader(remote, **SETTINGS), 0)
        assert len(remote.supply.open) == 6
        # Another cache on the same folder (its own descriptors: its locks conflict with
        # ours as another process's would) whose budget has no room while ours are held.
        other = CacheDir(tmp_path / "c", max_bytes=remote.supply.cache.used_bytes() + 100_000)
        before = other.wanted_stamp()
        stored: list[Any] = []
        writer = threading.Thread(
            target=lambda: stored.append(
                other.get(
                    other.archive_dir("0000000000000000000000cc") / "big", lambda: b"x" * 200_000
                )
            )
        )
        writer.start()
        try:
            for _ in range(400):  # the writer stamps .wanted once it waits
                if other.wanted_stamp() != before:
                    break
                writer.join(0.01)
            assert other.wanted_stamp() != before and not stored
            assert remote[0]["key"] == "k000"  # the next ask lets the loose shards go
        finally:
            writer.join(30)
        assert stored and stored[0].bytes == 200_000
        assert other.used_bytes() <= other.max_bytes
        other.let_go(stored[0])
        remote.close()


def test_a_shards_entries_are_kept_while_it_is_mapped_and_forgotten_with_it(
    site: Path, tmp_path: Path
) -> None:
    with FaultProxy(root=site) as proxy:
        remote = open_remote(
            proxy.url + "/a", cache_dir=tmp_path / "c", cache_bytes=1 << 20, retry=FAST
        )
        first = remote.gather(torch.tensor([0, 1, 2]))
        slots = remote.planner.planners.slots
        for _ in range(3000):  # shard 0 whole (a regression fails below, never hangs)
            if not remote.supply.arrive.streams:
                break
            time.sleep(0.01)
        again = remote.gather(torch.tensor([1, 3]))  # the same shard: put once, kept
        stamp = int(slots.stamps[0])
        assert stamp >= 0 and remote.gather(torch.tensor([4]))["key"] == ["k004"]
        assert int(slots.stamps[0]) == stamp  # not put again
        assert first["key"] == ["k000", "k001", "k002"] and again["key"] == ["k001", "k003"]
        assert remote.supply.squeeze()  # shard 0, loose, let go of: its entries go too
        assert slots.stamps[0] == -2 and 0 not in slots.texts["key"].texts
        assert remote.gather(torch.tensor([4]))["key"] == ["k004"]
        remote.close()


# Raw fields, fixed-size, ragged (in one or in two dimensions) or text: planned by
# Slots (runtime.archive.planning), by shard number over every shard mapped here.
SLOTTED = {
    "fixed": ["label", "logmel"],
    "ragged": ["label", "speech", "image"],
    "text": ["key", "label", "text"],
}


def through_cache(proxy: FaultProxy, tmp_path: Path, fields: list[str]) -> Any:
    """``fields`` of archive ``a`` served by ``proxy``, through a cache."""
    url = proxy.url + "/a"
    return open_remote(url, fields, cache_dir=tmp_path / "c", cache_bytes=1 << 20, retry=FAST)


def equal(got: dict[str, Any], want: dict[str, Any], fields: list[str]) -> bool:
    names = [n for n in want if n.split("_lengths")[0] in fields]
    tensors = [n for n in names if isinstance(want[n], torch.Tensor)]
    lists = [n for n in names if n not in tensors]
    return (
        all(torch.equal(got[n], want[n]) for n in tensors)
        and all(got[n] == want[n] for n in lists)
        and set(got) == set(want)
    )


@pytest.mark.parametrize("kind", SLOTTED)
def test_raw_fields_plan_by_one_table_refreshed_as_shards_are_mapped_anew(
    tmp_path: Path, kind: str
) -> None:
    fields = SLOTTED[kind]
    # zstd: each shard is served once whole (decoded into the cache), never arriving in
    # parts, so every shard a batch touches is in the table after it
    site = make_archive(tmp_path / "site" / "a", zstd=True).parent
    local = open_archive(site / "a", fields=fields)
    idx = torch.tensor([36, 0, 20, 7, 21, 1])  # several shards, in no order
    want = local.gather(idx)
    shards = len(local.supply.shard_sizes)
    with FaultProxy(root=site) as proxy:
        remote = open_remote(
            proxy.url + "/a", fields, cache_dir=tmp_path / "c", cache_bytes=1 << 20, retry=FAST
        )
        got = remote.gather(idx)
        assert equal(got, want, fields)
        slots = remote.planner.planners.slots
        assert slots is not None and not remote.planner.planners.kept  # no per-set gathers
        touched = sorted(set(remote.shards_of(idx).tolist()))
        others = [k for k in range(shards) if k not in touched]
        assert len(touched) > 2 and others
        before = slots.stamps[touched].copy()
        assert (before >= 0).all() and (slots.stamps[others] == -2).all()
        with remote.supply.lock:
            assert remote.supply.drop_loose()  # every shard let go of: its rows with it
        assert (slots.stamps == -2).all()
        assert all((t.nums == 0).all() and (t.bases == 0).all() for t in slots.tables.values())
        assert all((g.bases == 0).all() for g in slots.spans.values())
        got = remote.gather(idx)  # mapped anew: new stamps, the rows read again
        assert equal(got, want, fields)
        assert (slots.stamps[touched] > before).all()
        remote.close()


@contextlib.contextmanager
def every_sample(site: Path, tmp_path: Path, kind: str) -> Iterator[tuple[Any, dict[str, Any]]]:
    """The archive's ``SLOTTED[kind]`` fields through a cache (closed after), and its 37
    samples as one local batch."""
    fields = SLOTTED[kind]
    want = open_archive(site / "a", fields=fields).gather(torch.arange(37))
    with FaultProxy(root=site) as proxy:
        remote = through_cache(proxy, tmp_path, fields)
        yield remote, want
        remote.close()


@pytest.mark.parametrize("kind", SLOTTED)
def test_a_plan_keeps_its_rows_when_its_shards_are_let_go_of_before_its_copies(
    site: Path, tmp_path: Path, kind: str
) -> None:
    with every_sample(site, tmp_path, kind) as (remote, want):
        batch, plan = remote.plan(torch.arange(37))  # planned, nothing copied yet
        with remote.supply.lock:
            assert remote.supply.drop_loose()  # the batch's shards unmapped meanwhile
        assert not remote.supply.open
        remote.own_engine().run(plan)
        assert equal(batch, want, SLOTTED[kind])


@pytest.mark.parametrize("kind", SLOTTED)
def test_dataloader_workers_forked_after_the_parent_planned_read_their_own_mappings(
    site: Path, tmp_path: Path, kind: str
) -> None:
    from torch.utils.data import DataLoader

    with every_sample(site, tmp_path, kind) as (remote, want):
        remote.gather(torch.arange(37))  # the parent's table holds every shard
        loader = DataLoader(remote, batch_size=37, num_workers=2, multiprocessing_context="fork")
        (got,) = list(loader)  # one batch: ragged fields pad to the batch's longest
        assert equal(got, want, SLOTTED[kind])


@pytest.mark.parametrize("shards", [[-1], [6], [0, 7]])
def test_a_shard_number_outside_the_archive_is_refused_not_wrapped(
    site: Path, tmp_path: Path, shards: list[int]
) -> None:
    with FaultProxy(root=site) as proxy:
        remote = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", retry=FAST)
        with pytest.raises(IndexError, match=r"shard -?\d+ out of range 0\.\.5"):
            remote.supply.ask(shards)
        assert not remote.supply.refs.any() and remote.supply.asked == 0
        remote.close()


def test_entries_are_cleared_only_by_the_mapping_they_came_from(tmp_path: Path) -> None:
    """A planner that finds its shard let go of after its put clears only its own
    entries, never those another thread put from the shard's next mapping."""
    from dlop.formats import ShardReader
    from dlop.runtime.archive.planning import Slots

    path = make_archive(tmp_path / "a")
    local = open_archive(path, fields=["label", "speech", "text"])
    slots = Slots(local.fields, local.starts, len(local), 0.0)
    first = local.shards[0]
    again = ShardReader(first.path)  # the shard mapped anew
    slots.put(0, first, 7)
    slots.put(0, again, 8)
    slots.clear(0, only=first)  # the first mapping's planner, late: nothing of it is left
    assert slots.stamps[0] == 8 and slots.spans["speech"].bases[0] != 0
    assert 0 in slots.texts["text"].texts and slots.tables["label"].nums[0] > 0
    slots.clear(0, only=again)
    assert slots.stamps[0] == -2 and slots.spans["speech"].bases[0] == 0
    assert 0 not in slots.texts["text"].texts and slots.tables["label"].nums[0] == 0
    again.close()
    # a batch over a shard whose entries are gone is refused before any copy is planned
    from dlop.runtime.archive.planning import Gone
    from dlop.runtime.gather.fields import Groups

    one = [["speech"], ["text"]]  # a ragged field alone, text alone
    for fields in one:
        alone = Slots({f: local.fields[f] for f in fields}, local.starts, len(local), 0.0)
        alone.put(1, local.shards[1], 3)  # shard 1 in, shard 0 not
        idx = torch.tensor([0])
        with pytest.raises(Gone):
            alone.plan(
                idx, Groups(np.zeros(1, np.int64), np.zeros(1, np.int64)), np.array([0]), None
            )


def test_a_batch_over_an_arriving_shard_reads_its_own_copy_of_the_text(tmp_path: Path) -> None:
    """Entries of a shard still arriving are put for one batch (stamp -2): another
    batch may put its older copy between this batch's put and its plan, and this batch
    still reads the copy it made after its samples arrived."""
    from dlop.runtime.archive.planning import Slots
    from dlop.runtime.gather.fields import Groups
    from dlop.runtime.gather.samples import ShardText

    path = make_archive(tmp_path / "a")
    local = open_archive(path, fields=["key", "text"])
    slots = Slots(local.fields, local.starts, len(local), 0.0)
    mine = slots.put(0, local.shards[0], -2)
    for name, g in slots.texts.items():  # an older copy, of bytes that had not arrived
        text, where = mine[name]
        g.put(0, (ShardText("\0" * len(text.values), text.offsets), where))
    rows = np.arange(local.shards[0].num_samples, dtype=np.int64)
    idx, groups = torch.from_numpy(rows), Groups(np.zeros(len(rows), np.int64), rows)
    batch, _ = slots.plan(idx, groups, np.array([0]), None, {0: mine})
    want = local.gather(idx)
    assert batch["key"] == want["key"] and batch["text"] == want["text"]
    stale, _ = slots.plan(idx, groups, np.array([0]), None)  # without its own: the older
    assert stale["key"] != want["key"]


def test_a_child_forked_while_a_parent_thread_plans_reads_on(site: Path, tmp_path: Path) -> None:
    """The planners' lock held by a parent thread at the fork (a Loader planning while a
    DataLoader forks its workers) is not the child's: the child drops what the parent
    kept and reads, never waits on that lock forever."""
    want = open_archive(site / "a", fields=["key", "label"]).gather(torch.arange(37))["key"]
    with FaultProxy(root=site) as proxy:
        remote = through_cache(proxy, tmp_path, ["key", "label"])
        remote.gather(torch.arange(37))
        planners = remote.planner.planners

        def reads() -> bool:
            planners.forget(0)  # what a shard let go of in the child calls
            return bool(remote.gather(torch.arange(37))["key"] == want)

        with planners.lock:  # as a parent thread holding it at the fork
            answered = in_forked_child(reads)
        remote.close()
    assert answered


def test_a_late_put_of_an_arriving_copy_never_reaches_a_batch_over_the_whole_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch that saw a shard still arriving copies its text before the rest arrives
    and may put it after another batch put the whole shard's: that copy is the first
    batch's own, never what the other batch then reads."""
    from dlop.runtime.archive.planning import Slots
    from dlop.runtime.gather.fields import Groups
    from dlop.runtime.gather.samples import ShardText, SlottedText

    path = make_archive(tmp_path / "a")
    local = open_archive(path, fields=["key", "text"])
    slots = Slots(local.fields, local.starts, len(local), 0.0)
    slots.put(0, local.shards[0], 5)  # the second batch's put: the shard whole
    real = SlottedText.prepared

    def before_the_rest(self: Any, shard: Any, whole: bool) -> Any:
        text, where = real(self, shard, whole)
        return (text if whole else ShardText("\0" * len(text.values), text.offsets)), where

    monkeypatch.setattr(SlottedText, "prepared", before_the_rest)
    mine = slots.put(0, local.shards[0], -2)  # the first batch's put, late
    rows = np.arange(local.shards[0].num_samples, dtype=np.int64)
    idx, groups = torch.from_numpy(rows), Groups(np.zeros(len(rows), np.int64), rows)
    want = local.gather(idx)
    batch, _ = slots.plan(idx, groups, np.array([0]), None)  # the second batch's plan
    assert batch["key"] == want["key"] and batch["text"] == want["text"]
    own, _ = slots.plan(idx, groups, np.array([0]), None, {0: mine})
    assert own["key"] != want["key"]  # the first batch's own copy (it reads only what arrived)

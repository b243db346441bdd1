"""Archives read from object storage through the node-local shard cache: the same
batches as the local Loader, over S3 (moto on loopback) and HTTP with Range, and
through faults injected by tests/faultproxy.py."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dlop.formats import ArchiveReader, ArchiveWriter, Field, Zstd
from dlop.formats.storage import LocalStorage, Retry
from dlop.runtime import Archive, Loader, LoaderError, UsageError, UsageTypeError, open_archive
from dlop.runtime.storage.cache import STAMP_BYTES, CacheDir
from dlop.runtime.storage.cache_folder import CacheError
from dlop.runtime.storage.remote import fetch_head, fetch_index, storage_at
from dlop.runtime.storage.remote_sizes import ShardSizes
from dlop.runtime.storage.remote_supply import RemoteSupply
from tests.faultproxy import FaultProxy
from tests.runtime.helpers import make_archive, open_remote

FAST = Retry(attempts=4, backoff_s=0.001, max_backoff_s=0.01)
SETTINGS: dict[str, Any] = {"batch_size": 4, "seed": 5, "order": "window", "window_shards": 2}


def epoch_batches(loader: Loader, epoch: int) -> list[dict[str, Any]]:
    """The epoch's batches, copied out of the Loader's reused buffers."""
    loader.set_epoch(epoch)
    return [copied(b) for b in loader]


def copied(batch: Any) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    return all(a[k] == b[k] if isinstance(a[k], list) else torch.equal(a[k], b[k]) for k in a)


def check_like_local(remote: Archive, local: Path, world: int = 2, **settings: Any) -> None:
    for rank in range(world):
        kw = {**SETTINGS, "rank": rank, "world_size": world, **settings}
        for epoch in (0, 1):
            want = epoch_batches(Loader(local, **kw), epoch)
            got = epoch_batches(Loader(remote, **kw), epoch)
            assert [b["key"] for b in got] == [b["key"] for b in want]
            assert all(same(g, w) for g, w in zip(got, want, strict=True))


@pytest.fixture
def served(tmp_path: Path) -> Path:
    """A folder holding a raw archive ``a`` and a zstd one ``z``."""
    make_archive(tmp_path / "site" / "a")
    make_archive(tmp_path / "site" / "z", zstd=True)
    return tmp_path / "site"


@pytest.mark.parametrize("name", ["a", "z"])
def test_s3_batches_equal_local(s3: Any, served: Path, tmp_path: Path, name: str) -> None:
    s3.make_bucket("data")
    s3.filesystem().put(str(served / name), f"data/{name}", recursive=True)
    remote = open_remote(f"s3://data/{name}", cache_dir=tmp_path / "cache", cache_bytes=1 << 20)
    check_like_local(remote, served / name)
    # A zstd archive is cached raw: every cached shard maps without a block table.
    cached = [p for p in (tmp_path / "cache").rglob("shard-*.dlop")]
    assert cached and all(
        open_archive(served / "a").fields["logmel"].codec.mappable for _ in cached
    )
    assert not remote.fields["logmel"].ragged and remote.fields["logmel"].codec.mappable


def test_resume_matches_local(served: Path, tmp_path: Path) -> None:
    with FaultProxy(root=served) as proxy:
        remote = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", retry=FAST)
        kw = {**SETTINGS, "rank": 1, "world_size": 2}
        reference = epoch_batches(Loader(served / "a", **kw), 2)
        first = Loader(remote, **kw)
        first.set_epoch(2)
        it = iter(first)
        for _ in range(3):
            next(it)
        state = first.state_dict()
        first.close()
        resumed = Loader(remote, **kw)
        resumed.load_state_dict(state)
        rest = [copied(b) for b in resumed]
        assert all(same(g, w) for g, w in zip(rest, reference[3:], strict=True))
        assert len(rest) == len(reference) - 3


def test_http_ranged_parts(served: Path, tmp_path: Path) -> None:
    parts = Retry(attempts=2, backoff_s=0.001, part_bytes=16 << 10, parallel_parts=3)
    with FaultProxy(root=served) as proxy:
        remote = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", retry=parts)
        check_like_local(remote, served / "a", world=1)
        assert proxy.ranges and all(r.startswith("bytes=") for r in proxy.ranges)
        # every shard fetched once: the first ranged read of a shard (its header and up
        # to 64 KiB after) holds all of its 61440 bytes, so the parts are not asked for
        assert proxy.count("shard-00000") == 1


@pytest.mark.parametrize("fault", ["drop", "slowdown", "truncate", "corrupt"])
def test_faults_survived_over_http(served: Path, tmp_path: Path, fault: str) -> None:
    with FaultProxy(root=served) as proxy:
        for shard in ("shard-00001", "shard-00004"):
            proxy.fail(shard, fault, times=2)
        remote = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", retry=FAST)
        check_like_local(remote, served / "a", world=1)
        assert proxy.count("shard-00001") == 3  # two failures, then the good copy
        assert proxy.count("shard-00000") == 1


@pytest.mark.parametrize("fault", ["slowdown", "corrupt", "truncate"])
def test_faults_survived_over_s3(s3: Any, served: Path, tmp_path: Path, fault: str) -> None:
    s3.make_bucket("data")
    s3.filesystem().put(str(served / "a"), "data/a", recursive=True)
    with FaultProxy(upstream=s3.endpoint) as proxy:
        proxy.fail("shard-00002", fault, times=1)
        remote = open_remote(
            "s3://data/a",
            cache_dir=tmp_path / "c",
            storage_options={"endpoint_url": proxy.url},
            retry=FAST,
        )
        check_like_local(remote, served / "a", world=1)
        assert proxy.count("shard-00002") >= 2


def test_persistent_corruption_names_the_shard(served: Path, tmp_path: Path) -> None:
    with FaultProxy(root=served) as proxy:
        proxy.fail("shard-00003", "corrupt", times=None)
        remote = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", retry=FAST)
        with pytest.raises(LoaderError, match=r"shard 3 \(shard-00003\.dlop\).*CRC-32"):
            epoch_batches(Loader(remote, batch_size=4, shuffle=False), 0)
        assert proxy.count("shard-00003") == FAST.attempts
        assert not list((tmp_path / "c").rglob("shard-00003.dlop"))  # nothing corrupt cached


def test_budget_is_a_hard_ceiling(served: Path, tmp_path: Path) -> None:
    largest = max(p.stat().st_size for p in (served / "a").glob("shard-*"))
    budget = 4 * largest + 4096  # three batches in flight, within windows of one shard
    cache = tmp_path / "c"
    seen: list[int] = []
    stop = threading.Event()

    def size(p: Path) -> int:
        try:
            return p.stat().st_size if p.is_file() else 0
        except FileNotFoundError:  # evicted while listed
            return 0

    def sample() -> None:
        while not stop.is_set():
            seen.append(sum(size(p) for p in cache.rglob("*")))

    with FaultProxy(root=served) as proxy:
        remote = open_remote(proxy.url + "/a", cache_dir=cache, cache_bytes=budget, retry=FAST)
        watcher = threading.Thread(target=sample)
        watcher.start()
        try:
            check_like_local(remote, served / "a", world=1, window_shards=1)  # 6 shards
        finally:
            stop.set()
            watcher.join()
        assert seen and max(seen) <= budget
        assert proxy.count("shard-") > 6  # shards evicted and fetched again: data > budget


def test_budget_below_a_shards_in_flight_is_refused(served: Path, tmp_path: Path) -> None:
    with (
        FaultProxy(root=served) as proxy,
        pytest.raises(UsageError, match=r"2 shards x \(61440 bytes"),
    ):
        open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", cache_bytes=100_000)


def test_shards_held_are_never_evicted(tmp_path: Path) -> None:
    cache = CacheDir(tmp_path, max_bytes=340)  # two shards of 100 bytes and their stamps
    folder = cache.archive_dir("0000000000000000000000bb")
    a = cache.get(folder / "a", lambda: b"a" * 100)
    b = cache.get(folder / "b", lambda: b"b" * 100)
    cache.wait_s = 0.2
    with pytest.raises(Exception, match="still hold"):
        cache.get(folder / "c", lambda: b"c" * 100)  # a and b are held: no room
    cache.let_go(a)
    cache.get(folder / "c", lambda: b"c" * 100)  # a, unheld, goes
    assert not (folder / "a").exists() and (folder / "b").exists()
    cache.let_go(b)
    assert cache.used_bytes() <= 340


def test_links_and_folders_in_the_cache_are_refused_not_followed_or_evicted(
    tmp_path: Path,
) -> None:
    cache = CacheDir(tmp_path / "c", max_bytes=250)
    folder = cache.archive_dir("0000000000000000000000bb")
    (folder / "junk").mkdir()  # put there by hand: under budget pressure, never "evicted"
    (tmp_path / "big").write_bytes(b"x" * 1000)
    (folder / "a").symlink_to(tmp_path / "big")
    (folder / "b").mkdir()
    (folder / "c.lock").mkdir()
    assert cache.used_bytes() == 0  # neither the link's target nor the folders count
    for k in range(4):
        cache.let_go(cache.get(folder / f"s{k}", lambda: b"s" * 100))  # evicts s0, s1...
    assert (folder / "junk").is_dir() and (folder / "a").is_symlink()
    with pytest.raises(
        CacheError,
        match=r"/0000000000000000000000bb/a: cannot open the cached shard .*only what dlop",
    ):
        cache.get(folder / "a", lambda: b"a" * 100)
    with pytest.raises(CacheError, match=r"/0000000000000000000000bb/b: not a regular file"):
        cache.get(folder / "b", lambda: b"b" * 100)
    with pytest.raises(
        CacheError, match=r"/0000000000000000000000bb/c\.lock: cannot open the lock file"
    ):
        cache.get(folder / "c", lambda: b"c" * 100)


def test_open_archive_and_loader_take_urls(
    served: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DLOP_CACHE_DIR", str(tmp_path / "env-cache"))
    monkeypatch.setenv("DLOP_CACHE_BYTES", "1M")
    with FaultProxy(root=served) as proxy:
        url = proxy.url + "/z"
        ds = open_archive(url, cache_dir=tmp_path / "c", cache_bytes=1 << 20)
        assert isinstance(ds.supply, RemoteSupply) and ds[5]["key"] == "k005"
        assert list((tmp_path / "c").rglob("shard-*.dlop"))
        want = epoch_batches(Loader(served / "z", batch_size=8, seed=2), 1)
        got = epoch_batches(Loader(url, batch_size=8, seed=2), 1)  # cache from the environment
        assert all(same(g, w) for g, w in zip(got, want, strict=True)) and len(got) == len(want)
        assert list((tmp_path / "env-cache").rglob("shard-*.dlop"))


def test_loader_takes_cache_dir_and_cache_bytes(served: Path, tmp_path: Path) -> None:
    with FaultProxy(root=served) as proxy:
        url = proxy.url + "/a"
        want = epoch_batches(Loader(served / "a", **SETTINGS), 0)
        loader = Loader(url, cache_dir=tmp_path / "mine", cache_bytes=1 << 20, **SETTINGS)
        got = epoch_batches(loader, 0)
        loader.close()
        assert all(same(g, w) for g, w in zip(got, want, strict=True)) and len(got) == len(want)
        assert len(list((tmp_path / "mine").rglob("shard-*.dlop"))) == 6
        with pytest.raises(UsageError, match="cache_bytes 1000 is below"):
            Loader(url, cache_dir=tmp_path / "mine", cache_bytes=1000, **SETTINGS)


def test_later_windows_are_fetched_ahead(served: Path, tmp_path: Path) -> None:
    with FaultProxy(root=served) as proxy:
        remote = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", retry=FAST)
        loader = Loader(remote, prefetch=0, **SETTINGS)  # windows of 2 of the 6 shards
        it = iter(loader)
        first = copied(next(it))
        job = remote.supply.fetch_ahead.job
        assert job is not None
        job.result(timeout=30)
        # The shards of every later window are cached before a batch asks for them.
        assert len(list((tmp_path / "c").rglob("shard-*.dlop"))) == 6
        rest = [copied(b) for b in it]
        loader.close()
        want = epoch_batches(Loader(served / "a", **SETTINGS), 0)
        got = [first, *rest]
        assert all(same(g, w) for g, w in zip(got, want, strict=True)) and len(got) == len(want)
        assert all(proxy.count(f"shard-0000{k}") == 1 for k in range(6))  # each fetched once


def test_fetching_ahead_stays_within_the_budget(served: Path, tmp_path: Path) -> None:
    largest = max(p.stat().st_size for p in (served / "a").glob("shard-*"))
    with FaultProxy(root=served) as proxy:
        remote = open_remote(
            proxy.url + "/a",
            cache_dir=tmp_path / "c",
            cache_bytes=3 * (largest + STAMP_BYTES),
            retry=FAST,
        )
        loader = Loader(remote, prefetch=0, **{**SETTINGS, "window_shards": 1})
        it = iter(loader)
        next(it)
        job = remote.supply.fetch_ahead.job
        assert job is not None
        job.result(timeout=30)
        # batch 0 and 1 hold a shard each (or one between them): one more fits, not all six
        assert len(list((tmp_path / "c").rglob("shard-*.dlop"))) <= 3
        loader.close()


def compressible(path: Path) -> Path:
    """Shard 0 holds noise (its raw copy the size it is stored), shard 1 a single sample
    of zeros: small stored, 1 MiB raw."""
    fields = [Field.str_("key"), Field("x", "f32", (None,), codec=Zstd())]
    noise = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    with ArchiveWriter(path, fields, shard_bytes=60_000) as w:
        for i in range(4):
            w.write({"key": f"n{i}", "x": noise})
        w.write({"key": "zeros", "x": np.zeros(1 << 18, np.float32)})
    return path


def test_a_zstd_budget_counts_raw_sizes(tmp_path: Path) -> None:
    archive = tmp_path / "site" / "zeros"
    with ArchiveWriter(archive, [Field("x", "f32", (None,), codec=Zstd())]) as w:
        for _ in range(4):
            w.write({"x": np.zeros(1 << 16, np.float32)})  # 1 MiB raw in one shard
    (stored,) = [p.stat().st_size for p in archive.glob("shard-*")]
    assert 10 * stored < 1 << 20
    with FaultProxy(root=tmp_path / "site") as proxy:
        url = proxy.url + "/zeros"
        with pytest.raises(UsageError, match=r"1 shards x \(\d+ bytes, the largest, cached raw"):
            open_remote(url, cache_dir=tmp_path / "c", cache_bytes=10 * stored)
        assert proxy.count("shard-00000") == 1  # its header only
        ds = open_remote(url, cache_dir=tmp_path / "c", cache_bytes=2 << 20)
        assert ds[3]["x"].shape == (1 << 16,)


def test_a_shard_whose_raw_copy_exceeds_the_budget_is_refused_before_fetching(
    tmp_path: Path,
) -> None:
    archive = compressible(tmp_path / "site" / "zeros")
    stored = sorted(p.stat().st_size for p in archive.glob("shard-*"))
    assert stored[-1] < 100_000  # every shard as stored fits the budget many times
    with FaultProxy(root=tmp_path / "site") as proxy:
        remote = open_remote(
            proxy.url + "/zeros", cache_dir=tmp_path / "c", cache_bytes=400_000, retry=FAST
        )
        last = f"shard-{remote.reader.num_shards - 1:05d}"
        # refused by the shard's own check, or by the in-flight check once its size is known
        with pytest.raises(UsageError, match="cached raw"):
            epoch_batches(Loader(remote, batch_size=2, shuffle=False, prefetch=0), 0)
        assert proxy.count(last) <= 2  # its header only (one ranged read, maybe two)
        assert not list((tmp_path / "c").rglob(f"{last}*.dlop"))


def test_dataloader_workers_read_a_url_through_iterable_archive(
    served: Path, tmp_path: Path
) -> None:
    from torch.utils.data import DataLoader

    from dlop.runtime import IterableArchive

    with FaultProxy(root=served) as proxy:
        ds = IterableArchive(
            proxy.url + "/a", cache_dir=tmp_path / "c", cache_bytes=1 << 20, **SETTINGS
        )
        got = [copied(b) for b in DataLoader(ds, batch_size=None, num_workers=2)]
        want = epoch_batches(Loader(served / "a", **SETTINGS), 0)
        assert [b["key"] for b in got] == [b["key"] for b in want]
        assert all(proxy.count(f"shard-0000{k}") == 1 for k in range(6))  # one cache, shared


def test_an_index_over_its_cap_is_refused_after_one_bounded_read(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "index.json").write_bytes(b" " * 50_000 + b"{}")
    with FaultProxy(root=tmp_path) as proxy:
        store = storage_at(proxy.url + "/a")
        with pytest.raises(LoaderError, match=r"index\.json holds more than its 1000-byte cap"):
            fetch_index(store, proxy.url + "/a", 1000, FAST)
        assert proxy.ranges == ["bytes=0-1000"]  # not read whole, and not again
        assert proxy.count("index.json") == 1


@pytest.mark.parametrize("change", ["truncated", "flipped byte", "replaced"])
def test_a_cached_copy_changed_after_it_was_verified_is_fetched_again(
    served: Path, tmp_path: Path, change: str
) -> None:
    kw = {"cache_dir": tmp_path / "c", "retry": FAST}
    with FaultProxy(root=served) as proxy:
        remote = open_remote(proxy.url + "/a", **kw)  # type: ignore[arg-type]
        want = copied(remote.__getitems__(list(range(len(remote)))))
        remote.close()
        cached = next((tmp_path / "c").rglob("shard-00001.dlop"))
        data = bytearray(cached.read_bytes())
        fetched = proxy.count("shard-00001")
        if change == "truncated":
            cached.write_bytes(data[:5000])
        elif change == "flipped byte":  # in place: same inode and size
            with cached.open("r+b") as f:
                f.seek(len(data) - 9)
                f.write(bytes([data[-9] ^ 0xFF]))
        else:  # another file renamed over it, same size
            other = cached.with_name("other")
            other.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
            other.replace(cached)
        remote = open_remote(proxy.url + "/a", **kw)  # type: ignore[arg-type]
        assert same(copied(remote.__getitems__(list(range(len(remote))))), want)
        assert proxy.count("shard-00001") > fetched  # fetched again, not served
        assert cached.read_bytes() == data
        fetched = proxy.count("shard-00001")
        remote.close()
        remote = open_remote(proxy.url + "/a", **kw)  # type: ignore[arg-type]
        assert same(copied(remote.__getitems__(list(range(len(remote))))), want)
        assert proxy.count("shard-00001") == fetched  # the verified copy is served again
        remote.close()


def test_a_failed_shard_is_not_fetched_again_until_the_next_epoch(
    served: Path, tmp_path: Path
) -> None:
    """Batches of one epoch that read a shard whose retries are spent raise its failure
    (no second round of fetches, whichever thread asks); the next epoch tries again."""
    with FaultProxy(root=served) as proxy:
        proxy.fail("shard-00003", "corrupt", times=FAST.attempts)
        remote = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", retry=FAST)
        loader = Loader(remote, batch_size=2, shuffle=False, prefetch=4)
        with pytest.raises(LoaderError, match=r"shard 3 \(shard-00003\.dlop\)"):
            epoch_batches(loader, 0)  # batches 2 samples wide: several read shard 3
        assert proxy.count("shard-00003") == FAST.attempts
        got = epoch_batches(Loader(remote, batch_size=2, shuffle=False), 1)
        assert proxy.count("shard-00003") == FAST.attempts + 1  # a new epoch: fetched again
        want = epoch_batches(Loader(served / "a", batch_size=2, shuffle=False), 1)
        assert all(torch.equal(a["logmel"], b["logmel"]) for a, b in zip(got, want, strict=True))


def test_a_shard_named_like_the_caches_own_files_is_refused(served: Path, tmp_path: Path) -> None:
    import json

    site = served / "a"
    index = json.loads((site / "index.json").read_text())
    first = index["shards"][0]["file"]
    (site / first).rename(site / "source.txt")
    index["shards"][0]["file"] = "source.txt"
    (site / "index.json").write_text(json.dumps(index))
    with FaultProxy(root=served) as proxy, pytest.raises(CacheError, match=r"'source\.txt'"):
        open_remote(proxy.url + "/a", cache_dir=tmp_path / "c")


def test_an_index_declaring_a_huge_shard_is_refused_before_any_plan(
    served: Path, tmp_path: Path
) -> None:
    import json

    index = json.loads((served / "a" / "index.json").read_text())
    index["shards"][1]["bytes"] = 2**63
    (served / "a" / "index.json").write_text(json.dumps(index))
    with (
        FaultProxy(root=served) as proxy,
        pytest.raises(LoaderError, match=r"shard 1 \(shard-00001\.dlop\) is 9223372036854775808"),
    ):
        Loader(proxy.url + "/a", 4, cache_dir=tmp_path / "c", cache_bytes=2**80)


def test_a_budget_the_caches_own_files_fill_is_refused_without_waiting(tmp_path: Path) -> None:
    cache = CacheDir(tmp_path / "c", max_bytes=400)
    folder = cache.archive_dir("0000000000000000000000cc")
    (folder / "index.json").write_bytes(b"{}" + b" " * 248)  # 250 bytes, never evicted

    def waited() -> bool:
        raise AssertionError("waited for room that no process holds")

    cache.squeeze = waited
    with pytest.raises(CacheError, match=r"a 100-byte shard does not fit beside the cache's own"):
        cache.get(folder / "s", lambda: b"s" * 100)
    cache.let_go(cache.get(folder / "t", lambda: b"t" * 40))  # what fits is cached


class FlippedOnce(LocalStorage):
    """A folder whose first read of each shard's start comes back with a byte of its
    JSON header flipped, as a corrupt transfer would."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.flipped: set[str] = set()
        self.reads = 0

    def read_once(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        data = super().read_once(name, start, end)
        self.reads += 1
        if name.startswith("shard-") and not start and name not in self.flipped:
            self.flipped.add(name)
            return data[:30] + bytes([data[30] ^ 0x20]) + data[31:]
        return data


def test_a_header_corrupt_in_transfer_is_read_again(tmp_path: Path) -> None:
    """A zstd shard's header failing its CRC on arrival, when its raw size is bounded
    before the fetch, is read again (as a streamed shard's is), not refused at once."""
    local = make_archive(tmp_path / "z", zstd=True)
    index = ArchiveReader(local).index
    store = FlippedOnce(local)
    sizes = ShardSizes(str(local), index, 1 << 30, lambda: store, FAST)
    clean = ShardSizes(str(local), index, 1 << 30, lambda: LocalStorage(local), FAST)
    assert sizes.size(0) == clean.size(0) > 0
    assert store.flipped == {index.shards[0].file} and store.reads == 2
    head, layout = fetch_head(store, index.shards[1].file, index.shards[1].bytes, "shard 1", FAST)
    assert layout.num_samples == index.shards[1].num_samples and head.startswith(b"DLOPSHRD")


def test_storage_options_reach_the_store_and_are_never_kept(
    s3: Any, served: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.utils.data import DataLoader

    from dlop.runtime import IterableArchive, open_archive

    s3.make_bucket("data")
    s3.filesystem().put(str(served / "a"), "data/a", recursive=True)
    # the environment names no endpoint and other keys: only storage_options reach the server
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "from-the-environment")
    secret = "s3cr3t-never-shown"
    options = {"endpoint_url": s3.endpoint, "key": s3.key, "secret": secret}
    want = epoch_batches(Loader(served / "a", **SETTINGS), 0)
    loader = Loader("s3://data/a", **SETTINGS, cache_dir=tmp_path / "c", storage_options=options)
    assert [b["key"] for b in epoch_batches(loader, 0)] == [b["key"] for b in want]
    assert secret not in repr(loader.reading) and secret not in json.dumps(loader.state_dict())
    loader.close()
    ds = open_archive("s3://data/a", cache_dir=tmp_path / "c2", storage_options=options)
    assert len(ds) == sum(len(b["key"]) for b in want)
    it = IterableArchive(
        "s3://data/a", cache_dir=tmp_path / "c3", storage_options=options, **SETTINGS
    )
    got = [copied(b) for b in DataLoader(it, batch_size=None, num_workers=2)]
    assert [b["key"] for b in got] == [b["key"] for b in want]
    assert not any(secret in p.read_text(errors="replace") for p in tmp_path.rglob("*.txt"))
    # refused where they cannot apply
    with pytest.raises(UsageError, match="storage_options= are for an archive at a URL"):
        open_archive(served / "a", storage_options=options)
    with pytest.raises(UsageTypeError, match="storage_options must be a dict"):
        open_archive("s3://data/a", cache_dir=tmp_path / "c2", storage_options="key=x")  # type: ignore[arg-type]

"""The first epoch streams: a raw shard from object storage is served part by part as
its CRC pieces pass, never from an unverified byte, through the counting fault proxy."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dlop.formats import ArchiveWriter, Field, ShardReader
from dlop.formats.constants import CRC_PIECE_BYTES
from dlop.formats.storage import Retry
from dlop.runtime import Archive, Loader, LoaderError, open_archive
from dlop.runtime.storage.cache import Arriving
from dlop.runtime.storage.remote import HEAD_BYTES
from dlop.runtime.storage.streamed import LATER, Incoming, part_pieces
from tests.faultproxy import FaultProxy
from tests.formats.helpers import read_header
from tests.runtime.helpers import open_remote, piece_parts

PARTS = piece_parts(4)  # the header first (no lead ranges: test_lead.py)
WAVE = 16384  # f32 values a sample: 64 KiB, 16 samples a piece


def make(path: Path, n: int = 96) -> Path:
    """Shards of about 8 MiB: fixed, ragged and text fields long enough for pieces."""
    rng = np.random.default_rng(11)
    fields = [
        Field.str_("key"),
        Field("label", "i64", ()),
        Field("wave", "f32", (WAVE,)),
        Field("speech", "f32", (None,)),
        Field.str_("text"),  # 40 KiB a sample: pieces of text too
    ]
    with ArchiveWriter(path, fields, shard_bytes=8 << 20) as w:
        for i in range(n):
            w.write(
                {
                    "key": f"k{i:03d}",
                    "label": i,
                    "wave": rng.standard_normal(WAVE).astype(np.float32),
                    "speech": rng.standard_normal(int(rng.integers(0, 12000))).astype(np.float32),
                    # some of it not ASCII, every sample 40 KiB all the same
                    "text": (f"{i:03d}é" if i % 3 == 0 else f"{i:05d}") * 8192,
                }
            )
    return path


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("site")
    make(root / "a")
    return root


def data_at(site: Path, field: str, shard: int = 0) -> int:
    """Where ``field``'s values start in a shard of the served archive."""
    header, _ = read_header(site / "a" / f"shard-{shard:05d}.dlop")
    f = next(f for f in header["fields"] if f["name"] == field)
    assert "crcs" in f["regions"], "the fixture's fields must carry pieces"
    return int(f["regions"]["data"]["offset"])


def copied(b: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()}


def batches(loader: Loader, epoch: int = 0) -> list[dict[str, Any]]:
    loader.set_epoch(epoch)
    return [copied(b) for b in loader]


def same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    def eq(x: Any, y: Any) -> bool:
        return bool(torch.equal(x, y)) if isinstance(x, torch.Tensor) else x == y

    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x) for x, y in zip(a, b, strict=True)
    )


def shards(site: Path) -> list[str]:
    return sorted(p.name for p in (site / "a").glob("shard-*"))


def cached(cache: Path) -> list[str]:
    """The shards whole in the cache (not those arriving, under temporary names)."""
    return sorted(p.name for p in cache.rglob("shard-*.dlop"))


SETTINGS = [
    {"batch_size": 8, "shuffle": False},
    {"batch_size": 8, "seed": 3},
    {"batch_size": 8, "seed": 3, "order": "window", "window_shards": 1},
]


@pytest.mark.parametrize("settings", SETTINGS, ids=["in order", "global", "window"])
def test_cold_and_warm_epochs_equal_local(
    site: Path, tmp_path: Path, settings: dict[str, Any]
) -> None:
    with FaultProxy(root=site) as proxy:
        remote = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", retry=PARTS)
        for epoch in (0, 1):  # cold, then warm from the cache
            want = batches(Loader(site / "a", **settings), epoch)
            assert same(batches(Loader(remote, **settings), epoch), want)
        # The pieced data came in parts of one piece: ranged reads of 1 MiB.
        assert (
            f"bytes={data_at(site, 'wave')}-{data_at(site, 'wave') + CRC_PIECE_BYTES - 1}"
            in proxy.ranges
        )
        assert cached(tmp_path / "c") == shards(site)
        # Each shard sent once, but for its first read (header and up to 64 KiB after),
        # of which the bytes past the header that a part brings again are not kept.
        total = sum(p.stat().st_size for p in (site / "a").glob("shard-*"))
        assert total <= proxy.sent_bytes("shard-") <= total + len(shards(site)) * HEAD_BYTES


# Every field, or those of one kind (each planned by the node cache's Slots,
# runtime.archive.planning: an arriving shard's entries read for its batch only).
FIELDS = [None, ["label", "wave"], ["label", "speech", "wave"], ["key", "text"]]


@pytest.mark.parametrize(
    "fields", FIELDS, ids=["every field", "fixed fields", "ragged fields", "text fields"]
)
def test_batches_are_served_before_the_shard_is_whole(
    site: Path, tmp_path: Path, fields: list[str] | None
) -> None:
    """The part holding shard 0's last pieces is held back by the server: the first
    batches, whose samples lie in its first pieces, arrive meanwhile."""
    held = data_at(site, "wave") + 2 * CRC_PIECE_BYTES  # samples 32.. of shard 0
    settings = {"batch_size": 8, "shuffle": False, "prefetch": 1}
    want = batches(Loader(open_archive(site / "a", fields=fields), **settings))
    with FaultProxy(root=site) as proxy:
        proxy.fail("shard-00000", "hold", at=held)
        safety = threading.Timer(30, proxy.let_through)  # a regression fails, never hangs
        safety.start()
        try:
            remote = open_remote(proxy.url + "/a", fields, cache_dir=tmp_path / "c", retry=PARTS)
            loader = Loader(remote, **settings)
            it = iter(loader)
            first = [copied(next(it)) for _ in range(3)]  # samples 0..23
            let_through_before = proxy.through.is_set()
            assert "shard-00000.dlop" not in cached(tmp_path / "c")  # not whole yet
            assert any(".tmp-" in p.name for p in (tmp_path / "c").rglob("shard-00000*"))
            proxy.let_through()
            rest = [copied(b) for b in it]
        finally:
            safety.cancel()
        assert not let_through_before
        assert same(first, want[:3]) and same(rest, want[3:])


@pytest.mark.parametrize(
    ("field", "fields"),
    [
        ("wave", None),
        ("speech", None),
        ("wave", ["label", "wave"]),
        ("speech", ["speech"]),
        ("text", ["key", "text"]),
    ],
)
def test_a_corrupt_part_being_served_is_fetched_again(
    site: Path, tmp_path: Path, field: str, fields: list[str] | None
) -> None:
    """The part the first batch reads arrives corrupt twice: it is fetched again, and
    every batch equals the local one (no sample from an unverified byte)."""
    at = data_at(site, field)
    settings = {"batch_size": 8, "shuffle": False}
    with FaultProxy(root=site) as proxy:
        proxy.fail("shard-00000", "corrupt", times=2, at=at)
        remote = open_remote(proxy.url + "/a", fields, cache_dir=tmp_path / "c", retry=PARTS)
        want = batches(Loader(open_archive(site / "a", fields=fields), **settings))
        assert same(batches(Loader(remote, **settings)), want)
        asked = [r for p, r in proxy.ranged if "shard-00000" in p and r.startswith(f"bytes={at}-")]
        assert len(asked) == 3  # two corrupt copies, then the good one
        for _ in range(3000):  # a shard whose batches are read may still be landing
            if not remote.supply.arrive.streams:
                break
            time.sleep(0.01)
        assert cached(tmp_path / "c") == shards(site)


@pytest.mark.parametrize("fault", ["drop", "slowdown", "truncate"])
def test_part_faults_survived(site: Path, tmp_path: Path, fault: str) -> None:
    at = data_at(site, "wave", 1) + CRC_PIECE_BYTES
    settings = {"batch_size": 8, "seed": 1}
    with FaultProxy(root=site) as proxy:
        proxy.fail("shard-00001", fault, times=2, at=at)
        remote = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", retry=PARTS)
        assert same(batches(Loader(remote, **settings)), batches(Loader(site / "a", **settings)))
        assert proxy.faults[0][2] == 0  # both faults met: the part was asked for again
        asked = [r for p, r in proxy.ranged if "shard-00001" in p and r.startswith(f"bytes={at}-")]
        assert len(asked) == (1 if fault in ("drop", "slowdown") else 3)  # answered in whole


@pytest.mark.parametrize("fields", FIELDS[:3], ids=["every field", "fixed fields", "ragged"])
def test_a_part_never_verified_fails_its_batches_and_caches_nothing(
    site: Path, tmp_path: Path, fields: list[str] | None
) -> None:
    """Its batches raise the fetch's own failure (not that the shard was let go of),
    whichever way they are planned."""
    at = data_at(site, "wave") + CRC_PIECE_BYTES
    with FaultProxy(root=site) as proxy:
        proxy.fail("shard-00000", "corrupt", times=None, at=at)
        remote = open_remote(proxy.url + "/a", fields, cache_dir=tmp_path / "c", retry=PARTS)
        loader = Loader(remote, batch_size=8, shuffle=False)
        got = []
        with pytest.raises(LoaderError, match=r"shard 0 \(shard-00000\.dlop\).*CRC piece 1"):
            for b in loader:
                got.append(b["label"].clone())
        # Batches before the bad piece came through; none holds a sample of it.
        assert all(int(x) < 16 for labels in got for x in labels)
        loader.close()
        remote.close()
        assert "shard-00000.dlop" not in cached(tmp_path / "c")
        assert not [p for p in (tmp_path / "c").rglob("*") if ".tmp-" in p.name]


HELD_SETTINGS = {"batch_size": 8, "shuffle": False, "prefetch": 1}


def a_part_held(site: Path, tmp_path: Path, proxy: FaultProxy) -> tuple[Archive, Loader]:
    """The served archive and a Loader of it whose shard 0 has a part held back (from
    its wave field's third piece)."""
    proxy.fail("shard-00000", "hold", at=data_at(site, "wave") + 2 * CRC_PIECE_BYTES)
    remote = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", retry=PARTS)
    return remote, Loader(remote, **HELD_SETTINGS)


def test_closing_while_a_shard_arrives_leaves_nothing_behind(site: Path, tmp_path: Path) -> None:
    settings = HELD_SETTINGS
    with FaultProxy(root=site) as proxy:
        remote, loader = a_part_held(site, tmp_path, proxy)
        next(iter(loader))
        # the held part ends while close waits for its thread (a second at most)
        threading.Timer(0.5, proxy.let_through).start()
        loader.close()
        remote.close()
        assert not [p for p in (tmp_path / "c").rglob("*") if ".tmp-" in p.name]
        # Its fetch lock went with it: a new reader of the same cache fetches and reads it.
        again = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", retry=PARTS)
        assert same(batches(Loader(again, **settings)), batches(Loader(site / "a", **settings)))


def test_a_part_that_comes_in_after_close_is_not_the_next_reads_failure(
    site: Path, tmp_path: Path
) -> None:
    """close() leaves a part stuck in its request to itself; the bytes it brings later
    are refused by their shard (failed by the close), and that refusal is no failure of
    the shard: read again, the supply fetches it anew."""
    settings = HELD_SETTINGS
    with FaultProxy(root=site) as proxy:
        remote, loader = a_part_held(site, tmp_path, proxy)
        before = set(threading.enumerate())
        next(iter(loader))
        parts = [t for t in threading.enumerate() if t.name == "dlop-part" and t not in before]
        assert parts  # the held part's among them
        safety = threading.Timer(30, proxy.let_through)  # a regression fails, never hangs
        safety.start()
        loader.close()
        remote.close()
        still_held = not proxy.through.is_set()
        safety.cancel()
        assert still_held, "close() waited for the held part"
        proxy.let_through()
        deadline = time.monotonic() + 30
        while any(t.is_alive() for t in parts):
            assert time.monotonic() < deadline, "the part's thread never ended"
            time.sleep(0.01)
        # (a failure recorded now would fail the shard's reads until an epoch begins)
        assert not remote.supply.ahead_errors, remote.supply.ahead_errors
        assert same(batches(Loader(remote, **settings)), batches(Loader(site / "a", **settings)))
        remote.close()
    assert not [p for p in (tmp_path / "c").rglob("*") if ".tmp-" in p.name]


def test_parts_are_ranked_by_the_first_read_of_their_samples(site: Path) -> None:
    """A part's place in the fetch queue is the earliest position in the epoch that reads
    a sample in it: read in reverse, the last part goes first; without an order, file
    order."""
    path = site / "a" / "shard-00000.dlop"
    with ShardReader(path) as reader:
        layout = reader.layout
        size = path.stat().st_size
        arriving = Arriving(path, path, -1, -1, size)
        one = Retry(part_bytes=CRC_PIECE_BYTES, parallel_parts=8)  # parts of one piece
        inc = Incoming(0, arriving, layout, 24, one, keep=False)
        n = reader.num_samples
        assert inc.ranks(np.arange(n))[-1] == LATER  # the ragged field's, before the front
        inc.fronted(reader, [])
        n = reader.num_samples
        wave = [p for p in inc.parts if inc.pieced[p.region].fdef.name == "wave"]
        assert len(wave) == -(-n * WAVE * 4 // CRC_PIECE_BYTES) >= 2
        assert inc.ranks(None) == [0] * len(inc.parts)
        reverse = np.arange(n, dtype=np.int64)[::-1].copy()  # sample s read at n-1-s
        ranks = dict(zip(map(id, inc.parts), inc.ranks(reverse), strict=True))
        got = [ranks[id(p)] for p in wave]
        per_piece = CRC_PIECE_BYTES // (WAVE * 4)
        assert got == [n - 1 - min(n - 1, (j + 1) * per_piece - 1) for j in range(len(wave))]
        unread = np.full(n, np.iinfo(np.int64).max)
        unread[-1] = 5  # only the last sample is read: every other wave part waits
        assert [r for p, r in zip(inc.parts, inc.ranks(unread), strict=True) if p in wave][-1] == 5


def test_part_sizes() -> None:
    """As many parts as threads, each from part_bytes to four times it, whole pieces."""
    mib = 1 << 20
    assert part_pieces(211 * mib, mib, Retry()) == 53  # four parts
    assert part_pieces(4 * mib, mib, Retry()) == 16  # one part of part_bytes at least
    assert part_pieces(1 << 30, mib, Retry()) == 64  # at most four times part_bytes
    assert part_pieces(10 * mib, 4 * mib, Retry(part_bytes=mib, parallel_parts=2)) == 1


def test_a_part_failing_before_the_front_is_in_fails_the_shard_cleanly(
    site: Path, tmp_path: Path
) -> None:
    """A part's retries run out while the front is still arriving: the shard fails with
    the part's error (nothing written to a closed file), leaves no temporary file, and
    the next epoch fetches it."""
    header, _ = read_header(site / "a" / "shard-00000.dlop")
    wave = next(f for f in header["fields"] if f["name"] == "wave")["regions"]["data"]
    tail = wave["offset"] + wave["length"]  # where the front's second span starts
    with FaultProxy(root=site) as proxy:
        proxy.fail("shard-00000", "slowdown", times=PARTS.attempts, at=data_at(site, "wave"))
        proxy.fail("shard-00000", "hold", at=tail)
        threading.Timer(1.0, proxy.let_through).start()
        remote = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", retry=PARTS)
        loader = Loader(remote, batch_size=8, shuffle=False)
        with pytest.raises(LoaderError, match=r"shard 0 \(shard-00000\.dlop\) bytes \d+\.\.\d+"):
            batches(loader)
        assert not list((tmp_path / "c").rglob("shard-00000.dlop.tmp-*"))
        assert proxy.faults[1][2] == 0  # the front was held while the part failed
        assert same(batches(loader, 1), batches(Loader(site / "a", batch_size=8, shuffle=False), 1))


def test_a_forked_child_lets_go_of_the_shards_its_parent_writes(site: Path, tmp_path: Path) -> None:
    """A flock belongs to every copy of a descriptor: a child forked while a shard
    arrives closes its copies at once, so the parent's fetch lock ends with its own."""
    held = data_at(site, "wave") + 2 * CRC_PIECE_BYTES
    with FaultProxy(root=site) as proxy:
        proxy.fail("shard-00000", "hold", at=held)
        remote = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", retry=PARTS)
        loader = Loader(remote, batch_size=8, shuffle=False, prefetch=0)
        it = iter(loader)
        next(it)
        source = remote.supply
        arriving = [a for a in source.arrive.arrivals if a.path.name == "shard-00000.dlop"]
        assert arriving  # shard 0 is still arriving
        pid = os.fork()
        if pid == 0:  # the child: are its copies of the parent's descriptors closed?
            try:
                os.fstat(arriving[0].lock_fd)
                os._exit(1)
            except OSError:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        os.fstat(arriving[0].lock_fd)  # the parent's own are open
        proxy.let_through()
        rest = [copied(b) for b in it]
        assert len(rest) == len(batches(Loader(site / "a", batch_size=8, shuffle=False))) - 1


def riding(site: Path) -> tuple[int, int, int]:
    """Shard 0's size, where its last part starts (parts of one piece) and where the
    front's last span starts (the end of the last pieced values)."""
    path = site / "a" / "shard-00000.dlop"
    header, _ = read_header(path)
    tail = max(
        f["regions"]["data"]["offset"] + f["regions"]["data"]["length"]
        for f in header["fields"]
        if "crcs" in f["regions"]
    )
    last = tail - (tail - data_at(site, "text")) % CRC_PIECE_BYTES
    return path.stat().st_size, last if last < tail else last - CRC_PIECE_BYTES, tail


@pytest.mark.parametrize("fault", [None, "corrupt", "truncate"])
def test_the_fronts_last_span_rides_with_the_part_before_it(
    site: Path, tmp_path: Path, fault: str | None
) -> None:
    """With no more parts than threads, the metadata after the last values comes in the
    same request as the last part: one request fewer per shard. A fault in that request
    costs a retry of it, and a short answer sends the front to read its span itself."""
    wide = Retry(
        attempts=4, backoff_s=0.001, part_bytes=CRC_PIECE_BYTES, parallel_parts=16, lead=False
    )
    size, last, tail = riding(site)
    settings = {"batch_size": 8, "seed": 2}
    with FaultProxy(root=site) as proxy:
        if fault is not None:
            proxy.fail("shard-00000", fault, times=2, at=last)
        remote = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", retry=wide)
        assert same(batches(Loader(remote, **settings)), batches(Loader(site / "a", **settings)))
        asked = [r for p, r in proxy.ranged if "shard-00000" in p]
        # the last part and the span at once, again after each fault
        assert asked.count(f"bytes={last}-{size - 1}") == (1 if fault is None else 3)
        # corrupt values: the span came whole with the first answer; a short answer: the
        # front read its span itself at once, not after the part's retries
        alone = [r for r in asked if r.startswith(f"bytes={tail}-")]
        assert alone == ([f"bytes={tail}-{size - 1}"] if fault == "truncate" else [])


def test_a_front_whose_riding_part_fails_reads_its_span_itself(site: Path, tmp_path: Path) -> None:
    wide = Retry(
        attempts=3, backoff_s=0.001, part_bytes=CRC_PIECE_BYTES, parallel_parts=16, lead=False
    )
    size, last, tail = riding(site)
    with FaultProxy(root=site) as proxy:
        proxy.fail("shard-00000", "drop", times=None, at=last)
        remote = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", retry=wide)
        with pytest.raises(LoaderError, match=rf"bytes {last}\.\.{tail}"):
            batches(Loader(remote, batch_size=8, shuffle=False))
        asked = [r for p, r in proxy.ranged if "shard-00000" in p]
        assert f"bytes={tail}-{size - 1}" in asked  # the front read its last span itself

"""A shard that one wave of parts covers is asked for in byte ranges at once, before its
header is read (streamed ``Lead``): one request fewer a shard, and every byte of those
ranges still checked before it is served, through the counting fault proxy."""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Generator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlop.formats import ArchiveWriter, Field
from dlop.formats.storage import Rejected, Retry, Storage
from dlop.runtime import Loader, LoaderError
from dlop.runtime.storage.cache import Arriving
from dlop.runtime.storage.remote import HEAD_BYTES
from dlop.runtime.storage.streamed import Lead, lead_spans
from tests.faultproxy import FaultProxy
from tests.runtime.helpers import open_remote, piece_parts
from tests.runtime.test_streamed import batches, cached, make, same, shards

LEADS = piece_parts(4, lead=True)
SETTINGS = {"batch_size": 8, "seed": 3}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("site")
    make(root / "a")
    return root


def spans(site: Path, shard: int = 0) -> list[tuple[int, int]]:
    size = (site / "a" / f"shard-{shard:05d}.dlop").stat().st_size
    got = lead_spans(size, LEADS)
    assert len(got) == LEADS.parallel_parts  # the fixture's shards take a whole wave
    return got


def asked(proxy: FaultProxy, shard: int = 0) -> list[str]:
    return [r for p, r in proxy.asked if f"shard-{shard:05d}" in p]


def ranges(got: list[tuple[int, int]]) -> list[str]:
    return [f"bytes={lo}-{hi - 1}" for lo, hi in got]


def local(site: Path, epoch: int = 0) -> list[dict]:
    return batches(Loader(site / "a", **SETTINGS), epoch)


def test_lead_spans() -> None:
    """As many ranges as part threads, each from part_bytes (a header read at least) to
    four times part_bytes; none when one wave does not cover the file, or lead is off."""
    mib = 1 << 20
    assert lead_spans(211 * mib, Retry()) == [
        (i * 211 * mib // 4, min((i + 1) * 211 * mib // 4, 211 * mib)) for i in range(4)
    ]
    assert lead_spans(20 * mib, Retry()) == [(0, 20 * mib)]  # one range of part_bytes or more
    assert lead_spans(HEAD_BYTES + 1, Retry(part_bytes=1, parallel_parts=8)) == [
        (0, HEAD_BYTES + 1)
    ]
    assert lead_spans(257 * mib, Retry()) == []  # more than four parts of 64 MiB
    assert lead_spans(8 * mib, Retry(lead=False)) == []
    assert lead_spans(0, Retry()) == []
    for size in (1, 4095, 5 * mib + 7, 256 * mib):
        got = lead_spans(size, Retry())
        assert got[0][0] == 0 and got[-1][1] == size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(got))


def test_cold_and_warm_epochs_equal_local_with_only_the_lead_requests(
    site: Path, tmp_path: Path
) -> None:
    with FaultProxy(root=site) as proxy:
        remote = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", retry=LEADS)
        for epoch in (0, 1):  # cold, then warm from the cache
            assert same(batches(Loader(remote, **SETTINGS), epoch), local(site, epoch))
        for k, name in enumerate(shards(site)):
            # no request for the header alone, none for a part: the ranges, once each
            assert sorted(asked(proxy, k)) == sorted(ranges(spans(site, k))), name
        assert cached(tmp_path / "c") == shards(site)


@pytest.mark.parametrize("which", [0, 1, 3], ids=["header's", "middle", "metadata's"])
@pytest.mark.parametrize("fault", ["corrupt", "truncate", "drop", "slowdown"])
def test_a_lead_range_that_fails_is_read_again_by_what_needs_it(
    site: Path, tmp_path: Path, fault: str, which: int
) -> None:
    """A lead range arrives damaged (or not at all): no batch holds a byte of it unless
    it was read again and verified; the shard lands whole."""
    lo, _ = spans(site)[which]
    with FaultProxy(root=site) as proxy:
        proxy.fail("shard-00000", fault, times=1, at=lo)
        remote = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", retry=LEADS)
        assert same(batches(Loader(remote, **SETTINGS)), local(site))
        assert proxy.faults[0][2] == 0  # the fault was met
        # what the range held was asked for again (the client's own retry of a dropped
        # connection asks for the same range again)
        assert len(asked(proxy)) > len(spans(site))
        for _ in range(3000):  # a shard whose batches are read may still be landing
            if not remote.supply.arrive.streams:
                break
            threading.Event().wait(0.01)
        assert cached(tmp_path / "c") == shards(site)


def test_a_shard_swapped_for_another_of_its_size_is_never_served(
    site: Path, tmp_path: Path
) -> None:
    with FaultProxy(root=site) as proxy:
        proxy.swap("shard-00000", "shard-00001")
        remote = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", retry=LEADS)
        with pytest.raises(LoaderError, match="not the shard the index lists"):
            batches(Loader(remote, batch_size=8, shuffle=False))
        assert "shard-00000.dlop" not in cached(tmp_path / "c")


def test_a_shard_swapped_after_its_header_came_serves_nothing(site: Path, tmp_path: Path) -> None:
    """The first range (the header) comes from the shard the index lists; the object is
    replaced before the others are answered (a recompile uploaded meanwhile): their
    bytes fail the header's checks, every read again too, and no batch is served."""
    later = [lo for lo, _ in spans(site)[1:]]
    with FaultProxy(root=site) as proxy:
        for lo in later:
            proxy.fail("shard-00000", "hold", at=lo)
        remote = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", retry=LEADS)
        loader = Loader(remote, 8, shuffle=False, prefetch=0)
        got: list[int] = []
        failed: list[BaseException] = []

        def read() -> None:
            try:
                got.extend(1 for _ in loader)
            except LoaderError as e:
                failed.append(e)

        reader = threading.Thread(target=read)
        reader.start()
        for _ in range(3000):  # until the header's range is answered
            if any(r.startswith("bytes=0-") for p, r in proxy.ranged if "shard-00000" in p):
                break
            threading.Event().wait(0.01)
        proxy.swap("shard-00000", "shard-00001")
        proxy.let_through()
        reader.join(60)
        assert not reader.is_alive()
        assert failed and "shard 0" in str(failed[0]) and not got
        loader.close()
        remote.close()  # the shards fetched ahead are let go of too
        assert "shard-00000.dlop" not in cached(tmp_path / "c")
        assert not [p for p in (tmp_path / "c").rglob("*") if ".tmp-" in p.name]


def test_over_s3_lead_ranges_written_as_they_come_survive_faults(
    site: Path, tmp_path: Path, s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over S3 a lead range is written into the file as its body arrives: one cut off
    halfway (its first half written), one corrupt and one stalled halfway are read
    again by what needs them; every batch equals the local archive's, and the shards
    land whole."""
    monkeypatch.setenv("DLOP_READ_TIMEOUT", "1")
    s3.make_bucket("lead")
    s3.filesystem().put(str(site / "a"), "lead/a", recursive=True)
    with FaultProxy(upstream=s3.endpoint) as proxy:
        proxy.fail("shard-00000", "truncate", at=spans(site)[1][0])
        proxy.fail("shard-00000", "corrupt", at=spans(site)[0][0])
        proxy.fail("shard-00001", "stall", at=spans(site, 1)[3][0])
        remote = open_remote(
            "s3://lead/a",
            cache_dir=tmp_path / "c",
            storage_options={"endpoint_url": proxy.url},
            retry=LEADS,
        )
        assert same(batches(Loader(remote, **SETTINGS)), local(site))
        assert [f[2] for f in proxy.faults] == [0, 0, 0]  # each was met
        for _ in range(3000):  # a shard whose batches are read may still be landing
            if not remote.supply.arrive.streams:
                break
            threading.Event().wait(0.01)
        assert cached(tmp_path / "c") == shards(site)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shards of one pieced field: their front is the header and the metadata after the
    values, so the middle ranges hold values only."""
    root = tmp_path_factory.mktemp("plain")
    with ArchiveWriter(root / "a", [Field("x", "f32", (16384,))], shard_bytes=8 << 20) as w:
        for i in range(256):
            w.write({"x": np.full(16384, i, np.float32)})
    return root


def firsts(loader: Loader) -> list[int]:
    return [int(v) for b in loader for v in b["x"][:, 0]]


def test_closing_while_a_lead_range_is_held_leaves_nothing_behind(
    plain: Path, tmp_path: Path
) -> None:
    """The first batch comes from the first range while the second is held; closing
    then ends the shard's arrival and removes its temporary file."""
    lo, _ = spans(plain)[1]
    with FaultProxy(root=plain) as proxy:
        proxy.fail("shard-00000", "hold", at=lo)
        remote = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", retry=LEADS)
        loader = Loader(remote, batch_size=8, shuffle=False, prefetch=1)
        first = next(iter(loader))
        assert [int(v) for v in first["x"][:, 0]] == list(range(8))
        assert not proxy.through.is_set()  # the second range is still held
        threading.Timer(0.5, proxy.let_through).start()  # the held range ends; close waits
        loader.close()
        remote.close()
        assert not [p for p in (tmp_path / "c").rglob("*") if ".tmp-" in p.name]
        again = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", retry=LEADS)
        assert firsts(Loader(again, batch_size=8, shuffle=False)) == list(range(256))


def test_bytes_a_reader_fetched_itself_are_never_overwritten_by_the_lead(tmp_path: Path) -> None:
    """A read across two ranges: the first failed, so the reader fetches the bytes
    itself and writes them; the second range, still arriving (with wrong bytes of the
    right length) and written a chunk at a time as it comes, is lost: no chunk of it is
    written over them, and its request ends."""
    size, half, quarter = 1 << 20, 1 << 19, 1 << 18
    data = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = tmp_path / "shard.tmp"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, size)
    lead = Lead(Arriving(path, path, fd, -1, size), [(0, half), (half, size)])
    release, ended = threading.Event(), threading.Event()

    class Store(Storage):
        def read_chunks(
            self, name: str, start: int, end: int, chunk: int = 0
        ) -> Generator[bytes, None, None]:
            if start == 0:
                raise ConnectionError("503 Slow Down")
            try:  # wrong bytes, the first chunk at once
                yield b"\xff" * quarter
                release.wait(10)
                yield b"\xff" * (end - start - quarter)
            finally:
                ended.set()

    fetches = [threading.Thread(target=lead.fetch, args=(i, Store(), "shard")) for i in range(2)]
    for t in fetches:
        t.start()
    fetches[0].join()
    for _ in range(1000):  # the second range's first chunk is written as it came
        if os.pread(fd, quarter, half) == b"\xff" * quarter:
            break
        threading.Event().wait(0.01)
    else:
        raise AssertionError("the first chunk was not written before the range was in")
    lo, hi = half - 10, size - 10
    with pytest.raises(ConnectionError):
        lead.take(lo, hi)
    os.pwrite(fd, data[lo:hi], lo)  # the reader's own fetch, verified
    release.set()
    fetches[1].join()
    assert ended.is_set()  # the request was ended, not read to its end
    assert os.pread(fd, hi - lo, lo) == data[lo:hi]
    assert lead.take(half, size) is None  # the second range was lost
    lead.stop()
    os.close(fd)


def test_a_range_longer_than_asked_writes_nothing(tmp_path: Path) -> None:
    """A storage that sends more than a range's bytes: none of them is written (past the
    span lie the next range's bytes, a reader's own perhaps), and the range fails as a
    rejected first try."""
    size, half = 1 << 16, 1 << 15
    path = tmp_path / "shard.tmp"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    os.pwrite(fd, b"\x01" * size, 0)
    lead = Lead(Arriving(path, path, fd, -1, size), [(0, half), (half, size)])

    class Store(Storage):
        def read_chunks(
            self, name: str, start: int, end: int, chunk: int = 0
        ) -> Generator[bytes, None, None]:
            yield b"\xff" * (end - start + 10)

    lead.fetch(0, Store(), "shard")
    assert os.pread(fd, size, 0) == b"\x01" * size
    with pytest.raises(Rejected, match="more than the 32768 bytes"):
        lead.take(0, half)
    lead.stop()
    os.close(fd)

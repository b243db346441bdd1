"""No byte reaches a batch unless it chains to a verified index.json: a shard replaced in
object storage by another of the same size (for a whole epoch, or while it arrives) is
refused, an index written before it recorded shard headers is served whole shards only,
and a cached shard whose bytes changed on disk is fetched again, never served."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from dlop.formats import ArchiveWriter, Field, StorageError
from dlop.formats.constants import CRC_PIECE_BYTES
from dlop.runtime import IterableArchive, Loader, LoaderError
from dlop.runtime.storage.remote import HEAD_BYTES
from tests.faultproxy import FaultProxy
from tests.formats.helpers import read_header
from tests.runtime.helpers import open_remote, piece_parts

PARTS = piece_parts(3)  # the header first (no lead ranges: test_lead.py)
WAVE = 16384  # f32 values a sample: 64 KiB; 64 samples a 4 MiB shard, 16 a piece
PER_SHARD = 64
SHARDS = 3


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Archive ``a``: three shards of the same size and sample count, each sample's
    values its number."""
    root = tmp_path_factory.mktemp("site")
    fields = [Field("label", "i64", ()), Field("wave", "f32", (WAVE,))]
    with ArchiveWriter(root / "a", fields, shard_bytes=4 << 20) as w:
        for i in range(PER_SHARD * SHARDS):
            w.write({"label": i, "wave": np.full(WAVE, i, np.float32)})
    shards = json.loads((root / "a" / "index.json").read_text())["shards"]
    assert [s["num_samples"] for s in shards] == [PER_SHARD] * SHARDS
    assert len({s["bytes"] for s in shards}) == 1
    return root


def check_batch(b: dict[str, Any]) -> None:
    """A batch is right when every sample's values are its own label (shard 1 served in
    shard 0's place gives labels 0.. with values 64..)."""
    labels = b["label"]
    assert torch.equal(b["wave"][:, 0].to(torch.int64), labels), labels.tolist()
    assert torch.equal(b["wave"][:, -1].to(torch.int64), labels)


def served(batches: Any) -> tuple[int, BaseException | None]:
    """Batches served (each checked) until the iterator ends or fails, and the failure."""
    n = 0
    try:
        for b in batches:
            check_batch(b)
            n += 1
    except (LoaderError, StorageError) as e:  # a Loader's batch, or a DataLoader worker's
        return n, e
    return n, None


SETTINGS = [{"shuffle": False}, {"seed": 3}, {"seed": 3, "order": "window", "window_shards": 1}]


@pytest.mark.parametrize("settings", SETTINGS, ids=["in order", "global", "window"])
def test_a_shard_replaced_for_the_whole_epoch_is_never_served(
    site: Path, tmp_path: Path, settings: dict[str, Any]
) -> None:
    with FaultProxy(root=site) as proxy:
        proxy.swap("shard-00000", "shard-00001")  # same size, same sample count
        remote = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", retry=PARTS)
        for epoch in (0, 1):
            loader = Loader(remote, 8, **settings)
            loader.set_epoch(epoch)
            _, error = served(loader)
            loader.close()
            assert error is not None and "shard 0" in str(error)
            assert "index.json records" in str(error) and "not the shard" in str(error)
        # nothing of it was cached either
        assert not list((tmp_path / "c").rglob("shard-00000.dlop"))


def test_a_shard_replaced_while_it_arrives_serves_only_its_verified_pieces(
    site: Path, tmp_path: Path
) -> None:
    header, _ = read_header(site / "a" / "shard-00000.dlop")
    wave = next(f for f in header["fields"] if f["name"] == "wave")
    later = int(wave["regions"]["data"]["offset"]) + 2 * CRC_PIECE_BYTES  # its third part
    with FaultProxy(root=site) as proxy:
        proxy.fail("shard-00000", "hold", times=None, at=later)
        remote = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", retry=PARTS)
        loader = Loader(remote, 8, shuffle=False, prefetch=0)
        it = iter(loader)
        check_batch(next(it))  # from its first piece, verified before the swap
        proxy.swap("shard-00000", "shard-00001")  # replaced mid-epoch (a recompile uploaded)
        proxy.let_through()
        n, error = served(it)
        loader.close()
        assert error is not None and "shard 0" in str(error)
        assert "CRC piece" in str(error)  # the replaced object's pieces fail the header's CRCs
        assert n < 2 * 2  # at most the batches of the pieces that came before the swap


def test_dataloader_workers_never_serve_a_replaced_shard(site: Path, tmp_path: Path) -> None:
    with FaultProxy(root=site) as proxy:
        proxy.swap("shard-00000", "shard-00001")
        ds = IterableArchive(
            proxy.url + "/a", 8, shuffle=False, cache_dir=tmp_path / "c", cache_bytes=64 << 20
        )
        _, error = served(DataLoader(ds, batch_size=None, num_workers=2))
        assert error is not None and "not the shard" in str(error)


def old_index(site: Path, to: Path) -> Path:
    """The archive with its index as written before shard headers were recorded."""
    shutil.copytree(site / "a", to)
    index = json.loads((to / "index.json").read_text())
    for s in index["shards"]:
        del s["header_crc32"]
    (to / "index.json").write_text(json.dumps(index))
    return to


def test_an_index_without_shard_headers_serves_whole_verified_shards_only(
    site: Path, tmp_path: Path
) -> None:
    old = old_index(site, tmp_path / "site" / "a")
    with FaultProxy(root=tmp_path / "site") as proxy:
        remote = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", retry=PARTS)
        want = [b["label"].clone() for b in Loader(old, 8, seed=1)]
        loader = Loader(remote, 8, seed=1)
        got = [b["label"].clone() for b in loader]
        loader.close()
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        # no shard streamed: none had its header read first (a streamed shard's first read)
        assert f"bytes=0-{HEAD_BYTES - 1}" not in proxy.ranges
        assert f"bytes=0-{CRC_PIECE_BYTES - 1}" in proxy.ranges  # fetched whole, in parts
    with FaultProxy(root=tmp_path / "site") as proxy:  # and a replaced one is refused whole
        proxy.swap("shard-00000", "shard-00001")
        remote = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c2", retry=PARTS)
        loader = Loader(remote, 8, shuffle=False)
        n, error = served(loader)
        loader.close()
        assert n == 0 and error is not None and "CRC-32" in str(error)


def test_dlop_inspect_info_says_how_an_archive_is_read_remotely(site: Path, tmp_path: Path) -> None:
    def info(path: Path) -> str:
        run = [sys.executable, "-m", "dlop.tools.inspect_cli", "info", str(path)]
        return subprocess.run(run, capture_output=True, text=True, check=True).stdout

    assert "stream piece by verified piece" in info(site / "a")
    said = info(old_index(site, tmp_path / "old"))
    assert "served once whole and verified" in said and "recompile" in said


def flip(path: Path, at: int) -> None:
    """XORs one byte of ``path`` in place and restores its modification time."""
    st = path.stat()
    with path.open("r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x5A]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


READ_BACK = """
import sys, warnings, torch
from dlop.runtime import Loader, open_archive
warnings.simplefilter("always")
remote = open_archive(sys.argv[1], cache_dir=sys.argv[2])
with warnings.catch_warnings(record=True) as caught:
    for b in Loader(remote, 8, shuffle=False):
        assert torch.equal(b["wave"][:, 0].to(torch.int64), b["label"]), b["label"].tolist()
print(sum("changed on disk" in str(w.message) for w in caught))
"""


def test_bit_rot_in_the_node_cache_is_fetched_again_never_served(
    site: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "c"
    with FaultProxy(root=site) as proxy:
        url = proxy.url + "/a"
        remote = open_remote(url, cache_dir=cache, retry=PARTS)
        first, _ = served(Loader(remote, 8, shuffle=False))
        assert first == PER_SHARD * SHARDS // 8
        (cached,) = cache.rglob("shard-00000.dlop")
        header, _ = read_header(cached)
        wave = next(f for f in header["fields"] if f["name"] == "wave")
        verify = [sys.executable, "-m", "dlop.tools.inspect_cli", "verify", "-q", "--cache"]
        ok = subprocess.run([*verify, str(cache)], capture_output=True, text=True)
        assert ok.returncode == 0 and f"{SHARDS} cached shard(s)" in ok.stdout
        flip(cached, int(wave["regions"]["data"]["offset"]) + 4)  # sample 0's x[1]
        flip(cached, int(wave["regions"]["data"]["offset"]) + 2)  # and its x[0]
        bad = subprocess.run([*verify, str(cache)], capture_output=True, text=True)
        assert bad.returncode == 1 and "shard-00000.dlop: CRC-32" in bad.stdout
        assert "changed on disk" in bad.stdout
        before = proxy.count("shard-00000")
        # a new process (a new run on the node) holds the shard for the first time
        run = [sys.executable, "-c", READ_BACK, url, str(cache)]
        out = subprocess.run(run, capture_output=True, text=True, check=True).stdout
        assert out.split()[-1] == "1"  # warned of once
        assert proxy.count("shard-00000") > before  # fetched again
        # the cache now holds the right bytes
        again = subprocess.run(run, capture_output=True, text=True, check=True).stdout
        assert again.split()[-1] == "0"


def test_a_stamp_without_a_crc_is_fetched_again(site: Path, tmp_path: Path) -> None:
    cache = tmp_path / "c"
    with FaultProxy(root=site) as proxy:
        remote = open_remote(proxy.url + "/a", cache_dir=cache, retry=PARTS)
        served(Loader(remote, 8, shuffle=False))
        (lock,) = cache.rglob("shard-00001.dlop.lock")
        stamp = lock.read_bytes().split(b" ")
        lock.write_bytes(b" ".join(stamp[:3]) + b"\n")  # as an earlier version wrote it
        before = proxy.count("shard-00001")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # not bit rot: no warning
            remote = open_remote(proxy.url + "/a", cache_dir=cache, retry=PARTS)
            n, error = served(Loader(remote, 8, shuffle=False))
        assert error is None and n == PER_SHARD * SHARDS // 8
        assert proxy.count("shard-00001") > before


def test_clearing_the_cache_while_a_shard_streams_breaks_nothing(
    site: Path, tmp_path: Path
) -> None:
    header, _ = read_header(site / "a" / "shard-00000.dlop")
    wave = next(f for f in header["fields"] if f["name"] == "wave")
    later = int(wave["regions"]["data"]["offset"]) + 2 * CRC_PIECE_BYTES
    cache = tmp_path / "c"
    with FaultProxy(root=site) as proxy:
        proxy.fail("shard-00000", "hold", times=None, at=later)  # shard 0 stays arriving
        remote = open_remote(proxy.url + "/a", cache_dir=cache, retry=PARTS)
        loader = Loader(remote, 8, shuffle=False, prefetch=0)
        it = iter(loader)
        check_batch(next(it))
        clear = [sys.executable, "-m", "dlop.tools.inspect_cli", "cache", str(cache), "--clear"]
        subprocess.run(clear, capture_output=True, text=True, check=True)
        (folder,) = [p for p in cache.iterdir() if p.is_dir()]
        assert (folder / "index.json").exists() and (folder / "shard-00000.dlop.lock").exists()
        assert list(folder.glob("shard-00000.dlop.tmp-*"))  # the arriving shard is kept
        proxy.let_through()
        n, error = served(it)
        assert error is None and n == PER_SHARD * SHARDS // 8 - 1
        loader.close()
        remote.close()
    del loader, it, remote
    gc.collect()  # the archive no longer open here: a clear now removes its folder
    subprocess.run(clear, capture_output=True, text=True, check=True)
    assert not [p for p in cache.iterdir() if p.is_dir()]


EXIT_AFTER_EPOCH = """
import os, sys, time
from dlop.formats.constants import CRC_PIECE_BYTES
from dlop.formats.storage import Retry
from dlop.runtime import Loader
from tests.runtime.helpers import open_remote
sync = os.fsync
def slow_disk(fd):  # a disk that takes a while to sync: landing outlasts the last batch
    time.sleep(float(sys.argv[3]))
    sync(fd)
os.fsync = slow_disk
parts = Retry(part_bytes=CRC_PIECE_BYTES, parallel_parts=4)  # streamed: served as it arrives
loader = Loader(open_remote(sys.argv[1], cache_dir=sys.argv[2], retry=parts), 8, shuffle=False)
n = sum(1 for _ in loader)
print(n)
"""  # and exits at once, its last shard's parts just in and still landing


def test_a_shard_whose_bytes_are_all_in_is_published_when_the_process_exits(
    site: Path, tmp_path: Path
) -> None:
    with FaultProxy(root=site) as proxy:
        for run in range(2):
            cache = tmp_path / f"c{run}"
            cmd = [sys.executable, "-c", EXIT_AFTER_EPOCH, proxy.url + "/a", str(cache), "0.3"]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            assert out.split()[-1] == str(PER_SHARD * SHARDS // 8)
            assert not list(cache.rglob("*.tmp-*")), run  # none left half published
            assert len(list(cache.rglob("shard-*.dlop"))) == SHARDS, run


@pytest.mark.parametrize("value", ["1234", -1, 2**32, True, 1.5, [1]])
def test_an_index_with_a_malformed_header_crc_is_refused(
    site: Path, tmp_path: Path, value: object
) -> None:
    from dlop.formats import FormatError, read_index

    bad = old_index(site, tmp_path / "bad")
    index = json.loads((bad / "index.json").read_text())
    index["shards"][1]["header_crc32"] = value
    (bad / "index.json").write_text(json.dumps(index))
    with pytest.raises(FormatError, match=r"shard entry #1 .*header_crc32 must be an integer"):
        read_index(bad)


def test_verify_names_a_header_crc_the_index_records_wrongly(site: Path, tmp_path: Path) -> None:
    bad = old_index(site, tmp_path / "bad")
    index = json.loads((bad / "index.json").read_text())
    index["shards"][2]["header_crc32"] = 12345
    (bad / "index.json").write_text(json.dumps(index))
    run = [sys.executable, "-m", "dlop.tools.inspect_cli", "verify", "-q", str(bad)]
    said = subprocess.run(run, capture_output=True, text=True)
    assert said.returncode == 1
    assert "shard-00002.dlop" in said.stdout and "header_crc32 0x00003039" in said.stdout
    with FaultProxy(root=tmp_path) as proxy:  # and read remotely, shard 2 is refused
        remote = open_remote(proxy.url + "/bad", cache_dir=tmp_path / "c", retry=PARTS)
        n, error = served(Loader(remote, 8, shuffle=False))
        assert n == 2 * PER_SHARD // 8 and error is not None and "shard 2" in str(error)

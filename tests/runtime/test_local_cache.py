"""A local zstd archive given a cache_dir: each shard decoded once on the node into the
shard cache and its raw copy mapped; without a cache_dir nothing changes and
``cache_bytes`` is the decoded-block cache."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from dlop.formats import read_index
from dlop.runtime import Archive, Loader, LoaderError, open_archive
from dlop.runtime.errors import UsageError
from dlop.runtime.storage import remote_supply
from tests.runtime.helpers import make_archive

SETTINGS: dict[str, Any] = {"batch_size": 4, "seed": 3, "order": "window", "window_shards": 2}


def batches(loader: Loader) -> list[dict[str, Any]]:
    return [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in loader
    ]


def same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys()
        and all(x[k] == y[k] if isinstance(x[k], list) else torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


@pytest.fixture
def zstd(tmp_path: Path) -> Path:
    return make_archive(tmp_path / "z", zstd=True)


def test_each_shard_is_decoded_once_into_the_cache(
    zstd: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded: list[str] = []
    real = remote_supply.transcode_bytes

    def counted(data: bytes, name: str = "shard") -> bytes:
        decoded.append(name)
        return real(data, name)

    monkeypatch.setattr(remote_supply, "transcode_bytes", counted)
    cache = tmp_path / "cache"
    ds = open_archive(zstd, cache_dir=cache, cache_bytes=4 << 20)
    assert isinstance(ds.supply, remote_supply.RemoteSupply)
    want = batches(Loader(zstd, **SETTINGS))
    assert same(batches(Loader(ds, **SETTINGS)), want)
    shards = [s.file for s in read_index(zstd).shards]
    assert sorted(decoded) == sorted(shards)  # each once
    cached = sorted(p.name for p in cache.rglob("shard-*.dlop"))
    assert cached == sorted(shards)
    assert all(f.codec.mappable for f in ds.fields.values())  # raw copies, mapped
    ds.close()
    # Another Loader (a new process would do the same) maps the cached copies: no decode.
    loader = Loader(zstd, cache_dir=cache, cache_bytes=4 << 20, **SETTINGS)
    assert same(batches(loader), want)
    loader.close()
    assert sorted(decoded) == sorted(shards)
    # DataLoader workers get it by pickle and reopen it over the same cache.
    again = pickle.loads(pickle.dumps(ds))
    assert isinstance(again.supply, remote_supply.RemoteSupply) and again[7]["key"] == "k007"
    again.close()


def test_without_cache_dir_no_cache_is_touched(
    zstd: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DLOP_CACHE_DIR", str(tmp_path / "env-cache"))
    ds = open_archive(zstd, block_cache_bytes=123_456)
    assert type(ds) is Archive
    assert ds.reader.block_cache.max_bytes == 123_456  # decoded zstd blocks
    assert same(
        batches(Loader(zstd, block_cache_bytes=123_456, **SETTINGS)),
        batches(Loader(ds, **SETTINGS)),
    )
    assert not (tmp_path / "env-cache").exists()


def test_each_cache_budget_has_one_name(zstd: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cache_bytes= is the shard cache's budget"):
        open_archive(zstd, cache_bytes=123_456)
    with pytest.raises(UsageError, match="block_cache_bytes= sizes a local archive's"):
        open_archive(zstd, cache_dir=tmp_path / "c", block_cache_bytes=123_456)
    with pytest.raises(UsageError, match="block_cache_bytes= sizes a local archive's"):
        Loader("s3://bucket/a", 4, block_cache_bytes=123_456)


def test_with_cache_dir_cache_bytes_is_the_budget(zstd: Path, tmp_path: Path) -> None:
    ds = open_archive(zstd, cache_dir=tmp_path / "c", cache_bytes=3 << 20)
    assert (
        isinstance(ds.supply, remote_supply.RemoteSupply) and ds.supply.cache.max_bytes == 3 << 20
    )
    with pytest.raises(UsageError, match="cache_bytes 1000 is below"):
        open_archive(zstd, cache_dir=tmp_path / "c", cache_bytes=1000)
    ds.close()


def test_a_raw_archive_ignores_cache_dir(tmp_path: Path) -> None:
    raw = make_archive(tmp_path / "a")
    ds = open_archive(raw, cache_dir=tmp_path / "c")
    assert type(ds) is Archive and not (tmp_path / "c").exists()


def test_what_cache_dir_does_not_take_is_refused(zstd: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="where= and indices= do not take cache_dir"):
        open_archive(zstd, cache_dir=tmp_path / "c", indices=[1, 2])
    other = make_archive(tmp_path / "z2", zstd=True)
    with pytest.raises(UsageError, match="got a list of 2 archives"):
        open_archive([zstd, other], cache_dir=tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_a_corrupt_shard_file_names_the_shard(zstd: Path, tmp_path: Path) -> None:
    shard = read_index(zstd).shards[1]
    path = zstd / shard.file
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    ds = open_archive(zstd, cache_dir=tmp_path / "c", cache_bytes=4 << 20)
    with pytest.raises(LoaderError, match=rf"shard 1 \({shard.file}\).*CRC-32"):
        batches(Loader(ds, batch_size=4, shuffle=False))
    assert not list((tmp_path / "c").rglob(f"{shard.file}"))  # nothing corrupt cached
    ds.close()

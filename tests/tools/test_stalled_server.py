"""No network wait without a time limit: a server that accepts connections and never
answers (or answers the index and stalls the shards) ends every entry point in a dlop
error naming the URL, within its connect/read timeouts times the retry policy."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from dlop.formats import StorageError
from dlop.formats.urls import timeouts
from dlop.runtime import IterableArchive, Loader, LoaderError, open_archive
from dlop.tools import compile_cli, inspect_cli
from tests.faultproxy import FaultProxy
from tests.runtime.helpers import make_archive


@pytest.fixture(autouse=True)
def short_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLOP_CONNECT_TIMEOUT", "0.5")
    monkeypatch.setenv("DLOP_READ_TIMEOUT", "0.5")


@pytest.fixture
def silent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The URL of a server that accepts every connection and never answers: nothing of it
    is ever read, so the shortest timeouts serve (each attempt waits them out)."""
    monkeypatch.setenv("DLOP_CONNECT_TIMEOUT", "0.2")
    monkeypatch.setenv("DLOP_READ_TIMEOUT", "0.2")
    make_archive(tmp_path / "site" / "a")
    with FaultProxy(root=tmp_path / "site") as proxy:
        proxy.fail("", "hang", times=None)
        yield proxy.url


@pytest.fixture
def stalled_shards(tmp_path: Path) -> Iterator[str]:
    """An archive URL whose index is served and whose shards never answer."""
    make_archive(tmp_path / "site" / "a")
    with FaultProxy(root=tmp_path / "site") as proxy:
        proxy.fail("shard-", "hang", times=None)
        yield proxy.url + "/a"


def test_the_timeouts_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert timeouts() == (0.5, 0.5)
    monkeypatch.setenv("DLOP_READ_TIMEOUT", "never")
    with pytest.raises(Exception, match="DLOP_READ_TIMEOUT='never': give the read timeout"):
        timeouts()


def test_open_archive_and_loader_end_on_a_silent_server(silent: str, tmp_path: Path) -> None:
    kw: dict[str, Any] = {"cache_dir": tmp_path / "c", "cache_bytes": "64MiB"}
    with pytest.raises(StorageError, match=f"{silent}/a"):
        open_archive(f"{silent}/a", **kw)
    with pytest.raises(StorageError, match=f"{silent}/a"):
        Loader(f"{silent}/a", 4, **kw)


def test_stalled_shards_end_the_loader_and_dataloader_workers(
    stalled_shards: str, tmp_path: Path
) -> None:
    kw: dict[str, Any] = {"cache_dir": tmp_path / "c", "cache_bytes": "64MiB"}
    with pytest.raises(LoaderError, match=r"shard \d+ .*failed \d+ times"):
        next(iter(Loader(stalled_shards, 4, **kw)))
    workers = DataLoader(IterableArchive(stalled_shards, 4, **kw), batch_size=None, num_workers=1)
    with pytest.raises(StorageError, match=r"shard \d+ .*failed"):
        next(iter(workers))


def test_an_s3_endpoint_that_never_answers(
    silent: str, tmp_path: Path, s3_env: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    s3_env(silent)
    with pytest.raises(StorageError, match="s3://bucket/a"):
        open_archive("s3://bucket/a", cache_dir=tmp_path / "c", cache_bytes="64MiB")
    out = tmp_path / "out"
    assert compile_cli.main(["s3://bucket/corpus", "-o", str(out), "-q"]) == 1
    assert not out.exists() and "s3://bucket/corpus" in capsys.readouterr().err
    assert inspect_cli.main(["info", "s3://bucket/a"]) == 1
    assert "s3://bucket/a" in capsys.readouterr().err


def test_compile_and_inspect_end_on_a_silent_server(
    silent: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert compile_cli.main([f"{silent}/m.jsonl", "-o", str(out), "-q"]) == 1
    err = capsys.readouterr().err
    assert f"{silent}/m.jsonl" in err and "did not answer" in err
    assert not out.exists()
    for command in ("info", "verify"):
        assert inspect_cli.main([command, f"{silent}/a"]) == 1
        assert f"{silent}/a" in capsys.readouterr().err


def test_compile_on_a_dask_scheduler_that_never_answers(
    silent: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("distributed")
    from tests.compiler.fixtures import manifest_corpus

    manifest = manifest_corpus(tmp_path / "m")
    out = tmp_path / "out"
    address = silent.replace("http://", "tcp://")
    assert compile_cli.main([str(manifest), "-o", str(out), "-q", "--dask", address]) == 1
    assert f"--dask {address}: cannot reach the Dask scheduler" in capsys.readouterr().err
    assert not out.exists()  # OUT is taken only once the cluster answered

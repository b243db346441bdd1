"""What a reader says when storage refuses or misbehaves: a refused permission and a
server that ignores Range are not retried and are named as such, a reason never comes
empty, a full disk names the cache, and a URL whose query grants the whole folder reads."""

from __future__ import annotations

import dataclasses
import errno
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlop.formats import ArchiveWriter, Field
from dlop.formats.storage import FetchError, Retry, retrying
from dlop.runtime import Loader, LoaderError
from dlop.runtime.storage.cache_folder import CacheError
from dlop.runtime.storage.remote import HEAD_BYTES
from tests.faultproxy import FaultProxy
from tests.runtime.helpers import make_archive, open_remote

FAST = Retry(attempts=4, backoff_s=0.001, max_backoff_s=0.01)
SETTINGS: dict[str, Any] = {"batch_size": 4, "shuffle": False, "prefetch": 0}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``a``: small shards of every field kind; ``big``: shards past one header read."""
    root = tmp_path_factory.mktemp("site")
    make_archive(root / "a")
    with ArchiveWriter(root / "big", [Field("x", "f32", (8192,))], shard_bytes=256 << 10) as w:
        for i in range(24):
            w.write({"x": np.full(8192, i, np.float32)})
    assert (root / "big" / "shard-00001.dlop").stat().st_size > HEAD_BYTES
    return root


def keys(loader: Loader) -> list[str]:
    return [k for b in loader for k in b["key"]]


# A shard's first requests: its header alone, then its parts; or (lead) byte ranges of
# 64 KiB at once, the header read from the first.
HEADER_FIRST = dataclasses.replace(FAST, lead=False)
RANGES = dataclasses.replace(FAST, part_bytes=64 << 10)


@pytest.mark.parametrize("retry", [HEADER_FIRST, RANGES], ids=["header first", "lead ranges"])
@pytest.mark.parametrize("fault", ["forbidden", "norange"])
def test_a_refusal_no_retry_fixes_is_tried_once_and_named(
    site: Path, tmp_path: Path, fault: str, retry: Retry
) -> None:
    said = {"forbidden": "HTTP 403", "norange": "ignores HTTP Range requests"}[fault]
    with FaultProxy(root=site) as proxy:
        proxy.fail("shard-00001", fault, times=None)
        remote = open_remote(proxy.url + "/big", cache_dir=tmp_path / "c", retry=retry)
        with pytest.raises(LoaderError, match=said) as caught:
            for _ in Loader(remote, **SETTINGS):
                pass
        assert "shard 1" in str(caught.value)
        asked = [r for p, r in proxy.asked if "shard-00001" in p]
        assert asked and len(asked) == len(set(asked))  # no range asked for again
        if retry.lead:  # the ranges went out at once, each refused
            assert len(asked) <= retry.parallel_parts
        else:
            assert len(asked) == 1


def test_a_server_ignoring_range_serves_a_shard_one_request_covers(
    site: Path, tmp_path: Path
) -> None:
    """A lead of one range asks for the whole file: what a server ignoring Range sends
    is exactly that, and it is checked like any other answer."""
    want = [int(x) for b in Loader(site / "big", **SETTINGS) for x in b["x"][:, 0]]
    with FaultProxy(root=site) as proxy:
        proxy.fail("shard-00001", "norange", times=None)
        remote = open_remote(proxy.url + "/big", cache_dir=tmp_path / "c", retry=FAST)
        assert [int(x) for b in Loader(remote, **SETTINGS) for x in b["x"][:, 0]] == want
        assert proxy.count("shard-00001") == 1


def test_a_failure_without_a_message_says_its_type_and_what_was_read() -> None:
    def once() -> bytes:
        raise TimeoutError()

    with pytest.raises(FetchError) as caught:
        retrying(once, "shard 3", "https://host/a/shard-00003.dlop", FAST)
    message = str(caught.value)
    assert (
        "TimeoutError: no message from the storage client, reading https://host/a/shard-00003.dlop"
        in message
    )


def test_a_url_whose_query_grants_the_folder_reads(site: Path, tmp_path: Path) -> None:
    want = keys(Loader(site / "a", **SETTINGS))
    with FaultProxy(root=site) as proxy:
        url = proxy.url + "/a?sv=2024-01-01&sig=s3cr3t"  # as an Azure SAS token for a folder
        loader = Loader(url, **SETTINGS, cache_dir=tmp_path / "c")
        assert keys(loader) == want
        loader.close()
        assert any(path.endswith("/a/shard-00000.dlop") for path, _ in proxy.ranged)
    (source,) = (tmp_path / "c").rglob("source.txt")
    assert "s3cr3t" not in source.read_text()


def test_a_full_disk_names_the_cache_and_its_budget(
    site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with FaultProxy(root=site) as proxy:
        remote = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c", retry=FAST)
        monkeypatch.setattr(os, "posix_fallocate", full)
        loader = Loader(remote, **SETTINGS)
        with pytest.raises((CacheError, LoaderError)) as caught:
            keys(loader)
        # the fetch ahead may still be making its file as the error reaches the loop:
        # nothing half made is left once the Loader and the archive are closed
        loader.close()
        remote.close()
        message = str(caught.value)
        assert (
            str(tmp_path / "c") in message and "the disk holding the shard cache is full" in message
        )
        assert "cache_bytes" in message
        assert not list((tmp_path / "c").rglob("*.tmp-*"))  # nothing half made left behind


READ_SHARD_1 = """
import sys
from dlop.runtime import Loader
try:
    for batch in Loader(sys.argv[1], 4, shuffle=False, cache_dir=sys.argv[2]):
        pass
except Exception as e:
    print(type(e).__name__, e)
"""


def test_a_fetch_that_failed_is_the_answer_of_the_nodes_other_processes(
    site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess
    import sys

    from dlop.runtime.storage import cache as cache_module

    with FaultProxy(root=site) as proxy:
        proxy.fail("shard-00001", "slowdown", times=None)  # 503 to every request
        url = proxy.url + "/big"
        remote = open_remote(url, cache_dir=tmp_path / "c", retry=FAST)
        with pytest.raises(LoaderError, match=r"shard 1 .*failed 4 times"):
            for _ in Loader(remote, **SETTINGS):
                pass
        tried = proxy.count("shard-00001")
        assert tried == 4
        # another process on the node (another rank) needing shard 1 takes that answer
        run = [sys.executable, "-c", READ_SHARD_1, url, str(tmp_path / "c")]
        said = subprocess.run(run, capture_output=True, text=True, check=True).stdout
        assert "another process on this node failed to fetch it" in said
        assert "503" in said or "SlowDown" in said
        assert proxy.count("shard-00001") == tried  # no new wait, no new request
        # the server well again and the record expired: tried afresh, and read
        proxy.faults.clear()
        monkeypatch.setattr(cache_module, "FAILURE_KEPT_S", 0.0)
        remote = open_remote(url, cache_dir=tmp_path / "c", retry=FAST)
        assert sum(len(b["x"]) for b in Loader(remote, **SETTINGS)) == 24


def test_a_source_read_again_after_close_still_retries(site: Path, tmp_path: Path) -> None:
    # close() cuts the retries' sleeps short; a source read again after it retries as new
    slept = Retry(attempts=4, backoff_s=0.001, max_backoff_s=0.01)
    with FaultProxy(root=site) as proxy:
        remote = open_remote(proxy.url + "/big", cache_dir=tmp_path / "c", retry=slept)
        first = Loader(remote, **SETTINGS)
        next(iter(first))
        first.close()
        remote.close()
        for cached in (tmp_path / "c").rglob("shard-00002.dlop"):
            cached.unlink()  # evicted: the next read fetches it again
        proxy.fail("shard-00002", "slowdown", times=1)  # one 503, then the shard
        again = Loader(remote, **SETTINGS)
        assert sum(len(b["x"]) for b in again) == 24
        again.close()
        assert proxy.count("shard-00002") >= 2

"""dlop-inspect info|verify|show on an archive in S3 (moto's server on loopback)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlop.formats import ArchiveWriter, Field, Zstd, storage
from dlop.formats.constants import MAX_INDEX_BYTES
from dlop.tools.inspect_cli import main


def _archive(out: Path) -> Path:
    fields = [
        Field.str_("key"),
        Field("label", "i64", ()),
        Field("logmel", "f16", (None, 8), codec=Zstd(block_bytes=1024)),
    ]
    rng = np.random.default_rng(0)
    with ArchiveWriter(out, fields, shard_bytes=600) as w:
        for i in range(10):
            w.write({"key": f"c{i}.wav", "label": i % 3, "logmel": rng.normal(0, 1, (5 + i, 8))})
        w.skip("bad.wav", "zero-byte file")
    return out


@pytest.fixture
def in_s3(s3: Any, tmp_path: Path) -> tuple[Any, str, Path]:
    local = _archive(tmp_path / "a")
    s3.reset()  # moto's buckets live in the process, past one server
    s3.make_bucket("arch")
    fs = s3.filesystem()
    fs.put(str(local), "arch/a", recursive=True)
    return fs, "s3://arch/a", local


def test_info_verify_show_read_an_archive_from_s3(
    in_s3: tuple[Any, str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, url, local = in_s3
    assert main(["info", url, "--json"]) == 0
    remote = json.loads(capsys.readouterr().out)
    assert main(["info", str(local), "--json"]) == 0
    here = json.loads(capsys.readouterr().out)
    assert remote["path"] == url
    assert {k: v for k, v in remote.items() if k != "path"} == {
        k: v for k, v in here.items() if k != "path"
    }
    assert main(["verify", "-q", url]) == 0
    assert f"OK {url}" in capsys.readouterr().out
    assert main(["show", url, "7"]) == 0
    assert "c7.wav" in capsys.readouterr().out


def test_verify_names_a_damaged_or_missing_shard_by_its_url(
    in_s3: tuple[Any, str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    fs, url, local = in_s3
    shards = json.loads((local / "index.json").read_text())["shards"]
    first, second = shards[0]["file"], shards[1]["file"]
    data = bytearray((local / first).read_bytes())
    data[-3] ^= 0xFF
    fs.pipe_file(f"arch/a/{first}", bytes(data) + b"longer than the index says")
    fs.rm_file(f"arch/a/{second}")
    assert main(["verify", "-q", url]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {url}/{first}" in out and f"FAIL {url}/{second}" in out
    assert "/tmp" not in out.replace(url, "")


def test_an_oversized_index_is_refused_before_it_is_read_whole(
    s3: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    s3.make_bucket("huge")
    s3.filesystem().pipe_file("huge/a/index.json", b" " * (MAX_INDEX_BYTES + 1))
    assert main(["verify", "-q", "s3://huge/a"]) == 1
    assert "cap" in capsys.readouterr().err


def test_storage_options_reach_the_filesystem(
    in_s3: tuple[Any, str, Path],
    s3: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, url, _ = in_s3
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # the option alone says where the server is
    good = ["--storage-option", f"endpoint_url={s3.endpoint}"]
    assert main(["verify", "-q", url, *good]) == 0
    assert f"OK {url}" in capsys.readouterr().out


def test_a_fetched_shard_is_copied_in_chunks_not_read_whole(
    in_s3: tuple[Any, str, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What one fetch holds in memory is one chunk, whatever size the index gives a shard
    (eight shards are fetched at once)."""
    from dlop.tools import inspect_cli

    fs, url, _ = in_s3
    asked: list[int] = []
    real_open = fs.open

    def open_counting(path: str, mode: str = "rb", **kw: Any) -> Any:
        f = real_open(path, mode, **kw)
        real_read = f.read
        f.read = lambda n=-1: (asked.append(n), real_read(n))[1]
        return f

    monkeypatch.setattr(inspect_cli, "FETCH_CHUNK", 64)
    real_storage = storage.open_storage

    def same_client(u: str, o: Any) -> storage.FsspecStorage:
        root = real_storage(u, o)
        assert isinstance(root, storage.FsspecStorage)
        return storage.FsspecStorage(fs, root.root, u)

    monkeypatch.setattr(storage, "open_storage", same_client)
    monkeypatch.setattr(fs, "open", open_counting)
    assert main(["verify", "-q", url]) == 0
    assert f"OK {url}" in capsys.readouterr().out
    assert asked and max(asked) == 64

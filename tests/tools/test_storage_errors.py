"""Storage failures are dlop errors naming the URL: a refused connection (HTTP, or an S3
endpoint where nothing listens) is not "no such file", and a bucket that does not exist
is named."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from dlop.formats import StorageError
from dlop.runtime import open_archive
from dlop.tools import compile_cli, inspect_cli


@pytest.fixture
def nobody(monkeypatch: pytest.MonkeyPatch) -> str:
    """A loopback URL where nothing listens."""
    monkeypatch.setenv("DLOP_CONNECT_TIMEOUT", "1")
    monkeypatch.setenv("DLOP_READ_TIMEOUT", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_a_refused_connection_is_named_not_missing(
    nobody: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("aiohttp")
    assert compile_cli.main([f"{nobody}/m.jsonl", "-o", str(tmp_path / "o"), "-q"]) == 1
    err = capsys.readouterr().err
    assert f"{nobody}/m.jsonl: the storage did not answer as asked" in err, err
    assert "Cannot connect" in err and "no such file" not in err
    assert inspect_cli.main(["info", f"{nobody}/a"]) == 1
    err = capsys.readouterr().err
    assert f"{nobody}/a/index.json: the storage did not answer" in err
    with pytest.raises(StorageError, match=r"index\.json failed \d+ times; last: .*Cannot connect"):
        open_archive(f"{nobody}/a", cache_dir=tmp_path / "c", cache_bytes="64MiB")


def test_an_s3_endpoint_where_nothing_listens(
    nobody: str, tmp_path: Path, s3_env: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    s3_env(nobody)
    assert compile_cli.main(["s3://bucket/corpus", "-o", str(tmp_path / "o"), "-q"]) == 1
    err = capsys.readouterr().err
    assert "s3://bucket/corpus failed" in err, err
    assert "EndpointConnectionError" in err
    with pytest.raises(StorageError, match=r"s3://bucket/a: .*EndpointConnectionError"):
        open_archive("s3://bucket/a", cache_dir=tmp_path / "c", cache_bytes="64MiB")


def test_a_bucket_that_does_not_exist_is_named(
    s3: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert compile_cli.main(["s3://no-such-bucket/corpus", "-o", str(tmp_path / "o"), "-q"]) == 1
    assert "s3://no-such-bucket/corpus" in capsys.readouterr().err
    with pytest.raises(StorageError, match="no-such-bucket/a"):
        open_archive("s3://no-such-bucket/a", cache_dir=tmp_path / "c", cache_bytes="64MiB")
    assert inspect_cli.main(["info", "s3://no-such-bucket/a"]) == 1
    assert "s3://no-such-bucket/a" in capsys.readouterr().err

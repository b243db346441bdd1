"""A URL's credentials (user:password@, signed query values) are used to read, but never
stored (index.json, errors.jsonl, a cache's source.txt) nor printed (errors, CLI output)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dlop.compiler.errors import CompileError
from dlop.compiler.run import pipeline
from dlop.formats.redact import redact
from dlop.tools import compile_cli, inspect_cli
from tests.compiler.fixtures import manifest_corpus
from tests.compiler.test_urls import _http_server

SECRET = "PASSWORD123"


def test_redact_removes_userinfo_and_query_values() -> None:
    assert redact(f"http://user:{SECRET}@host:8080/m.jsonl") == "http://***@host:8080/m.jsonl"
    assert redact(f"s3://AKIA:{SECRET}/x+y@bucket/key") == "s3://***@bucket/key"
    signed = f"https://h/x.wav?X-Amz-Credential=AKIA%2F1&X-Amz-Signature={SECRET}#t"
    assert redact(signed) == "https://h/x.wav?X-Amz-Credential=***&X-Amz-Signature=***#t"
    said = f"cannot open 'gs://b/o?token={SECRET}': gone; and /local/p@x.wav"
    assert redact(said) == "cannot open 'gs://b/o?token=***': gone; and /local/p@x.wav"
    for kept in ("s3://bucket/a@2x.png", "http://127.0.0.1:9/x", "/home/me/a:b@c.wav"):
        assert redact(kept) == kept
    assert SECRET not in str(CompileError(f"http://u:{SECRET}@h/x: not found"))


def test_a_compile_from_a_url_with_a_password_keeps_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("aiohttp")
    manifest = manifest_corpus(tmp_path / "man")
    with manifest.open("a") as f:
        f.write(json.dumps({"audio_filepath": "wav/gone.wav", "text": "x"}) + "\n")
    out = tmp_path / "a"
    with _http_server(manifest.parent) as base:
        url = base.replace("http://", f"http://reader:{SECRET}@") + "/train.jsonl"
        assert compile_cli.main([url, "-o", str(out), "-q", "--workers", "1"]) == 0
        printed = capsys.readouterr()
        assert inspect_cli.main(["info", str(out)]) == 0
        info = capsys.readouterr().out
    stored = (out / "index.json").read_text() + (out / "errors.jsonl").read_text()
    assert "gone.wav" in stored and "http://***@127.0.0.1" in stored
    for text in (stored, info, printed.out, printed.err):
        assert SECRET not in text and "reader" not in text


def test_tool_output_is_redacted_whatever_raised_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    def storage_failure(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"botocore said: s3://key:{SECRET}@bucket/x is not reachable")

    monkeypatch.setattr(pipeline, "compile_corpus", storage_failure)
    with pytest.raises(SystemExit) as stopped:
        compile_cli.main([str(tmp_path), "--layout", "folder", "-o", str(tmp_path / "o")])
    assert stopped.value.code == 1
    err = capsys.readouterr().err
    assert "dlop-compile: error: RuntimeError: botocore said: s3://***@bucket/x" in err
    assert SECRET not in err


def test_a_loader_cache_keeps_no_password(tmp_path: Path) -> None:
    pytest.importorskip("aiohttp")
    from dlop.runtime import open_archive
    from tests.runtime.helpers import make_archive

    make_archive(tmp_path / "srv" / "arch")
    cache = tmp_path / "cache"
    with _http_server(tmp_path / "srv") as base:
        url = base.replace("http://", f"http://reader:{SECRET}@") + "/arch"
        ds = open_archive(url, cache_dir=cache, cache_bytes="64MiB")
        assert len(ds) > 0
        with pytest.raises(Exception) as missing:
            open_archive(url + "-gone", cache_dir=cache, cache_bytes="64MiB")
    assert SECRET not in str(missing.value)
    (source,) = cache.rglob("source.txt")
    assert source.read_text() == redact(url) + "\n" and SECRET not in source.read_text()

"""formats.urls: which texts are URLs, and the fsspec filesystem of one, as the
compiler and the runtime both use it (each with its own error type)."""

from __future__ import annotations

import contextlib

import pytest

from dlop.compiler.errors import CompileError
from dlop.compiler.urls import filesystem as compiler_filesystem
from dlop.formats import urls
from dlop.runtime.errors import LoaderError
from dlop.runtime.storage.remote import storage_at


def test_urls_and_paths() -> None:
    assert urls.is_url("s3://b/x") and urls.is_url("HTTPS://h/a") and urls.is_url("memory://a")
    for text in ("/data/a", "rel/a", "file:///data/a", "c:\\data", 3, None):
        assert not urls.is_url(text)
    assert urls.scheme("GS://b/x") == "gs" and urls.scheme("/x") is None


def test_memory_filesystem_and_the_path_inside() -> None:
    fs, path = urls.filesystem("memory://bucket/archive")
    assert type(fs).__name__ == "MemoryFileSystem" and path.endswith("bucket/archive")


def test_a_missing_backend_names_the_extra_in_each_callers_error() -> None:
    with contextlib.suppress(ImportError):
        import gcsfs  # noqa: F401

        pytest.skip("gcsfs is installed here")
    extra = r"gs://b/a: gs:// URLs need an fsspec backend .*pip install 'dlop\[gcs\]'"
    with pytest.raises(urls.StorageError, match=extra):
        urls.filesystem("gs://b/a")
    with pytest.raises(CompileError, match=extra):
        compiler_filesystem("gs://b/a")
    with pytest.raises(LoaderError, match=extra):
        storage_at("gs://b/a")


def test_an_unknown_protocol_is_refused() -> None:
    with pytest.raises(urls.StorageError, match="nosuchproto://b/a: not a URL fsspec knows"):
        urls.filesystem("nosuchproto://b/a")


def test_runtime_keeps_one_client_per_process_and_url() -> None:
    a = storage_at("memory://b/a")
    assert storage_at("memory://b/a") is a
    assert storage_at("memory://b/a", {"skip_instance_cache": True}) is not a

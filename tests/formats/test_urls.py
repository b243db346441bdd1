"""formats.urls: which texts are URLs, and the fsspec filesystem of one, as the
compiler and the runtime both use it (one error type, StorageError, for both)."""

from __future__ import annotations

import contextlib

import pytest

from dlop.compiler.corpus.place import source_place
from dlop.formats import StorageError, storage, urls
from dlop.runtime.storage.remote import storage_at


def test_urls_and_paths() -> None:
    assert urls.is_url("s3://b/x") and urls.is_url("HTTPS://h/a") and urls.is_url("memory://a")
    for text in ("/data/a", "rel/a", "file:///data/a", "c:\\data", 3, None):
        assert not urls.is_url(text)
    assert urls.scheme("GS://b/x") == "gs" and urls.scheme("/x") is None


def test_memory_filesystem_and_the_path_inside() -> None:
    fs, path = urls.filesystem("memory://bucket/archive")
    assert type(fs).__name__ == "MemoryFileSystem" and path.endswith("bucket/archive")


def test_a_missing_backend_names_the_extra_wherever_a_storage_is_opened() -> None:
    with contextlib.suppress(ImportError):
        import gcsfs  # noqa: F401

        pytest.skip("gcsfs is installed here")
    extra = r"gs://b/a: gs:// URLs need an fsspec backend .*pip install 'dlop\[gcs\]'"
    for opening in (urls.filesystem, storage.open_storage, source_place, storage_at):
        with pytest.raises(StorageError, match=extra):
            opening("gs://b/a")


def test_an_unknown_protocol_is_refused() -> None:
    with pytest.raises(StorageError, match="nosuchproto://b/a: not a URL fsspec knows"):
        urls.filesystem("nosuchproto://b/a")


def test_runtime_keeps_one_client_per_process_and_url() -> None:
    a = storage_at("memory://b/a")
    assert storage_at("memory://b/a") is a
    assert storage_at("memory://b/a", {"skip_instance_cache": True}) is not a

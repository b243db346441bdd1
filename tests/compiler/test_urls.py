"""SOURCE and OUT as fsspec URLs: the filesystem, the path layouts list, input bytes, the store.

S3 is moto's server on loopback (the ``s3`` fixture); HTTP is a loopback http.server.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dlop.compiler import urls
from dlop.compiler.corpus.layouts import open_corpus, stream_items
from dlop.compiler.corpus.place import source_place
from dlop.compiler.corpus.records import Corpus, Item
from dlop.compiler.errors import CompileError
from dlop.compiler.output import store as output_store
from dlop.formats import ArchiveReader, StorageError
from dlop.formats import urls as formats_urls
from dlop.tools.compile_cli import main
from tests.compiler.fixtures import (
    esc50_corpus,
    librispeech_corpus,
    manifest_corpus,
    webdataset_corpus,
)


def test_urls_and_plain_paths() -> None:
    assert urls.is_url("s3://b/x") and urls.is_url("https://h/m.jsonl")
    assert not urls.is_url("/data/corpus") and not urls.is_url("file:///data/corpus")
    assert formats_urls.local_path("file:///data/corpus") == "/data/corpus"
    assert formats_urls.local_path("rel/path") == "rel/path"


def test_storage_options_parse_json_values_and_refuse_bare_words() -> None:
    got = urls.parse_storage_options(
        ["endpoint_url=http://h:9000", "anon=true", 'client_kwargs={"region_name": "x"}']
    )
    assert got == {
        "endpoint_url": "http://h:9000",
        "anon": True,
        "client_kwargs": {"region_name": "x"},
    }
    with pytest.raises(CompileError, match="expected KEY=VALUE"):
        urls.parse_storage_options(["anon"])


def test_a_missing_backend_names_the_extra() -> None:
    pytest.importorskip("fsspec")
    with contextlib.suppress(ImportError):
        import gcsfs  # noqa: F401

        pytest.skip("gcsfs is installed here")
    with pytest.raises(StorageError, match=r"pip install 'dlop\[gcs\]'"):
        source_place("gs://bucket/corpus")


def test_an_output_prefix_must_lie_apart_from_the_corpus_prefix() -> None:
    urls.check_url_apart("s3://b/archive", ["s3://b/corpus"])
    urls.check_url_apart("s3://b/corpus2", ["s3://b/corpus"])
    for out in ("s3://b/corpus", "s3://b/corpus/out", "s3://b"):
        with pytest.raises(CompileError, match="overlaps the corpus prefix"):
            urls.check_url_apart(out, ["s3://b/corpus"])


def test_a_url_place_has_no_local_meaning() -> None:
    p = source_place("s3://bucket/corpus") / "meta" / "esc50.csv"
    assert str(p) == "s3://bucket/corpus/meta/esc50.csv" and p.local is None
    assert str(p.relative_to(p.parent.parent)) == "meta/esc50.csv"
    with pytest.raises(TypeError, match="StoredPlace"):
        open(p)  # type: ignore[call-overload]  # noqa: SIM115 - the point: no local file is opened


# -- listing from S3 ---------------------------------------------------------------------


class _Counting:
    """An fsspec filesystem that counts the calls the listing makes."""

    def __init__(self, fs: Any) -> None:
        self.fs, self.calls = fs, {"info": 0, "find": 0, "cat_file": 0, "open": 0}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.fs, name)
        if name in self.calls:

            @functools.wraps(attr)
            def counted(*a: Any, **k: Any) -> Any:
                self.calls[name] += 1
                return attr(*a, **k)

            return counted
        return attr


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> list[_Counting]:
    made: list[_Counting] = []
    real = formats_urls.filesystem

    def wrapped(url: str, options: dict[str, Any] | None = None) -> tuple[Any, str]:
        fs, path = real(url, options)
        made.append(_Counting(fs))
        return made[-1], path

    monkeypatch.setattr(formats_urls, "filesystem", wrapped)
    return made


def _upload(s3: Any, local: Path, bucket: str) -> str:
    s3.reset()  # moto's buckets live in the process, past one server
    s3.make_bucket(bucket)
    fs = s3.filesystem()
    fs.put(str(local), f"{bucket}/corpus", recursive=True)
    return f"s3://{bucket}/corpus"


def _same_listing(local: Corpus, remote: Corpus, local_root: str, url: str) -> None:
    assert remote.layout == local.layout and remote.media == local.media
    assert remote.fingerprint == local.fingerprint  # sizes from the bucket listing
    assert [it.key for it in remote.items] == [it.key for it in local.items]
    assert [(it.label, it.text, it.extras, it.error) for it in remote.items] == [
        (it.label, it.text, it.extras, it.error) for it in local.items
    ]
    for a, b in zip(local.items, remote.items, strict=True):
        if a.path is not None:
            assert b.path == url + a.path[len(local_root) :]


def test_folder_layouts_list_from_s3_as_from_disk_with_one_listing(
    s3: Any, tmp_path: Path, counting: list[_Counting]
) -> None:
    root = esc50_corpus(tmp_path / "esc", [("wav", 16000, 1)] * 4 + [("flac", 8000, 2)] * 3)
    url = _upload(s3, root, "esc")
    local = open_corpus(str(root), None)
    remote = open_corpus(url, None)
    _same_listing(local, remote, str(root), url)
    calls = {name: sum(c.calls[name] for c in counting) for name in counting[0].calls}
    # detection and sizes from listings: far fewer requests than files, none per input
    assert calls["find"] + calls["info"] + calls["cat_file"] < 12, calls
    assert calls["open"] == 0


def test_librispeech_and_manifest_list_from_s3(s3: Any, tmp_path: Path) -> None:
    libri = librispeech_corpus(tmp_path / "libri")
    url = _upload(s3, libri, "libri")
    _same_listing(open_corpus(str(libri), None), open_corpus(url, None), str(libri), url)
    manifest = manifest_corpus(tmp_path / "man")
    base = _upload(s3, manifest.parent, "man")
    local = open_corpus(str(manifest), None)
    remote = open_corpus(f"{base}/train.jsonl", None)
    _same_listing(local, remote, str(manifest.parent), base)


def test_webdataset_tars_list_and_stream_from_s3(s3: Any, tmp_path: Path) -> None:
    tars = webdataset_corpus(tmp_path / "wds")
    url = _upload(s3, tars, "wds")
    local, remote = open_corpus(str(tars), None), open_corpus(url, None)
    assert remote.layout == "webdataset" and remote.fingerprint == local.fingerprint
    assert [it.key for it in remote.items] == [it.key for it in local.items]
    got = [(it.key, it.data) for it in stream_items(remote, 1, 5)]
    assert got == [(it.key, it.data) for it in stream_items(local, 1, 5)]
    assert all(data for _, data in got)
    pattern = open_corpus(f"{url}/train-{{000..001}}.tar", None)
    assert [it.key for it in pattern.items] == [it.key for it in local.items]


def test_workers_fetch_url_inputs_as_bytes(s3: Any, tmp_path: Path) -> None:
    root = esc50_corpus(tmp_path / "esc", [("wav", 16000, 1)] * 3)
    url = _upload(s3, root, "fetch")
    corpus = open_corpus(url, None)
    items = corpus.items[:]  # Items made from the listing, as a work unit carries them
    s3.filesystem().rm_file(f"fetch/corpus/audio/{Path(items[1].path or '').name}")
    urls.fetch_inputs(items, corpus.storage_options)
    local = open_corpus(str(root), None).items
    assert items[0].fetched == {items[0].path: Path(local[0].path or "").read_bytes()}
    assert items[1].fetched is None and "no such object" in (items[1].error or "")
    assert items[2].fetched is not None and items[2].error is None


def test_units_take_their_inputs_sizes_from_one_listing_of_the_bucket(
    s3: Any, tmp_path: Path, counting: list[_Counting]
) -> None:
    """An ESC-50 corpus's fingerprint is its CSV, and each unit takes its clips' sizes as it
    starts: from the listing of the clips' folder made once per compile, not once a unit
    (a unit of a large corpus would list every clip's entry to size its own)."""
    root = esc50_corpus(tmp_path / "esc", [("wav", 16000, 1)] * 6)
    url = _upload(s3, root, "units")
    counting.clear()
    argv = [url, "--unit-inputs", "1", "--workers", "1", "-q", "--duration", "0.5"]
    assert main([*argv, "-o", str(tmp_path / "out")]) == 0
    finds = sum(c.calls["find"] for c in counting)
    assert 0 < finds < 6, finds  # six units
    assert len(ArchiveReader(tmp_path / "out")) == 6


# -- the output store --------------------------------------------------------------------


def test_fsspec_store_publishes_reads_lists_and_deletes(s3: Any, tmp_path: Path) -> None:
    s3.make_bucket("out")
    store = output_store.open_store("s3://out/archive")
    assert store.read("index.json") is None and store.list() == []
    staged = store.staging() / "shard.tmp"
    staged.write_bytes(b"x" * 1000)
    store.put(staged, "units/u00000/shard-00000.dlop")
    assert not staged.exists()  # published, as a local os.replace would move it
    store.write("units/u00000.json", b"{}")
    store.write("index.json", b"[]")
    assert store.read("units/u00000/shard-00000.dlop") == b"x" * 1000
    assert store.list() == ["index.json", "units/u00000.json", "units/u00000/shard-00000.dlop"]
    assert store.list("units/u") == ["units/u00000.json", "units/u00000/shard-00000.dlop"]
    store.delete("units/u00000.json")
    store.delete("units/never-written.json")
    assert store.list("units/") == ["units/u00000/shard-00000.dlop"]
    folder = staged.parent
    (folder / "unit").mkdir()  # a unit's staging folder, emptied by its unit
    del store
    gc.collect()
    assert not folder.exists()  # no empty staging folder left behind


def test_fsspec_store_reads_small_files_within_a_cap(
    s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3.make_bucket("cap")
    store = output_store.open_store("s3://cap/a")
    store.write("index.json", b"y" * 101)
    monkeypatch.setattr(output_store, "MAX_READ_BYTES", 100)
    with pytest.raises(CompileError, match="100-byte cap"):
        store.read("index.json")


# -- HTTP: a manifest served on loopback ------------------------------------------------------


@contextlib.contextmanager
def _http_server(folder: Path) -> Iterator[str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_manifest_over_http_lists_and_its_inputs_fetch(tmp_path: Path) -> None:
    pytest.importorskip("aiohttp")
    manifest = manifest_corpus(tmp_path / "man")
    with _http_server(manifest.parent) as base:
        corpus = open_corpus(f"{base}/train.jsonl", None)
        assert corpus.layout == "manifest"
        assert [it.path for it in corpus.items] == [
            f"{base}/wav/long.wav",
            f"{base}/wav/long.wav",
            f"{base}/wav/b.flac",
        ]
        unit = corpus.items[2:]  # a unit's inputs: Items made from the listing
        urls.fetch_inputs(unit)
        assert unit[0].fetched == {unit[0].path: (manifest.parent / "wav" / "b.flac").read_bytes()}


class _Flaky:
    """An fsspec-like filesystem whose object fails in the given ways, one per open()."""

    def __init__(self, data: bytes, faults: list[str]) -> None:
        self.data, self.faults, self.opens = data, list(faults), 0

    def open(self, url: str, mode: str) -> Any:
        import io

        self.opens += 1
        fault = self.faults.pop(0) if self.faults else ""
        if fault == "reset":
            raise ConnectionResetError("connection reset by peer")
        if fault == "missing":
            raise FileNotFoundError(url)
        f = io.BytesIO(self.data[: len(self.data) // 2] if fault == "short" else self.data)
        f.size = len(self.data)  # type: ignore[attr-defined]  # what the storage says it holds
        return f


def test_an_input_read_is_tried_again_through_resets_and_short_bodies() -> None:
    from dlop.formats.storage import FetchError, FsspecStorage, Retry

    fast = Retry(attempts=4, backoff_s=0.0)
    fs = _Flaky(b"0123456789", ["reset", "short", "reset"])
    inputs = FsspecStorage(fs, None, "s3://")
    assert inputs.fetch("s3://b/x.wav", cap=urls.MAX_FETCH_BYTES, retry=fast) == b"0123456789"
    assert fs.opens == 4
    always = FsspecStorage(_Flaky(b"0123456789", ["short"] * 4), None, "s3://")
    with pytest.raises(
        Exception, match=r"s3://b/x.wav failed 4 times; last: got 5 bytes of the 10"
    ):
        always.fetch("s3://b/x.wav", cap=urls.MAX_FETCH_BYTES, retry=fast)
    # a missing object is not tried again, and the compile records it as such
    gone = _Flaky(b"", ["missing"])
    item = Item("x", path="s3://b/gone.wav")
    urls.fetch_inputs([item], None, {"s3": FsspecStorage(gone, None, "s3://")})
    assert gone.opens == 1 and item.error == "s3://b/gone.wav: no such object"
    # an object over the cap is refused at once, from the size the storage gives
    big = _Flaky(b"x" * 100, [])
    item = Item("big", path="s3://b/big.wav")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(urls, "MAX_FETCH_BYTES", 10)
        urls.fetch_inputs([item], None, {"s3": FsspecStorage(big, None, "s3://")})
    assert item.error == "s3://b/big.wav: larger than the 10-byte cap on one input read into memory"
    assert big.opens == 1
    # a store that cannot be reached is no input's fault: the unit stops, nothing recorded
    down = FsspecStorage(_Flaky(b"0123456789", ["reset"] * 4), None, "s3://")
    down.retry = fast
    item = Item("d", path="s3://b/d.wav")
    with pytest.raises(FetchError, match=r"s3://b/d.wav failed 4 times"):
        urls.fetch_inputs([item], None, {"s3": down})
    assert item.error is None and item.fetched is None


def test_a_storage_that_cannot_list_or_write_is_refused_where_it_enters() -> None:
    """An https:// OUT or prefix of inputs was taken as any other: fsspec "lists" an HTTP
    folder by scraping its page for links, and cannot write at all."""
    pytest.importorskip("aiohttp")
    from dlop.compiler.custom.compiling import read_inputs

    with pytest.raises(CompileError, match="cannot write its archive there"):
        output_store.open_store("https://example.invalid/out")
    with pytest.raises(CompileError, match=r"cannot be listed; give the inputs as a \.jsonl"):
        read_inputs("https://example.invalid/inputs/")

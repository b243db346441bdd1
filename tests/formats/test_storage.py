"""formats.storage: a local folder and an fsspec URL behave as one storage (read whole or a
range, write atomically, put, list with sizes, delete, download in chunks), and a read is
tried again through passing faults and refused when its check fails."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dlop.formats import storage
from dlop.formats.storage import FetchError, Retry, TooLargeError

FAST = Retry(attempts=3, backoff_s=0.0, max_backoff_s=0.0)


@pytest.fixture(params=["local", "fsspec", "in-memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[storage.Storage]:
    if request.param == "local":
        yield storage.open_storage(tmp_path)
        return
    if request.param == "in-memory":
        yield storage.MemoryStorage()
        return
    pytest.importorskip("fsspec")
    yield storage.open_storage(f"memory://dlop-{uuid.uuid4().hex}/archive")


def test_a_location_is_opened_as_the_storage_it_names(tmp_path: Path) -> None:
    assert isinstance(storage.open_storage(tmp_path), storage.LocalStorage)
    local = storage.open_storage(f"file://{tmp_path}")
    assert isinstance(local, storage.LocalStorage) and local.root == tmp_path
    pytest.importorskip("fsspec")
    remote = storage.open_storage("memory://b/archive")
    assert isinstance(remote, storage.FsspecStorage) and remote.lists and remote.writes
    assert remote.name_url("index.json") == "memory://b/archive/index.json"
    whole = storage.open_storage("memory://b", whole_urls=True)
    assert whole.name_url("memory://b/x/y.wav") == "memory://b/x/y.wav"
    pytest.importorskip("aiohttp")
    http = storage.open_storage("https://example.invalid/a")
    assert not http.lists and not http.writes  # stated, not found out by a failure


def test_write_read_list_delete(store: storage.Storage, tmp_path: Path) -> None:
    store.write("index.json", b"{}")
    store.write("shard-00000.dlop", b"0123456789")
    assert store.fetch("index.json") == b"{}"
    assert store.fetch_range("shard-00000.dlop", 2, 5) == b"234"
    assert store.fetch_range("index.json", 0, 100, exact=False) == b"{}"
    with pytest.raises(FetchError, match="got 2 bytes"):
        store.fetch_range("index.json", 0, 100, retry=FAST)  # exactly 100 asked
    assert store.sizes() == {"index.json": 2, "shard-00000.dlop": 10}
    assert store.sizes("shard-") == {"shard-00000.dlop": 10}
    local = tmp_path / "staged.bin"
    local.write_bytes(b"x" * 300)
    store.put(local, "shard-00001.dlop")
    assert not local.exists() and store.sizes()["shard-00001.dlop"] == 300
    store.delete("index.json")
    store.delete("never-written")
    assert sorted(store.sizes()) == ["shard-00000.dlop", "shard-00001.dlop"]
    with pytest.raises(FetchError) as missing:
        store.fetch("index.json", retry=FAST)
    assert isinstance(missing.value.cause, FileNotFoundError)


def test_a_cap_refuses_a_larger_object_at_once(store: storage.Storage) -> None:
    store.write("big", b"y" * 101)
    assert store.fetch("big", cap=101) == b"y" * 101
    with pytest.raises(TooLargeError, match="100-byte cap"):
        store.fetch("big", cap=100)


def test_download_copies_in_chunks_up_to_a_limit(
    store: storage.Storage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.write("shard", bytes(range(256)) * 4)
    asked: list[int] = []
    real = store.open_read

    def counting(name: str) -> Any:
        f = real(name)
        read = f.read
        f.read = lambda n=-1: (asked.append(n), read(n))[1]  # type: ignore[method-assign]
        return f

    monkeypatch.setattr(store, "open_read", counting)
    target = tmp_path / "copy"
    assert store.download("shard", target, 1025, chunk=100) == 1024
    assert target.read_bytes() == bytes(range(256)) * 4 and max(asked) == 100
    assert store.download("shard", target, 10) == 10 and target.read_bytes() == bytes(range(10))


class Flaky(storage.LocalStorage):
    """Fails the first ``fail`` reads, then returns short bodies ``short`` times."""

    def __init__(self, root: Path, fail: int, short: int) -> None:
        super().__init__(root)
        self.fail, self.short, self.tries = fail, short, 0

    def read_once(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        self.tries += 1
        if self.fail:
            self.fail -= 1
            raise ConnectionResetError("reset by peer")
        data = super().read_once(name, start, end)
        if self.short:
            self.short -= 1
            return data[:-1]
        return data


def test_a_read_is_tried_again_until_its_check_passes(tmp_path: Path) -> None:
    (tmp_path / "s").write_bytes(b"abcdef")
    flaky = Flaky(tmp_path, fail=1, short=1)
    check = storage.checker(6, storage.crc_of(b"abcdef"))
    assert flaky.fetch("s", check, retry=FAST) == b"abcdef" and flaky.tries == 3
    always = Flaky(tmp_path, fail=0, short=99)
    with pytest.raises(FetchError, match=r"failed 3 times; last: got 5 bytes"):
        always.fetch("s", check, retry=FAST)


def test_ranged_parts_are_run_by_the_callers_map(tmp_path: Path) -> None:
    data = bytes(range(256)) * 40
    (tmp_path / "s").write_bytes(data)
    spans: list[tuple[int, int]] = []

    def in_order(read: Any, parts: Any) -> list[bytes]:
        parts = list(parts)
        spans.extend(parts)
        return [read(p) for p in parts]

    parts = Retry(part_bytes=4096)
    got = storage.LocalStorage(tmp_path).fetch("s", size=len(data), retry=parts, map_parts=in_order)
    assert got == data and spans == [(0, 4096), (4096, 8192), (8192, 10240)]

"""Storage.read_chunks: one request for a byte range, handed on in order a chunk at a
time on every storage; over S3 (moto on loopback, through the fault proxy) as the body
arrives, with a server that ignores Range, a cut body and a stalled one each ending
the read with an error, never with wrong or extra bytes."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlop.formats import storage
from dlop.formats.storage import RangeIgnored
from tests.faultproxy import FaultProxy

DATA = np.random.default_rng(11).integers(0, 256, (1 << 20) + 77, dtype=np.uint8).tobytes()
CHUNK = 64 << 10


@pytest.fixture(params=["local", "in-memory", "fsspec", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[storage.Storage]:
    if request.param == "local":
        yield storage.open_storage(tmp_path)
    elif request.param == "in-memory":
        yield storage.MemoryStorage()
    elif request.param == "fsspec":
        pytest.importorskip("fsspec")
        yield storage.open_storage(f"memory://dlop-{uuid.uuid4().hex}/archive")
    else:
        request.getfixturevalue("s3").make_bucket("chunks")
        yield storage.open_storage("s3://chunks/a")


def joined(chunks: Iterator[bytes | memoryview]) -> bytes:
    return b"".join(bytes(c) for c in chunks)


def test_a_range_is_handed_on_in_order_a_chunk_at_a_time(store: storage.Storage) -> None:
    store.write("obj", DATA)
    got = [bytes(c) for c in store.read_chunks("obj", 100, len(DATA) - 5, CHUNK)]
    assert b"".join(got) == DATA[100:-5]
    assert all(0 < len(c) <= CHUNK for c in got) and len(got) >= len(DATA) // CHUNK
    # an object that ends first: the bytes it holds, no more
    assert joined(store.read_chunks("obj", len(DATA) - 10, len(DATA) + 50, 4)) == DATA[-10:]
    # stopped after one chunk, the storage reads on as before
    first = store.read_chunks("obj", 0, len(DATA), CHUNK)
    assert bytes(next(first)) == DATA[:CHUNK]
    first.close()
    assert joined(store.read_chunks("obj", 7, 70_000, CHUNK)) == DATA[7:70_000]


@pytest.fixture
def proxied(s3: Any) -> Iterator[tuple[FaultProxy, storage.Storage]]:
    s3.make_bucket("chunks")
    storage.open_storage("s3://chunks/a").write("obj", DATA)
    with FaultProxy(upstream=s3.endpoint) as proxy:
        yield proxy, storage.open_storage("s3://chunks/a", {"endpoint_url": proxy.url})


@pytest.mark.parametrize("fault", ["stall", "truncate"])
def test_over_s3_chunks_come_as_the_body_arrives(
    proxied: tuple[FaultProxy, storage.Storage], monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """A body that stalls halfway (or is cut off there): the chunks before are handed on
    as they came (a read whole would hand on none), then the read timeout (the cut)
    ends the read with an error, never with wrong bytes or a silent short range."""
    monkeypatch.setenv("DLOP_READ_TIMEOUT", "1")
    proxy, _ = proxied
    store = storage.open_storage("s3://chunks/a", {"endpoint_url": proxy.url})
    proxy.fail("obj", fault)
    got: list[bytes] = []
    with pytest.raises(Exception) as caught:  # the client's own type
        for c in store.read_chunks("obj", 0, len(DATA), CHUNK):
            got.append(bytes(c))
    assert not isinstance(caught.value, RangeIgnored)
    had = b"".join(got)
    assert had == DATA[: len(had)] and len(had) <= len(DATA) // 2
    if fault == "stall":  # all that came before the stall
        assert len(had) >= len(DATA) // 2 - CHUNK


def test_over_s3_a_server_ignoring_range_is_named_before_its_body_is_read(
    proxied: tuple[FaultProxy, storage.Storage],
) -> None:
    proxy, store = proxied
    proxy.fail("obj", "norange")
    chunks = store.read_chunks("obj", 10, 20, CHUNK)
    with pytest.raises(RangeIgnored, match=r"asked for bytes 10\.\.20 \(10 bytes\)"):
        next(chunks)
    assert joined(store.read_chunks("obj", 10, 20, CHUNK)) == DATA[10:20]

"""A Loader closed while a shard's fetch is stalled, then read again: close() returns
without waiting for the stalled request, and the next epoch reads every sample, neither
failing with the close nor kept from a shard that the request begun before it brings
in (or fails to) after the close."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dlop.runtime import Loader, LoaderError
from tests.faultproxy import FaultProxy
from tests.runtime.helpers import make_archive, open_remote

SAMPLES = 37  # make_archive's


def labels(loader: Loader) -> list[int]:
    return [int(x) for b in loader for x in b["label"]]


def first_batch(loader: Loader, got: list[Any]) -> threading.Thread:
    """Asks for the first batch on a thread of its own; its batch or error goes to ``got``."""

    def ask() -> None:
        try:
            got.append(next(iter(loader)))
        except Exception as e:
            got.append(e)

    t = threading.Thread(target=ask)
    t.start()
    return t


def asked(proxy: FaultProxy, match: str, n: int = 1) -> None:
    deadline = time.monotonic() + 60
    while proxy.count(match) < n:
        assert time.monotonic() < deadline, f"{match} was never asked for"
        time.sleep(0.01)


def closed_mid_fetch(proxy: FaultProxy, loader: Loader) -> None:
    """Closes ``loader`` while its first batch waits for shard 0's stalled request, which
    close() must leave to itself."""
    got: list[Any] = []
    before = proxy.count("shard-00000")
    t = first_batch(loader, got)
    asked(proxy, "shard-00000", before + 1)
    loader.close()
    t.join(60)
    assert not t.is_alive()
    assert isinstance(got[0], LoaderError), got[0]


def closed_while_hung(tmp_path: Path, proxy: FaultProxy, requests: int) -> Loader:
    """A Loader of ``tmp_path / "a"``, closed while its first batch waits for shard 0,
    whose first ``requests`` requests are never answered."""
    proxy.fail("shard-00000", "hang", times=requests)
    loader = Loader(proxy.url + "/a", 4, shuffle=False, cache_dir=str(tmp_path / "c"))
    closed_mid_fetch(proxy, loader)
    return loader


def nothing_arriving(cache: Path) -> bool:
    return not [p for p in cache.rglob("*") if ".tmp-" in p.name]


def test_a_fetch_that_ends_after_close_does_not_hold_it_up_or_fail_the_next_read(
    tmp_path: Path,
) -> None:
    make_archive(tmp_path / "a")
    with FaultProxy(root=tmp_path) as proxy:
        for attempt in range(3):  # the next epoch meets the fetch at other moments
            proxy.fail("shard-00000", "hold")  # answered whole once let through
            proxy.through.clear()
            # a regression (close waiting for the request) fails below, never hangs
            safety = threading.Timer(30, proxy.let_through)
            safety.start()
            cache = tmp_path / f"c{attempt}"
            loader = Loader(proxy.url + "/a", 4, shuffle=False, cache_dir=str(cache))
            closed_mid_fetch(proxy, loader)
            still_held = not proxy.through.is_set()
            safety.cancel()
            assert still_held, "close() waited for the stalled request"
            # The request ends now, with the next epoch under way or about to be: what
            # its fetch brings in is let go of, and the next epoch fetches it anew.
            release = threading.Timer(0.1 * attempt, proxy.let_through)
            release.start()
            assert labels(loader) == list(range(SAMPLES))
            assert labels(loader) == list(range(SAMPLES))  # and the one after it
            loader.close()
            release.join()  # let through before the next attempt holds again
            assert nothing_arriving(cache)


@pytest.mark.parametrize(
    ("read_timeout", "requests"),
    [("2", 2), ("3600", 1)],
    ids=["fails with the close after it", "waits for a range close stopped"],
)
def test_a_fetch_stalled_at_close_neither_fails_nor_holds_up_the_next_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read_timeout: str, requests: int
) -> None:
    # Shard 0's first request (a range asked for before its header) never answers.
    # - With a second one too (its header, which the fetch reads itself once close
    #   stopped that range) and a 2 s read timeout, the fetch fails with the close
    #   after it: no failure of the shard.
    # - Alone, with reads that wait an hour for a byte: the fetch waits for that range
    #   no longer once close stopped it (else a minute), nor does the next read.
    monkeypatch.setenv("DLOP_READ_TIMEOUT", read_timeout)
    make_archive(tmp_path / "a")
    with FaultProxy(root=tmp_path) as proxy:
        loader = closed_while_hung(tmp_path, proxy, requests)
        got: list[Any] = []
        epoch = threading.Thread(target=lambda: got.append(labels(loader)), daemon=True)
        epoch.start()
        epoch.join(30)  # a hang detector
        assert got == [list(range(SAMPLES))]
        loader.close()
    assert nothing_arriving(tmp_path / "c")


@pytest.mark.parametrize("delay", [0.0, 0.1, 0.2])
def test_a_read_waiting_behind_a_fetch_ahead_at_close_leaves_the_next_read_alone(
    tmp_path: Path, delay: float
) -> None:
    """A batch's read of shard 0 waits behind the fetch ahead of it when close() comes;
    a read after close asks for shard 0 again. Once the requests go on, the read begun
    before close ends with the close and never lets go of the next read's shard."""
    make_archive(tmp_path / "a")
    with FaultProxy(root=tmp_path) as proxy:
        supply = open_remote(proxy.url + "/a", cache_dir=tmp_path / "c").supply
        assert supply.streams_shard(0)
        proxy.fail("shard-00000", "hold", times=None)
        got: dict[str, Any] = {}

        def run(name: str, call: Any) -> threading.Thread:
            def go() -> None:
                try:
                    got[name] = call()
                except Exception as e:
                    got[name] = e

            t = threading.Thread(target=go, daemon=True)
            t.start()
            return t

        ahead = run("ahead", lambda: supply.stream(0, False, supply.stopping))
        asked(proxy, "shard-00000")
        before = run("before", lambda: supply.load(0))
        time.sleep(0.2)  # (waiting behind the fetch ahead, or about to)
        supply.close()
        supply.ask([0])  # the next read
        time.sleep(delay)
        proxy.let_through()
        reader = supply.shard(0)
        ahead.join(30)
        before.join(30)
        assert isinstance(got["before"], LoaderError), got["before"]
        supply.check([0])
        assert supply.mapping(0) is not None and supply.mapping(0)[0] is reader  # type: ignore[index]
        supply.release([0])
        supply.close()
    assert nothing_arriving(tmp_path / "c")

"""The retry window a fetch rides out by default: tens of seconds of back-off, stated in
formats.storage, changed by the environment; a short outage is survived."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

import pytest

from dlop.formats import StorageError
from dlop.formats.storage import ATTEMPTS, MAX_BACKOFF_S, FetchError, Retry, retrying

SHOW = """
import json
from dlop.formats.storage import DEFAULT_RETRY as r
sleeps = [min(r.max_backoff_s, r.backoff_s * 2**a) for a in range(r.attempts - 1)]
print(json.dumps([r.attempts, sum(sleeps)]))
"""


def defaults(**env: str) -> list[float]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DLOP_FETCH_")}
    out = subprocess.run(
        [sys.executable, "-c", SHOW], env={**clean, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout))


def test_a_fetch_rides_out_tens_of_seconds_by_default() -> None:
    attempts, backoff = defaults()
    assert attempts == 8 and backoff == pytest.approx(25.75)  # 13 to 39 s with jitter
    assert defaults(DLOP_FETCH_ATTEMPTS="3", DLOP_FETCH_MAX_BACKOFF="0.5") == [3, 0.75]


def test_a_bad_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in [
        ("DLOP_FETCH_ATTEMPTS", "0"),
        ("DLOP_FETCH_ATTEMPTS", "2.5"),
        ("DLOP_FETCH_MAX_BACKOFF", "-1"),
        ("DLOP_FETCH_MAX_BACKOFF", "soon"),
    ]:
        monkeypatch.setenv(name, value)
        with pytest.raises(StorageError, match=name):
            Retry()
        monkeypatch.delenv(name)


def test_an_outage_shorter_than_the_window_is_survived() -> None:
    slept: list[float] = []

    def retry() -> Retry:  # the defaults, sleeping on a clock of our own
        return Retry(attempts=ATTEMPTS, max_backoff_s=MAX_BACKOFF_S, sleep=slept.append)

    outage = 6.0  # seconds the endpoint refuses every request

    def once() -> bytes:
        if sum(slept) < outage:
            raise ConnectionResetError("the endpoint is down")
        return b"ok"

    assert retrying(once, "shard 0", "s3://b/a/shard-00000.dlop", retry()) == b"ok"

    # 25 SlowDown answers spread over 4 fetches: each fetch meets 6 or 7 in a row
    def throttled(failures: int) -> Callable[[], bytes]:
        left = iter(range(failures))

        def once() -> bytes:
            if next(left, None) is not None:
                raise OSError("503 SlowDown")
            return b"ok"

        return once

    for burst in (7, 6, 6, 6):
        assert retrying(throttled(burst), "shard 0", "s3://b/a/s.dlop", retry()) == b"ok"
    with pytest.raises(FetchError, match=f"failed {ATTEMPTS} times"):  # more: named
        retrying(throttled(ATTEMPTS), "shard 0", "s3://b/a/s.dlop", retry())

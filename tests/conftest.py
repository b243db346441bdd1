import os
import signal

import pytest

# Tests run on CPUs with few cores; keep torch from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", "2")
# Fetches that fail for good (the fault tests') give up after short back-offs, not the
# half minute a job rides out by default (formats.storage.Retry; tested in
# tests/formats/test_storage_retry.py without these).
os.environ.setdefault("DLOP_FETCH_ATTEMPTS", "6")
os.environ.setdefault("DLOP_FETCH_MAX_BACKOFF", "0.05")
# The Ctrl-C tests send SIGINT to dlop processes as a terminal would. A suite started as a
# background job by a shell without job control inherits SIGINT ignored, and so would
# every process it starts; the suite takes it back, so they meet a terminal's Ctrl-C.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def _s3_server():  # type: ignore[no-untyped-def]
    """One moto server for the session (starting one costs about half a second); each
    test that asks for ``s3`` gets it emptied, with the environment pointing at it."""
    pytest.importorskip("moto")
    from tests.objectstore import s3_server

    saved = dict(os.environ)
    with s3_server() as server:
        os.environ.clear()  # the server's variables go to each test through monkeypatch
        os.environ.update(saved)
        yield server


@pytest.fixture
def s3(_s3_server, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """S3 over HTTP on loopback (tests/objectstore.py), empty; the environment points at it."""
    _s3_server.reset()
    for name, value in _s3_server.environ.items():
        monkeypatch.setenv(name, value)
    return _s3_server


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Points this process's S3 clients at an endpoint of the test's own (a fault proxy, a
    closed port): ``s3_env(url)``. Skips where s3fs is not installed."""
    pytest.importorskip("s3fs")
    from dlop.tools.bench.remote_bench import moto_environ

    def point(endpoint: str) -> None:
        for name, value in moto_environ(endpoint).items():
            monkeypatch.setenv(name, value)

    return point


@pytest.fixture
def malloc_env() -> dict[str, str]:
    """This process's environment without anything that sets or replaces malloc (dlop's
    opt-out, glibc's variables and tunables, a preloaded allocator): for subprocesses
    that test dlop.formats.heap."""
    drop = ("MALLOC_", "DLOP_MALLOC", "GLIBC_TUNABLES", "LD_PRELOAD")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}

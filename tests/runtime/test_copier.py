"""The copy engine: compiled byte-run copies (plain and streaming), the torch/ctypes
fallback, pipelined plans on helper threads, errors at wait, fork safety, and
the Loader and Dataset giving identical batches either way."""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dlop.formats import ArchiveWriter, Field
from dlop.runtime import Loader, LoaderError, open_archive
from dlop.runtime.gather import engine as engine_module
from dlop.runtime.gather.engine import CopyEngine, compiled
from dlop.runtime.gather.plan import CopyPlan, Rows, RowTable, Runs
from dlop.runtime.gather.threads import HELPER_NICE

from .test_loader import run_epoch

needs_native = pytest.mark.skipif(compiled() is None, reason="compiled copier not built")


def _runs(rng: np.random.Generator, sizes: list[int]) -> tuple[np.ndarray, np.ndarray, list[Any]]:
    """A source and a destination with runs at odd offsets; returns (src, dst, [(d, s, n)])."""
    total = sum(sizes) + 64 * len(sizes) + 64
    src = rng.integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros(total + 64, dtype=np.uint8)
    runs, s_at, d_at = [], 0, 1  # destinations start unaligned
    for n in sizes:
        s_at += int(rng.integers(0, 64))
        runs.append((d_at, s_at, n))
        s_at += n
        d_at += n + 3 + int(rng.integers(0, 61))  # gaps that must stay untouched
    return src, dst, runs


def test_compiled_copier_is_built_where_a_compiler_is() -> None:
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here: the fallback copies serve")
    assert engine_module.built(), "runtime/gather/_copy.c was not built at install"


@needs_native
@pytest.mark.parametrize("streaming", [False, True])
def test_copy_runs_copies_exactly_the_runs(streaming: bool) -> None:
    rng = np.random.default_rng(0)
    sizes = [0, 1, 15, 63, 64, 65, 255, 256, 257, 4095, 4097, 65_536 + 7, 110_336]
    src, dst, runs = _runs(rng, sizes)
    expected = dst.copy()
    for d, s, n in runs:
        expected[d : d + n] = src[s : s + n]
    d_addr = np.array([dst.ctypes.data + d for d, _, _ in runs], np.int64)
    s_addr = np.array([src.ctypes.data + s for _, s, _ in runs], np.int64)
    nbytes = np.array([n for *_, n in runs], np.int64)
    lib = compiled()
    assert lib is not None
    lib.copy_runs(d_addr.ctypes.data, s_addr.ctypes.data, nbytes.ctypes.data, len(runs), streaming)
    np.testing.assert_array_equal(dst, expected)
    with pytest.raises(ValueError, match="count must be 0 or more"):
        lib.copy_runs(0, 0, 0, -1, streaming)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("streaming", [False, True])
def test_copy_rows_gathers_checked_rows_from_a_table(
    monkeypatch: pytest.MonkeyPatch, native: bool, streaming: bool
) -> None:
    """One Rows step reads rows of any of its table's sources, compiled or not; a row or
    source number out of range is refused before anything is copied."""
    if native and compiled() is None:
        pytest.skip("compiled copier not built")
    if not native:
        monkeypatch.setenv("DLOP_NATIVE_COPY", "0")
    rng = np.random.default_rng(3)
    whole = rng.integers(0, 256, (40, 5000), dtype=np.uint8)  # rows of 5000 bytes
    cut = [0, 13, 14, 40]  # three sources of 13, 1 and 26 rows
    sources = [torch.from_numpy(whole[a:b]) for a, b in itertools.pairwise(cut)]
    table = RowTable(sources, 5000)
    picked = np.array([39, 0, 7, 7, 21, 38, 13, 1, 0, 12, 30], np.int64)  # rows of whole
    shards = (np.searchsorted(cut, picked, side="right") - 1).astype(np.int64)
    rows = picked - np.asarray(cut)[shards]
    c = CopyEngine(threads=2, streaming=streaming)
    try:
        for sl in (slice(None), slice(0, 1), slice(0, 0)):
            for tiled in (1, 30):  # one share and two
                take, sh, ro = (np.tile(a[sl], tiled) for a in (picked, shards, rows))
                out = torch.zeros((len(take) + 1) * 5000, dtype=torch.uint8)
                c.run(CopyPlan([Rows(out[: len(take) * 5000], table, sh, ro)]))
                got = out.numpy().reshape(-1, 5000)
                np.testing.assert_array_equal(got[: len(take)], whole[take])
                assert not got[len(take) :].any()  # nothing past the last row
        alone = RowTable(sources[:1], 5000)  # shards None: every row from source 0
        out = torch.zeros(2 * 5000, dtype=torch.uint8)
        c.run(CopyPlan([Rows(out, alone, None, np.array([12, 3], np.int64))]))
        np.testing.assert_array_equal(out.numpy().reshape(2, 5000), whole[[12, 3]])
        out = torch.zeros(3 * 5000, dtype=torch.uint8)
        for sh, ro, message in (
            ([0, 2, 1], [0, 26, 0], r"row 26 out of range 0\.\.25 of table 2"),
            ([0, 1, 0], [-1, 0, 3], r"row -1 out of range 0\.\.12 of table 0"),
            ([0, 3, 0], [0, 0, 0], r"table 3 out of range 0\.\.2"),
            ([-1, 0, 0], [0, 0, 0], r"table -1 out of range"),
        ):
            step = Rows(out, table, np.array(sh, np.int64), np.array(ro, np.int64))
            with pytest.raises(IndexError, match=message):
                c.run(CopyPlan([step]))
            assert not out.any()  # checked before anything is copied
    finally:
        c.close()


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="no per-thread priority here")
@pytest.mark.parametrize("nice", [None, "0"])
def test_helpers_yield_the_cpu(monkeypatch: pytest.MonkeyPatch, nice: str | None) -> None:
    if nice is not None:
        monkeypatch.setenv("DLOP_COPY_NICE", nice)
    c = CopyEngine(threads=2)
    src = torch.zeros(4 << 20, dtype=torch.uint8)
    try:
        table = RowTable([src.view(-1, 1 << 16)], 1 << 16)
        c.run(CopyPlan([Rows(torch.empty_like(src), table, None, np.arange(64))]))
        (helper,) = c.helpers()  # the calling thread took one share, a helper the other
        base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert helper.native_id is not None
        got = os.getpriority(os.PRIO_PROCESS, helper.native_id)
    finally:
        c.close()
    expected = base if nice == "0" else min(19, base + HELPER_NICE)
    assert got == expected


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("streaming", [False, True])
def test_copier_spreads_runs_over_threads(
    monkeypatch: pytest.MonkeyPatch, compiled: bool, streaming: bool
) -> None:
    if compiled and engine_module.compiled() is None:
        pytest.skip("compiled copier not built")
    if not compiled:
        monkeypatch.setenv("DLOP_NATIVE_COPY", "0")
    rng = np.random.default_rng(1)
    sizes = [int(x) for x in rng.integers(1, 300_000, 60)]  # above the streaming minimum
    src, dst, runs = _runs(rng, sizes)
    expected = dst.copy()
    for d, s, n in runs:
        expected[d : d + n] = src[s : s + n]
    c = CopyEngine(threads=2, streaming=streaming)
    out = torch.from_numpy(dst)
    try:
        c.run(
            CopyPlan(
                [
                    Runs(
                        out,
                        np.array([d for d, _, _ in runs], np.int64),
                        np.array([src.ctypes.data + s for _, s, _ in runs], np.int64),
                        np.array([n for *_, n in runs], np.int64),
                        (src,),
                    )
                ]
            )
        )
        assert len(c.helpers()) == 1  # the runs were spread over two threads
    finally:
        c.close()
    np.testing.assert_array_equal(dst, expected)


def _tagged_plan(tags: dict[int, tuple[int, int]], batch: int) -> CopyPlan:
    """A plan of two equal steps, one per share, each tagged (batch, part); large
    enough to go to the helpers (INLINE_MAX_BYTES)."""
    row = engine_module.INLINE_MAX_BYTES
    table = RowTable([torch.zeros(1, row, dtype=torch.uint8)], row)
    steps = []
    for part in (0, 1):
        step = Rows(torch.empty(row, dtype=torch.uint8), table, None, np.zeros(1, np.int64))
        tags[id(step)] = (batch, part)
        steps.append(step)
    return CopyPlan(steps)


def test_started_plans_run_in_order_and_errors_surface_at_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c = CopyEngine(threads=2)
    log: list[tuple[int, int]] = []
    tags: dict[int, tuple[int, int]] = {}
    lock = threading.Lock()

    def execute(step: Any, streaming: bool) -> None:
        batch, part = tags[id(step)]
        if (batch, part) == (1, 0):
            raise RuntimeError("copy failed")
        with lock:
            log.append((batch, part))

    monkeypatch.setattr(engine_module, "execute_step", execute)
    try:
        first = c.start(_tagged_plan(tags, 0))
        second = c.start(_tagged_plan(tags, 1))
        first.wait()
        with pytest.raises(RuntimeError, match="copy failed"):
            second.wait()
        assert (1, 1) in log  # the other share still ran to its end
        for part in (0, 1):  # each helper ran its share of plan 0 before plan 1's
            order = [b for b, p in log if p == part]
            assert order == sorted(order)
        c.run(_tagged_plan(tags, 2))  # still usable after the error
        assert sorted(log[-2:]) == [(2, 0), (2, 1)]
    finally:
        c.close()
    assert not c.helpers()


def _use_after_fork(c: CopyEngine, out: Any) -> None:
    # numpy-made tensors: torch's own parallel kernels can hang in a forked child
    src = np.arange(4 << 20, dtype=np.int64).astype(np.uint8)
    dst = np.zeros_like(src)
    table = RowTable([torch.from_numpy(src).view(-1, 1 << 16)], 1 << 16)
    c.run(CopyPlan([Rows(torch.from_numpy(dst), table, None, np.arange(64))]))
    out.put([len(c.helpers()), bool(np.array_equal(dst, src))])


def test_a_forked_child_uses_the_engine_with_threads_of_its_own() -> None:
    c = CopyEngine(threads=2)
    src = torch.zeros(4 << 20, dtype=torch.uint8)
    table = RowTable([src.view(-1, 1 << 16)], 1 << 16)
    c.run(CopyPlan([Rows(torch.empty_like(src), table, None, np.arange(64))]))
    assert len(c.helpers()) == 1  # a helper exists in the parent
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_use_after_fork, args=(c, out))
    child.start()
    child.join(timeout=60)
    try:
        assert child.exitcode == 0 and out.get(timeout=5) == [1, True]
    finally:
        if child.is_alive():
            child.kill()
        c.close()


@pytest.fixture(scope="module")
def big_rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rows large enough for the row-copy path (16 KiB), over several shards."""
    path = tmp_path_factory.mktemp("copier") / "a"
    rng = np.random.default_rng(2)
    fields = [
        Field("x", "f32", (64, 64)),
        Field("label", "i64", ()),
        Field("speech", "f16", (None, 80)),
    ]
    with ArchiveWriter(path, fields, shard_bytes=200_000) as w:
        for i in range(57):
            w.write(
                {
                    "x": rng.normal(size=(64, 64)).astype(np.float32),
                    "label": i,
                    "speech": rng.normal(size=(1 + (i * 37) % 300, 80)).astype(np.float16),
                }
            )
    return path


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_loader_and_getitems_agree_with_and_without_the_compiled_copier(
    monkeypatch: pytest.MonkeyPatch, big_rows: Path, prefetch: int
) -> None:
    ds = open_archive(big_rows)
    assert len(ds.shards) > 3
    expected = [ds[i] for i in range(len(ds))]
    results = []
    for setting in ("1", "0"):
        monkeypatch.setenv("DLOP_NATIVE_COPY", setting)
        batches = run_epoch(Loader(ds, 8, seed=5, prefetch=prefetch))
        for b in batches:
            for j, label in enumerate(b["label"].tolist()):
                assert torch.equal(b["x"][j], expected[label]["x"])
                n = int(b["speech_lengths"][j])
                assert torch.equal(b["speech"][j, :n], expected[label]["speech"])
                assert not b["speech"][j, n:].any()
        picked = [50, 3, 17, 17, 0, 56]
        got = ds.__getitems__(picked)
        for j, i in enumerate(picked):
            assert torch.equal(got["x"][j], expected[i]["x"])
        results.append(batches)
    assert len(results[0]) == len(results[1])
    for a, b in zip(*results, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_gather_thread_is_kept_across_epochs_and_stopped_by_close(big_rows: Path) -> None:
    loader = Loader(big_rows, 8, seed=0)
    workers = set()
    for epoch in range(5):
        loader.set_epoch(epoch)
        assert sum(len(b["label"]) for b in loader) == 57
        workers.add(loader.threads().producer)
    helpers = loader.threads().helpers
    assert len(workers) == 1 and helpers
    it = iter(loader)
    next(it)  # abandon an epoch midway: the next one starts cleanly
    assert sum(len(b["label"]) for b in loader) == 57
    assert {loader.threads().producer} == workers
    loader.close()
    assert not any(t.is_alive() for t in [*workers, *helpers])


def test_exit_in_the_middle_of_an_epoch_is_clean(big_rows: Path) -> None:
    script = textwrap.dedent(
        f"""
        from dlop.runtime import Loader, LoaderError, open_archive
        ds = open_archive({str(big_rows)!r})
        loaders = [Loader(ds, 8, seed=s) for s in range(3)]
        for loader in loaders:
            for i, batch in enumerate(loader):
                if i == 2:
                    break
        ds.__getitems__([1, 2, 3])
        """
    )
    for _ in range(3):  # exit-time thread teardown failures are intermittent
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-2000:]


def test_a_copy_failing_on_a_helper_reaches_the_loop(
    monkeypatch: pytest.MonkeyPatch, big_rows: Path
) -> None:
    calls = {"n": 0}
    real = engine_module.execute_step

    def flaky(*args: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("simulated copy failure")
        real(*args)

    loader = Loader(big_rows, 8, seed=0)
    monkeypatch.setattr(engine_module, "execute_step", flaky)
    with pytest.raises(LoaderError, match=r"gathering batch \d+ of epoch 0 failed: OSError"):
        for _ in loader:
            pass
    monkeypatch.setattr(engine_module, "execute_step", real)
    assert sum(len(b["label"]) for b in loader) == 57  # the next epoch runs cleanly
    loader.close()


def test_a_loader_dropped_mid_epoch_stops_its_threads(big_rows: Path) -> None:
    loader = Loader(big_rows, 8, seed=0)
    for i, _ in enumerate(loader):
        if i == 1:
            break  # the iterator is dropped here, mid-epoch
    threads = [loader.threads().producer, *loader.threads().helpers]
    assert all(t is not None and t.is_alive() for t in threads)
    del loader
    gc.collect()
    for t in threads:
        assert t is not None
        t.join(timeout=10)
        assert not t.is_alive()


def test_the_calling_threads_own_copy_error_is_the_one_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caller = threading.current_thread()

    def failing(*args: Any) -> None:
        if threading.current_thread() is caller:
            raise ValueError("the caller's share failed")
        raise OSError("a helper's share failed too")

    monkeypatch.setattr(engine_module, "execute_step", failing)
    c = CopyEngine(threads=2)
    src = torch.zeros(4 << 20, dtype=torch.uint8)
    table = RowTable([src.view(-1, 1 << 16)], 1 << 16)
    try:
        with pytest.raises(ValueError, match="the caller's share failed"):
            c.run(CopyPlan([Rows(torch.empty_like(src), table, None, np.arange(64))]))
        assert len(c.helpers()) == 1  # a helper took the other share
    finally:
        c.close()


_FAULT = textwrap.dedent(
    """
    import ctypes, mmap, os, sys, tempfile
    import numpy as np
    from dlop.runtime.gather import _copy

    path = os.path.join(tempfile.mkdtemp(), "shard")
    with open(path, "wb") as f:
        f.write(bytes(range(256)) * 64)  # 4 pages
    fd = os.open(path, os.O_RDONLY)
    view = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    src_base = np.frombuffer(view, np.uint8).ctypes.data
    os.truncate(path, 4096)  # the file shrinks to one page under its mapping
    dst = np.zeros(16384, np.uint8)
    for streaming in (False, True):
        try:
            runs = [np.array(v, np.int64) for v in ([dst.ctypes.data], [src_base], [16384])]
            _copy.copy_runs(runs[0].ctypes.data, runs[1].ctypes.data, runs[2].ctypes.data,
                            1, streaming)
        except _copy.MappingFault as e:
            print("runs", streaming, "caught:", e)
        rows, bases, nums = (np.array(v, np.int64) for v in ([0, 3], [src_base], [4]))
        try:
            _copy.copy_rows(dst.ctypes.data, bases.ctypes.data, nums.ctypes.data, 1, 0,
                            rows.ctypes.data, 2, 4096, streaming)
        except _copy.MappingFault as e:
            print("rows", streaming, "caught:", e)
    sys.stdout.flush()
    if sys.argv[1] == "outside":  # a fault outside a copy still ends the process
        ctypes.string_at(src_base + 8192, 16)
    print("done")
    """
)


@needs_native
@pytest.mark.parametrize("then", ["stop", "outside"])
def test_a_shard_that_shrinks_under_a_copy_is_an_error_not_a_crash(then: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _FAULT, then], capture_output=True, text=True, timeout=60
    )
    caught = [line for line in proc.stdout.splitlines() if "caught:" in line]
    assert len(caught) == 4, proc.stdout + proc.stderr
    assert all("(SIGBUS): the file shrank under its mapping" in line for line in caught)
    if then == "stop":
        assert proc.returncode == 0 and proc.stdout.endswith("done\n")
    else:
        assert proc.returncode == -7 and "done" not in proc.stdout  # SIGBUS, as before


def test_a_shard_truncated_after_its_check_raises_shard_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if compiled() is None:
        pytest.skip("compiled copier not built")
    from dlop.runtime import ShardChangedError
    from dlop.runtime.storage.supply import LocalSupply

    with ArchiveWriter(tmp_path / "a", [Field("x", "u8", (8192,))], shard_bytes=1 << 20) as w:
        for i in range(64):
            w.write({"x": np.full(8192, i, np.uint8)})
    ds = open_archive(tmp_path / "a")
    monkeypatch.setattr(LocalSupply, "check", lambda self, shards: None)  # the race's window
    (shard,) = (tmp_path / "a").glob("shard-*")
    os.truncate(shard, 4096)
    with pytest.raises(ShardChangedError, match=rf"{shard.name}: shard shrank from \d+ to 4096"):
        ds.__getitems__(list(range(40, 64)))  # the fault's address names the file


def test_a_started_plan_returns_once_its_copies_have_begun() -> None:
    # start() hands the GIL to the helpers before the caller plans on: it returns once
    # each share has begun, behind whatever its helper was copying before
    c = CopyEngine(threads=2)
    src = torch.arange(4 << 20, dtype=torch.int32).view(torch.uint8)[: 4 << 20]
    table = RowTable([src.view(-1, 1 << 16)], 1 << 16)
    plan = CopyPlan([Rows(torch.empty_like(src), table, None, np.arange(64))])
    try:
        c.run(plan)  # a helper made (the caller takes the other share)
        busy, go = threading.Event(), threading.Event()
        c.helpers()[0].submit(lambda: (busy.set(), go.wait(10)))
        assert busy.wait(10)
        started: list[Any] = []
        starter = threading.Thread(target=lambda: started.append(c.start(plan)))
        starter.start()
        starter.join(0.3)
        assert starter.is_alive() and not started  # the first share waits for its helper
        go.set()
        starter.join(10)
        assert len(started) == 1
        started[0].wait()
        assert torch.equal(plan.steps[0].dst, src)
    finally:
        go.set()
        c.close()

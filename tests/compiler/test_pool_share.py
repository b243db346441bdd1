"""A local pool's work is shared out so that no worker idles while another has a queue
(a small compile or an append of a few inputs), and a compile that returns has ended
every worker process and pool thread it started."""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path

import pytest

from dlop.compiler import compile_corpus
from dlop.compiler.recipe import build_recipe
from dlop.compiler.run import pipeline
from dlop.compiler.run.pipeline import shared_chunks
from dlop.formats import ArchiveReader

from .fixtures import esc50_corpus


@pytest.mark.parametrize(
    ("chunk", "inputs", "workers", "want"),
    [
        (16, 20, 2, 10),  # 16 + 4 left one worker waiting on the other
        (16, 21, 2, 11),
        (16, 2000, 2, 16),  # a large compile keeps the Work's chunks
        (16, 3, 4, 1),
        (16, 1, 1, 1),
        (16, 0, 2, 1),
        (1, 50, 2, 1),  # whole images go one at a time whatever the count
        (64, 100, 3, 34),
    ],
)
def test_shared_chunks_give_every_worker_a_share(
    chunk: int, inputs: int, workers: int, want: int
) -> None:
    assert shared_chunks(chunk, inputs, workers) == want


def test_chunks_cover_inputs_within_one_round_of_workers() -> None:
    for inputs in range(1, 200):
        for workers in (1, 2, 3, 8):
            size = shared_chunks(16, inputs, workers)
            chunks = -(-inputs // size)
            assert size <= 16
            # no more rounds of chunks than the Work's own size needs
            assert -(-chunks // workers) <= max(1, -(-inputs // (16 * workers)))


def _threads() -> set[int]:
    return {t.ident for t in threading.enumerate() if t.ident is not None}


@pytest.mark.parametrize("clips", [3, 9])
def test_a_compile_ends_its_workers_and_threads(tmp_path: Path, clips: int) -> None:
    corpus = esc50_corpus(tmp_path / "c", [("wav", 16000, 1)] * clips, seconds=0.3)
    recipe = build_recipe({"source": str(corpus), "duration": 0.3})
    before = _threads()
    for n in range(2):
        out = tmp_path / f"out{n}"
        compile_corpus(recipe, out, workers=2, progress=False)
        assert multiprocessing.active_children() == []
        assert _threads() <= before
        with ArchiveReader(out) as r:
            assert len(r) == clips


def test_the_workers_are_told_to_end_before_the_last_unit_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once every chunk is answered the pool is shut down, so its workers exit while the
    driver writes the last unit's shards, not after."""
    corpus = esc50_corpus(tmp_path / "c", [("wav", 16000, 1)] * 6, seconds=0.3)
    recipe = build_recipe({"source": str(corpus), "duration": 0.3})
    events: list[str] = []

    class Pool(pipeline.ProcessPoolExecutor):
        def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
            events.append("shutdown")
            super().shutdown(wait, cancel_futures=cancel_futures)

    commit = pipeline.UnitWriter.commit

    def committed(writer: pipeline.UnitWriter) -> object:
        events.append("commit")
        return commit(writer)

    monkeypatch.setattr(pipeline, "ProcessPoolExecutor", Pool)
    monkeypatch.setattr(pipeline.UnitWriter, "commit", committed)
    compile_corpus(recipe, tmp_path / "out", workers=2, progress=False, unit_inputs=2)
    assert events.count("commit") == 3
    assert events.index("shutdown") < len(events) - 1 - events[::-1].index("commit")
    assert multiprocessing.active_children() == []

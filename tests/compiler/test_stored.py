"""Features refused when the stored dtype cannot hold them; the caller's heap during a compile."""

from __future__ import annotations

import gc
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dlop.compiler.errors import InputError
from dlop.compiler.recipe import build_recipe
from dlop.compiler.run import pipeline, processes
from dlop.compiler.run.items import CorpusShape, _stored, _stored_together
from dlop.compiler.run.work import PresetWork

from .fixtures import esc50_corpus


@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), float("-inf"), 65520.0, -65520.0, 1e30]
)
def test_values_float16_cannot_hold_are_refused(value: float) -> None:
    feat = torch.zeros(4, 3)
    feat[2, 1] = value
    recipe = SimpleNamespace(dtype="float16")
    with pytest.raises(InputError, match="features are not finite in float16"):
        _stored(feat, recipe, "clip.wav")  # type: ignore[arg-type]


def test_largest_float16_values_are_kept() -> None:
    feat = torch.tensor([[65504.0, -65504.0], [0.5, -3.0]])
    out = _stored(feat, SimpleNamespace(dtype="float16"), "clip.wav")  # type: ignore[arg-type]
    assert out.dtype == np.float16
    assert out.tolist() == [[65504.0, -65504.0], [0.5, -3.0]]
    wide = _stored(feat * 1e6, SimpleNamespace(dtype="float32"), "c")  # type: ignore[arg-type]
    assert wide.dtype == np.float32 and np.isfinite(wide).all()
    brain = _stored(feat * 1e30, SimpleNamespace(dtype="bfloat16"), "c")  # type: ignore[arg-type]
    assert brain.dtype == np.uint16  # bfloat16 travels as its bit pattern


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_clips_stored_together_are_those_stored_one_by_one(dtype: str) -> None:
    """Clips that are rows of one tensor (as featurize_clips lays them out) are checked and
    converted in one pass: the same arrays as clip by clip. Where that tensor holds a value
    the stored type cannot (even in rows between clips) each clip is left to _stored."""
    recipe = SimpleNamespace(dtype=dtype)
    base = torch.randn(12, 3) * 1000
    clips = [base[0:3], base[3:3], base[4:9], base[9:12]]
    together = _stored_together(clips, recipe)  # type: ignore[arg-type]
    assert together is not None
    for got, clip in zip(together, clips, strict=True):
        want = _stored(clip, recipe, "c")  # type: ignore[arg-type]
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()
    base[3, 1] = float("nan")  # a row no clip holds
    assert _stored_together(clips, recipe) is None  # type: ignore[arg-type]
    assert _stored_together([torch.zeros(2, 3), base[0:3]], recipe) is None  # type: ignore[arg-type]
    assert _stored_together([], recipe) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [-3.4e38, 3.4e38, float("nan")])
def test_values_bfloat16_cannot_hold_are_refused(value: float) -> None:
    feat = torch.tensor([[1.0, value], [-2.0, 2.0]])
    with pytest.raises(InputError, match="features are not finite in bfloat16"):
        _stored(feat, SimpleNamespace(dtype="bfloat16"), "c")  # type: ignore[arg-type]


def _collected(obj: object) -> bool:
    """Whether the cyclic collector scans obj (it is in none of its generations when frozen)."""
    return any(o is obj for o in gc.get_objects())


def test_compile_leaves_the_callers_heap_as_it_found_it(tmp_path: Path) -> None:
    corpus = esc50_corpus(tmp_path / "esc", [("wav", 22050, 1)] * 4)
    recipe = build_recipe({"preset": "librosa", "source": str(corpus), "layout": "esc50"})
    seen: list[int] = []  # the freeze count while the compile runs

    def compile_into(out: Path) -> None:
        pipeline.compile_corpus(
            recipe,
            out,
            workers=1,
            progress=False,
            on_progress=lambda _: seen.append(gc.get_freeze_count()),
        )

    assert gc.get_freeze_count() == 0
    try:
        compile_into(tmp_path / "a")
        assert seen and min(seen) > 0 and gc.get_freeze_count() == 0  # while it ran, not after
        # A caller that froze its heap keeps it frozen. The count alone cannot tell: a
        # frozen object that dies during the compile leaves the frozen set, so a marker
        # object is followed instead (frozen objects are in no collected generation).
        marker = [object()]
        gc.freeze()
        assert not _collected(marker)
        compile_into(tmp_path / "b")
        assert gc.get_freeze_count() > 0 and not _collected(marker)
    finally:
        gc.unfreeze()


def test_pool_workers_start_with_their_heap_frozen(tmp_path: Path) -> None:
    recipe = build_recipe({"preset": "librosa", "source": str(tmp_path), "layout": "esc50"})
    shape = CorpusShape(has_label=True, has_text=False, extra={})
    work = PresetWork(recipe.to_json(), recipe.digest(), shape)
    initargs = (work, str(tmp_path), os.getpid(), dict(os.environ), 1)
    with ProcessPoolExecutor(
        1,
        mp_context=processes.worker_context(),
        initializer=pipeline._init_worker,
        initargs=initargs,
    ) as pool:
        assert pool.submit(gc.get_freeze_count).result(timeout=120) > 0

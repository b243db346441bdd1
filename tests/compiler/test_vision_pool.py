"""Vision compiles in a worker pool: decode threads shared out, decoders preloaded, cropped
images a few to a chunk; the archive's bytes never depend on any of it."""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.forkserver
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from dlop.compiler.recipe import build_recipe
from dlop.compiler.run import pipeline, processes, work
from dlop.compiler.vision import video
from dlop.compiler.vision.options import VisionConfig
from dlop.tools.compile_cli import main as compile_main

from .media import write_image, write_video

EPOCH = "1700000000"


@pytest.fixture
def decode_threads_restored() -> object:
    before = video.decode_threads()
    yield None
    video.set_decode_threads(before)


def test_decode_threads_reach_the_codec_and_keep_the_pixels(
    tmp_path: Path, decode_threads_restored: object
) -> None:
    clip = write_video(tmp_path / "a.mp4", frames=45, size=(96, 64))
    cfg = VisionConfig(size=48, crop=(40, 40), clip_frames=8)
    decoded = {}
    for threads in (0, 1, 3):
        video.set_decode_threads(threads)
        with video._open(clip) as container:
            stream = video._video_stream(container, "a.mp4")
            if threads:
                assert stream.codec_context.thread_count == threads
        clips, _ = video.decode_clips(clip, "a.mp4", cfg)
        decoded[threads] = clips[0].frames
    assert decoded[0].shape == (8, 40, 40, 3)
    np.testing.assert_array_equal(decoded[1], decoded[0])
    np.testing.assert_array_equal(decoded[3], decoded[0])


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2"])
def test_decode_threads_refuse_what_is_not_a_count(bad: object) -> None:
    with pytest.raises(ValueError, match="decode threads"):
        video.set_decode_threads(bad)  # type: ignore[arg-type]


def test_pool_workers_share_the_cores_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert pipeline.worker_decode_threads(2) == 8
    assert pipeline.worker_decode_threads(3) == 5
    assert pipeline.worker_decode_threads(32) == 1


def test_each_pool_worker_decodes_with_its_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool's initializer hands every worker its share (forked workers run the
    recorder below, as they see this process's modules)."""
    for i in range(4):
        write_video(tmp_path / "corpus" / f"class{i % 2}" / f"clip{i}.mp4", frames=12)
    seen = tmp_path / "seen"
    seen.mkdir()

    def record(count: int) -> None:
        (seen / str(os.getpid())).write_text(str(count))

    monkeypatch.setattr(video, "set_decode_threads", record)
    monkeypatch.setattr(pipeline, "worker_decode_threads", lambda workers: 7)
    monkeypatch.setattr(processes, "worker_context", lambda: multiprocessing.get_context("fork"))
    recipe = build_recipe({"source": str(tmp_path / "corpus"), "size": 32, "crop": 32})
    index = pipeline.compile_corpus(recipe, tmp_path / "out", workers=2, progress=False)
    assert index.num_samples == 4
    counts = [p.read_text() for p in seen.iterdir()]
    assert counts and set(counts) == {"7"}


def test_the_fork_server_preloads_the_decoders(monkeypatch: pytest.MonkeyPatch) -> None:
    server = multiprocessing.forkserver._forkserver
    monkeypatch.setattr(server, "_preload_modules", list(server._preload_modules))
    monkeypatch.setattr(threading, "active_count", lambda: 2)
    ctx = processes.worker_context()
    assert ctx.get_start_method() == "forkserver"
    preload = server._preload_modules
    assert preload[0] == "dlop.compiler.run.pipeline"
    assert {"av", "PIL.Image", "dlop.compiler.vision.video", "dlop.compiler.vision.image"} <= set(
        preload
    )
    for name in (processes.PIPELINE, *processes.FORKSERVER_PRELOAD):
        importlib.import_module(name)


def test_cropped_images_go_a_few_to_a_chunk_whole_images_one(tmp_path: Path) -> None:
    corpus = _images_with_masks(tmp_path, 1)

    def size(**opts: object) -> int:
        return work.chunk_items(build_recipe({"source": str(corpus), **opts}), "image")

    assert size(size=64, crop=48) == work.CHUNK_ITEMS["image"] > 1
    assert size() == 1
    assert size(size=64) == 1
    assert size(tile=32) == 1
    recipe = build_recipe({"source": str(corpus)})
    assert work.chunk_items(recipe, "video") == work.CHUNK_ITEMS["video"]


def _images_with_masks(root: Path, count: int) -> Path:
    rng = np.random.default_rng(3)
    for i in range(count):
        stem = f"core{i:03d}"
        image = rng.integers(0, 256, (48, 64, 3), np.uint8)
        if i == 2:
            (root / "images").mkdir(parents=True, exist_ok=True)
            (root / "images" / f"{stem}.jpg").write_bytes(b"not an image")
        else:
            write_image(root / "images" / f"{stem}.jpg", image, quality=90)
        for a, folder in enumerate(("Maps1_T", "Maps2_T")):
            mask = rng.choice(np.array([0, 1, 3], np.uint8), (48, 64))
            write_image(root / folder / f"{stem}_classimg_nonconvex{a}.png", mask)
    return root


def test_image_archives_match_for_any_chunking_and_worker_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = _images_with_masks(tmp_path / "corpus", 7)  # chunks of 4 and 3, one bad input
    args = [str(corpus), "--size", "40", "--crop", "32", "--unit-inputs", "5", "-q"]

    def files(out: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(out.iterdir())}

    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    assert compile_main([*args, "--workers", "1", "-o", str(tmp_path / "one")]) == 0
    whole = files(tmp_path / "one")
    assert "errors.jsonl" in whole
    assert compile_main([*args, "--workers", "2", "-o", str(tmp_path / "two")]) == 0
    assert files(tmp_path / "two") == whole
    monkeypatch.setitem(work.CHUNK_ITEMS, "image", 1)
    assert compile_main([*args, "--workers", "2", "-o", str(tmp_path / "single")]) == 0
    assert files(tmp_path / "single") == whole

"""Video compile: frames sampled by time equal an independent PyAV decode; bad inputs recorded."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlop.compiler.vision.options import VisionConfig, shape_image
from dlop.formats import ArchiveReader
from dlop.tools.compile_cli import main as compile_main

from .media import charades_corpus, decode_all, frame_at, write_video


@pytest.fixture(scope="module")
def charades(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("charades")
    charades_corpus(root)
    return root


def _samples(out: Path) -> list[dict]:
    with ArchiveReader(out) as r:
        return [r.sample(i) for i in range(r.num_samples)]


def _times(sample: dict) -> list[float]:
    t = len(sample["frames"])
    start, end = float(sample["clip_start"]), float(sample["clip_end"])
    return [start + i * (end - start) / t for i in range(t)]


def test_uniform_frames_equal_an_independent_decode(charades: Path, tmp_path: Path) -> None:
    out = tmp_path / "a"
    assert compile_main([str(charades), "-o", str(out), "--clip-frames", "8", "-q"]) == 0
    samples = _samples(out)
    assert [s["key"] for s in samples] == [
        "Charades_v1_480/AAAA1.mp4",
        "Charades_v1_480/BBBB2.avi",
        "Charades_v1_480/CCCC3.mp4",
        "Charades_v1_480/DDDD4.mp4",
        "Charades_v1_480/EEEE5.mp4",
    ]
    for s in samples:
        frames = decode_all(charades / s["key"])
        assert s["frames"].shape[0] == 8
        for got, t in zip(s["frames"], _times(s), strict=True):
            np.testing.assert_array_equal(got, frame_at(frames, t), err_msg=f"{s['key']} at {t}")
    by_id = {s["video_id"]: s for s in samples}
    # TSN segment centres of a 30-frame 30 fps clip: 1/16 s, then every 1/8 s
    assert by_id["AAAA1"]["clip_start"] == pytest.approx(1 / 16, abs=2e-3)
    # variable frame rate: frames alternate 60 ms and 20 ms, so sampling by index would differ
    vfr = decode_all(charades / by_id["CCCC3"]["key"])
    assert len({round(b[0] - a[0], 3) for a, b in itertools.pairwise(vfr)}) == 2
    # rotation applied: a 64x48 (WxH) frame turned 90 degrees is 48 wide and 64 high,
    # and the red top-left marker lands bottom-left (counterclockwise)
    rotated = by_id["DDDD4"]["frames"]
    assert rotated.shape[1:] == (64, 48, 3)
    assert rotated[0, -3, 2, 0] > 200 and rotated[0, -3, 2, 1] < 60
    assert rotated[0, 2, 2, 1] > 0 or rotated[0, 2, 2, 0] < 200  # not at top-left any more
    # the one-frame clip repeats its only frame
    one = by_id["EEEE5"]["frames"]
    assert all((f == one[0]).all() for f in one)
    # multi-hot labels from the action spans
    assert by_id["BBBB2"]["labels"].nonzero()[0].tolist() == [1, 156]
    assert by_id["AAAA1"]["labels"].sum() == 0
    assert by_id["BBBB2"]["actions"] == "c001 0.00 0.50;c156 0.10 0.90"
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    reasons = {e["key"].split("/")[-1]: e["reason"] for e in errors}
    assert set(reasons) == {"FFFF6.mp4", "GGGG7.mp4", "HHHH8"}
    assert "cannot decode video" in reasons["FFFF6.mp4"]
    assert "empty file" in reasons["GGGG7.mp4"]
    assert "no video named HHHH8" in reasons["HHHH8"]


def test_dense_clips_resized_equal_the_same_resize_of_an_independent_decode(
    charades: Path, tmp_path: Path
) -> None:
    out = tmp_path / "d"
    args = [str(charades), "-o", str(out), "-q", "--clip", "dense", "--clip-frames", "4"]
    args += ["--clip-stride", "2", "--clips", "3", "--size", "24", "--crop", "24", "--audio"]
    assert compile_main(args) == 0
    samples = _samples(out)
    assert len(samples) == 5 * 3
    cfg = VisionConfig(size=24, crop=(24, 24))
    for s in samples:
        assert s["frames"].shape == (4, 24, 24, 3)
        frames = decode_all(charades / s["key"])
        for got, t in zip(s["frames"], _times(s), strict=True):
            np.testing.assert_array_equal(got, shape_image(frame_at(frames, t), cfg))
    starts = [float(s["clip_start"]) for s in samples if s["video_id"] == "AAAA1"]
    assert starts == sorted(starts) and len(set(starts)) == 3  # spread over the video
    # the audio track's log-mel beside the frames; a clip without audio has 0 frames of it
    with_audio = [s for s in samples if s["video_id"] == "AAAA1"]
    assert all(s["logmel"].shape[0] > 0 for s in with_audio)
    assert all(s["logmel"].shape[0] == 0 for s in samples if s["video_id"] == "BBBB2")


def test_video_workers_and_fail_mode(
    charades: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    base = [str(charades), "-q", "--clip-frames", "4", "--size", "32"]
    assert compile_main([*base, "-o", str(one), "--workers", "1"]) == 0
    assert compile_main([*base, "-o", str(two), "--workers", "2"]) == 0
    for p in sorted(one.glob("*.dlop")):
        assert p.read_bytes() == (two / p.name).read_bytes()
    assert not list(two.glob(".dlop-*"))  # no worker chunk files or journal left behind
    fail = tmp_path / "fail"
    assert compile_main([*base, "-o", str(fail), "--on-error", "fail"]) == 1
    assert "FFFF6.mp4" in capsys.readouterr().err
    assert not fail.exists()


def test_folder_and_manifest_video_layouts(tmp_path: Path) -> None:
    root = tmp_path / "videos"
    write_video(root / "jump" / "a.mp4", frames=10)
    write_video(root / "run" / "b.mp4", frames=15)
    out = tmp_path / "f"
    assert compile_main([str(root), "-o", str(out), "-q", "--clip-frames", "2"]) == 0
    with ArchiveReader(out) as r:
        assert r.index.metadata["classes"] == ["jump", "run"]
        assert [r.sample(i)["label"] for i in range(2)] == [0, 1]
    manifest = tmp_path / "m.jsonl"
    lines = [
        {"video_filepath": "videos/jump/a.mp4", "labels": ["jump", "fast"]},
        {"video_filepath": "videos/run/b.mp4", "labels": ["run"]},
    ]
    manifest.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "m"
    assert compile_main([str(manifest), "-o", str(out), "-q", "--clip-frames", "2"]) == 0
    with ArchiveReader(out) as r:
        assert r.index.metadata["label_classes"] == ["fast", "jump", "run"]
        assert r.sample(0)["labels"].tolist() == [1, 1, 0]
        assert r.sample(1)["labels"].tolist() == [0, 0, 1]


def test_long_video_seeks_to_keyframes_and_still_matches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dlop.compiler.vision import video

    root = tmp_path / "long"
    write_video(root / "a" / "long.mp4", frames=200, rate=10, size=(32, 24), gop=10)
    seeks = []
    real = video.frames_at

    class Counting:
        def __init__(self, container):  # type: ignore[no-untyped-def]
            self.container = container

        def seek(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            seeks.append(args)
            return self.container.seek(*args, **kwargs)

        def __getattr__(self, name):  # type: ignore[no-untyped-def]
            return getattr(self.container, name)

    def counting(container, stream, times, name, *rest):  # type: ignore[no-untyped-def]
        return real(Counting(container), stream, times, name, *rest)

    monkeypatch.setattr(video, "frames_at", counting)
    cfg = VisionConfig(clip="dense", clip_frames=3, clip_stride=2, clips=4)
    clips, info = video.decode_clips(root / "a" / "long.mp4", "long.mp4", cfg)
    assert info.duration == pytest.approx(20.0, abs=0.2) and len(clips) == 4
    assert len(seeks) >= 3  # 20 s of video, clips about 5 s apart: it seeks rather than decodes
    frames = decode_all(root / "a" / "long.mp4")
    for c in clips:
        step = (c.end - c.start) / 3
        for i, got in enumerate(c.frames):
            np.testing.assert_array_equal(got, frame_at(frames, c.start + i * step))


@pytest.mark.parametrize(
    ("codec", "vfr", "frames", "clip_frames"),
    [
        ("libx264", False, 90, 16),
        ("libx264", True, 60, 7),
        ("mpeg4", False, 45, 5),
        ("libsvtav1", False, 60, 7),  # libdav1d reads skip_frame once: always decoded in full
    ],
)
def test_frames_nothing_sampled_needs_are_skipped_and_the_pixels_stay(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    codec: str,
    vfr: bool,
    frames: int,
    clip_frames: int,
) -> None:
    """Non-reference frames between the sampled ones are not decoded; the clips are the
    bytes a full decode gives (the decode with no probe timestamps to go by)."""
    from dlop.compiler.vision import video

    path = write_video(tmp_path / "a" / "v.mp4", codec=codec, frames=frames, vfr=vfr, size=(64, 48))
    cfg = VisionConfig(clip="uniform", clip_frames=clip_frames)
    decoded: list[int] = []
    real = video._frames

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        for item in real(*args, **kwargs):
            decoded.append(item[1].pts)
            yield item

    monkeypatch.setattr(video, "_frames", counting)
    skipped, info = video.decode_clips(path, "v.mp4", cfg)
    partial = len(decoded)
    decoded.clear()
    monkeypatch.setattr(video, "picked_pts", lambda *a: None)  # no timestamps: decode all
    full, _ = video.decode_clips(path, "v.mp4", cfg)
    assert [c.frames.tobytes() for c in skipped] == [c.frames.tobytes() for c in full]
    assert [(c.start, c.end) for c in skipped] == [(c.start, c.end) for c in full]
    if codec == "libx264":  # B-frames that nothing references: skipped
        assert partial < len(decoded)
    assert len(info.pts) == frames


def full_decode(tmp_path: Path) -> tuple[Path, VisionConfig, list[Any]]:
    """A 60-frame H.264 clip, an 8-frame uniform config, and the clips decode_clips gives."""
    from dlop.compiler.vision import video

    path = write_video(tmp_path / "a" / "v.mp4", frames=60, size=(64, 48))
    cfg = VisionConfig(clip="uniform", clip_frames=8)
    return path, cfg, video.decode_clips(path, "v.mp4", cfg)[0]


def test_a_decode_that_disagrees_with_the_probe_is_done_again_in_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dlop.compiler.vision import video

    path, cfg, want = full_decode(tmp_path)
    real = video.picked_pts
    # timestamps off by one: the frames decoded are not the ones picked, so all are decoded
    monkeypatch.setattr(video, "picked_pts", lambda *a: [p + 1 for p in real(*a)])
    calls: list[object] = []
    real_frames_at = video.frames_at

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args[4] if len(args) > 4 else None)
        return real_frames_at(*args, **kwargs)

    monkeypatch.setattr(video, "frames_at", spy)
    got, _ = video.decode_clips(path, "v.mp4", cfg)
    assert len(calls) == 2 and calls[0] is not None and calls[1] is None
    assert [c.frames.tobytes() for c in got] == [c.frames.tobytes() for c in want]


def test_a_skip_pass_that_fails_leaves_the_verdict_to_a_full_decode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dlop.compiler.errors import InputError
    from dlop.compiler.vision import video

    path, cfg, want = full_decode(tmp_path)
    real = video.frames_at

    def failing(container, stream, times, name, needed=None):  # type: ignore[no-untyped-def]
        if needed is not None:
            raise InputError(name, "corrupt frame at 0.500 s")
        return real(container, stream, times, name)

    monkeypatch.setattr(video, "frames_at", failing)
    got, _ = video.decode_clips(path, "v.mp4", cfg)
    assert [c.frames.tobytes() for c in got] == [c.frames.tobytes() for c in want]


def test_the_documented_clip_pipeline_on_clips_compiled_without_crop(
    charades: Path, tmp_path: Path
) -> None:
    """docs/vision.md's video Loader on clips whose height and width vary per video."""
    from dlop.runtime import Loader, Normalize, RandomResizedCrop, RandomTemporalCrop

    out = tmp_path / "clips"
    assert compile_main([str(charades), "-o", str(out), "-q", "--clip-frames", "4"]) == 0
    loader = Loader(
        out,
        3,
        transforms=(
            RandomTemporalCrop(frames=2, reverse=0.0),
            RandomResizedCrop(24, fields=("frames",)),
            Normalize(field="frames"),
        ),
    )
    try:
        shapes = {tuple(b["frames"].shape[1:]) for b in loader}
    finally:
        loader.close()
    assert shapes == {(3, 2, 24, 24)}

"""Video and image fixtures written by the tests (PyAV and Pillow encoders), and independent readers."""

from __future__ import annotations

import csv
from fractions import Fraction
from pathlib import Path

import numpy as np


def frame_pattern(i: int, width: int, height: int) -> np.ndarray:
    """A frame whose content changes with ``i`` and whose top-left corner is marked red."""
    y, x = np.mgrid[0:height, 0:width]
    img = np.stack(
        [(x * 4 + i * 9) % 256, (y * 5 + i * 17) % 256, ((x + y) * 3 + i * 31) % 256], axis=-1
    ).astype(np.uint8)
    img[: height // 4, : width // 4] = (255, 0, 0)
    return img


def write_video(
    path: Path,
    *,
    codec: str = "libx264",
    frames: int = 30,
    rate: int = 30,
    size: tuple[int, int] = (64, 48),
    rotate: int | None = None,
    vfr: bool = False,
    audio: bool = False,
    gop: int | None = None,
) -> Path:
    """An H.264 or MPEG-4 clip; ``vfr`` alternates 20 ms and 60 ms frames; ``audio`` adds AAC."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    width, height = size
    tb = Fraction(1, 1000) if vfr else Fraction(1, rate)
    with av.open(str(path), "w") as c:
        s = c.add_stream(codec, rate=rate)
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        if gop is not None:
            s.codec_context.gop_size = gop
        s.time_base = tb
        s.codec_context.time_base = tb
        if rotate:
            s.set_display_rotation(rotate)
        a = c.add_stream("aac", rate=16000) if audio else None
        pts = 0
        for i in range(frames):
            fr = av.VideoFrame.from_ndarray(frame_pattern(i, width, height), format="rgb24")
            fr.pts, fr.time_base = pts, tb
            pts += (20 if i % 2 else 60) if vfr else 1
            for p in s.encode(fr):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
        if a is not None:
            seconds = frames / rate
            t = np.arange(int(16000 * seconds)) / 16000
            wave = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
            for k in range(0, len(wave), 1024):
                af = av.AudioFrame.from_ndarray(
                    wave[None, k : k + 1024], format="flt", layout="mono"
                )
                af.sample_rate, af.pts = 16000, k
                for p in a.encode(af):
                    c.mux(p)
            for p in a.encode():
                c.mux(p)
    return path


def decode_all(path: Path) -> list[tuple[float, np.ndarray]]:
    """Every frame (time in seconds, upright RGB), decoded plainly from the start, no threads."""
    import av

    from dlop.compiler.vision.video import RGB_CONVERSION

    out = []
    with av.open(str(path)) as c:
        s = c.streams.video[0]
        for f in c.decode(s):
            rgb = f.reformat(format="rgb24", interpolation=RGB_CONVERSION).to_ndarray()
            quarter = round((getattr(f, "rotation", 0) or 0) / 90) % 4
            out.append((float(f.pts * s.time_base), np.ascontiguousarray(np.rot90(rgb, quarter))))
    return out


def frame_at(frames: list[tuple[float, np.ndarray]], t: float) -> np.ndarray:
    """The frame shown at time t: the last at or before it (the first before the first)."""
    shown = frames[0][1]
    for time, img in frames:
        if time <= t + 1e-6:
            shown = img
    return shown


def charades_corpus(root: Path) -> dict[str, str]:
    """A Charades-layout corpus with good and bad videos; returns id -> what it is."""
    videos = root / "Charades_v1_480"
    kinds = {
        "AAAA1": "h264 with audio",
        "BBBB2": "mpeg4",
        "CCCC3": "variable frame rate",
        "DDDD4": "rotated 90",
        "EEEE5": "one frame",
        "FFFF6": "corrupt bitstream",
        "GGGG7": "zero bytes",
        "HHHH8": "missing file",
    }
    write_video(videos / "AAAA1.mp4", audio=True)
    write_video(videos / "BBBB2.avi", codec="mpeg4", frames=20, rate=25, size=(48, 32))
    write_video(videos / "CCCC3.mp4", vfr=True, frames=24)
    write_video(videos / "DDDD4.mp4", rotate=90, frames=12)
    write_video(videos / "EEEE5.mp4", frames=1)
    good = bytearray(write_video(videos / "FFFF6.mp4", frames=30).read_bytes())
    at = good.find(b"mdat") + 200
    good[at : at + 1000] = np.random.default_rng(0).integers(0, 256, 1000, np.uint8).tobytes()
    (videos / "FFFF6.mp4").write_bytes(bytes(good))
    (videos / "GGGG7.mp4").write_bytes(b"")
    with open(root / "Charades_v1_train.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "subject", "scene", "actions", "length"])
        for n, vid in enumerate(kinds):
            actions = f"c{n:03d} 0.00 0.50;c156 0.10 0.90" if n % 2 else ""
            w.writerow([vid, "S", "Kitchen", actions, "1.0"])
    return kinds


def write_image(path: Path, array: np.ndarray, **save: object) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, **save)
    return path

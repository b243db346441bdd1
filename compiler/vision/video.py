"""Video decoding with PyAV: frames sampled by presentation time, not by frame index.

The frame shown at time ``t`` is the last frame whose timestamp is at or
before ``t`` (the first frame for times before it, the last frame for times
past the end), so variable frame rate clips sample correctly. Decoding runs
forward; a target further ahead than ``SEEK_AHEAD_S`` seeks back to the
keyframe before it instead of decoding the gap. Rotation metadata (the display
matrix) is applied to every frame. Containers are always closed.

Frames that no sampled frame needs are not decoded when the decoder can tell
(FFmpeg's non-reference skip): the packets' timestamps, read by the probe, say
which frames the sample times pick, and every other packet is decoded only if
later frames depend on it. The frames picked are then checked against those
timestamps; any disagreement decodes the video again in full, so the pixels
are always those of a full decode. Damage in a frame that nothing sampled
depends on goes unnoticed, as it does after the last sampled frame.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from dlop.formats.extras import needs_extra

from ..audio.decode import check_file
from ..errors import InputError
from .options import VisionConfig, rotate, shape_image

SEEK_AHEAD_S = 4.0
_EPS = 1e-6
# Threads one decode may use; 0 lets FFmpeg choose (about one per core). A compile's
# worker pool lowers it (set_decode_threads) so that its workers together use each
# core once: frame threads on top of a busy worker per core cost CPU (a third more
# for H.264) and gain no time. Decoding is bit-exact whatever the count.
_decode_threads = 0


def set_decode_threads(count: int) -> None:
    """Sets the threads each later decode in this process uses (0: FFmpeg's choice)."""
    global _decode_threads
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"decode threads {count!r}: expected a count of 0 or more")
    _decode_threads = count


def decode_threads() -> int:
    """The threads each decode in this process uses (0: FFmpeg's choice)."""
    return _decode_threads


@dataclass
class Clip:
    frames: np.ndarray  # [T, H, W, C] uint8
    start: float  # seconds of the first sampled time, on the video's own timeline
    end: float  # seconds just after the last sampled frame's time


@dataclass
class VideoInfo:
    start: float  # timestamp of the first frame, seconds
    duration: float  # seconds
    rate: float  # average frames per second (for dense sampling's default fps)
    has_audio: bool  # the container also holds an audio stream
    pts: tuple[int, ...] = ()  # every packet's timestamp, ascending; () when one has none


def _open(source: str | os.PathLike[str] | bytes) -> Any:
    with needs_extra("compile", "decoding video"):
        import av

    handle = io.BytesIO(source) if isinstance(source, bytes) else str(source)
    return av.open(handle, metadata_errors="ignore")


def _video_stream(container: Any, name: str) -> Any:
    if not container.streams.video:
        raise InputError(name, "no video stream")
    stream = container.streams.video[0]
    stream.thread_type = "AUTO"
    if _decode_threads:
        stream.codec_context.thread_count = _decode_threads
    return stream


def probe(container: Any, stream: Any, name: str) -> VideoInfo:
    """Start, duration and rate from the packets' timestamps (headers can be wrong or absent)."""
    tb = float(stream.time_base)
    first: float | None = None
    end = 0.0
    pts: list[int] = []
    untimed = False
    for packet in container.demux(stream):
        if packet.pts is None:
            untimed = untimed or packet.size > 0  # the final flush packet has neither
            continue
        t = packet.pts * tb
        first = t if first is None else min(first, t)
        end = max(end, t + (packet.duration or 0) * tb)
        pts.append(packet.pts)
    if first is None:
        raise InputError(name, "no video frames")
    duration = max(end - first, _EPS)
    rate = float(stream.average_rate or stream.guessed_rate or 0) or len(pts) / duration
    container.seek(0)
    shown = () if untimed else tuple(sorted(pts))
    return VideoInfo(first, duration, rate, bool(container.streams.audio), shown)


def picked_pts(info: VideoInfo, tb: float, times: list[float]) -> list[int] | None:
    """The timestamp of the frame shown at each of the ascending ``times`` (as
    frames_at picks them), from the probe's packet timestamps; None when unknown."""
    if not info.pts:
        return None
    out, k = [], 0
    for t in times:
        while k + 1 < len(info.pts) and info.pts[k + 1] * tb <= t + _EPS:
            k += 1
        out.append(info.pts[k])
    return out


def clip_times(info: VideoInfo, cfg: VisionConfig) -> list[list[float]]:
    """The sample times of every clip, in seconds on the video's timeline."""
    t0, d, n = info.start, info.duration, cfg.clip_frames
    if cfg.clip == "uniform":  # TSN: the centre of each of n equal segments
        return [[t0 + (i + 0.5) * d / n for i in range(n)]]
    fps = cfg.clip_fps or info.rate
    step = cfg.clip_stride / fps
    span = n * step
    room = max(d - span, 0.0)
    starts = [t0 + room * (k + 0.5) / cfg.clips for k in range(cfg.clips)]
    return [[s + i * step for i in range(n)] for s in starts]


def _frames(
    container: Any, stream: Any, name: str, needed: frozenset[int] | None = None
) -> Iterator[tuple[float, Any]]:
    """(seconds, frame) of the decoded frames; with ``needed``, packets of other
    timestamps are decoded only when they are reference frames."""
    # float arithmetic, as probe's: a Fraction product per frame costs more than
    # converting the frame's pixels
    tb = float(stream.time_base)
    ctx = stream.codec_context
    try:
        for packet in container.demux(stream):
            if needed is not None:
                ctx.skip_frame = "DEFAULT" if packet.pts in needed else "NONREF"
            for frame in packet.decode():
                if frame.pts is None:
                    raise InputError(name, "a decoded frame has no timestamp")
                if getattr(frame, "is_corrupt", False):
                    raise InputError(name, f"corrupt frame at {frame.pts * tb:.3f} s")
                yield frame.pts * tb, frame
    finally:
        if needed is not None:
            ctx.skip_frame = "DEFAULT"


def frames_at(
    container: Any,
    stream: Any,
    times: list[float],
    name: str,
    needed: frozenset[int] | None = None,
) -> list[Any]:
    """The decoded frame shown at each of the ascending ``times`` (decoding only the
    frames ``needed`` ones depend on, when given)."""
    tb = float(stream.time_base)
    out: list[Any] = []
    it: Iterator[tuple[float, Any]] | None = None
    shown: tuple[float, Any] | None = None  # last frame at or before the target
    ahead: tuple[float, Any] | None = None  # first frame after it
    for t in times:
        if it is not None and ahead is not None and t - ahead[0] > SEEK_AHEAD_S:
            # Seek back to the keyframe before t; if the demuxer lands past t, decode from the top.
            container.seek(int(t / tb), stream=stream, backward=True, any_frame=False)
            it, shown, ahead = _frames(container, stream, name, needed), None, None
            first = next(it, None)
            if first is None or first[0] > t + _EPS:
                container.seek(0)
                it = _frames(container, stream, name, needed)
            else:
                ahead = first
        if it is None:
            it = _frames(container, stream, name, needed)
        while True:
            if ahead is None:
                ahead = next(it, None)
                if ahead is None:
                    break  # past the end: the last frame stays shown
            if ahead[0] <= t + _EPS:
                shown, ahead = ahead, None
            else:
                break
        if shown is None:  # before the first frame
            shown, ahead = ahead, None
        if shown is None:
            raise InputError(name, "no video frames decoded")
        out.append(shown[1])
    return out


# Decoders that read skip_frame for every packet; others (libdav1d) read it once, as
# they open, and are always decoded in full.
SKIP_DECODERS = frozenset({"h264", "hevc", "mpeg4", "mpeg2video", "vp8", "vp9"})


def _skipping_frames(
    container: Any, stream: Any, info: VideoInfo, wanted: list[float], name: str
) -> list[Any] | None:
    """frames_at, decoding only the frames the picked ones depend on, when the decoder
    allows it and the probe's timestamps say which those are; None when it cannot be
    used or its frames disagree with those timestamps (or it fails): the caller then
    decodes in full, on a new decoder."""
    import av

    if stream.codec_context.name not in SKIP_DECODERS:
        return None
    picks = picked_pts(info, float(stream.time_base), wanted)
    if picks is None:
        return None
    try:
        decoded = frames_at(container, stream, wanted, name, frozenset(picks))
    except (InputError, av.FFmpegError, ValueError, OSError):
        return None  # the full decode says what is wrong
    return decoded if [f.pts for f in decoded] == picks else None


def _shaped(wanted: list[float], decoded: list[Any], cfg: VisionConfig) -> dict[float, np.ndarray]:
    """Each sample time's frame, rotated and shaped (a frame shown at several times once)."""
    by_time: dict[float, np.ndarray] = {}
    converted: dict[int, np.ndarray] = {}
    for t, frame in zip(wanted, decoded, strict=True):
        if id(frame) not in converted:
            converted[id(frame)] = shape_image(to_rgb(frame), cfg)
        by_time[t] = converted[id(frame)]
    return by_time


# swscale's flags for the conversion to RGB: SWS_BILINEAR | SWS_ACCURATE_RND | SWS_BITEXACT,
# FFmpeg's exact C conversion. Without them swscale takes vector code chosen by the CPU,
# which need not round as the C code does: the same video would give other pixels on
# another machine.
RGB_CONVERSION = 0x2 | 0x40000 | 0x80000


def to_rgb(frame: Any) -> np.ndarray:
    """One decoded frame -> ``[H, W, 3]`` uint8 RGB with its display rotation applied."""
    rgb = frame.reformat(format="rgb24", interpolation=RGB_CONVERSION).to_ndarray()
    return rotate(rgb, float(getattr(frame, "rotation", 0) or 0))


def decode_clips(
    source: str | os.PathLike[str] | bytes, name: str, cfg: VisionConfig
) -> tuple[list[Clip], VideoInfo]:
    """Samples, rotates, resizes and crops every clip the config asks of one video."""
    with needs_extra("compile", "decoding video"):
        import av

    check_file(source, name)
    try:
        with _open(source) as container:
            stream = _video_stream(container, name)
            info = probe(container, stream, name)
            clips = clip_times(info, cfg)
            wanted = sorted({t for times in clips for t in times})
            decoded = _skipping_frames(container, stream, info, wanted, name)
            by_time = _shaped(wanted, decoded, cfg) if decoded is not None else None
        if by_time is None:  # in full, on a new decoder: no setting of the first lingers
            with _open(source) as container:
                stream = _video_stream(container, name)
                by_time = _shaped(wanted, frames_at(container, stream, wanted, name), cfg)
    except InputError:
        raise
    except (av.FFmpegError, ValueError, OSError) as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(name, f"cannot decode video: {text[:200]}") from None
    shapes = {a.shape for a in by_time.values()}
    if len(shapes) > 1:
        raise InputError(name, f"frames change size mid-video ({sorted(shapes)}); give --crop")
    out = []
    for times in clips:
        step = times[1] - times[0] if len(times) > 1 else info.duration / cfg.clip_frames
        out.append(Clip(np.stack([by_time[t] for t in times]), times[0], times[-1] + step))
    return out, info

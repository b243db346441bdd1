"""Frame and image geometry shared by the video and image compilers.

Images are ``[H, W, C]`` uint8 and masks ``[H, W]`` uint8. Images shrink with
an antialiasing filter (Pillow's bilinear widens its support when it
downsamples); masks only ever use nearest neighbour, so every stored mask value
is one the annotator drew.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from dlop.formats.extras import needs_extra

CLIP_MODES = ("uniform", "dense")
MISSING_MASK_RULES = ("fill", "skip")
# 150 megapixels: a Sentinel-2 tile (10980 x 10980, 121 MP) and Gleason
# tissue-microarray cores (about 5k x 5k, 26 MP) fit; one decoded RGB image at
# the cap takes about 450 MB per worker. Whole-slide regions of 20k x 20k
# (400 MP, 1.2 GB) are a conscious opt-in with --max-image-pixels.
DEFAULT_MAX_IMAGE_PIXELS = 150_000_000
_HW = re.compile(r"^\s*(\d+)\s*(?:[xX]\s*(\d+))?\s*$")


def parse_hw(value: Any, what: str) -> tuple[int, int] | None:
    """``224``, ``"224"``, ``"256x320"`` or ``[256, 320]`` -> (height, width)."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and len(value) == 2:
        h, w = (int(v) for v in value)
    elif isinstance(value, int) and not isinstance(value, bool):
        h = w = value
    else:
        m = _HW.match(str(value))
        if not m:
            raise ValueError(f"{what} {value!r} must be N or HxW (for example 224 or 256x320)")
        h = int(m.group(1))
        w = int(m.group(2) or m.group(1))
    if h <= 0 or w <= 0:
        raise ValueError(f"{what} {value!r} must be positive")
    return h, w


def parse_remap(value: Any) -> tuple[tuple[int, int], ...] | None:
    """``"0:0,1:1,3:2"``, ``{"3": 2}`` or ``[[3, 2]]`` -> sorted (from, to) pairs of mask values."""
    if value is None or value == "":
        return None
    pairs: list[Any]
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, str):
        pairs = [p.split(":", 1) for p in value.split(",") if p.strip()]
        if any(len(p) != 2 for p in pairs):
            raise ValueError(f"mask remap {value!r} must look like 0:0,1:1,3:2")
    else:
        pairs = [tuple(p) for p in value]
    try:
        out = sorted((int(a), int(b)) for a, b in pairs)
    except (TypeError, ValueError):
        raise ValueError(f"mask remap {value!r} must map integers to integers") from None
    for a, b in out:
        if not (0 <= a <= 255 and 0 <= b <= 255):
            raise ValueError(f"mask remap {a}:{b}: values must lie in 0-255")
    if len({a for a, _ in out}) != len(out):
        raise ValueError(f"mask remap {value!r} maps one value twice")
    return tuple(out)


@dataclass(frozen=True)
class VisionConfig:
    """How frames and images are sampled and shaped; ``None`` keeps native sizes."""

    size: int | None = None  # resize so the short side is this many pixels
    crop: tuple[int, int] | None = None  # centre crop (height, width) after the resize
    # video
    clip: str = "uniform"  # uniform: clip_frames segment centres; dense: consecutive frames
    clip_frames: int = 16
    clip_fps: float | None = None  # dense: frame rate the stride counts in (default: the video's)
    clip_stride: int = 1  # dense: take every clip_stride-th frame at clip_fps
    clips: int = 1  # dense: clips per video, starts spread evenly over the video
    audio: bool = False  # video: the audio track's features beside the frames
    # images
    tile: tuple[int, int] | None = None  # cut each (resized) image into patches of this size
    mask_fill: int = 255  # value of a mask an annotator did not provide
    missing_mask: str = "fill"  # fill | skip the image
    mask_remap: tuple[tuple[int, int], ...] | None = None
    consensus: bool = False  # add a per-pixel majority-vote mask
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # larger images (or masks) are bad inputs
    # under size, a baseline JPEG decodes reduced in the DCT (with masks, only
    # by a scale dividing both sides); False decodes every image at full size
    jpeg_draft: bool = True

    def __post_init__(self) -> None:
        if self.size is not None and self.size <= 0:
            raise ValueError(f"size {self.size} must be a positive number of pixels")
        if self.clip not in CLIP_MODES:
            raise ValueError(f"clip {self.clip!r} must be one of {CLIP_MODES}")
        if self.clip_frames <= 0 or self.clip_stride <= 0 or self.clips <= 0:
            raise ValueError("clip_frames, clip_stride and clips must be positive")
        if self.clip_fps is not None and self.clip_fps <= 0:
            raise ValueError(f"clip_fps {self.clip_fps} must be positive")
        if self.missing_mask not in MISSING_MASK_RULES:
            raise ValueError(
                f"missing_mask {self.missing_mask!r} must be one of {MISSING_MASK_RULES}"
            )
        if not 0 <= self.mask_fill <= 255:
            raise ValueError(f"mask_fill {self.mask_fill} must lie in 0-255")
        cap = self.max_image_pixels
        if not isinstance(cap, int) or isinstance(cap, bool):
            raise ValueError(
                f"max_image_pixels {cap!r} must be a whole number of pixels written as an "
                "integer (150000000, not 1.5e8)"
            )
        if not isinstance(self.jpeg_draft, bool):
            raise ValueError(f"jpeg_draft {self.jpeg_draft!r} must be true or false")
        if self.max_image_pixels <= 0:
            raise ValueError(
                f"max_image_pixels {self.max_image_pixels} must be a positive number of pixels"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "crop": list(self.crop) if self.crop else None,
            "clip": self.clip,
            "clip_frames": self.clip_frames,
            "clip_fps": self.clip_fps,
            "clip_stride": self.clip_stride,
            "clips": self.clips,
            "audio": self.audio,
            "tile": list(self.tile) if self.tile else None,
            "mask_fill": self.mask_fill,
            "missing_mask": self.missing_mask,
            "mask_remap": [list(p) for p in self.mask_remap] if self.mask_remap else None,
            "consensus": self.consensus,
            "max_image_pixels": self.max_image_pixels,
            "jpeg_draft": self.jpeg_draft,
        }

    @classmethod
    def from_options(cls, opts: dict[str, Any]) -> VisionConfig:
        return cls(
            size=None if opts.get("size") in (None, 0) else int(opts["size"]),
            crop=parse_hw(opts.get("crop"), "crop"),
            clip=str(opts.get("clip", "uniform")),
            clip_frames=int(opts.get("clip_frames", 16)),
            clip_fps=None if opts.get("clip_fps") is None else float(opts["clip_fps"]),
            clip_stride=int(opts.get("clip_stride", 1)),
            clips=int(opts.get("clips", 1)),
            audio=bool(opts.get("audio", False)),
            tile=parse_hw(opts.get("tile"), "tile"),
            mask_fill=int(opts.get("mask_fill", 255)),
            missing_mask=str(opts.get("missing_mask", "fill")),
            mask_remap=parse_remap(opts.get("mask_remap")),
            consensus=bool(opts.get("consensus", False)),
            max_image_pixels=opts.get("max_image_pixels", DEFAULT_MAX_IMAGE_PIXELS),
            jpeg_draft=opts.get("jpeg_draft", True),
        )

    def output_hw(self) -> tuple[int, int] | None:
        """The stored (height, width) when it is the same for every sample, else None."""
        if self.tile is not None:
            return self.tile
        return self.crop


def resized_hw(height: int, width: int, size: int | None) -> tuple[int, int]:
    """(height, width) with the short side scaled to ``size`` (the long side rounded)."""
    if size is None:
        return height, width
    if height <= width:
        return size, max(1, round(width * size / height))
    return max(1, round(height * size / width)), size


def shape_pil(
    image: Any,
    cfg: VisionConfig,
    *,
    nearest: bool = False,
    grid: tuple[int, int] | None = None,
) -> np.ndarray:
    """Resize (short side) then centre-crop a Pillow image; the result as an array.

    ``grid``: the (height, width) to resize to, when it is worked out from
    another size than the image's own (a reduced decode shaped like its
    full-size masks). Raises ValueError when the resized image is smaller than
    the crop.
    """
    from PIL import Image

    h, w = grid or resized_hw(image.height, image.width, cfg.size)
    if (h, w) != (image.height, image.width):
        method = Image.Resampling.NEAREST if nearest else Image.Resampling.BILINEAR
        image = image.resize((w, h), method)
    if cfg.crop is not None:
        ch, cw = cfg.crop
        if h < ch or w < cw:
            raise ValueError(
                f"{w}x{h} (width x height) is smaller than the {cw}x{ch} crop; resize with --size first"
            )
        top, left = (h - ch) // 2, (w - cw) // 2
        image = image.crop((left, top, left + cw, top + ch))
    return np.asarray(image)


def shape_image(array: np.ndarray, cfg: VisionConfig, *, nearest: bool = False) -> np.ndarray:
    """Resize (short side) then centre-crop one image, frame or mask array as the config says."""
    with needs_extra("compile", "resizing images and video frames"):
        from PIL import Image

    return shape_pil(Image.fromarray(array), cfg, nearest=nearest)


def tile_origins(height: int, width: int, tile: tuple[int, int]) -> list[tuple[int, int]]:
    """Top-left corners of the whole ``tile`` patches that fit, row by row (edges that do not fill a tile are dropped)."""
    return [
        (y, x)
        for y in range(0, height - tile[0] + 1, tile[0])
        for x in range(0, width - tile[1] + 1, tile[1])
    ]


def rotate(array: np.ndarray, degrees: float) -> np.ndarray:
    """Turns an ``[H, W, ...]`` frame counterclockwise by a multiple of 90 degrees."""
    quarter = round(degrees / 90) % 4
    return np.ascontiguousarray(np.rot90(array, quarter)) if quarter else array

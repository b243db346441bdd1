"""Image and mask decoding with Pillow (JPEG, PNG, WebP, TIFF), EXIF orientation applied.

Images become ``[H, W, 3]`` uint8 RGB. Masks become ``[H, W]`` uint8 label
maps: a grey or palette PNG's values are the labels; an RGB mask is accepted
only when its three channels agree. A mask whose size differs from its image's
is brought to the image's size with nearest neighbour before anything else.
"""

from __future__ import annotations

import io
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import InputError
from .vision import VisionConfig, resize, shape_image, tile_origins

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".tif", ".tiff", ".bmp")

Source = str | os.PathLike[str] | bytes


def _open(source: Source, name: str) -> Any:
    from PIL import Image, ImageOps, UnidentifiedImageError

    if isinstance(source, bytes):
        if not source:
            raise InputError(name, "empty file (0 bytes)")
        handle: Any = io.BytesIO(source)
    else:
        try:
            if Path(source).stat().st_size == 0:
                raise InputError(name, "empty file (0 bytes)")
        except FileNotFoundError:
            raise InputError(name, "file not found") from None
        handle = str(source)
    Image.MAX_IMAGE_PIXELS = None  # whole-slide cores are large by design
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Truncated File Read": decoding below decides
            image = Image.open(handle)
            image.load()
            return ImageOps.exif_transpose(image)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise InputError(name, f"cannot decode image: {e}") from None


def decode_image(source: Source, name: str) -> np.ndarray:
    """``[H, W, 3]`` uint8 RGB, upright."""
    image = _open(source, name)
    if image.mode != "RGB":
        image = image.convert("RGB")
    return np.asarray(image)


def decode_mask(source: Source, name: str) -> np.ndarray:
    """``[H, W]`` uint8 labels, upright."""
    image = _open(source, name)
    if image.mode in ("L", "P"):
        return np.asarray(image)
    if image.mode in ("1", "I;16", "I", "F"):
        arr = np.asarray(image)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise InputError(
                name, f"mask values span {arr.min()}-{arr.max()}; labels must fit in 0-255"
            )
        return arr.astype(np.uint8)
    rgb = np.asarray(image.convert("RGB"))
    if not ((rgb[..., 0] == rgb[..., 1]).all() and (rgb[..., 1] == rgb[..., 2]).all()):
        raise InputError(name, "colour mask: store labels as a grey or palette image")
    return np.ascontiguousarray(rgb[..., 0])


def remap(mask: np.ndarray, table: tuple[tuple[int, int], ...] | None, name: str) -> np.ndarray:
    """Applies the label remap table; a value the table does not name is an error."""
    if table is None:
        return mask
    lut = np.full(256, -1, dtype=np.int16)
    for a, b in table:
        lut[a] = b
    out = lut[mask]
    if (out < 0).any():
        missing = sorted(set(np.unique(mask[out < 0]).tolist()))
        raise InputError(name, f"mask values {missing} are not in the remap table")
    return out.astype(np.uint8)


def consensus(masks: list[np.ndarray], fill: int) -> np.ndarray:
    """Per-pixel majority vote of the annotators' masks; ties go to the smaller label, no votes to ``fill``."""
    if not masks:
        raise ValueError("consensus of no masks")
    stack = np.stack(masks)
    labels = [v for v in np.unique(stack).tolist() if v != fill]
    best = np.full(stack.shape[1:], fill, dtype=np.uint8)
    best_count = np.zeros(stack.shape[1:], dtype=np.int32)
    for (
        v
    ) in labels:  # ascending, and only a strictly larger count wins: ties keep the smaller label
        count = (stack == v).sum(axis=0, dtype=np.int32)
        better = count > best_count
        best[better] = v
        best_count[better] = count[better]
    return best


@dataclass
class Patch:
    image: np.ndarray  # [h, w, 3]
    masks: dict[str, np.ndarray]  # name -> [h, w]
    origin: tuple[int, int]  # top-left (y, x) in the resized image; (0, 0) untiled


def shape_sample(image: np.ndarray, masks: dict[str, np.ndarray], cfg: VisionConfig) -> list[Patch]:
    """Resizes and crops an image and its masks identically, then tiles them when asked."""
    h, w = image.shape[:2]
    aligned = {n: resize(m, (h, w), nearest=True) for n, m in masks.items()}
    img = shape_image(image, cfg)  # ValueError when smaller than the crop
    shaped = {n: shape_image(m, cfg, nearest=True) for n, m in aligned.items()}
    if cfg.tile is None:
        return [Patch(img, shaped, (0, 0))]
    th, tw = cfg.tile
    return [
        Patch(
            np.ascontiguousarray(img[y : y + th, x : x + tw]),
            {n: np.ascontiguousarray(m[y : y + th, x : x + tw]) for n, m in shaped.items()},
            (y, x),
        )
        for y, x in tile_origins(*img.shape[:2], cfg.tile)
    ]

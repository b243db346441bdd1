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
from typing import Any

import numpy as np

from .decode import check_file
from .errors import InputError
from .vision import VisionConfig, shape_pil, tile_origins

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".tif", ".tiff", ".bmp")

Source = str | os.PathLike[str] | bytes


def _open(source: Source, name: str, cfg: VisionConfig, shrink_to: int | None = None) -> Any:
    """Opens, checks the pixel cap from the header, decodes and turns upright.

    ``shrink_to``: the short side a resize will bring the image to; a baseline
    JPEG then decodes at 1/2, 1/4 or 1/8 scale (never below that side) and only
    the pixels decoded count against the cap. Every other image (a progressive
    JPEG too) is held to the cap at its header's size.
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    check_file(source, name)
    handle: Any = io.BytesIO(source) if isinstance(source, bytes) else str(source)
    cap = cfg.max_image_pixels
    before = Image.MAX_IMAGE_PIXELS
    # Pillow checks the header's size in Image.open, before decoding; its warning
    # band (cap to 2x cap) is made an error so that the cap is the cap. A JPEG
    # that a draft can shrink may pass the header check with up to 64x the cap
    # (a 1/8 draft) and is held to the cap at its drafted size below; anything
    # not drafted is held to the cap at its header's size there.
    Image.MAX_IMAGE_PIXELS = cap * 64 if shrink_to else cap
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Truncated File Read": decoding below decides
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            try:
                image = Image.open(handle)
            except (Image.DecompressionBombError, Image.DecompressionBombWarning):
                raise InputError(name, _over_cap(_header_size(handle), cap)) from None
            # Only a baseline JPEG decodes reduced in memory: a progressive one
            # keeps coefficient buffers for the whole image whatever the draft.
            if (
                shrink_to
                and image.format == "JPEG"
                and not image.info.get("progressive")
                and not image.info.get("progression")
            ):
                image.draft(None, (shrink_to, shrink_to))
            if image.width * image.height > cap:
                raise InputError(name, _over_cap(image.size, cap))
            image.load()
            ImageOps.exif_transpose(image, in_place=True)
            return image
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise InputError(name, f"cannot decode image: {e}") from None
    finally:
        Image.MAX_IMAGE_PIXELS = before


def _header_size(handle: Any) -> tuple[int, int]:
    """The size a header states, read without decoding and without Pillow's cap."""
    from PIL import Image

    if isinstance(handle, io.BytesIO):
        handle.seek(0)
    Image.MAX_IMAGE_PIXELS = None  # restored by the caller; nothing is decoded here
    with Image.open(handle) as image:
        return image.size


def _over_cap(size: tuple[int, int], cap: int) -> str:
    w, h = size
    return (
        f"{w}x{h} image (width x height) is {w * h} pixels, over the {cap} pixel cap; "
        "if it is meant to be this large, raise the cap with --max-image-pixels "
        "(recipe max_image_pixels), which decoding needs about 3 bytes per pixel of memory"
    )


def load_image(
    source: Source, name: str, cfg: VisionConfig | None = None, *, draft: bool = True
) -> Any:
    """A Pillow RGB image, upright (kept as Pillow until it is resized: no full-size array copies).

    With ``cfg.size`` and ``draft``, a JPEG decodes at the largest reduction
    (1/2, 1/4 or 1/8, done in the DCT) that keeps its short side at least
    ``cfg.size``: the resize then starts from far fewer pixels. Images with
    masks are decoded at full size (``draft=False``) so that image and masks
    are resized from the same grid.
    """
    cfg = cfg or VisionConfig()
    image = _open(source, name, cfg, cfg.size if draft else None)
    return image if image.mode == "RGB" else image.convert("RGB")


def load_mask(source: Source, name: str, cfg: VisionConfig | None = None) -> Any:
    """A Pillow ``L`` image of labels, upright (always decoded at full size: labels are exact)."""
    from PIL import Image

    image = _open(source, name, cfg or VisionConfig())
    if image.mode == "L":
        return image
    if image.mode == "P":  # the palette indices are the labels, not the colours
        return Image.fromarray(np.asarray(image), "L")
    if image.mode in ("1", "I;16", "I", "F"):
        arr = np.asarray(image)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise InputError(
                name, f"mask values span {arr.min()}-{arr.max()}; labels must fit in 0-255"
            )
        return Image.fromarray(arr.astype(np.uint8), "L")
    rgb = np.asarray(image.convert("RGB"))
    if not ((rgb[..., 0] == rgb[..., 1]).all() and (rgb[..., 1] == rgb[..., 2]).all()):
        raise InputError(name, "colour mask: store labels as a grey or palette image")
    return Image.fromarray(np.ascontiguousarray(rgb[..., 0]), "L")


def remap(mask: Any, table: tuple[tuple[int, int], ...] | None, name: str) -> Any:
    """Applies the label remap table to an ``L`` mask image; a value the table does not name is an error."""
    if table is None:
        return mask
    mapping = dict(table)
    counts = mask.histogram()
    missing = [v for v in range(256) if counts[v] and v not in mapping]
    if missing:
        raise InputError(name, f"mask values {missing} are not in the remap table")
    return mask.point([mapping.get(v, 0) for v in range(256)])


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


def shape_sample(image: Any, masks: dict[str, Any], cfg: VisionConfig) -> list[Patch]:
    """Resizes and crops a Pillow image and its ``L`` masks identically, then tiles them when asked.

    ``masks`` values may also be a fill value (int): a missing annotator's mask,
    made at the output size directly.
    """
    from PIL import Image

    size = (image.width, image.height)
    img = shape_pil(image, cfg)  # ValueError when smaller than the crop
    shaped = {}
    for n, m in masks.items():
        if isinstance(m, int):
            shaped[n] = np.full(img.shape[:2], m, np.uint8)
            continue
        if m.size != size:  # an annotator's mask at another size: align it first
            m = m.resize(size, Image.Resampling.NEAREST)
        shaped[n] = shape_pil(m, cfg, nearest=True)
    if cfg.tile is None:
        return [Patch(img, shaped, (0, 0))]
    th, tw = cfg.tile
    height, width = img.shape[:2]
    return [
        Patch(
            np.ascontiguousarray(img[y : y + th, x : x + tw]),
            {n: np.ascontiguousarray(m[y : y + th, x : x + tw]) for n, m in shaped.items()},
            (y, x),
        )
        for y, x in tile_origins(height, width, cfg.tile)
    ]

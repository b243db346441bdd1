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

from dlop.formats.extras import needs_extra

from ..audio.decode import check_file
from ..errors import InputError
from .options import VisionConfig, resized_hw, shape_pil, tile_origins

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".tif", ".tiff", ".bmp")

Source = str | os.PathLike[str] | bytes
# Image.info key: the scale an exact JPEG draft decoded at (the full size is the size times it).
DRAFT_SCALE = "dlop.draft_scale"


def _open(
    source: Source, name: str, cfg: VisionConfig, shrink_to: int | None = None, exact: bool = False
) -> Any:
    """Opens, checks the pixel cap from the header, decodes and turns upright.

    ``shrink_to``: the short side a resize will bring the image to; a baseline
    JPEG then decodes at 1/2, 1/4 or 1/8 scale (never below that side) and only
    the pixels decoded count against the cap. Every other image (a progressive
    JPEG too) is held to the cap at its header's size.

    ``exact``: draft only at a scale ``s`` that divides both sides, so the
    decoded image is exactly the full size / ``s`` (the same field of view,
    whichever way EXIF turns it), recorded as ``info[DRAFT_SCALE]``. The image
    is then held to the cap at its full size, the size its masks are shaped at.
    """
    with needs_extra("compile", "decoding images"):
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
    Image.MAX_IMAGE_PIXELS = cap * 64 if shrink_to and not exact else cap
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
                scale = exact_scale(image.size, shrink_to) if exact else 0
                if scale > 1:
                    image.draft(None, (image.width // scale, image.height // scale))
                    image.info[DRAFT_SCALE] = scale
                elif not exact:
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


def exact_scale(size: tuple[int, int], shrink_to: int) -> int:
    """The largest JPEG draft scale (8, 4, 2, else 1) dividing both sides and keeping the short side >= ``shrink_to``."""
    w, h = size
    for s in (8, 4, 2):
        if w % s == 0 and h % s == 0 and min(w, h) // s >= shrink_to:
            return s
    return 1


def full_size(image: Any) -> tuple[int, int]:
    """(width, height) of the image before an exact draft reduced it (its own size when none did)."""
    scale = int(image.info.get(DRAFT_SCALE, 1))
    return image.width * scale, image.height * scale


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
    source: Source,
    name: str,
    cfg: VisionConfig | None = None,
    *,
    draft: bool = True,
    masked: bool = False,
) -> Any:
    """A Pillow RGB image, upright (kept as Pillow until it is resized: no full-size array copies).

    With ``cfg.size``, ``cfg.jpeg_draft`` and ``draft``, a baseline JPEG
    decodes at the largest reduction (1/2, 1/4 or 1/8, done in the DCT) that
    keeps its short side at least ``cfg.size``: the resize then starts from far
    fewer pixels. An image with masks (``masked``) is reduced only by a scale
    that divides both its sides (see ``exact_scale``), else decoded at full
    size, so that ``shape_sample`` resizes it and its full-size masks to the
    same grid.
    """
    cfg = cfg or VisionConfig()
    shrink_to = cfg.size if draft and cfg.jpeg_draft else None
    image = _open(source, name, cfg, shrink_to, exact=masked)
    return image if image.mode == "RGB" else image.convert("RGB")


def load_mask(source: Source, name: str, cfg: VisionConfig | None = None) -> Any:
    """A Pillow ``L`` image of labels, upright (always decoded at full size: labels are exact)."""
    with needs_extra("compile", "decoding images"):
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
    made at the output size directly. The output grid comes from the image's
    full size, so an image drafted exactly (``load_image(masked=True)``) and
    its full-size masks are resized to the same grid a full decode would give.
    """
    from PIL import Image

    size = full_size(image)
    grid = resized_hw(size[1], size[0], cfg.size)
    img = shape_pil(image, cfg, grid=grid)  # ValueError when smaller than the crop
    shaped = {}
    for n, m in masks.items():
        if isinstance(m, int):
            shaped[n] = np.full(img.shape[:2], m, np.uint8)
            continue
        if m.size != size:  # an annotator's mask at another size: align it first
            m = m.resize(size, Image.Resampling.NEAREST)
        shaped[n] = shape_pil(m, cfg, nearest=True, grid=grid)
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

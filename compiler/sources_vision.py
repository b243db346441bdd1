"""The video and image layouts under their former names (``compiler.layouts.charades`` and
``compiler.layouts.segmentation`` hold them)."""

from __future__ import annotations

from pathlib import Path

from .corpus import Corpus, ListOptions
from .layouts import charades as _charades
from .layouts import segmentation as _segmentation
from .layouts.segmentation import IMAGE_DIRS, RESERVED, field_name, match_stem

CHARADES_CSVS = _charades.CHARADES_CSVS
CHARADES_CLASSES = _charades.CHARADES_CLASSES
is_charades = _charades.detect
is_segmentation = _segmentation.detect

__all__ = [
    "CHARADES_CLASSES",
    "CHARADES_CSVS",
    "IMAGE_DIRS",
    "RESERVED",
    "charades",
    "field_name",
    "is_charades",
    "is_segmentation",
    "match_stem",
    "segmentation",
]


def charades(root: Path) -> Corpus:
    """A Charades corpus's listing (see compiler.layouts.charades)."""
    return _charades.list_corpus(root, ListOptions(media="video"))


def segmentation(root: Path, images: str | None, masks: tuple[str, ...] | None) -> Corpus:
    """An images-with-masks corpus's listing (see compiler.layouts.segmentation)."""
    return _segmentation.list_corpus(root, ListOptions(media="image", images=images, masks=masks))

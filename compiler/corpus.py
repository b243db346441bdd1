"""What a layout's listing gives: a Corpus of Items, in corpus order.

Item is the one record for every media for now (the decode and featurize
stages read it); a field that a media does not use stays at its default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import listing

MAX_LABEL = 2**31 - 1  # largest single class index a corpus may give
MAX_MULTI_LABELS = 1 << 16  # widest multi-hot ``labels`` vector (one byte per class per sample)


@dataclass
class Item:
    """One input: where its audio is, and what the corpus says about it."""

    key: str
    path: str | None = None  # file on disk
    member: tuple[str, str] | None = None  # webdataset: (tar path, audio extension)
    label: int | None = None
    text: str | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    offset: float = 0.0
    duration: float | None = None
    error: str | None = None  # known bad before decoding (e.g. a malformed manifest line)
    data: dict[str, bytes] | None = None  # webdataset: the sample's members by extension
    labels: list[int] | None = None  # multi-label classes (Charades actions, manifest "labels")
    masks: dict[str, str | None] | None = None  # segmentation: mask field -> file (None: missing)
    # webdataset: listing stopped at damage in this sample's tar, so the tar stream may not
    # hold it (it is bad either way)
    unread: bool = False


@dataclass
class Corpus:
    layout: str
    root: str
    items: list[Item]
    has_label: bool
    has_text: bool
    extra_fields: dict[str, str]  # name -> "i64" | "str"
    metadata: dict[str, Any]
    fingerprint: str
    media: str = "audio"
    num_labels: int = 0  # multi-hot width when items carry ``labels``
    mask_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class ListOptions:
    """What a compile asks of a layout's listing besides its SOURCE."""

    media: str = "audio"
    images: str | None = None  # segmentation: the images folder (default: detected)
    masks: tuple[str, ...] | None = None  # segmentation: mask folders (default: detected)


def fingerprint(items: list[Item], extra: bytes = b"") -> str:
    """sha256 over every input's key and size plus the corpus's listing files (``extra``)."""
    return listing.fingerprint(((it.key, it.path, it.offset, it.duration) for it in items), extra)

"""Corpus sources: the names the rest of the compiler imports, from where they now live.

Each layout is a module of ``compiler.layouts`` (its registry detects and
lists); the shared listing helpers are in ``compiler.listing`` and the
records in ``compiler.corpus``. Listing order is deterministic (sorted paths,
or file order for CSV, manifests and tars), so the same corpus always
compiles to the same shard bytes.
"""

from __future__ import annotations

from .corpus import MAX_LABEL, MAX_MULTI_LABELS, Corpus, Item, ListOptions
from .layouts import detect_layout, layout_media, names, open_corpus
from .layouts.webdataset import stream_webdataset, webdataset_fields
from .listing import (
    ALL_MEDIA_EXTS,
    AUDIO_EXTS,
    IMAGE_EXTS,
    MEDIA,
    MEDIA_EXTS,
    PROGRESS_NAME,
    VIDEO_EXTS,
    CsvRow,
    files_below,
    is_archive,
    key_name,
    media_of,
    name_key,
    read_csv,
    text_path,
    walk_files,
)

LAYOUTS = names()  # the built-in layouts, in detection order

__all__ = [
    "ALL_MEDIA_EXTS",
    "AUDIO_EXTS",
    "IMAGE_EXTS",
    "LAYOUTS",
    "MAX_LABEL",
    "MAX_MULTI_LABELS",
    "MEDIA",
    "MEDIA_EXTS",
    "PROGRESS_NAME",
    "VIDEO_EXTS",
    "Corpus",
    "CsvRow",
    "Item",
    "ListOptions",
    "detect_layout",
    "files_below",
    "is_archive",
    "key_name",
    "layout_media",
    "media_of",
    "name_key",
    "open_corpus",
    "read_csv",
    "stream_webdataset",
    "text_path",
    "walk_files",
    "webdataset_fields",
]

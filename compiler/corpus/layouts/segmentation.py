"""Images plus one mask folder per annotator; a mask matches an image's stem (plus an optional ``_suffix``)."""

from __future__ import annotations

import re
from pathlib import Path

from ...errors import CompileError
from ..listing import IMAGE_EXTS, name_key
from ..place import Place
from ..records import Corpus, Item, ListOptions, fingerprint

NAME = "segmentation"
MEDIA = ("image",)
SIGNS = "images + mask folders"
IMAGE_DIRS = ("images", "Images", "Train Imgs", "Train_Imgs", "train_imgs", "imgs")
_FIELD_CHARS = re.compile(r"[^A-Za-z0-9_.\-]")
RESERVED = {"key", "image", "frames", "label", "labels", "origin", "masks_present", "consensus"}


def _images_dir(root: Place, images: str | None) -> Place | None:
    if images:
        p = root.at(images) if Path(images).is_absolute() else root / images
        if not p.is_dir():
            raise CompileError(f"{p}: images folder not found")
        return p
    return next((root / n for n in IMAGE_DIRS if (root / n).is_dir()), None)


def _image_files(
    folder: Place, root: Place | None = None, allowed: tuple[str, ...] | None = None
) -> list[Place]:
    return folder.files_below(IMAGE_EXTS, corpus=root, allowed=allowed)


def _home(folder: Place, root: Place) -> Place:
    """What a folder's links may lead into: the corpus, or the folder itself when it was
    named outside the corpus (--images, --masks)."""
    return root if root in folder.parents or folder == root else folder


def match_stem(stem: str, image_stems: set[str]) -> str | None:
    """The image a mask file belongs to: its stem, or the longest image stem it starts with before a ``_``."""
    candidate = stem
    while True:
        if candidate in image_stems:
            return candidate
        cut = candidate.rfind("_")
        if cut <= 0:
            return None
        candidate = candidate[:cut]


def _mask_dirs(
    root: Place, images_dir: Place, stems: set[str], allowed: tuple[str, ...] | None = None
) -> list[Place]:
    found = []
    for d in root.subfolders(allowed):
        if d != images_dir and any(
            match_stem(f.stem, stems) for f in _image_files(d, root, allowed)
        ):
            found.append(d)
    return found


def detect(source: Place) -> bool:
    images_dir = _images_dir(source, None)
    if images_dir is None:
        return False
    stems = {f.stem for f in _image_files(images_dir)}
    return bool(stems) and bool(_mask_dirs(source, images_dir, stems))


def field_name(folder: str) -> str:
    """A mask folder's name as a field name (characters outside A-Z a-z 0-9 _ . - become _)."""
    name = _FIELD_CHARS.sub("_", folder)
    return f"mask_{name}" if name in RESERVED else name


def list_corpus(root: Place, options: ListOptions) -> Corpus:
    if not root.is_dir():
        raise CompileError(f"{root}: segmentation layout needs a folder")
    images_dir = _images_dir(root, options.images)
    if images_dir is None:
        raise CompileError(
            f"{root}: no images folder (looked for {', '.join(IMAGE_DIRS)}); pass --images DIR"
        )
    allowed = options.allow_paths
    files = _image_files(images_dir, _home(images_dir, root), allowed)
    by_stem: dict[str, Place] = {}
    for f in files:
        if f.stem in by_stem:
            raise CompileError(
                f"{f}: two images share the stem {f.stem!r} ({by_stem[f.stem].name})"
            )
        by_stem[f.stem] = f
    if options.masks:
        dirs = [root.at(m) if Path(m).is_absolute() else root / m for m in options.masks]
        for d in dirs:
            if not d.is_dir():
                raise CompileError(f"{d}: mask folder not found")
    else:
        dirs = _mask_dirs(root, images_dir, set(by_stem), allowed)
    names = [field_name(d.name) for d in dirs]
    if len(set(names)) != len(names):
        raise CompileError(
            f"mask folders {[d.name for d in dirs]} give clashing field names {names}"
        )
    found: dict[str, dict[str, Place]] = {n: {} for n in names}
    for name, d in zip(names, dirs, strict=True):
        for f in _image_files(d, _home(d, root), allowed):
            stem = match_stem(f.stem, set(by_stem))
            if stem is None:
                continue
            if stem in found[name]:
                raise CompileError(
                    f"{d}: two masks for image {stem!r} ({found[name][stem].name} and {f.name})"
                )
            found[name][stem] = f
    items = []
    for f in files:
        item = Item(key=name_key(str(f.relative_to(root))), path=str(f))
        item.masks = {n: str(found[n][f.stem]) if f.stem in found[n] else None for n in names}
        items.append(item)
    listing = "\n".join(
        f"{n}\0{name_key(str(p.relative_to(root)))}\0{p.size()}"
        for n in names
        for p in sorted(found[n].values())
    )
    return Corpus(
        "segmentation",
        str(root),
        items,
        False,
        False,
        {},
        {
            "mask_folders": {
                n: name_key(str(d.relative_to(root)) if d.is_relative_to(root) else str(d))
                for n, d in zip(names, dirs, strict=True)
            }
        },
        fingerprint(items, listing.encode(), root),
        media="image",
        mask_names=tuple(names),
    )

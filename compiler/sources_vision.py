"""Video and image corpus layouts (REFERENCE §5): Charades and images with mask folders."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from .errors import CompileError
from .sources import (
    IMAGE_EXTS,
    VIDEO_EXTS,
    Corpus,
    Item,
    _fingerprint,
    files_below,
    is_archive,
    name_key,
    read_csv,
)

CHARADES_CSVS = ("Charades_v1_train.csv", "Charades_v1_test.csv")
CHARADES_CLASSES = 157
IMAGE_DIRS = ("images", "Images", "Train Imgs", "Train_Imgs", "train_imgs", "imgs")
_SPAN = re.compile(r"^c(\d{3})\s+(-?\d+(?:\.\d+)?)\s+(-?\d+(?:\.\d+)?)$")
_FIELD_CHARS = re.compile(r"[^A-Za-z0-9_.\-]")
RESERVED = {"key", "image", "frames", "label", "labels", "origin", "masks_present", "consensus"}


def is_charades(root: Path) -> bool:
    return any((root / name).is_file() for name in CHARADES_CSVS)


def charades(root: Path) -> Corpus:
    """Charades: the CSVs' rows in file order (train, then test), videos ``<id>.<ext>`` anywhere below."""
    csvs = [root / n for n in CHARADES_CSVS if (root / n).is_file()]
    if not csvs:
        raise CompileError(f"{root}: charades layout needs {' or '.join(CHARADES_CSVS)}")
    videos: dict[str, Path] = {}
    for f in files_below(root, VIDEO_EXTS):
        videos.setdefault(f.stem, f)  # the first by sorted path when one id has several files
    classes = [f"c{i:03d}" for i in range(CHARADES_CLASSES)]
    names_file = root / "Charades_v1_classes.txt"
    meta = hashlib.sha256()
    if names_file.is_file():
        try:
            names_text = names_file.read_bytes().decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise CompileError(
                f"{names_file}: not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8"
            ) from None
        for line in names_text.splitlines():
            code, _, name = line.strip().partition(" ")
            if _SPAN.match(f"{code} 0 0") and int(code[1:]) < CHARADES_CLASSES:
                classes[int(code[1:])] = name or code
    items: list[Item] = []
    for table in csvs:
        raw, rows = read_csv(table, root, {"id", "actions"})
        meta.update(raw)
        split = "train" if "train" in table.name else "test"
        for row in rows:
            n = row.line
            vid = row.fields.get("id", "").strip()
            if row.error is not None:
                items.append(
                    Item(key=name_key(vid) if vid else f"{table.name} line {n}", error=row.error)
                )
                continue
            video = videos.get(vid)
            key = name_key(str(video.relative_to(root))) if video else vid
            item = Item(key=key, path=str(video) if video else None)
            item.extras = {"video_id": vid, "split": split, "actions": row.fields["actions"]}
            labels: set[int] = set()
            for span in filter(None, (s.strip() for s in row.fields["actions"].split(";"))):
                m = _SPAN.match(span)
                if not m or int(m.group(1)) >= CHARADES_CLASSES:
                    item.error = f"{table.name} line {n}: action {span!r} is not 'cNNN START END'"
                    break
                labels.add(int(m.group(1)))
            item.labels = sorted(labels)
            if video is None and item.error is None:
                item.error = f"{table.name} line {n}: no video named {vid}.<ext> below {root}"
            items.append(item)
    return Corpus(
        "charades",
        str(root),
        items,
        False,
        False,
        {"video_id": "str", "split": "str", "actions": "str"},
        {"label_classes": classes},
        _fingerprint(root, items, meta.digest()),
        media="video",
        num_labels=CHARADES_CLASSES,
    )


def _images_dir(root: Path, images: str | None) -> Path | None:
    if images:
        p = Path(images)
        p = p if p.is_absolute() else root / p
        if not p.is_dir():
            raise CompileError(f"{p}: images folder not found")
        return p
    return next((root / n for n in IMAGE_DIRS if (root / n).is_dir()), None)


def _image_files(folder: Path) -> list[Path]:
    return files_below(folder, IMAGE_EXTS)


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


def _mask_dirs(root: Path, images_dir: Path, stems: set[str]) -> list[Path]:
    found = []
    for d in sorted(
        p for p in root.iterdir() if p.is_dir() and p != images_dir and not is_archive(p)
    ):
        if any(match_stem(f.stem, stems) for f in _image_files(d)):
            found.append(d)
    return found


def is_segmentation(root: Path) -> bool:
    images_dir = _images_dir(root, None)
    if images_dir is None:
        return False
    stems = {f.stem for f in _image_files(images_dir)}
    return bool(stems) and bool(_mask_dirs(root, images_dir, stems))


def field_name(folder: str) -> str:
    """A mask folder's name as a field name (characters outside A-Z a-z 0-9 _ . - become _)."""
    name = _FIELD_CHARS.sub("_", folder)
    return f"mask_{name}" if name in RESERVED else name


def segmentation(root: Path, images: str | None, masks: tuple[str, ...] | None) -> Corpus:
    """Images plus one mask folder per annotator; masks match an image's stem (plus an optional ``_suffix``)."""
    if not root.is_dir():
        raise CompileError(f"{root}: segmentation layout needs a folder")
    images_dir = _images_dir(root, images)
    if images_dir is None:
        raise CompileError(
            f"{root}: no images folder (looked for {', '.join(IMAGE_DIRS)}); pass --images DIR"
        )
    files = _image_files(images_dir)
    by_stem: dict[str, Path] = {}
    for f in files:
        if f.stem in by_stem:
            raise CompileError(
                f"{f}: two images share the stem {f.stem!r} ({by_stem[f.stem].name})"
            )
        by_stem[f.stem] = f
    if masks:
        dirs = [Path(m) if Path(m).is_absolute() else root / m for m in masks]
        for d in dirs:
            if not d.is_dir():
                raise CompileError(f"{d}: mask folder not found")
    else:
        dirs = _mask_dirs(root, images_dir, set(by_stem))
    names = [field_name(d.name) for d in dirs]
    if len(set(names)) != len(names):
        raise CompileError(
            f"mask folders {[d.name for d in dirs]} give clashing field names {names}"
        )
    found: dict[str, dict[str, Path]] = {n: {} for n in names}
    for name, d in zip(names, dirs, strict=True):
        for f in _image_files(d):
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
        f"{n}\0{name_key(str(p.relative_to(root)))}\0{p.stat().st_size}"
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
                n: name_key(str(d.relative_to(root) if d.is_relative_to(root) else d))
                for n, d in zip(names, dirs, strict=True)
            }
        },
        _fingerprint(root, items, listing.encode()),
        media="image",
        mask_names=tuple(names),
    )

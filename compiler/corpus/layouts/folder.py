"""One subfolder per class, holding the media files at any depth; labels in sorted folder order."""

from __future__ import annotations

from ...errors import CompileError
from ..listing import ALL_MEDIA_EXTS, MEDIA_EXTS, media_of, name_key
from ..place import Place, is_archive
from ..records import Corpus, Item, ListOptions, fingerprint

NAME = "folder"
MEDIA = ("audio", "video", "image")
SIGNS = "class subfolders holding media"
FALLBACK = True  # any folder of folders of media looks like this; asked last


def _class_folders(
    root: Place, exts: tuple[str, ...] | frozenset[str], allowed: tuple[str, ...] | None = None
) -> list[Place]:
    """Subfolders that hold media (at any depth); hidden folders and archives are no classes."""
    return [
        p
        for p in root.subfolders(allowed)
        if not p.name.startswith(".")
        and next(p.walk(exts, corpus=root, allowed=allowed), None) is not None
    ]


def detect(source: Place) -> bool:
    return bool(_class_folders(source, ALL_MEDIA_EXTS))


def source_media(source: Place) -> str:
    """The media most of the folder's files are (audio when it is no folder)."""
    if not source.is_dir():
        return "audio"
    return media_of(source.walk(ALL_MEDIA_EXTS))


def list_corpus(root: Place, options: ListOptions) -> Corpus:
    media = options.media
    if not root.is_dir():
        raise CompileError(f"{root}: folder layout needs a folder")
    if is_archive(root):
        raise CompileError(f"{root}: is a dlop archive, not a corpus")
    folders = _class_folders(root, MEDIA_EXTS[media], options.allow_paths)
    if not folders:
        raise CompileError(f"{root}: folder layout needs one subfolder of {media} files per class")
    classes = [name_key(p.name) for p in folders]
    items = []
    for label, folder in enumerate(folders):
        for f in folder.files_below(MEDIA_EXTS[media], corpus=root, allowed=options.allow_paths):
            items.append(Item(key=name_key(str(f.relative_to(root))), path=str(f), label=label))
    return Corpus(
        "folder",
        str(root),
        items,
        True,
        False,
        {},
        {"classes": classes},
        fingerprint(items, root=root),
        media=media,
    )

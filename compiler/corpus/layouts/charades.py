"""Charades: the CSVs' rows in file order (train, then test), videos ``<id>.<ext>`` anywhere below."""

from __future__ import annotations

import hashlib
import re

from ...errors import CompileError
from ..listing import VIDEO_EXTS, name_key, read_csv
from ..place import Place
from ..records import Corpus, Item, ListOptions, fingerprint

NAME = "charades"
MEDIA = ("video",)
SIGNS = "Charades_v1_*.csv"
CHARADES_CSVS = ("Charades_v1_train.csv", "Charades_v1_test.csv")
CHARADES_CLASSES = 157
_SPAN = re.compile(r"^c(\d{3})\s+(-?\d+(?:\.\d+)?)\s+(-?\d+(?:\.\d+)?)$")


def detect(source: Place) -> bool:
    return any((source / name).is_file() for name in CHARADES_CSVS)


def list_corpus(root: Place, options: ListOptions) -> Corpus:
    csvs = [root / n for n in CHARADES_CSVS if (root / n).is_file()]
    if not csvs:
        raise CompileError(f"{root}: charades layout needs {' or '.join(CHARADES_CSVS)}")
    videos: dict[str, Place] = {}
    for f in root.files_below(VIDEO_EXTS, allowed=options.allow_paths):
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
        fingerprint(items, meta.digest(), root),
        media="video",
        num_labels=CHARADES_CLASSES,
    )

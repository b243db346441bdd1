"""LibriSpeech: FLAC files beside ``SPK-CHAP.trans.txt`` transcripts, in key order."""

from __future__ import annotations

import hashlib

from ..listing import lines, name_key, utf8
from ..place import Place
from ..records import Corpus, Item, ListOptions, fingerprint

NAME = "librispeech"
MEDIA = ("audio",)
SIGNS = "*.trans.txt"


def detect(source: Place) -> bool:
    # by extension first: only .txt files are asked whether they are files
    return any(f.name.endswith(".trans.txt") for f in source.walk((".txt",)))


def list_corpus(root: Place, options: ListOptions) -> Corpus:
    items, meta = [], hashlib.sha256()
    for trans in root.files_below(allowed=options.allow_paths):
        if not trans.name.endswith(".trans.txt"):
            continue
        raw = trans.read_bytes()
        meta.update(raw)
        rel = name_key(str(trans.relative_to(root)))
        for n, offset, data in lines(raw, rel):
            line, error = utf8(data, f"{rel} line {n}", offset)
            if not line.strip():
                continue
            utt, _, text = line.strip().partition(" ")
            audio = trans.parent / f"{utt}.flac"
            key = name_key(str(audio.relative_to(root)))
            parts = utt.split("-")
            if error is None and (
                len(parts) != 3
                or not all(p.isascii() and p.isdigit() and len(p) < 19 for p in parts)
            ):
                error = f"{rel} line {n}: utterance id {name_key(utt)!r} is not SPK-CHAP-UTT"
            if error is not None:
                items.append(Item(key=key, error=error))
                continue
            items.append(
                Item(
                    key=key,
                    path=str(audio),
                    text=text,
                    extras={"speaker": int(parts[0]), "chapter": int(parts[1])},
                )
            )
    items.sort(key=lambda it: it.key)
    return Corpus(
        "librispeech",
        str(root),
        items,
        False,
        True,
        {"speaker": "i64", "chapter": "i64"},
        {},
        fingerprint(items, meta.digest(), root),
    )

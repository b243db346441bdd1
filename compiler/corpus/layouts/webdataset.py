"""WebDataset tar shards: raw audio members plus .cls / .txt / .json, grouped by key.

Members are read as bytes and never decoded by extension, so nothing in a tar
is ever unpickled or executed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import re
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dlop.formats.extras import needs_extra
from dlop.formats.urls import is_url

from ...errors import CompileError
from ..listing import AUDIO_EXTS, is_text, name_bytes, name_key
from ..place import Place, source_place
from ..records import MAX_LABEL, Corpus, Item, ListOptions

NAME = "webdataset"
MEDIA = ("audio",)
SIGNS = "*.tar shards"


def _is_pattern(source: Place) -> bool:
    """A brace pattern (``train-{000..099}.tar``) rather than a file or folder."""
    return "{" in str(source) and not source.exists()


def detect(source: Place) -> bool:
    if _is_pattern(source):
        return True
    if source.is_file():
        return source.suffix == ".tar"
    return source.is_dir() and next(source.glob("*.tar"), None) is not None


def _tar_paths(source: Place) -> list[Place]:
    if source.is_dir():
        return sorted(source.glob("*.tar"))
    if "{" in str(source):
        import braceexpand  # a webdataset dependency

        return [source.at(p) for p in braceexpand.braceexpand(str(source))]
    return [source]


def list_corpus(source: Place, options: ListOptions) -> Corpus:
    """Every sample of every tar, in tar order then member order."""
    tars = _tar_paths(source)
    if not tars:
        raise CompileError(f"{source}: no .tar shards found")
    items: list[Item] = []
    h = hashlib.sha256()
    has_label = has_text = False
    for tar in tars:
        if not tar.is_file():
            raise CompileError(f"{tar}: tar shard not found")
        h.update(name_bytes(tar.name) + f"\0{tar.size()}\n".encode())
        for position, (key, members, damage) in enumerate(_group_members(tar)):
            exts = [m[len(key) + 1 :].lower() for m in members]
            audio = [e for e in exts if f".{e}" in AUDIO_EXTS]
            # every item names its tar, so the stream reads each tar on its own
            member = (str(tar), audio[0] if len(audio) == 1 else "")
            item = Item(key=name_key(key), member=member, position=position)
            if damage is not None:
                item.error, item.unread = damage, True
            elif len(audio) != 1:
                item.error = (
                    f"{name_key(tar.name)}: sample {item.key!r} has {len(audio)} audio members"
                )
            has_label |= "cls" in exts or "json" in exts
            has_text |= "txt" in exts
            items.append(item)
    return Corpus("webdataset", str(source), items, has_label, has_text, {}, {}, h.hexdigest())


def _group_members(tar: Place) -> Iterator[tuple[str, list[str], str | None]]:
    """Consecutive members sharing a key (everything before the first '.' of the basename),
    each group with the damage that ended the tar's listing inside it, if any.

    A tar that cannot be read at all is one damaged group named for the tar; one whose
    member's header claims more bytes than the file holds, or that breaks off, ends there
    with the group it broke off in marked damaged.
    """
    current: str | None = None
    group: list[str] = []
    where = name_key(tar.name)
    try:
        size = tar.asked_size()
        handle = tar.open("rb")
    except OSError as e:
        yield tar.name, [], f"{where}: not a readable tar file ({e})"
        return
    with handle:  # a file object (a local file, or the storage's) tarfile seeks over
        try:
            tf = tarfile.open(fileobj=handle)  # noqa: SIM115 - closed by the with below
        except (tarfile.TarError, OSError, EOFError) as e:
            yield tar.name, [], f"{where}: not a readable tar file ({e})"
            return
        with tf:
            members = iter(tf)
            while True:
                try:
                    m = next(members, None)
                except (tarfile.TarError, OSError, EOFError) as e:
                    damage = f"{where}: broken off after byte {tf.offset} ({e})"
                    yield (current or tar.name), group, damage
                    return
                if m is None:
                    break
                key = _sample_key(m.name) if m.isfile() else None
                if key is None:
                    continue
                if key != current and group:
                    yield current or "", group, None
                    group = []
                current = key
                group.append(m.name)
                if m.offset_data + m.size > size:
                    damage = (
                        f"{where}: member {name_key(m.name)!r} at byte {m.offset_data} claims "
                        f"{m.size} bytes, but the file ends at byte {size} (truncated tar)"
                    )
                    yield key, group, damage
                    return
    if group:
        yield current or "", group, None


# The members webdataset's tar reader passes over (its tar_file_iterator defaults).
_META = re.compile(r"__[^/]*__($|/)")


def _sample_key(name: str) -> str | None:
    """The key webdataset groups a member under (everything before the first '.' of the
    basename), or None for a member it passes over: a name with no '.' (a README) or a
    ``__meta__`` name. The listing groups as the stream will."""
    with needs_extra("compile", "reading WebDataset tars (layout webdataset)"):
        from webdataset.tariterators import base_plus_ext

    if _META.match(name) or ("/" not in name and name.startswith("__") and name.endswith("__")):
        return None
    key: str | None = base_plus_ext(name)[0]
    return key


def stream_webdataset(corpus: Corpus, start: int = 0, stop: int | None = None) -> Iterator[Item]:
    """The corpus's items [start, stop), each a copy with its members' bytes, read with
    webdataset (the corpus's own items stay light).

    Samples come back as raw bytes: nothing is decoded here, so no member is
    ever unpickled or executed. Each tar is read on its own from the first
    wanted sample (items name their place in the tar, so any slice of the
    items streams alike); a sample the listing found damaged is passed on as
    the bad input it is, and one the tar stream cannot deliver becomes a bad
    input naming the stream's error.
    """
    with needs_extra("compile", "reading WebDataset tars (layout webdataset)"):
        import webdataset as wds

    items = corpus.items[start:stop]
    for tar, run in itertools.groupby(items, key=lambda it: (it.member or ("", ""))[0]):
        todo = list(run)
        failures: list[BaseException] = []

        def halt(e: BaseException, failures: list[BaseException] = failures) -> bool:
            failures.append(e)
            return False  # stop reading this tar; its undelivered samples are bad inputs

        samples = _tar_samples(wds, tar, halt, corpus.storage_options)
        # samples before the first wanted one are passed over, not kept
        yield from _matched(
            itertools.islice(samples, max(0, todo[0].position), None), tar, todo, failures
        )


def _matched(
    samples: Iterator[Any], tar: str, todo: list[Item], failures: list[BaseException]
) -> Iterator[Item]:
    """Each listed item with the tar stream's sample of its key, in order."""
    held: dict[str, Any] | None = None
    for item in todo:
        sample = held if held is not None else next(samples, None)
        held = None
        got = None if sample is None else name_key(str(sample.get("__key__")))
        if got != item.key:
            if item.unread:
                held = sample  # the damaged sample never came; this one is the next's
                yield item
            elif sample is None and failures:
                why = f"{name_key(Path(tar).name)}: the tar stream stopped ({failures[0]})"
                yield dataclasses.replace(item, error=why)
            else:
                raise CompileError(
                    f"{tar}: tar stream gave sample {got!r} where {item.key!r} was listed; the "
                    "tar changed during the compile"
                )
        elif item.unread:
            yield item
        else:
            data = {
                k: v
                for k, v in (sample or {}).items()
                if not k.startswith("__") and isinstance(v, bytes)
            }
            yield dataclasses.replace(item, data=data)


def _tar_samples(
    wds: Any, tar: str, stop: Callable[[BaseException], bool], options: dict[str, Any]
) -> Iterator[Any]:
    """One tar's samples as webdataset groups them; a URL tar is read as one fsspec stream."""
    if not is_url(tar):
        return iter(wds.WebDataset([tar], shardshuffle=False, empty_check=False, handler=stop))
    from webdataset.tariterators import group_by_keys, tar_file_expander

    def opened() -> Iterator[dict[str, Any]]:
        with source_place(tar, options).open("rb") as f:
            yield {"url": tar, "stream": f}

    samples: Iterator[Any] = group_by_keys(tar_file_expander(opened(), handler=stop), handler=stop)
    return samples


def stream(corpus: Corpus, start: int, stop: int | None) -> Iterator[Item]:
    """The registry's hook: items [start, stop) with their members' bytes."""
    return stream_webdataset(corpus, start, stop)


def webdataset_fields(item: Item) -> None:
    """Fills label/text from the item's cls/txt/json member bytes; a bad one sets item.error."""
    data = item.data or {}
    try:
        cls = data["cls"].decode("utf-8").strip() if "cls" in data else None
        txt = data["txt"].decode("utf-8").strip() if "txt" in data else None
    except UnicodeDecodeError as e:
        item.error = f"{item.key}: a .cls or .txt member is not UTF-8 text (byte {e.start})"
        return
    if cls is not None:
        try:
            item.label = int(cls)
        except ValueError:
            item.error = f"{item.key}.cls: {cls[:40]!r} is not an integer class"
            return
    if txt is not None:  # items of other layouts carry their text already
        item.text = txt
    if "json" in data:
        try:
            obj = json.loads(data["json"])
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            item.error = f"{item.key}.json: not JSON ({e})"
            return
        if isinstance(obj, dict):
            if item.label is None and type(obj.get("label")) is int:
                item.label = obj["label"]
            if item.text is None and isinstance(obj.get("text"), str):
                item.text = obj["text"]
    if item.label is not None and not 0 <= item.label <= MAX_LABEL:
        item.error = f"{item.key}: label {item.label} is not a class index from 0 to {MAX_LABEL}"
    elif item.text is not None and not is_text(item.text):
        item.error = f"{item.key}: text holds an unpaired surrogate escape, which is no text"

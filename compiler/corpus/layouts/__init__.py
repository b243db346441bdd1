"""The corpus layouts (docs/compile.md, Layouts): one module per layout, found here and asked in one place.

A layout module defines::

    NAME = "esc50"                 # the --layout word
    MEDIA = ("audio",)             # the media it can hold; the first is its default
    SIGNS = "meta/esc50.csv"       # what detection looks for, for messages
    FALLBACK = False               # optional: asked only when no other layout matches
    def detect(source: Place) -> bool
    def list_corpus(source: Place, options: ListOptions) -> Corpus
    def source_media(source: Place) -> str   # optional: the media this SOURCE holds
    def stream(corpus: Corpus, start: int, stop: int | None) -> Iterator[Item]
        # optional: the items [start, stop) with their bytes filled in (Item.data), read
        # in corpus order; for layouts whose inputs live inside container files (tar
        # members, Parquet rows) and are cheaper to read in one pass than one by one.
        # Without it a compile takes corpus.items[start:stop] as listed.

``source`` is a ``compiler.corpus.place.Place``: a local file or folder, or, for a
URL SOURCE (``s3://``, ``gs://``, ``https://``), an object or prefix whose questions
go to one listing of its storage. A layout that reads files only through its Place
(and the helpers of ``compiler.corpus.listing``) lists URLs as it lists folders.

Every module in this package whose name does not start with ``_`` is
registered when the package is imported, so adding a layout is adding a
file; ``register`` adds one from elsewhere. A layout module imports the
shared listing helpers (``compiler.corpus.listing``, ``compiler.corpus.records``), never
another layout.

Detection asks every layout that is not a fallback, in name order; one
match is the layout, two or more are an error asking for ``--layout``. Only
when none matches are the fallbacks asked (``folder``), in name order, the
first match winning.
"""

from __future__ import annotations

import importlib
import itertools
import pkgutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

from ...errors import CompileError
from ..listing import MEDIA, collector_paused
from ..place import Place, forget_real_paths, is_archive, source_place
from ..records import Corpus, Item, Known, ListOptions, Picked


@dataclass(frozen=True)
class Layout:
    """One registered layout: its module's names, checked once at registration."""

    name: str
    media: tuple[str, ...]
    signs: str
    fallback: bool
    detect: Callable[[Place], bool]
    list: Callable[[Place, ListOptions], Corpus]
    source_media: Callable[[Place], str]
    stream: Callable[[Corpus, int, int | None], Iterator[Item]] | None = None


_REGISTRY: dict[str, Layout] = {}


def register(module: ModuleType) -> Layout:
    """Adds a layout module to the registry (see the module docstring for what it defines)."""
    missing = [
        a for a in ("NAME", "MEDIA", "SIGNS", "detect", "list_corpus") if not hasattr(module, a)
    ]
    if missing:
        raise CompileError(f"layout module {module.__name__} lacks {', '.join(missing)}")
    name = module.NAME
    if name in _REGISTRY:
        raise CompileError(
            f"layout module {module.__name__}: layout {name!r} is registered already"
        )
    media = tuple(module.MEDIA)
    if not media or not set(media) <= set(MEDIA):
        raise CompileError(f"layout {name}: MEDIA {media} must name some of {MEDIA}")
    default = media[0]
    layout = Layout(
        name=name,
        media=media,
        signs=module.SIGNS,
        fallback=bool(getattr(module, "FALLBACK", False)),
        detect=module.detect,
        list=module.list_corpus,
        source_media=getattr(module, "source_media", lambda source: default),
        stream=getattr(module, "stream", None),
    )
    _REGISTRY[name] = layout
    return layout


def unregister(name: str) -> None:
    """Drops a layout that ``register`` added."""
    _REGISTRY.pop(name, None)


def _discover() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            register(importlib.import_module(f"{__name__}.{info.name}"))


def names() -> tuple[str, ...]:
    """The registered layouts' names, in detection order."""
    return tuple(layout.name for layout in _in_order())


def _in_order() -> list[Layout]:
    return sorted(_REGISTRY.values(), key=lambda layout: (layout.fallback, layout.name))


def get(name: str) -> Layout:
    layout = _REGISTRY.get(name)
    if layout is None:
        raise CompileError(f"unknown layout {name!r}; choose one of {names()}")
    return layout


def detect_layout(source: Place) -> str:
    """The one layout that recognises ``source`` (see the module docstring for the order)."""
    if source.is_dir() and is_archive(source):
        raise CompileError(
            f"{source}: is a dlop archive (or an interrupted compile's output), not a corpus; "
            "to rebuild it, pass it as --recipe"
        )
    ordered = _in_order()
    found = [layout.name for layout in ordered if not layout.fallback and layout.detect(source)]
    if len(found) > 1:
        raise CompileError(
            f"{source}: layout is ambiguous ({' and '.join(found)} match); pass --layout"
        )
    if found:
        return found[0]
    if not source.exists() and not source.is_link():
        raise CompileError(f"{source}: no such file or directory")
    fallback = next((la.name for la in ordered if la.fallback and la.detect(source)), None)
    if fallback is not None:
        return fallback
    signs = [layout.signs for layout in ordered]
    raise CompileError(
        f"{source}: cannot tell the layout (found no {', '.join(signs[:-1])} or {signs[-1]}); "
        "pass --layout"
    )


def layout_media(layout: str, source: Place) -> str:
    """The media a layout's SOURCE holds (told by its files where the layout holds several)."""
    return get(layout).source_media(source)


def stream_items(corpus: Corpus, start: int = 0, stop: int | None = None) -> Iterator[Item]:
    """The corpus's items [start, stop) in corpus order, through the layout's ``stream``
    where it has one (see the module docstring)."""
    forget_real_paths()
    if isinstance(corpus.items, Picked):  # an append's inputs: each run as a slice
        picked, whole = corpus.items, replace(corpus, items=corpus.items.base, ids=None)
        return itertools.chain.from_iterable(
            stream_items(whole, a, b) for a, b in picked.runs(start, stop)
        )
    layout = _REGISTRY.get(corpus.layout)
    if layout is not None and layout.stream is not None:
        want = len(range(len(corpus.items))[start:stop])
        return _exactly(layout.stream(corpus, start, stop), want, layout.name, start)
    if not isinstance(corpus.items, list):  # a compact listing: made from ``start``, not 0
        return iter(corpus.items[start:stop])
    return itertools.islice(corpus.items, start, stop)


def _exactly(items: Iterator[Item], want: int, layout: str, start: int) -> Iterator[Item]:
    """A layout's stream, held to giving exactly the ``want`` items asked for: a work unit
    takes its inputs by count, so one too few or too many would shift every later input
    into the wrong place."""
    got = 0
    for item in items:
        got += 1
        if got > want:
            break
        yield item
    if got != want:
        raise CompileError(
            f"layout {layout}: asked to stream {want} inputs from input {start}, it gave "
            f"{'more' if got > want else got}; a layout's stream must give exactly the items "
            "asked for"
        )


def open_corpus(
    source: str,
    layout: str | None,
    media: str | None = None,
    images: str | None = None,
    masks: tuple[str, ...] | None = None,
    *,
    text_column: str | None = None,
    label_column: str | None = None,
    keep_columns: tuple[str, ...] = (),
    storage_options: dict[str, Any] | None = None,
    allow_paths: tuple[str, ...] = (),
    known: Known | None = None,
) -> Corpus:
    """Lists ``source`` (a path or URL) with its layout (detected when None) into a Corpus,
    in corpus order; ``storage_options`` reach the filesystem of a URL (compiler.urls).
    ``known``: an append's, what its archive says of the listing it read (a layout that
    lists from one file may list the lines after it only, Corpus.after)."""
    forget_real_paths()
    path = source_place(source, storage_options)
    chosen = get(layout or detect_layout(path))
    media = media or chosen.source_media(path)
    if media not in chosen.media:
        raise CompileError(
            f"layout {chosen.name} holds {' or '.join(chosen.media)}, not {media}; "
            "drop --media or pick another --layout"
        )
    options = ListOptions(
        media=media,
        images=images,
        masks=masks,
        text_column=text_column,
        label_column=label_column,
        keep_columns=keep_columns,
        allow_paths=allow_paths,
        known=known,
    )
    with collector_paused():
        corpus = chosen.list(path, options)
    corpus.storage_options = dict(storage_options or {})
    corpus.allow_paths = allow_paths
    return corpus


_discover()

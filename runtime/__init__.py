"""Training-time loading: open archives, order, gather, transfer, augment.

``open_archive`` gives a map-style Dataset (fast with a plain DataLoader
through ``__getitems__``); ``Loader`` is the faster, resumable, DDP-aware
iterator; ``IterableArchive`` serves DataLoader worker processes. Both
``open_archive`` and ``Loader`` read several archives as one and choose
samples (``where=``, ``indices=``); ``Loader`` also mixes sources by weight.

Inside: ``archive`` (the Dataset, opening, selections), ``storage`` (where shard bytes
come from: mapped files, object storage, the node-local cache), ``order`` (which
samples each batch holds), ``gather`` (copying them into buffers), ``pipeline``
(rings, prefetch, the device copy) and ``transforms`` (augmentations); ``loader`` and
``iterable`` are the two front ends.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The names below load on first use (PEP 562): importing one runtime module, such as
# the shard cache's for ``dlop-inspect cache``, does not load torch and the front ends.
_WHERE = {
    "Archive": ".archive.dataset",
    "count_selected": ".archive.opening",
    "open_archive": ".archive.opening",
    "Batch": ".batch",
    "batch_as_is": ".batch",
    "LoaderError": ".errors",
    "SampleIndexError": ".errors",
    "ShardChangedError": ".errors",
    "UsageError": ".errors",
    "UsageTypeError": ".errors",
    "IterableArchive": ".iterable",
    "Loader": ".loader",
    "OrderSpec": ".order.epochs",
    "epoch_order": ".order.epochs",
    "rank_batches": ".order.epochs",
    "Source": ".order.mixture",
    "ReadingOptions": ".order.reading",
    "Mixup": ".transforms.audio",
    "RandomTimeCrop": ".transforms.audio",
    "SpecAugment": ".transforms.audio",
    "Normalize": ".transforms.vision",
    "RandomHorizontalFlip": ".transforms.vision",
    "RandomResizedCrop": ".transforms.vision",
    "RandomTemporalCrop": ".transforms.vision",
}

if TYPE_CHECKING:
    from .archive.dataset import Archive
    from .archive.opening import count_selected, open_archive
    from .batch import Batch, batch_as_is
    from .errors import (
        LoaderError,
        SampleIndexError,
        ShardChangedError,
        UsageError,
        UsageTypeError,
    )
    from .iterable import IterableArchive
    from .loader import Loader
    from .order.epochs import OrderSpec, epoch_order, rank_batches
    from .order.mixture import Source
    from .order.reading import ReadingOptions
    from .transforms.audio import Mixup, RandomTimeCrop, SpecAugment
    from .transforms.vision import (
        Normalize,
        RandomHorizontalFlip,
        RandomResizedCrop,
        RandomTemporalCrop,
    )


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


__all__ = [
    "Archive",
    "Batch",
    "IterableArchive",
    "Loader",
    "LoaderError",
    "Mixup",
    "Normalize",
    "OrderSpec",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "RandomTemporalCrop",
    "RandomTimeCrop",
    "ReadingOptions",
    "SampleIndexError",
    "ShardChangedError",
    "Source",
    "SpecAugment",
    "UsageError",
    "UsageTypeError",
    "batch_as_is",
    "count_selected",
    "epoch_order",
    "open_archive",
    "rank_batches",
]

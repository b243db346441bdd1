"""Training-time loading: open archives, order, gather, transfer, augment.

``open_archive`` gives a map-style Dataset (fast with a plain DataLoader
through ``__getitems__``); ``Loader`` is the faster, resumable, DDP-aware
iterator; ``IterableArchive`` serves DataLoader worker processes. Both
``open_archive`` and ``Loader`` read several archives as one and choose
samples (``where=``, ``indices=``); ``Loader`` also mixes sources by weight.
"""

from .augment import Mixup, RandomTimeCrop, SpecAugment
from .batch import Batch
from .dataset import Archive
from .errors import (
    LoaderError,
    SampleIndexError,
    ShardChangedError,
    UsageError,
    UsageTypeError,
)
from .iterable import IterableArchive
from .loader import Loader
from .mixture import Source
from .opening import count_selected, open_archive
from .order import OrderSpec, epoch_order, rank_batches
from .vision import Normalize, RandomHorizontalFlip, RandomResizedCrop, RandomTemporalCrop

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
    "SampleIndexError",
    "ShardChangedError",
    "Source",
    "SpecAugment",
    "UsageError",
    "UsageTypeError",
    "count_selected",
    "epoch_order",
    "open_archive",
    "rank_batches",
]

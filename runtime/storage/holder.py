"""What the concerns beside a remote supply (runtime.storage.ahead, .arrival) read of
the supply that holds the shards: ``Holder``, all under its ``lock``."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Protocol

from dlop.formats import ShardReader
from dlop.formats.archive import Index

from .cache import CacheDir, Held
from .remote_sizes import ShardSizes


class Holder(Protocol):
    """The archive at ``url`` and its cache folder, the shards open here (mapped and
    held) and loose (held for a later read), and the fetch failures recorded."""

    url: str
    lock: threading.Lock
    index: Index
    folder: Path
    cache: CacheDir
    sizes: ShardSizes
    open: dict[int, tuple[ShardReader, Held]]
    loose: OrderedDict[int, None]
    ahead_errors: dict[int, Exception]

    def note_failure(
        self, k: int, e: BaseException, stopping: threading.Event
    ) -> BaseException: ...

"""Where a shard's bytes come from: the source stage.

A source hands out opened shards (``dlop.formats.ShardReader``) by number,
and hears ahead of time which shards a batch will read (``ask``) and when a
batch is done with them (``release``). The Loader asks for batch j's and
j+1's shards as it plans batch j (so a shard may be asked for more than once)
and releases batch j's once its copies are done. ``LocalSource`` maps local files and
needs neither (the page cache does the rest); a remote source with a
node-local cache fetches on ``ask`` and may evict after ``release``. Before
each read, ``check`` refuses a shard that changed under its mapping.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from dlop.formats import ArchiveReader, ShardReader

from ..errors import ShardChangedError


class ShardSource(Protocol):
    """What the runtime asks of a shard source."""

    def shard(self, k: int) -> ShardReader:
        """Shard ``k``, opened and validated."""
        ...

    def ask(self, shards: Sequence[int]) -> None:
        """These shards will be read soon (a hint; reading does not depend on it)."""
        ...

    def release(self, shards: Sequence[int]) -> None:
        """A batch that asked for these shards is done with them."""
        ...

    def check(self, shards: Sequence[int] | np.ndarray) -> None:
        """Raises when one of these shards can no longer be read safely."""
        ...


class LocalSource:
    """Shards of a local archive, memory-mapped once when the archive opens."""

    def __init__(self, reader: ArchiveReader) -> None:
        self.reader = reader
        self.shards = [reader.shard(k) for k in range(reader.num_shards)]
        self.sizes = [info.bytes for info in reader.index.shards]  # as validated when mapped

    def shard(self, k: int) -> ShardReader:
        return self.shards[k]

    def ask(self, shards: Sequence[int]) -> None:
        pass  # mapped already; the page cache reads ahead

    def release(self, shards: Sequence[int]) -> None:
        pass

    def check(self, shards: Sequence[int] | np.ndarray) -> None:
        """Raises ShardChangedError when a shard among ``shards`` (numbers) has shrunk
        since it was mapped; reading its pages past the new end would kill the
        process with SIGBUS. A shard deleted or replaced by another file
        (``os.replace``) is not an error: the mapping keeps the file it opened.
        """
        for k in np.unique(np.asarray(shards, dtype=np.int64)).tolist():
            # fstat of the mapping's own descriptor: the mapped file, whatever its path names now
            size, now = self.sizes[k], self.shards[k].mapped_size()
            if now < size:
                path = self.shards[k].path
                raise ShardChangedError(
                    f"{path}: shard shrank from {size} to {now} bytes after the "
                    "archive opened it; rewrite shards under a new name and os.replace "
                    "them, never in place, while a job reads them"
                )

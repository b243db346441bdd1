"""The batch type, and its bridge to torch's default_collate."""

from __future__ import annotations

from typing import Any

from torch.utils.data._utils.collate import default_collate_fn_map


class Batch(dict[str, Any]):
    """A collated batch: field name -> tensor ``[B, ...]`` (or a list for text/bytes fields).

    ``DataLoader`` hands whatever ``__getitems__`` returns to its collate
    function, and ``default_collate`` starts by reading ``batch[0]``. A Batch
    answers ``batch[0]`` with itself and is registered in torch's documented
    ``default_collate_fn_map`` as already collated, so the default DataLoader
    passes it through untouched instead of re-stacking every row.
    """

    # Set by IterableArchive: the batch's number in its epoch on this rank (0 first).
    position: int | None = None

    def __getitem__(self, key: Any) -> Any:
        if key == 0 and not isinstance(key, str) and not dict.__contains__(self, key):
            return self
        return super().__getitem__(key)

    def __missing__(self, key: Any) -> Any:
        raise KeyError(f"{key!r}: the batch has no such field; it has {', '.join(sorted(self))}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (Batch, (dict(self),), self.__dict__ or None)


def split_batch(batch: Batch, sizes: list[int]) -> list[Batch]:
    """A batch of tensors cut along its first dimension into batches of ``sizes``
    samples, views of its tensors."""
    parts = {k: v.split(sizes) for k, v in batch.items()}
    return [Batch({k: p[i] for k, p in parts.items()}) for i in range(len(sizes))]


class Collated:
    """A batch in the shape of a user's samples (a tuple, or nested: runtime.archive.structure),
    as ``__getitems__`` hands it to DataLoader's collate: registered as already collated,
    the default collate passes on ``value``, the batch itself."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __getitem__(self, key: Any) -> Any:
        if key == 0:
            return self
        raise TypeError("a Collated batch is DataLoader's to unwrap; take its .value")


def batch_as_is(batch: Any) -> Any:
    """A ``collate_fn`` for ``DataLoader(IterableArchive(...), batch_size=None)``: each batch
    as the dataset made it. The default with ``batch_size=None``, torch's
    ``default_convert``, returns an equal batch, a copy whose text lists it rebuilds
    by walking every string in the worker (a few microseconds a string: 0.2 ms a
    batch of 32 keys and 32 transcripts)."""
    return batch


def _already_collated(batch: Any, *, collate_fn_map: Any = None) -> Any:
    return batch[0]


def _unwrapped(batch: Any, *, collate_fn_map: Any = None) -> Any:
    return batch[0].value


default_collate_fn_map[Batch] = _already_collated
default_collate_fn_map[Collated] = _unwrapped

"""The transform stage: callables ``(batch, generator) -> batch`` with reproducible randomness.

The generator is a host (CPU) generator on every device. Transforms draw their
random numbers with it on the host and move the few numbers they need to the
batch's device (``draw``): the same seed gives the same augmentations on the
CPU and on any GPU, and drawing never waits for the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..batch import Batch
from ..errors import UsageError

Transform = Callable[[Batch, torch.Generator], Batch]


def draw(
    gen: torch.Generator,
    shape: tuple[int, ...],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Uniform [0, 1) numbers of ``shape`` drawn on the host from ``gen``, on ``device``.

    The copy to a GPU is queued without waiting (a small staged copy), so a
    transform that draws never synchronizes the training loop with the device.
    """
    return to_device(torch.rand(shape, generator=gen, dtype=dtype), device)


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``, copied without waiting for the device."""
    return x if x.device == device else x.to(device, non_blocking=True)


def needs(transform: Transform) -> tuple[str, ...]:
    """The batch fields a transform reads: its ``needed_fields()`` where it says (the
    built-in augmentations do), none otherwise."""
    needed = getattr(transform, "needed_fields", None)
    return tuple(needed()) if callable(needed) else ()


def check_transforms(transforms: Sequence[Transform], archive: Any, mixture: bool) -> None:
    """Refuses, when the Loader is made, transforms that would fail on its first batch:
    a field the archive's batches do not have (a mixture's add ``source``), or
    ``Mixup(num_classes)`` below the class count of the archive's metadata."""
    where = str(archive.path)
    fields = [*archive.gathers, *(["source"] if mixture else [])]
    metadata = getattr(getattr(archive, "index", None), "metadata", None) or {}
    listed = metadata.get("classes")
    classes = len(listed) if isinstance(listed, list) else None
    have = set(fields) | {f"{f}_lengths" for f in fields}
    for t in transforms:
        missing = [f for f in needs(t) if f not in have]
        if missing:
            raise UsageError(
                f"{where}: transform {t!r} reads field {missing[0]!r}, which this Loader's "
                f"batches do not have; they have {', '.join(sorted(fields))}"
            )
        num_classes = getattr(t, "num_classes", None)
        if isinstance(num_classes, int) and classes is not None and num_classes < classes:
            raise UsageError(
                f"{where}: transform {t!r} makes one-hot targets of {num_classes} classes, "
                f"but the archive has {classes} (its metadata's 'classes'); give "
                f"num_classes={classes}"
            )


class TransformStage:
    """Runs the transforms on the batch's device, with a host generator seeded from
    (seed, epoch, batch number): a resumed epoch repeats its augmentations exactly,
    on whichever device it runs."""

    def __init__(self, transforms: Sequence[Transform], seed: int, device: torch.device) -> None:
        self.transforms = tuple(transforms)
        self.seed = seed
        self.device = device

    def __call__(self, batch: Batch, epoch: int, number: int) -> Batch:
        if not self.transforms:
            return batch
        gen = torch.Generator()
        seed = np.random.SeedSequence([self.seed, epoch, number, 0x5EED]).generate_state(1)
        for i, transform in enumerate(self.transforms):
            gen.manual_seed(int(seed[0]) + i)
            batch = transform(batch, gen)
        return batch

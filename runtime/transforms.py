"""The transform stage: callables ``(batch, generator) -> batch`` with reproducible randomness."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from .batch import Batch

Transform = Callable[[Batch, torch.Generator], Batch]


class TransformStage:
    """Runs the transforms on the batch's device, with generators seeded from (seed,
    epoch, batch number): a resumed epoch repeats its augmentations exactly."""

    def __init__(self, transforms: Sequence[Transform], seed: int, device: torch.device) -> None:
        self.transforms = tuple(transforms)
        self.seed = seed
        self.device = device

    def __call__(self, batch: Batch, epoch: int, number: int) -> Batch:
        if not self.transforms:
            return batch
        gen = torch.Generator(device=self.device)
        seed = np.random.SeedSequence([self.seed, epoch, number, 0x5EED]).generate_state(1)
        for i, transform in enumerate(self.transforms):
            gen.manual_seed(int(seed[0]) + i)
            batch = transform(batch, gen)
        return batch

"""Random augmentations on the batch's device, per sample, from the Loader's seeded generator.

Each is a callable ``(batch, generator) -> batch`` for ``Loader(transforms=...)``;
every random number comes from the generator, drawn on the host (runtime.transforms.base),
so a resumed epoch repeats its augmentations exactly, on the CPU and on a GPU
alike: what the device computes from the draws is exact arithmetic (products,
sums, comparisons, truncation), the same bits on either. Ragged features use ``<field>_lengths``: masks and crops
stay inside each sample's valid frames.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..batch import Batch
from .base import draw, to_device


def _lengths(batch: Batch, field: str, x: torch.Tensor) -> torch.Tensor:
    """Each sample's valid length along axis 1 (frames), ``[B]``.

    ``<field>_lengths`` is ``[B]`` when axis 1 alone varies, and ``[B, k]`` when k
    axes do: then axis 1 is its first column if every axis but the last (channels)
    varies, and otherwise does not vary (a clip of a fixed number of frames whose
    height and width vary has ``[B, 2]``: height and width, as images have).
    """
    lengths: torch.Tensor | None = batch.get(f"{field}_lengths")
    if lengths is not None and lengths.ndim == 2:
        lengths = lengths[:, 0] if lengths.shape[1] == x.ndim - 2 else None
    if lengths is None:
        return torch.full((x.shape[0],), x.shape[1], dtype=torch.int64, device=x.device)
    return lengths.to(x.device)


def _set_lengths(batch: Batch, field: str, lengths: torch.Tensor, x: torch.Tensor) -> None:
    """Writes back axis 1's lengths where ``<field>_lengths`` holds them (``_lengths``)."""
    key = f"{field}_lengths"
    held: torch.Tensor | None = batch.get(key)
    if held is None:
        return
    if held.ndim == 1:
        batch[key] = lengths.to(held.device)
    elif held.shape[1] == x.ndim - 2:
        held = held.clone()
        held[:, 0] = lengths.to(held.device)
        batch[key] = held


def _spans(
    count: int, max_width: int, limit: torch.Tensor, size: int, gen: torch.Generator
) -> torch.Tensor:
    """``count`` random [start, start+width) masks per sample over ``size`` positions -> bool [B, size]."""
    b = limit.shape[0]
    dev = limit.device
    pos = torch.arange(size, device=dev)
    mask = torch.zeros(b, size, dtype=torch.bool, device=dev)
    u = draw(gen, (count, 2, b), dev)
    for i in range(count):
        width = (u[i, 0] * (max_width + 1)).long()
        width = torch.minimum(width, limit)
        start = (u[i, 1] * (limit - width + 1)).long()
        mask |= (pos[None, :] >= start[:, None]) & (pos[None, :] < (start + width)[:, None])
    return mask


@dataclass(frozen=True)
class SpecAugment:
    """Time and frequency masks on ``[B, frames, bins]`` features (SpecAugment, Park et al. 2019)."""

    field: str = "logmel"
    freq_masks: int = 2
    freq_width: int = 27
    time_masks: int = 2
    time_width: int = 40
    mask_value: float = 0.0

    def needed_fields(self) -> tuple[str, ...]:
        return (self.field,)

    def __call__(self, batch: Batch, gen: torch.Generator) -> Batch:
        x = batch[self.field]
        lengths = _lengths(batch, self.field, x)
        bins = torch.full_like(lengths, x.shape[2])
        freq = _spans(self.freq_masks, self.freq_width, bins, x.shape[2], gen)
        time = _spans(self.time_masks, self.time_width, lengths, x.shape[1], gen)
        x.masked_fill_(time[:, :, None] | freq[:, None, :], self.mask_value)
        return batch


@dataclass(frozen=True)
class RandomTimeCrop:
    """A random window of ``frames`` frames from each sample's valid frames (shorter ones are padded).

    With ``reverse`` > 0, that share of samples gets its window in reverse order.
    """

    field: str = "logmel"
    frames: int = 400
    pad_value: float = 0.0
    reverse: float = 0.0

    def needed_fields(self) -> tuple[str, ...]:
        return (self.field,)

    def __call__(self, batch: Batch, gen: torch.Generator) -> Batch:
        x = batch[self.field]
        b, _, *rest = x.shape
        lengths = _lengths(batch, self.field, x)
        room = (lengths - self.frames).clamp_min(0)
        u = draw(gen, (2, b), x.device)
        start = (u[0] * (room + 1)).long()
        steps = torch.arange(self.frames, device=x.device)
        pos = start[:, None] + steps[None, :]
        valid = pos < lengths[:, None]
        if self.reverse > 0:
            count = torch.minimum(lengths, torch.full_like(lengths, self.frames))
            backwards = start[:, None] + count[:, None] - 1 - steps[None, :]
            flip = u[1] < self.reverse
            pos = torch.where(flip[:, None] & valid, backwards, pos)
        pos = pos.clamp_max(max(x.shape[1] - 1, 0))
        index = pos.view(b, self.frames, *([1] * len(rest))).expand(b, self.frames, *rest)
        out = torch.gather(x, 1, index) if x.shape[1] else x.new_zeros((b, self.frames, *rest))
        out.masked_fill_(~valid.view(b, self.frames, *([1] * len(rest))), self.pad_value)
        batch[self.field] = out
        _set_lengths(
            batch, self.field, torch.minimum(lengths, torch.full_like(lengths, self.frames)), x
        )
        return batch


@dataclass(frozen=True)
class Mixup:
    """Mixes each sample with another of the batch: x = lam x + (1 - lam) x[perm], lam ~ Beta(alpha, alpha).

    Adds ``mixup_lambda`` [B] and ``mixup_index`` [B]; with ``num_classes``,
    also ``<label>_soft`` [B, num_classes], the mixed one-hot targets.
    """

    alpha: float = 0.4
    fields: tuple[str, ...] = ("logmel",)
    label: str = "label"
    num_classes: int | None = None

    def needed_fields(self) -> tuple[str, ...]:
        return (*self.fields, self.label) if self.num_classes is not None else self.fields

    def __call__(self, batch: Batch, gen: torch.Generator) -> Batch:
        first = batch[self.fields[0]]
        b, dev = first.shape[0], first.device
        # torch's Beta sampler takes no generator: lam comes from a seed the generator gives.
        seed = int(torch.randint(0, 2**62, (1,), generator=gen).item())
        lam_np = np.random.default_rng(seed).beta(self.alpha, self.alpha, size=b).astype(np.float32)
        lam = to_device(torch.from_numpy(lam_np), dev)
        perm = to_device(torch.randperm(b, generator=gen), dev)
        for name in self.fields:
            x = batch[name]
            w = lam.view(b, *([1] * (x.ndim - 1))).to(x.dtype)
            batch[name] = w * x + (1 - w) * x.index_select(0, perm)
            if f"{name}_lengths" in batch:
                lengths = batch[f"{name}_lengths"]
                batch[f"{name}_lengths"] = torch.maximum(
                    lengths, lengths.index_select(0, perm.to(lengths.device))
                )
        batch["mixup_lambda"] = lam
        batch["mixup_index"] = perm
        if self.num_classes is not None and self.label in batch:
            onehot = torch.nn.functional.one_hot(
                batch[self.label].to(dev), self.num_classes
            ).float()
            batch[f"{self.label}_soft"] = lam[:, None] * onehot + (
                1 - lam[:, None]
            ) * onehot.index_select(0, perm)
        return batch

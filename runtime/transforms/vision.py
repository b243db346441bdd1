"""Image and clip augmentations on the batch's device, per sample, from the Loader's generator.

Layouts: images ``[B, H, W, C]``, clips ``[B, T, H, W, C]`` and masks
``[B, H, W]``, as archives store them. Random numbers are drawn on the host
(runtime.transforms.base) and what the device computes from them is exact
arithmetic in float64 (products, quotients, square roots, rounding) and, for
bilinear resizing, float32 products and sums each rounded once: the same seed
gives the same bytes on the CPU and on a GPU. Geometry drawn once per sample applies
identically to an image, its clip frames and all its masks. Variable-size
images arrive padded with ``<field>_lengths`` ``[B, 2]`` (height, width):
crops and flips stay inside each sample's own pixels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..batch import Batch
from .audio import RandomTimeCrop
from .base import draw, to_device

__all__ = ["Normalize", "RandomHorizontalFlip", "RandomResizedCrop", "RandomTemporalCrop"]


def _hw(size: int | tuple[int, int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def _valid_hw(
    batch: Batch, name: str, x: torch.Tensor, is_mask: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's own (height, width) as two int64 [B] tensors."""
    lengths = batch.get(f"{name}_lengths")
    h_axis = x.ndim - (2 if is_mask else 3)
    b = x.shape[0]
    if lengths is None or lengths.ndim != 2:
        full = torch.full((b,), x.shape[h_axis], dtype=torch.int64, device=x.device)
        return full, torch.full_like(full, x.shape[h_axis + 1])
    lengths = lengths.to(x.device)
    return lengths[:, -2].long(), lengths[:, -1].long()


def _flip_draw(p: float, b: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return draw(gen, (b,), device) < p


@dataclass(frozen=True)
class RandomResizedCrop:
    """A random area/aspect crop of each sample, resized to ``size``, plus a horizontal flip.

    ``fields`` are images or clips (bilinear, or ``interpolation="nearest"``);
    ``masks`` always use nearest neighbour, so labels stay labels. The box
    follows torchvision's rule (10 tries at a random scale of the area and
    log-uniform aspect ratio, else the centre crop clamped to ``ratio``). Crops
    are sampled without an antialiasing prefilter: store images near the
    training size (``dlop-compile --size``) when crops shrink a lot.
    Integer inputs come back in their dtype (rounded); padded inputs lose
    their ``_lengths``, as every output is ``size``.
    """

    size: int | tuple[int, int] = 224
    fields: tuple[str, ...] = ("image",)
    masks: tuple[str, ...] = ()
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: float = 0.5
    interpolation: str = "bilinear"

    def needed_fields(self) -> tuple[str, ...]:
        return (*self.fields, *self.masks)

    def boxes(
        self, height: torch.Tensor, width: torch.Tensor, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(top, left, box height, box width) per sample, int64 [B] each."""
        b, dev, tries = height.shape[0], height.device, 10
        area = (height * width).double()[:, None]
        target = area * (
            self.scale[0]
            + (self.scale[1] - self.scale[0]) * draw(gen, (b, tries), dev, torch.float64)
        )
        lo, hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        # exp on the host: a device's exp may round its last bit otherwise
        log_aspect = torch.rand(b, tries, generator=gen, dtype=torch.float64)
        aspect = to_device(torch.exp(lo + (hi - lo) * log_aspect), dev)
        w = torch.sqrt(target * aspect).round().long()
        h = torch.sqrt(target / aspect).round().long()
        ok = (w > 0) & (h > 0) & (w <= width[:, None]) & (h <= height[:, None])
        first = torch.argmax(ok.long(), dim=1)
        found = ok.any(dim=1)
        pick_w = w.gather(1, first[:, None])[:, 0]
        pick_h = h.gather(1, first[:, None])[:, 0]
        # fallback: the whole image, trimmed to the ratio range
        in_ratio = width.double() / height.double()
        fw = torch.where(
            in_ratio > self.ratio[1], (height.double() * self.ratio[1]).round().long(), width
        )
        fh = torch.where(
            in_ratio < self.ratio[0], (width.double() / self.ratio[0]).round().long(), height
        )
        bw = torch.where(found, pick_w, fw).clamp(1)
        bh = torch.where(found, pick_h, fh).clamp(1)
        u = draw(gen, (b, 2), dev, torch.float64)
        top = (u[:, 0] * (height - bh + 1).double()).floor().long()
        left = (u[:, 1] * (width - bw + 1).double()).floor().long()
        return top, left, bh, bw

    def __call__(self, batch: Batch, gen: torch.Generator) -> Batch:
        names = [*self.fields, *self.masks]
        first = batch[names[0]]
        height, width = _valid_hw(batch, names[0], first, names[0] in self.masks)
        top, left, bh, bw = self.boxes(height, width, gen)
        flip = _flip_draw(self.flip, first.shape[0], gen, first.device)
        oh, ow = _hw(self.size)
        for name in names:
            is_mask = name in self.masks
            mode = "nearest" if is_mask else self.interpolation
            batch[name] = _crop_resize(
                batch[name], top, left, bh, bw, height, width, flip, (oh, ow), mode, is_mask
            )
            batch.pop(f"{name}_lengths", None)
        return batch


def _axis(
    n: int,
    start: torch.Tensor,
    extent: torch.Tensor,
    valid: torch.Tensor,
    flip: torch.Tensor | None,
) -> torch.Tensor:
    """Source pixel positions, float64 [B, n], of ``n`` samples over a box (pixel
    centres, as ``align_corners=False``), kept inside each sample's valid pixels."""
    steps = torch.arange(n, device=start.device, dtype=torch.float64)
    if flip is not None:
        steps = torch.where(flip[:, None], (n - 1) - steps, steps)
    pixel = start[:, None].double() + (steps + 0.5) * extent[:, None].double() / n - 0.5
    return torch.minimum(pixel.clamp_min(0.0), (valid[:, None] - 1).double())


def _taps(
    pixel: torch.Tensor, valid: torch.Tensor, mode: str, work: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The source pixels each output reads and their weights: one tap, weight None,
    for nearest (round half to even); two for bilinear."""
    if mode == "nearest":
        return [(pixel.round().long(), None)]
    low = pixel.floor()
    frac = pixel - low
    high = torch.minimum(low.long() + 1, valid[:, None] - 1)
    return [(low.long(), (1.0 - frac).to(work)), (high, frac.to(work))]


def _crop_resize(
    x: torch.Tensor,
    top: torch.Tensor,
    left: torch.Tensor,
    bh: torch.Tensor,
    bw: torch.Tensor,
    height: torch.Tensor,
    width: torch.Tensor,
    flip: torch.Tensor,
    out_hw: tuple[int, int],
    mode: str,
    is_mask: bool,
) -> torch.Tensor:
    """Each sample's box resized to ``out_hw`` by gathering its source pixels.

    Bilinear output is ``(v00 w0 + v01 w1) h0 + (v10 w0 + v11 w1) h1`` with every
    product and sum a rounding of its own (no fused multiply-add), so a CPU and
    a GPU give the same bits.
    """
    if mode not in ("nearest", "bilinear"):
        raise ValueError(f"interpolation must be 'nearest' or 'bilinear', not {mode!r}")
    b = x.shape[0]
    if is_mask:  # [B, H, W] -> [B, H, W, 1]
        v = x[..., None]
    else:  # images [B, H, W, C]; clips [B, T, H, W, C] -> [B, H, W, T * C]
        v = x if x.ndim == 4 else x.movedim(1, -2).reshape(b, *x.shape[-3:-1], -1)
    work = v.dtype if v.is_floating_point() else torch.float32
    rows = _taps(_axis(out_hw[0], top, bh, height, None), height, mode, work)
    cols = _taps(_axis(out_hw[1], left, bw, width, flip), width, mode, work)
    samples = torch.arange(b, device=x.device)[:, None, None]
    out: torch.Tensor | None = None
    for y, wy in rows:
        line: torch.Tensor | None = None
        for xs, wx in cols:
            tap = v[samples, y[:, :, None], xs[:, None, :]]  # [B, oh, ow, R]
            if wx is not None:
                tap = tap.to(work) * wx[:, None, :, None]
            line = tap if line is None else line + tap
        assert line is not None
        if wy is not None:
            line = line * wy[:, :, None, None]
        out = line if out is None else out + line
    assert out is not None
    if not x.is_floating_point() and out.is_floating_point():
        info = torch.iinfo(x.dtype)
        out = out.round_().clamp_(info.min, info.max).to(x.dtype)
    if is_mask:
        return out[..., 0]
    if x.ndim == 4:
        return out
    return out.reshape(b, *out_hw, x.shape[1], x.shape[-1]).movedim(-2, 1).contiguous()


@dataclass(frozen=True)
class RandomHorizontalFlip:
    """Mirrors each sample with probability ``p``, images, clips and masks alike (within valid widths)."""

    fields: tuple[str, ...] = ("image",)
    masks: tuple[str, ...] = ()
    p: float = 0.5

    def needed_fields(self) -> tuple[str, ...]:
        return (*self.fields, *self.masks)

    def __call__(self, batch: Batch, gen: torch.Generator) -> Batch:
        names = [*self.fields, *self.masks]
        first = batch[names[0]]
        flip = _flip_draw(self.p, first.shape[0], gen, first.device)
        for name in names:
            x = batch[name]
            is_mask = name in self.masks
            _, width = _valid_hw(batch, name, x, is_mask)
            w_axis = x.ndim - (1 if is_mask else 2)
            cols = torch.arange(x.shape[w_axis], device=x.device)
            mirrored = torch.where(
                cols[None, :] < width[:, None], width[:, None] - 1 - cols[None, :], cols[None, :]
            )
            index = torch.where(flip[:, None], mirrored, cols[None, :].expand(x.shape[0], -1))
            shape = [x.shape[0]] + [1] * (x.ndim - 1)
            shape[w_axis] = x.shape[w_axis]
            batch[name] = torch.gather(x, w_axis, index.view(shape).expand(x.shape))
        return batch


@dataclass(frozen=True)
class RandomTemporalCrop(RandomTimeCrop):
    """``frames`` consecutive frames of each clip from a random start, reversed with probability ``reverse``."""

    field: str = "frames"
    frames: int = 8
    reverse: float = 0.0


@dataclass(frozen=True)
class Normalize:
    """uint8 (or float) ``[B, ..., C]`` -> float ``(x * scale - mean) / std``, channels first by default.

    Channels-first output is a permuted view: for images it is ``[B, C, H, W]``
    in channels-last memory format, as ``model.to(memory_format=torch.channels_last)``
    wants; for clips ``[B, C, T, H, W]``.
    """

    field: str = "image"
    mean: tuple[float, ...] = (0.485, 0.456, 0.406)
    std: tuple[float, ...] = (0.229, 0.224, 0.225)
    scale: float = 1 / 255
    channels_first: bool = True
    dtype: torch.dtype = torch.float32

    def needed_fields(self) -> tuple[str, ...]:
        return (self.field,)

    def __call__(self, batch: Batch, gen: torch.Generator) -> Batch:
        x = batch[self.field]
        # made on the host and queued to the device: torch.tensor(device=...) would wait for it
        mean = to_device(torch.tensor(self.mean, dtype=self.dtype), x.device)
        inv_std = 1.0 / to_device(torch.tensor(self.std, dtype=self.dtype), x.device)
        out = (x.to(self.dtype) * self.scale - mean) * inv_std
        batch[self.field] = out.movedim(-1, 1) if self.channels_first else out
        return batch

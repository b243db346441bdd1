"""Pictures of one sample: spectrograms, frame grids, images with mask overlays."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dlop.formats import Field


def as_float(value: np.ndarray, field: Field) -> np.ndarray:
    """Numeric view for display; bf16 bit patterns become float32."""
    if field.dtype == "bf16":
        return (value.astype(np.uint32) << 16).view(np.float32)
    return value


def _is_image(shape: tuple[int, ...], dtype: str) -> bool:
    return dtype == "u8" and len(shape) == 3 and shape[-1] in (1, 3, 4)


def _is_clip(shape: tuple[int, ...], dtype: str) -> bool:
    return dtype == "u8" and len(shape) == 4 and shape[-1] in (1, 3, 4)


def _is_mask(shape: tuple[int, ...], dtype: str) -> bool:
    return dtype in ("u8", "bool", "i64", "i32") and len(shape) == 2


def render_sample(
    sample: Mapping[str, Any],
    fields: Mapping[str, Field],
    out: str | Path,
    *,
    title: str = "",
    recipe: Mapping[str, Any] | None = None,
) -> list[str]:
    """Draws the sample's visual fields into one PNG; returns the names drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arrays = {
        n: v for n, v in sample.items() if isinstance(v, np.ndarray) and fields[n].kind == "array"
    }
    images = [n for n, v in arrays.items() if _is_image(v.shape, fields[n].dtype)]
    clips = [n for n, v in arrays.items() if _is_clip(v.shape, fields[n].dtype)]
    masks = [
        n
        for n, v in arrays.items()
        if _is_mask(v.shape, fields[n].dtype)
        and any(arrays[i].shape[:2] == v.shape for i in images)
    ]
    spectra = [
        n
        for n, v in arrays.items()
        if v.ndim == 2
        and n not in masks
        and fields[n].dtype.startswith(("f", "bf"))
        and min(v.shape) > 1
    ]
    waves = [
        n
        for n, v in arrays.items()
        if v.ndim == 1 and v.size > 16 and fields[n].dtype.startswith("f")
    ]
    panels: list[tuple[str, str]] = (
        [("clip", n) for n in clips]
        + [("image", n) for n in images]
        + [("mask", n) for n in masks]
        + [("spectrogram", n) for n in spectra]
        + [("wave", n) for n in waves]
    )
    if not panels:
        raise ValueError(
            "nothing to draw: no field is a 2-D feature, an HWC/THWC uint8 image or clip, or a waveform"
        )
    rows = len(panels)
    fig, axes = plt.subplots(rows, 1, figsize=(10, 3.6 * rows), squeeze=False)
    for ax, (kind, name) in zip(axes[:, 0], panels, strict=True):
        value = as_float(arrays[name], fields[name])
        units = f" ({fields[name].units})" if fields[name].units else ""
        if kind == "clip":
            ax.imshow(_frame_grid(value))
            ax.set_title(f"{name}: {value.shape[0]} frames of {value.shape[1]}x{value.shape[2]}")
            ax.axis("off")
        elif kind == "image":
            ax.imshow(
                value[..., 0] if value.shape[-1] == 1 else value,
                cmap="gray" if value.shape[-1] == 1 else None,
            )
            ax.set_title(f"{name}: {value.shape[0]}x{value.shape[1]}")
            ax.axis("off")
        elif kind == "mask":
            image = next(arrays[i] for i in images if arrays[i].shape[:2] == value.shape)
            ax.imshow(image[..., 0] if image.shape[-1] == 1 else image, cmap="gray")
            shown = np.ma.masked_equal(value.astype(np.int64), 0)
            overlay = ax.imshow(
                shown, cmap="tab10", alpha=0.45, vmin=0, vmax=9, interpolation="nearest"
            )
            labels = sorted(int(v) for v in np.unique(value))
            ax.set_title(f"{name} over image: labels {labels}")
            fig.colorbar(overlay, ax=ax, fraction=0.03)
            ax.axis("off")
        elif kind == "spectrogram":
            params = dict(recipe or {})
            if isinstance(params.get("features"), dict):  # a dlop-compile recipe
                params.update(params["features"])
            hop = params.get("hop_length")
            sr = params.get("sample_rate")
            if params.get("features") == "fbank" and isinstance(sr, int):
                hop = int(sr * float(params.get("frame_shift_ms", 10.0)) / 1000)
            frames = value.shape[0]
            extent = None
            xlabel = "frame"
            if isinstance(hop, int) and isinstance(sr, int) and sr > 0:
                extent = (0.0, frames * hop / sr, 0.0, float(value.shape[1]))
                xlabel = "time (s)"
            im = ax.imshow(
                value.T.astype(np.float32),
                origin="lower",
                aspect="auto",
                cmap="magma",
                extent=extent,
            )
            ax.set_xlabel(xlabel)
            ax.set_ylabel("bin")
            ax.set_title(f"{name}{units}: {value.shape[0]} frames x {value.shape[1]} bins")
            fig.colorbar(im, ax=ax, label=fields[name].units or "value")
        else:
            ax.plot(value.astype(np.float32), linewidth=0.5)
            ax.set_xlabel("sample")
            ax.set_title(f"{name}{units}: {value.size} samples")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return [n for _, n in panels]


def _frame_grid(clip: np.ndarray, max_frames: int = 16) -> np.ndarray:
    """``[T, H, W, C] -> [rows*H, cols*W, C]``, up to max_frames evenly spaced."""
    t = clip.shape[0]
    if t == 0:
        return np.zeros((1, 1, 3), np.uint8)
    pick = np.linspace(0, t - 1, min(t, max_frames)).round().astype(int)
    frames = clip[pick]
    if frames.shape[-1] == 1:
        frames = np.repeat(frames, 3, axis=-1)
    cols = math.ceil(math.sqrt(len(frames)))
    rows = math.ceil(len(frames) / cols)
    h, w = frames.shape[1:3]
    grid = np.full((rows * (h + 2), cols * (w + 2), 3), 255, np.uint8)
    for k, frame in enumerate(frames[..., :3]):
        r, c = divmod(k, cols)
        grid[r * (h + 2) : r * (h + 2) + h, c * (w + 2) : c * (w + 2) + w] = frame
    return grid

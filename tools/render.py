"""Pictures of one sample: spectrograms, frame grids, images with mask overlays.

The figure is meant to go into a paper as it is:

- An image with masks is one row of panels of equal size: the image, then each
  mask (one per annotator, then the consensus) over the image. A mask is drawn
  on the image's own extent with nearest-neighbour sampling, so a mask stored at
  another resolution lands on the pixels it labels. One legend names each label
  of the archive (the recipe's ``mask_remap`` targets, the names in
  ``metadata.mask_classes``) and of the masks drawn; label 0 is left unshaded
  (hollow in the legend) so the tissue under it stays visible, and the
  compile's fill value (an annotator without a mask) is grey.
- A clip shows at most ``MAX_FRAMES`` evenly spaced frames, large, each titled
  with its time: ``clip_start + i * (clip_end - clip_start) / T`` as the
  compiler samples them, or ``i * clip_stride / clip_fps`` from the clip's first
  frame for dense clips without times, or the frame index where neither is
  recorded (the panel says so).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dlop.formats import Field
from dlop.formats.extras import needs_extra

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure, SubFigure

DPI = 150
FIGURE_WIDTH_IN = 10.5  # 4 panels of about 2.4 in: frames about 330 px wide at DPI
PANEL_COLUMNS = 4
MAX_FRAMES = 8
MAX_LEGEND_ENTRIES = 40
# Pictures beyond this many pixels a side are reduced before drawing (images by box
# averaging, masks by striding): a panel shows a few hundred pixels, and matplotlib
# resamples a 5k x 5k core through float copies of several hundred MB in every panel.
MAX_DRAWN_SIDE = 2048
OVERLAY_ALPHA = 0.5
FILL_RGBA = (0.55, 0.55, 0.55, 0.55)


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
    return dtype in ("u8", "bool", "i64", "i32") and len(shape) == 2 and min(shape) > 1


def _same_aspect(mask: tuple[int, ...], image: tuple[int, ...]) -> bool:
    """Whether a mask of this shape can label an image of that one (one pixel of
    rounding, or 2 %, either way: masks stored at a fraction of the image's size)."""
    h, w = mask[:2]
    ih, iw = image[:2]
    return abs(h * iw / ih - w) <= max(1.0, 0.02 * w)


@dataclass
class _Labels:
    """The colour and name of every mask value in the sample, shared by all panels."""

    names: dict[int, str]
    colours: dict[int, tuple[float, float, float, float]]
    fill: int | None
    shown_fill: bool  # some mask holds the fill value
    values: list[int]  # the legend's labels, ascending (the fill value apart)

    def overlay(self, mask: np.ndarray) -> np.ndarray:
        """RGBA uint8 of a mask: label 0 clear, the others in their colour."""
        keys = np.array(sorted(self.colours), np.int64)
        table = np.array([self.colours[int(k)] for k in keys], np.float64)
        rgba: np.ndarray = (
            (table * 255).round().astype(np.uint8)[np.searchsorted(keys, mask.astype(np.int64))]
        )
        return rgba


def _declared_labels(recipe: Mapping[str, Any], names: Mapping[int, str]) -> set[int]:
    declared = set(names)
    vision = recipe.get("vision")
    remap = vision.get("mask_remap") if isinstance(vision, Mapping) else None
    if isinstance(remap, list):
        declared |= {
            pair[1]
            for pair in remap
            if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], int)
        }
    return declared


def _label_names(metadata: Mapping[str, Any]) -> dict[int, str]:
    """``metadata.mask_classes``: a list (index = label) or an object {label: name}."""
    given = metadata.get("mask_classes")
    if isinstance(given, list):
        return {k: str(n) for k, n in enumerate(given)}
    if isinstance(given, Mapping):
        out = {}
        for k, n in given.items():
            try:
                out[int(k)] = str(n)
            except (TypeError, ValueError):
                continue
        return out
    return {}


def _labels(
    masks: Sequence[np.ndarray], recipe: Mapping[str, Any], metadata: Mapping[str, Any]
) -> _Labels:
    from matplotlib import colormaps

    vision = recipe.get("vision")
    fill_value = vision.get("mask_fill") if isinstance(vision, Mapping) else None
    fill = fill_value if isinstance(fill_value, int) and not isinstance(fill_value, bool) else None
    given = _label_names(metadata)
    present: set[int] = set()
    for m in masks:
        present |= {int(v) for v in np.unique(m)}
    values = sorted((_declared_labels(recipe, given) | present) - {fill})
    shaded = [v for v in values if v != 0]
    palette = "tab10" if len(shaded) <= 10 else "tab20" if len(shaded) <= 20 else "turbo"
    cmap = colormaps[palette]
    colours: dict[int, tuple[float, float, float, float]] = {}
    for k, v in enumerate(shaded):
        at = k if palette != "turbo" else k / max(len(shaded) - 1, 1)
        r, g, b, _ = cmap(at)
        colours[v] = (r, g, b, OVERLAY_ALPHA)
    if 0 in values:
        colours[0] = (0.0, 0.0, 0.0, 0.0)
    if fill is not None and fill in present:
        colours[fill] = FILL_RGBA
    names = {v: given.get(v, f"class {v}") for v in values}
    return _Labels(names, colours, fill, fill is not None and fill in present, values)


def _legend_handles(labels: _Labels) -> list[Any]:
    from matplotlib.patches import Patch

    handles: list[Any] = []
    for v in labels.values[:MAX_LEGEND_ENTRIES]:
        if v == 0:  # unshaded: an empty box, so it is not read as a colour of its own
            handles.append(Patch(facecolor="none", edgecolor="0.3", label=labels.names[v]))
        else:
            r, g, b, _ = labels.colours[v]
            handles.append(
                Patch(facecolor=(r, g, b, OVERLAY_ALPHA), edgecolor="0.3", label=labels.names[v])
            )
    if len(labels.values) > MAX_LEGEND_ENTRIES:
        more = len(labels.values) - MAX_LEGEND_ENTRIES
        handles.append(Patch(facecolor="none", edgecolor="none", label=f"... {more} more labels"))
    if labels.shown_fill:
        handles.append(
            Patch(facecolor=FILL_RGBA, edgecolor="0.3", label=f"no annotation ({labels.fill})")
        )
    return handles


def _reduction(shape: tuple[int, ...]) -> int:
    return max(1, math.ceil(max(shape[:2]) / MAX_DRAWN_SIDE))


def _strided(mask: np.ndarray) -> np.ndarray:
    step = _reduction(mask.shape)
    return mask[::step, ::step]


def _reduced(image: np.ndarray) -> np.ndarray:
    """A large uint8 image box-averaged to at most MAX_DRAWN_SIDE a side; Pillow's
    reduce averages the partial boxes at the edges too, so it still spans the image."""
    step = _reduction(image.shape)
    if step == 1 or image.dtype != np.uint8:
        return image
    from PIL import Image

    channels = image.shape[-1]
    plane = image[..., 0] if channels == 1 else image
    small = np.asarray(Image.fromarray(np.ascontiguousarray(plane)).reduce(step))
    return small[..., None] if channels == 1 else small


def _show_image(ax: Axes, image: np.ndarray) -> tuple[float, float, float, float]:
    """Draws an HWC image on extent (0, W, H, 0) and returns that extent, which every
    overlay on it uses too."""
    h, w = image.shape[:2]
    extent = (0.0, float(w), float(h), 0.0)
    image = _reduced(image)
    if image.shape[-1] == 1:
        ax.imshow(image[..., 0], cmap="gray", vmin=0, vmax=255, extent=extent)
    else:
        ax.imshow(image, extent=extent)
    ax.set_xlim(0.0, float(w))
    ax.set_ylim(float(h), 0.0)
    ax.set_xticks([])
    ax.set_yticks([])
    return extent


def _mask_title(name: str, mask: np.ndarray, labels: _Labels) -> str:
    if labels.fill is not None and mask.size and bool((mask == labels.fill).all()):
        return f"{name}: no annotation"
    return "consensus (majority vote)" if name == "consensus" else name


def _draw_picture(
    sf: SubFigure,
    image_name: str,
    image: np.ndarray,
    masks: Sequence[tuple[str, np.ndarray]],
    labels: _Labels | None,
) -> None:
    count = 1 + len(masks)
    cols = min(count, PANEL_COLUMNS)
    rows = math.ceil(count / cols)
    axes = sf.subplots(rows, cols, squeeze=False)
    flat = list(axes.ravel())
    _show_image(flat[0], image)
    flat[0].set_title(f"{image_name} ({image.shape[0]}x{image.shape[1]})")
    for ax, (name, mask) in zip(flat[1:], masks, strict=False):
        extent = _show_image(ax, image)
        if labels is not None:
            ax.imshow(labels.overlay(_strided(mask)), extent=extent, interpolation="nearest")
            ax.set_title(_mask_title(name, mask, labels))
    for ax in flat[count:]:
        ax.set_visible(False)
    if masks and labels is not None:
        sf.legend(
            handles=_legend_handles(labels),
            loc="outside right upper",
            title="labels",
            frameon=False,
        )


def _frame_times(
    count: int,
    sample: Mapping[str, Any],
    recipe: Mapping[str, Any],
    metadata: Mapping[str, Any],
) -> tuple[np.ndarray | None, str]:
    """Each frame's time in seconds and where it comes from (None: not recorded)."""
    start, end = sample.get("clip_start"), sample.get("clip_end")
    if start is not None and end is not None and count:
        t0, t1 = float(np.asarray(start)), float(np.asarray(end))
        if math.isfinite(t0) and math.isfinite(t1) and t1 >= t0:
            return t0 + np.arange(count) * (t1 - t0) / count, "seconds in the video"
    vision = recipe.get("vision")
    fps: Any = None
    stride = 1
    if isinstance(vision, Mapping) and vision.get("clip") == "dense":
        fps, every = vision.get("clip_fps"), vision.get("clip_stride")
        stride = every if isinstance(every, int) and every > 0 else 1
    if isinstance(fps, (int, float)) and not isinstance(fps, bool) and fps > 0:
        return np.arange(count) * stride / float(fps), "seconds from the clip's first frame"
    return None, "frame times not recorded: frame index"


def _draw_clip(
    sf: SubFigure,
    name: str,
    clip: np.ndarray,
    sample: Mapping[str, Any],
    recipe: Mapping[str, Any],
    metadata: Mapping[str, Any],
) -> None:
    t = clip.shape[0]
    times, source = _frame_times(t, sample, recipe, metadata)
    pick = np.linspace(0, t - 1, min(t, MAX_FRAMES)).round().astype(int) if t else np.array([], int)
    cols = max(1, min(len(pick), PANEL_COLUMNS))
    rows = max(1, math.ceil(len(pick) / cols))
    axes = list(sf.subplots(rows, cols, squeeze=False).ravel())
    for ax, k in zip(axes, pick, strict=False):
        _show_image(ax, clip[k])
        if times is None:
            ax.set_title(f"frame {k}")
        else:
            ax.set_title(f"{times[k]:.2f} s (frame {k})")
    for ax in axes[len(pick) :]:
        ax.set_visible(False)
    shown = f"{len(pick)} of {t} frames" if len(pick) < t else f"{t} frames"
    size = f" of {clip.shape[1]}x{clip.shape[2]}" if t else ""
    sf.suptitle(f"{name}: {shown}{size}; {source}")


def _draw_spectrogram(
    sf: SubFigure, name: str, value: np.ndarray, f: Field, recipe: Mapping[str, Any]
) -> None:
    ax = sf.subplots()
    params = dict(recipe)
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
        value.T.astype(np.float32), origin="lower", aspect="auto", cmap="magma", extent=extent
    )
    ax.set_xlabel(xlabel)
    ax.set_ylabel("bin")
    units = f" ({f.units})" if f.units else ""
    ax.set_title(f"{name}{units}: {value.shape[0]} frames x {value.shape[1]} bins")
    sf.colorbar(im, ax=ax, label=f.units or "value")


def _draw_wave(sf: SubFigure, name: str, value: np.ndarray, f: Field) -> None:
    ax = sf.subplots()
    ax.plot(value.astype(np.float32), linewidth=0.5)
    ax.set_xlabel("sample")
    units = f" ({f.units})" if f.units else ""
    ax.set_title(f"{name}{units}: {value.size} samples")


def _row_height(shape: tuple[int, ...], cols: int, beside: float = 0.0) -> float:
    """Inches for one row of ``cols`` panels of this HW shape, titles included, with
    ``beside`` inches of the width taken by a legend."""
    h, w = shape[:2]
    aspect = min(h / w, 1.5) if h and w else 1.0
    return (FIGURE_WIDTH_IN - beside) / max(cols, 2) * aspect + 0.4


def _legend_width(labels: _Labels) -> float:
    """About the inches a legend of these names takes (10 pt text)."""
    longest = max((len(n) for n in labels.names.values()), default=8)
    return min(0.8 + 0.08 * max(longest, 16 if labels.shown_fill else 0), 3.5)


def draw_sample(
    sample: Mapping[str, Any],
    fields: Mapping[str, Field],
    *,
    title: str = "",
    recipe: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> tuple[Figure, list[str]]:
    """The figure of the sample's visual fields and the names drawn, in the order
    clips, images, masks, spectrograms, waveforms."""
    with needs_extra("compile", "drawing a sample"):
        from matplotlib.figure import Figure

    recipe = recipe or {}
    metadata = metadata or {}
    arrays = {
        n: v for n, v in sample.items() if isinstance(v, np.ndarray) and fields[n].kind == "array"
    }
    images = [n for n, v in arrays.items() if _is_image(v.shape, fields[n].dtype)]
    clips = [n for n, v in arrays.items() if _is_clip(v.shape, fields[n].dtype)]
    # Each mask goes with the image of its shape, else the first of its aspect ratio.
    owner: dict[str, str] = {}
    for n, v in arrays.items():
        if not _is_mask(v.shape, fields[n].dtype):
            continue
        same = [i for i in images if arrays[i].shape[:2] == v.shape]
        near = [i for i in images if _same_aspect(v.shape, arrays[i].shape)]
        if same or near:
            owner[n] = (same or near)[0]
    masks = list(owner)
    spectra = [
        n
        for n, v in arrays.items()
        if v.ndim == 2
        and n not in owner
        and fields[n].dtype.startswith(("f", "bf"))
        and min(v.shape) > 1
    ]
    waves = [
        n
        for n, v in arrays.items()
        if v.ndim == 1 and v.size > 16 and fields[n].dtype.startswith("f")
    ]
    drawn = clips + images + masks + spectra + waves
    if not drawn:
        raise ValueError(
            "nothing to draw: no field is a 2-D feature, an HWC/THWC uint8 image or clip, or a waveform"
        )
    labels = _labels([arrays[m] for m in masks], recipe, metadata) if masks else None

    blocks: list[tuple[float, str, str]] = []
    for n in clips:
        t = arrays[n].shape[0]
        shown = min(t, MAX_FRAMES)
        cols = max(1, min(shown, PANEL_COLUMNS))
        rows = math.ceil(shown / cols)
        blocks.append((rows * _row_height(arrays[n].shape[1:3], cols) + 0.5, "clip", n))
    for n in images:
        count = 1 + sum(1 for m in masks if owner[m] == n)
        cols = min(count, PANEL_COLUMNS)
        rows = math.ceil(count / cols)
        beside = _legend_width(labels) if labels is not None and count > 1 else 0.0
        blocks.append((rows * _row_height(arrays[n].shape, cols, beside), "image", n))
    blocks += [(3.2, "spectrogram", n) for n in spectra]
    blocks += [(2.4, "wave", n) for n in waves]

    height = sum(b[0] for b in blocks) + (0.4 if title else 0.0)
    fig = Figure(figsize=(FIGURE_WIDTH_IN, height), dpi=DPI, layout="constrained")
    subfigs = fig.subfigures(len(blocks), 1, height_ratios=[b[0] for b in blocks], squeeze=False)
    for sf, (_, kind, name) in zip(subfigs[:, 0], blocks, strict=True):
        value = as_float(arrays[name], fields[name])
        if kind == "clip":
            _draw_clip(sf, name, value, sample, recipe, metadata)
        elif kind == "image":
            mine = [(m, arrays[m]) for m in masks if owner[m] == name]
            _draw_picture(sf, name, value, mine, labels)
        elif kind == "spectrogram":
            _draw_spectrogram(sf, name, value, fields[name], recipe)
        else:
            _draw_wave(sf, name, value, fields[name])
    if title:
        fig.suptitle(title)
    return fig, drawn


def render_sample(
    sample: Mapping[str, Any],
    fields: Mapping[str, Field],
    out: str | Path,
    *,
    title: str = "",
    recipe: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> list[str]:
    """Draws the sample's visual fields into one PNG; returns the names drawn."""
    fig, drawn = draw_sample(sample, fields, title=title, recipe=recipe, metadata=metadata)
    # No bbox_inches="tight": the PNG's pixels are the canvas's, at DPI.
    fig.savefig(out, dpi=DPI)
    return drawn

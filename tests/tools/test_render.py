"""dlop-inspect show --png draws pictures fit for a paper: masks registered on their image,
a legend naming the labels, clips as a few large frames titled with their times.

The checks read the figure each run saves (Figure.savefig is wrapped), so they hold for
whatever figure the command builds, and the saved PNG where pixels are the point.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.image import AxesImage
from matplotlib.legend import Legend
from PIL import Image

from dlop.formats import ArchiveReader, ArchiveWriter, Field
from dlop.tools.compile_cli import main as compile_main
from dlop.tools.inspect_cli import main
from tests.compiler.media import write_image, write_video

REMAP = "0:0,1:1,3:2,4:3,5:4,6:5"  # Gleason's six labels
GREY = 128


@pytest.fixture
def saved(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[Figure, float]]]:
    """Every figure saved during the test, with the dpi it was saved at."""
    got: list[tuple[Figure, float]] = []
    original = Figure.savefig

    def spy(self: Figure, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        dpi = kwargs.get("dpi")
        got.append((self, float(dpi if isinstance(dpi, (int, float)) else self.dpi)))

    monkeypatch.setattr(Figure, "savefig", spy)
    yield got


def _axes(fig: Figure) -> list[Axes]:
    return [a for a in fig.findobj(lambda o: isinstance(o, Axes)) if a.get_visible()]


def _images(ax: Axes) -> list[AxesImage]:
    return [c for c in ax.get_children() if isinstance(c, AxesImage)]


def _legend_texts(fig: Figure) -> list[list[str]]:
    return [[t.get_text() for t in leg.get_texts()] for leg in fig.findobj(Legend)]


def _is_colorbar(ax: Axes) -> bool:
    return getattr(ax, "_colorbar", None) is not None or ax.get_label() == "<colorbar>"


def _width_px(ax: Axes, fig: Figure, dpi: float) -> float:
    return float(ax.get_window_extent().width) * dpi / fig.dpi


def _rect_mask(h: int, w: int, box: tuple[int, int, int, int], label: int) -> np.ndarray:
    y0, y1, x0, x1 = box
    m = np.zeros((h, w), np.uint8)
    m[y0:y1, x0:x1] = label
    return m


@pytest.fixture
def gleason(tmp_path: Path) -> Path:
    """A Gleason-style corpus compiled with the remap and consensus: 40x60 cores, each
    annotator's mask a rectangle; the second annotator has no mask for core 2."""
    root = tmp_path / "corpus"
    for n in (1, 2):
        stem = f"slide01_core00{n}"
        write_image(root / "Train Imgs" / f"{stem}.png", np.full((40, 60, 3), GREY, np.uint8))
        write_image(
            root / "Maps1_T" / f"{stem}_classimg_nonconvex.png",
            _rect_mask(40, 60, (10, 30, 20, 40), 3),
        )
        if n == 1:
            write_image(
                root / "Maps2_T" / f"{stem}_classimg_nonconvex.png",
                _rect_mask(40, 60, (5, 25, 10, 30), 5),
            )
    out = tmp_path / "gleason.dlop"
    args = [str(root), "-o", str(out), "-q", "--mask-remap", REMAP, "--consensus"]
    assert compile_main(args) == 0
    return out


def _panels(fig: Figure) -> list[Axes]:
    """Axes showing a picture: the image alone or under a mask."""
    return [a for a in _axes(fig) if _images(a) and not _is_colorbar(a)]


def test_masks_are_panels_of_the_image_with_a_legend_of_label_names(
    gleason: Path, tmp_path: Path, saved: list[tuple[Figure, float]]
) -> None:
    png = tmp_path / "seg.png"
    assert main(["show", str(gleason), "0", "--png", str(png)]) == 0
    ((fig, _),) = saved
    assert not [a for a in fig.get_axes() + _axes(fig) if _is_colorbar(a)]
    # one legend: the six labels the remap declares (not 0-9), whatever this core holds
    assert _legend_texts(fig) == [[f"class {k}" for k in range(6)]]
    panels = _panels(fig)
    titles = [a.get_title() for a in panels]
    assert len(panels) == 4 and titles[1:] == ["Maps1_T", "Maps2_T", "consensus (majority vote)"]
    # registered: every overlay lies on exactly its image's extent, and all panels share
    # one size, so the masks line up with the image beside them
    image_extent = _images(panels[0])[0].get_extent()
    for ax in panels[1:]:
        under, over = _images(ax)
        assert under.get_extent() == image_extent == over.get_extent()
        assert over.get_interpolation() == "nearest"
    sizes = {
        (round(a.get_window_extent().width), round(a.get_window_extent().height)) for a in panels
    }
    assert len(sizes) == 1


def test_an_annotator_without_a_mask_is_named_and_its_fill_in_the_legend(
    gleason: Path, tmp_path: Path, saved: list[tuple[Figure, float]]
) -> None:
    assert main(["show", str(gleason), "1", "--png", str(tmp_path / "s.png")]) == 0
    ((fig, _),) = saved
    assert "Maps2_T: no annotation" in [a.get_title() for a in _panels(fig)]
    assert _legend_texts(fig) == [[*(f"class {k}" for k in range(6)), "no annotation (255)"]]


def _half_size_archive(tmp_path: Path, metadata: dict[str, Any] | None = None) -> Path:
    """An image of 40x60 and its mask stored at 20x30: the rectangle of label 2 covers
    image rows 10-30 and columns 20-40."""
    out = tmp_path / "half"
    fields = [
        Field.str_("key"),
        Field("image", "u8", (None, None, 3)),
        Field("seg", "u8", (None, None)),
    ]
    with ArchiveWriter(out, fields, metadata=metadata) as w:
        w.write(
            {
                "key": "a.png",
                "image": np.full((40, 60, 3), GREY, np.uint8),
                "seg": _rect_mask(20, 30, (5, 15, 10, 20), 2),
            }
        )
    return out


def test_a_mask_at_another_resolution_is_drawn_over_the_image_it_labels(
    tmp_path: Path, saved: list[tuple[Figure, float]], capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "half.png"
    assert main(["show", str(_half_size_archive(tmp_path)), "0", "--png", str(png)]) == 0
    assert "(image, seg)" in capsys.readouterr().out
    ((fig, dpi),) = saved
    panels = _panels(fig)
    under, over = _images(panels[1])
    assert over.get_extent() == under.get_extent() == _images(panels[0])[0].get_extent()
    # only the labels there are, by name
    assert _legend_texts(fig) == [["class 0", "class 2"]]
    # in the PNG, the shaded pixels of the panel are the rectangle's, where the image's
    # rows 10-30 and columns 20-40 are drawn
    ax = panels[1]
    scale = dpi / fig.dpi
    with Image.open(png) as im:
        pixels = np.asarray(im.convert("RGB")).astype(int)
    height = pixels.shape[0]
    box = ax.get_window_extent()
    x0, x1 = round(box.x0 * scale) + 3, round(box.x1 * scale) - 3
    y0, y1 = height - round(box.y1 * scale) + 3, height - round(box.y0 * scale) - 3
    inside = pixels[y0:y1, x0:x1]
    ys, xs = np.nonzero(np.abs(inside - GREY).sum(axis=-1) > 30)
    corners = ax.transData.transform([(20, 10), (40, 30)]) * scale
    expect_x = sorted(corners[:, 0] - x0)
    expect_y = sorted(height - corners[:, 1] - y0)
    assert xs.min() == pytest.approx(expect_x[0], abs=2)
    assert xs.max() + 1 == pytest.approx(expect_x[1], abs=2)
    assert ys.min() == pytest.approx(expect_y[0], abs=2)
    assert ys.max() + 1 == pytest.approx(expect_y[1], abs=2)


def test_label_names_recorded_in_the_archive_name_the_legend(
    tmp_path: Path, saved: list[tuple[Figure, float]]
) -> None:
    names = ["background", "benign", "Gleason 3"]
    archive = _half_size_archive(tmp_path, {"mask_classes": names})
    assert main(["show", str(archive), "0", "--png", str(tmp_path / "n.png")]) == 0
    ((fig, _),) = saved
    assert _legend_texts(fig) == [names]


@pytest.fixture
def charades(tmp_path: Path) -> Path:
    """A 3 s, 30 fps Charades-style video of 320x240, compiled to 16 uniform frames."""
    root = tmp_path / "charades"
    write_video(root / "Charades_v1_480" / "AAAA1.mp4", frames=90, rate=30, size=(320, 240))
    with open(root / "Charades_v1_train.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "subject", "scene", "actions", "length"])
        w.writerow(["AAAA1", "S", "Kitchen", "c001 0.00 1.00", "3.0"])
    out = tmp_path / "charades.dlop"
    assert compile_main([str(root), "-o", str(out), "-q"]) == 0
    return out


def test_a_clip_is_a_few_large_frames_titled_with_their_times(
    charades: Path, tmp_path: Path, saved: list[tuple[Figure, float]]
) -> None:
    png = tmp_path / "clip.png"
    assert main(["show", str(charades), "0", "--png", str(png)]) == 0
    ((fig, dpi),) = saved
    with ArchiveReader(charades) as r:
        s = r.sample(0)
    t = len(s["frames"])
    start, end = float(s["clip_start"]), float(s["clip_end"])
    frames = _panels(fig)
    assert 4 <= len(frames) <= 8
    for ax in frames:
        assert _width_px(ax, fig, dpi) >= 240
        m = re.fullmatch(r"(\d+\.\d\d) s \(frame (\d+)\)", ax.get_title())
        assert m, ax.get_title()
        k = int(m[2])
        assert float(m[1]) == pytest.approx(start + k * (end - start) / t, abs=0.006)
    # the first and last frames are among them; the PNG is one file at the saved size
    assert frames[0].get_title().endswith("(frame 0)")
    assert frames[-1].get_title().endswith(f"(frame {t - 1})")
    with Image.open(png) as im:
        assert im.format == "PNG"
        size = (fig.get_figwidth() * dpi, fig.get_figheight() * dpi)
        assert im.size == pytest.approx(size, abs=1)


def test_a_clip_without_recorded_times_says_so(
    tmp_path: Path, saved: list[tuple[Figure, float]]
) -> None:
    out = tmp_path / "clips"
    fields = [Field.str_("key"), Field("clip", "u8", (20, 24, 32, 3))]
    with ArchiveWriter(out, fields) as w:
        w.write({"key": "c", "clip": np.zeros((20, 24, 32, 3), np.uint8)})
    assert main(["show", str(out), "0", "--png", str(tmp_path / "c.png")]) == 0
    ((fig, dpi),) = saved
    frames = _panels(fig)
    assert [a.get_title() for a in frames] == [
        f"frame {k}" for k in np.linspace(0, 19, 8).round().astype(int)
    ]
    assert all(_width_px(a, fig, dpi) >= 240 for a in frames)
    headings = [sf.get_suptitle() for sf in fig.subfigs]
    assert any("frame times not recorded" in h for h in headings)

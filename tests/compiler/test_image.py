"""Image + mask compile: EXIF orientation, every mask value kept, annotator rules, tiles, bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dlop.compiler.vision.image import consensus
from dlop.formats import ArchiveReader
from dlop.tools.compile_cli import main as compile_main

from .media import write_image

LABELS = np.array([0, 1, 3, 4, 5, 6], np.uint8)


def _mask(seed: int, h: int, w: int) -> np.ndarray:
    """Blocks of Gleason labels, so nearest-neighbour resizing keeps regions."""
    rng = np.random.default_rng(seed)
    blocks = rng.choice(LABELS, size=(h // 8 + 1, w // 8 + 1))
    return np.ascontiguousarray(np.kron(blocks, np.ones((8, 8), np.uint8))[:h, :w])


def _image(seed: int, h: int, w: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), np.uint8)


@pytest.fixture(scope="module")
def gleason(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gleason-style: Train Imgs/ plus Maps1_T/ and Maps2_T/ with <stem>_classimg_nonconvex.png."""
    root = tmp_path_factory.mktemp("gleason")
    sizes = {"slide01_core001": (40, 56), "slide01_core002": (48, 48), "slide02_core001": (64, 40)}
    for n, (stem, (h, w)) in enumerate(sizes.items()):
        write_image(root / "Train Imgs" / f"{stem}.png", _image(n, h, w))
        write_image(root / "Maps1_T" / f"{stem}_classimg_nonconvex.png", _mask(n, h, w))
        if stem != "slide01_core002":  # annotator 2 skipped one image
            write_image(root / "Maps2_T" / f"{stem}_classimg_nonconvex.png", _mask(n + 10, h, w))
    # a JPEG whose EXIF says "rotate 90 clockwise to display" (orientation 6)
    exif = Image.Exif()
    exif[0x0112] = 6
    write_image(
        root / "Train Imgs" / "slide03_core001.jpg", _image(7, 24, 32), exif=exif, quality=95
    )
    write_image(root / "Maps1_T" / "slide03_core001_classimg_nonconvex.png", _mask(7, 32, 24))
    (root / "Train Imgs" / "slide04_core001.jpg").write_bytes(b"")
    (root / "Train Imgs" / "slide05_core001.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    return root


def _samples(out: Path) -> dict[str, dict]:
    with ArchiveReader(out) as r:
        return {r.get("key", i): r.sample(i) for i in range(r.num_samples)}


def test_native_size_round_trip_keeps_every_mask_value(gleason: Path, tmp_path: Path) -> None:
    out = tmp_path / "a"
    assert compile_main([str(gleason), "-o", str(out), "-q"]) == 0
    with ArchiveReader(out) as r:
        fields = dict(r.fields)
        assert r.index.provenance["source"]["layout"] == "segmentation"
    assert fields["image"].shape == (None, None, 3)
    assert fields["Maps1_T"].shape == (None, None) and fields["Maps2_T"].dtype == "u8"
    samples = _samples(out)
    assert len(samples) == 4
    for key, s in samples.items():
        stem = Path(key).stem
        if key.endswith(".png"):
            np.testing.assert_array_equal(s["image"], np.asarray(Image.open(gleason / key)))
        m1 = np.asarray(Image.open(gleason / "Maps1_T" / f"{stem}_classimg_nonconvex.png"))
        np.testing.assert_array_equal(s["Maps1_T"], m1)
        m2_path = gleason / "Maps2_T" / f"{stem}_classimg_nonconvex.png"
        if m2_path.exists():
            np.testing.assert_array_equal(s["Maps2_T"], np.asarray(Image.open(m2_path)))
            assert s["masks_present"].tolist() == [True, True]
        else:
            assert (s["Maps2_T"] == 255).all() and s["Maps2_T"].shape == s["image"].shape[:2]
            assert s["masks_present"].tolist() == [True, False]
    # EXIF orientation applied: the 32x24 (WxH) JPEG is stored upright, 24 wide and 32 high
    rotated = samples["Train Imgs/slide03_core001.jpg"]["image"]
    assert rotated.shape == (32, 24, 3)
    upright = np.asarray(
        Image.open(gleason / "Train Imgs/slide03_core001.jpg").transpose(Image.Transpose.ROTATE_270)
    )
    np.testing.assert_array_equal(rotated, upright)
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert {Path(e["key"]).name: e["reason"].split(":")[0] for e in errors} == {
        "slide04_core001.jpg": "empty file (0 bytes)",
        "slide05_core001.jpg": "cannot decode image",
    }


def test_resize_crop_remap_consensus_and_tiles(gleason: Path, tmp_path: Path) -> None:
    out = tmp_path / "b"
    args = [str(gleason), "-o", str(out), "-q", "--size", "32", "--crop", "24x32"]
    args += ["--mask-remap", "0:0,1:1,3:2,4:3,5:4,6:5", "--consensus"]
    assert compile_main(args) == 0
    samples = _samples(out)
    for key, s in samples.items():
        assert s["image"].shape == (24, 32, 3)
        stem = Path(key).stem
        m1 = np.asarray(Image.open(gleason / "Maps1_T" / f"{stem}_classimg_nonconvex.png"))
        h, w = s["image"].shape[:2]
        # nearest neighbour only: every stored value is a remapped label the annotator drew
        assert set(np.unique(s["Maps1_T"]).tolist()) <= set(
            np.searchsorted(LABELS, np.unique(m1)).tolist()
        )
        if s["masks_present"].all():
            expect = consensus([s["Maps1_T"], s["Maps2_T"]], 255)
            np.testing.assert_array_equal(s["consensus"], expect)
        else:
            np.testing.assert_array_equal(s["consensus"], s["Maps1_T"])
        assert (h, w) == (24, 32)
    tiles = tmp_path / "t"
    assert (
        compile_main([str(gleason), "-o", str(tiles), "-q", "--tile", "16", "--masks", "Maps1_T"])
        == 0
    )
    with ArchiveReader(tiles) as r:
        assert [n for n in r.fields if n.startswith("Maps")] == ["Maps1_T"]
        first = [
            r.sample(i)
            for i in range(r.num_samples)
            if r.get("key", i).endswith("slide01_core001.png")
        ]
    source = np.asarray(
        Image.open(gleason / "Train Imgs/slide01_core001.png")
    )  # 40x56 -> 2x3 tiles
    assert [tuple(t["origin"]) for t in first] == [(y, x) for y in (0, 16) for x in (0, 16, 32)]
    for t in first:
        y, x = t["origin"]
        np.testing.assert_array_equal(t["image"], source[y : y + 16, x : x + 16])


def test_missing_mask_skip_rule_and_consensus_ties(gleason: Path, tmp_path: Path) -> None:
    out = tmp_path / "s"
    assert compile_main([str(gleason), "-o", str(out), "-q", "--missing-mask", "skip"]) == 0
    errors = (out / "errors.jsonl").read_text()
    assert "slide01_core002" in errors and "no Maps2_T mask" in errors
    bad = tmp_path / "r"
    assert (
        compile_main([str(gleason), "-o", str(bad), "-q", "--mask-remap", "0:0,1:1,3:2,4:3,5:4"])
        == 0
    )
    reasons = (bad / "errors.jsonl").read_text()
    assert "mask values [6] are not in the remap table" in reasons
    a = np.array([[1, 2, 3]], np.uint8)
    b = np.array([[1, 3, 255]], np.uint8)
    c = np.array([[2, 2, 255]], np.uint8)
    assert consensus([a, b, c], 255).tolist() == [[1, 2, 3]]
    assert consensus([b, c], 255).tolist() == [[1, 2, 255]]  # tie 1 vs 2: the smaller


def test_image_folder_layout(tmp_path: Path) -> None:
    root = tmp_path / "imgs"
    write_image(root / "cat" / "a.png", _image(1, 20, 30))
    write_image(root / "dog" / "b.webp", _image(2, 30, 20), lossless=True)
    out = tmp_path / "o"
    assert compile_main([str(root), "-o", str(out), "-q", "--size", "10"]) == 0
    s = _samples(out)
    assert s["cat/a.png"]["image"].shape == (10, 15, 3) and s["cat/a.png"]["label"] == 0
    assert s["dog/b.webp"]["image"].shape == (15, 10, 3) and s["dog/b.webp"]["label"] == 1


def test_resolved_recipe_reproduces_an_image_archive(
    gleason: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    a, b = tmp_path / "a", tmp_path / "b"
    args = ["--size", "32", "--crop", "24x32", "--mask-remap", "0:0,1:1,3:2,4:3,5:4,6:5"]
    assert (
        compile_main([str(gleason), "-o", str(a), "-q", *args, "--consensus", "--tile", "16"]) == 0
    )
    assert compile_main(["--recipe", str(a), "-o", str(b), "-q"]) == 0
    for p in sorted(a.iterdir()):
        assert p.read_bytes() == (b / p.name).read_bytes(), p.name


def _disc_core(h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """An upright ``[h, w, 3]`` image: a bright disc on a dark gradient, and the disc's 0/1 mask."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    inside = (y - h * 0.43) ** 2 + (x - w * 0.41) ** 2 < (min(h, w) * 0.29) ** 2
    dark = np.stack([x * 90 / w, y * 90 / h, (x + y) * 60 / (w + h)], axis=-1)
    image = np.where(inside[..., None], 235.0, dark).round().astype(np.uint8)
    return image, inside.astype(np.uint8)


def _write_core(root: Path, stem: str, h: int, w: int, *, turned: bool = False) -> np.ndarray:
    """A Gleason-style JPEG core and its mask; ``turned`` stores it sideways with EXIF orientation 6."""
    image, mask = _disc_core(h, w)
    exif = Image.Exif()
    if turned:  # orientation 6: turn the stored pixels 90 degrees clockwise to display them
        exif[0x0112] = 6
    stored = np.ascontiguousarray(np.rot90(image, 1)) if turned else image
    write_image(root / "Train Imgs" / f"{stem}.jpg", stored, exif=exif, quality=95)
    write_image(root / "Maps1_T" / f"{stem}_classimg_nonconvex.png", mask)
    return mask


def test_an_image_with_masks_drafts_only_by_a_scale_dividing_both_sides(tmp_path: Path) -> None:
    from dlop.compiler.vision.image import DRAFT_SCALE, full_size, load_image
    from dlop.compiler.vision.options import VisionConfig

    cfg = VisionConfig(size=64)
    for (h, w), scale in {(384, 512): 4, (386, 516): 2, (384, 513): 1, (384, 520): 4}.items():
        path = write_image(tmp_path / f"{w}x{h}.jpg", _disc_core(h, w)[0], quality=90)
        image = load_image(path, path.name, cfg, masked=True)
        assert image.size == (w // scale, h // scale), (w, h)
        assert image.info.get(DRAFT_SCALE, 1) == scale and full_size(image) == (w, h)
    # 1/8 would leave a 48-pixel short side, under --size 64: 1/4 is the most
    assert load_image(tmp_path / "512x384.jpg", "a", VisionConfig(size=48), masked=True).size == (
        64,
        48,
    )
    # no --size, or jpeg_draft off: full size
    for off in (VisionConfig(), VisionConfig(size=64, jpeg_draft=False)):
        assert load_image(tmp_path / "512x384.jpg", "a", off, masked=True).size == (512, 384)


def test_the_pixel_cap_counts_a_masked_image_at_its_full_size(tmp_path: Path) -> None:
    from dlop.compiler.errors import InputError
    from dlop.compiler.vision.image import load_image
    from dlop.compiler.vision.options import VisionConfig

    path = write_image(tmp_path / "a.jpg", _disc_core(384, 512)[0], quality=90)
    cfg = VisionConfig(size=64, max_image_pixels=512 * 384 - 1)
    assert load_image(path, "a.jpg", cfg).size == (128, 96)  # no masks: drafted pixels count
    with pytest.raises(InputError, match=r"512x384 image .* over the 196607 pixel cap"):
        load_image(path, "a.jpg", cfg, masked=True)  # its masks are shaped at 512x384


def _near_an_edge(mask: np.ndarray) -> np.ndarray:
    """Pixels next to (8-neighbourhood) a pixel of another mask value: off by one pixel at most."""
    p = np.pad(mask, 1, mode="edge")
    h, w = mask.shape
    return np.any(
        [
            p[1 + dy : 1 + dy + h, 1 + dx : 1 + dx + w] != mask
            for dy in (-1, 0, 1)
            for dx in (-1, 0, 1)
        ],
        axis=0,
    )


def test_a_drafted_image_and_its_full_size_masks_share_one_grid(tmp_path: Path) -> None:
    """Pixels within a stated tolerance of a full decode; masks byte-identical; edges line up."""
    root = tmp_path / "cores"
    _write_core(root, "slide01_core001", 384, 512)
    _write_core(root, "slide01_core002", 520, 392, turned=True)  # 392 x 520 stored, EXIF 6
    _write_core(root, "slide01_core003", 384, 513)  # 513 is odd: decoded at full size
    drafted, full = tmp_path / "d", tmp_path / "f"
    args = ["-q", "--size", "64", "--crop", "60x60"]
    assert compile_main([str(root), "-o", str(drafted), *args]) == 0
    recipe = tmp_path / "full.json"
    recipe.write_text(json.dumps({"source": str(root), "jpeg_draft": False}))
    assert compile_main(["--recipe", str(recipe), "-o", str(full), *args]) == 0
    with ArchiveReader(drafted) as r:
        assert r.index.recipe["vision"]["jpeg_draft"] is True
    a, b = _samples(drafted), _samples(full)
    assert sorted(a) == sorted(b) and len(a) == 3
    for key in a:
        np.testing.assert_array_equal(a[key]["Maps1_T"], b[key]["Maps1_T"])
        x, y = a[key]["image"].astype(np.int16), b[key]["image"].astype(np.int16)
        assert x.shape == y.shape == (60, 60, 3)
        diff = np.abs(x - y)
        assert diff.mean() < 1.0 and np.percentile(diff, 99) <= 12, key
        # the disc seen in the stored image lies on the stored mask's disc
        mask = a[key]["Maps1_T"]
        off = (x.mean(axis=-1) > 160) != (mask == 1)
        assert not (off & ~_near_an_edge(mask)).any(), key

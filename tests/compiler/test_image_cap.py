"""The pixel cap: checked from the header before decoding, configurable, and JPEG drafts under --size."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dlop.compiler.errors import InputError
from dlop.compiler.vision.image import load_image, load_mask
from dlop.compiler.vision.options import DEFAULT_MAX_IMAGE_PIXELS, VisionConfig
from dlop.formats import ArchiveReader
from dlop.tools.compile_cli import main as compile_main

from .media import write_image


def png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose header states ``width x height`` (its pixel data stops after one row)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    row = zlib.compress(b"\x00" + bytes(3 * width))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", row) + chunk(b"IEND", b"")


def _pattern(h: int, w: int, seed: int = 0) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    smooth = np.stack([x * 255 // w, y * 255 // h, (x + y) * 255 // (w + h)], axis=-1)
    noise = np.random.default_rng(seed).integers(0, 8, (h, w, 3))
    return (smooth + noise).clip(0, 255).astype(np.uint8)


def test_a_huge_header_is_refused_before_decoding(tmp_path: Path) -> None:
    path = tmp_path / "bomb.png"
    path.write_bytes(png_claiming(20000, 20000))  # 1.2 GB of RGB if decoded
    assert path.stat().st_size < 100_000
    for source in (path, path.read_bytes()):
        with pytest.raises(InputError) as e:
            load_image(source, "bomb.png")
        assert "20000x20000" in e.value.reason and "400000000 pixels" in e.value.reason
        assert f"over the {DEFAULT_MAX_IMAGE_PIXELS} pixel cap" in e.value.reason
        assert "--max-image-pixels" in e.value.reason
    # just over the cap, inside Pillow's own warning band (cap to 2x cap): refused too
    with pytest.raises(InputError, match="over the 100 pixel cap"):
        load_image(png_claiming(11, 10), "a.png", VisionConfig(max_image_pixels=100))
    with pytest.raises(InputError, match="over the 100 pixel cap"):
        load_mask(png_claiming(11, 10), "m.png", VisionConfig(max_image_pixels=100))
    assert load_image(png_claiming(10, 10), "a.png", VisionConfig(max_image_pixels=100)).size == (
        10,
        10,
    )
    assert Image.MAX_IMAGE_PIXELS is not None  # Pillow's own check is left on


def test_the_cap_is_a_recipe_option_and_a_flag(tmp_path: Path) -> None:
    root = tmp_path / "imgs"
    write_image(root / "cat" / "a.png", _pattern(20, 30))
    write_image(root / "cat" / "big.png", _pattern(100, 120))
    write_image(root / "dog" / "b.png", _pattern(30, 20, seed=1))
    out = tmp_path / "o"
    assert compile_main([str(root), "-o", str(out), "-q", "--max-image-pixels", "5000"]) == 0
    r = ArchiveReader(out)
    assert [r.get("key", i) for i in range(len(r))] == ["cat/a.png", "dog/b.png"]
    np.testing.assert_array_equal(r.sample(0)["image"], _pattern(20, 30))
    [error] = r.errors()
    assert error["path"].endswith("big.png") and "120x100 image" in error["reason"]
    assert r.index.recipe["vision"]["max_image_pixels"] == 5000
    # raised, it admits the image; the recipe in the index repeats the choice
    out2 = tmp_path / "o2"
    assert compile_main([str(root), "-o", str(out2), "-q", "--max-image-pixels", "12000"]) == 0
    assert len(ArchiveReader(out2)) == 3
    fail = tmp_path / "f"
    args = [str(root), "-o", str(fail), "-q", "--max-image-pixels", "5000", "--on-error", "fail"]
    assert compile_main(args) == 1


def test_vision_config_checks_the_cap(tmp_path: Path) -> None:
    from dlop.compiler.errors import CompileError
    from dlop.compiler.recipe import build_recipe

    assert VisionConfig.from_options({"max_image_pixels": 400_000_000}).max_image_pixels == (
        400_000_000
    )
    assert VisionConfig().to_json()["max_image_pixels"] == DEFAULT_MAX_IMAGE_PIXELS
    # an integer everywhere: the recipe, the flag and VisionConfig refuse the same forms
    for bad in (0, -5, "1.5", "4e8", 1.5e8, True):
        with pytest.raises(ValueError, match="max_image_pixels"):
            VisionConfig.from_options({"max_image_pixels": bad})
    for bad in ("4e8", 1.5e8):
        with pytest.raises(CompileError, match="max_image_pixels"):
            build_recipe({"source": str(tmp_path), "max_image_pixels": bad})
        with pytest.raises(CompileError, match="max_image_pixels"):
            build_recipe({"source": str(tmp_path), "vision": {"max_image_pixels": bad}})
    with pytest.raises(SystemExit):
        compile_main([str(tmp_path), "-o", str(tmp_path / "o"), "--max-image-pixels", "4e8"])
    write_image(tmp_path / "c" / "a.png", _pattern(8, 8))
    recipe = build_recipe({"source": str(tmp_path), "max_image_pixels": 400_000_000})
    assert recipe.vision.max_image_pixels == 400_000_000


def test_a_jpeg_with_size_decodes_reduced_and_counts_its_reduced_pixels(tmp_path: Path) -> None:
    path = write_image(tmp_path / "a.jpg", _pattern(600, 800), quality=95)
    small = VisionConfig(size=100, max_image_pixels=100_000)
    image = load_image(path, "a.jpg", small)
    assert image.size == (200, 150)  # 1/4: the largest reduction keeping the short side >= 100
    with pytest.raises(InputError, match="800x600 image"):
        load_image(path, "a.jpg", VisionConfig(max_image_pixels=100_000))
    with pytest.raises(InputError, match="800x600 image"):
        load_image(path, "a.jpg", small, draft=False)
    # the reduced decode resizes to nearly what a full decode does
    full = load_image(path, "a.jpg", VisionConfig(size=100), draft=False)
    a = np.asarray(image.resize((133, 100), Image.Resampling.BILINEAR), np.float32)
    b = np.asarray(full.resize((133, 100), Image.Resampling.BILINEAR), np.float32)
    assert np.abs(a - b).mean() < 2.0
    # a PNG has no reduced decode: the cap counts all of it
    png = write_image(tmp_path / "a.png", _pattern(600, 800))
    with pytest.raises(InputError, match="800x600 image"):
        load_image(png, "a.png", small)


def jpeg_claiming(width: int, height: int, *, progressive: bool) -> bytes:
    """A small JPEG whose frame header (SOF0 or SOF2) states ``width x height``."""
    import io

    buf = io.BytesIO()
    Image.fromarray(_pattern(64, 64)[..., 0]).save(buf, "JPEG", progressive=progressive)
    data = bytearray(buf.getvalue())
    at = data.find(b"\xff\xc2" if progressive else b"\xff\xc0")  # SOF2 is progressive
    if at < 0:
        raise ValueError("Pillow wrote no frame header of the kind asked for")
    data[at + 5 : at + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def test_a_progressive_jpeg_is_held_to_the_cap_at_its_header_size() -> None:
    cfg = VisionConfig(size=224)  # the default 150 MP cap
    bomb = jpeg_claiming(16000, 16000, progressive=True)  # 256 MP, a 1/8 draft would be 4 MP
    with pytest.raises(InputError, match=r"16000x16000 image .* over the 150000000 pixel cap"):
        load_image(bomb, "bomb.jpg", cfg)
    # a baseline JPEG of that size decodes reduced (1/8): its header is within 64x the cap
    try:
        load_image(jpeg_claiming(16000, 16000, progressive=False), "big.jpg", cfg)
    except InputError as e:
        assert "pixel cap" not in e.reason
    # a real progressive image is decoded whole under --size, and counted whole
    real = jpeg_claiming(64, 64, progressive=True)
    assert load_image(real, "a.jpg", VisionConfig(size=16, max_image_pixels=4096)).size == (64, 64)
    with pytest.raises(InputError, match="64x64 image"):
        load_image(real, "a.jpg", VisionConfig(size=16, max_image_pixels=4095))

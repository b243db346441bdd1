"""Image and clip augmentations: image and masks stay aligned, crops stay inside each sample."""

from __future__ import annotations

import pytest
import torch

from dlop.runtime import Normalize, RandomHorizontalFlip, RandomResizedCrop, RandomTemporalCrop
from dlop.runtime.batch import Batch

PALETTE = torch.tensor(
    [[0, 0, 0], [250, 20, 20], [20, 250, 20], [20, 20, 250], [200, 200, 30], [30, 200, 200]],
    dtype=torch.uint8,
)


def shapes(b: int, h: int, w: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Masks of random rectangles (labels 1-5 on 0) and images coloured by label."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(b, h, w, dtype=torch.uint8)
    for i in range(b):
        for label in range(1, 6):
            y0 = int(torch.randint(0, h - 4, (1,), generator=g))
            x0 = int(torch.randint(0, w - 4, (1,), generator=g))
            hh, ww = (
                int(torch.randint(3, h // 2, (1,), generator=g)),
                int(torch.randint(3, w // 2, (1,), generator=g)),
            )
            mask[i, y0 : y0 + hh, x0 : x0 + ww] = label
    return PALETTE[mask.long()], mask


def _gen(seed: int = 1) -> torch.Generator:
    """The Loader's kind of generator: a host one, whatever the batch's device."""
    return torch.Generator().manual_seed(seed)


def _aligned_exactly(device: str) -> None:
    image, mask = shapes(8, 48, 64)
    batch = Batch(image=image.to(device), mask=mask.to(device), other=mask.clone().to(device))
    crop = RandomResizedCrop(32, masks=("mask", "other"), interpolation="nearest", flip=0.5)
    out = crop(batch, _gen())
    assert out["image"].shape == (8, 32, 32, 3) and out["mask"].shape == (8, 32, 32)
    assert out["image"].dtype == torch.uint8 and out["mask"].dtype == torch.uint8
    assert torch.equal(out["image"].cpu(), PALETTE[out["mask"].cpu().long()])
    assert torch.equal(out["mask"], out["other"])


def test_random_resized_crop_keeps_image_and_masks_aligned() -> None:
    _aligned_exactly("cpu")
    image, mask = shapes(8, 48, 64, seed=3)
    out = RandomResizedCrop((40, 40), masks=("mask",), scale=(0.3, 1.0))(
        Batch(image=image, mask=mask), _gen(2)
    )
    # bilinear images: pixels inside a region keep its colour; only edges blend
    diff = (out["image"].int() - PALETTE[out["mask"].long()].int()).abs().amax(-1)
    assert (diff <= 2).float().mean() > 0.9
    # flips happened for some samples and not others, and the draw is repeatable
    again = RandomResizedCrop((40, 40), masks=("mask",), scale=(0.3, 1.0))(
        Batch(image=image, mask=mask), _gen(2)
    )
    assert torch.equal(out["image"], again["image"])
    full = RandomResizedCrop((48, 64), masks=("mask",), scale=(1.0, 1.0), ratio=(4 / 3, 4 / 3))
    whole = full(Batch(image=image, mask=mask), _gen(5))["mask"]
    flipped = [torch.equal(whole[i], mask[i].flip(-1)) for i in range(8)]
    kept = [torch.equal(whole[i], mask[i]) for i in range(8)]
    assert all(f or k for f, k in zip(flipped, kept, strict=True)) and any(flipped) and any(kept)


def test_crops_of_padded_variable_size_images_never_read_padding() -> None:
    image, mask = shapes(6, 40, 50, seed=4)
    lengths = torch.tensor([[40, 50], [20, 30], [12, 45], [40, 9], [5, 5], [33, 21]])
    for i, (h, w) in enumerate(lengths.tolist()):
        image[i, h:], image[i, :, w:] = 7, 7  # padding sentinel, in no palette colour
        mask[i, h:], mask[i, :, w:] = 254, 254
    batch = Batch(image=image, image_lengths=lengths, mask=mask, mask_lengths=lengths)
    out = RandomResizedCrop(24, masks=("mask",), interpolation="nearest")(batch, _gen(7))
    assert not (out["mask"] == 254).any()
    assert not (out["image"] == 7).all(-1).any()
    assert torch.equal(out["image"], PALETTE[out["mask"].long()])
    assert "image_lengths" not in out and "mask_lengths" not in out
    flip = RandomHorizontalFlip(masks=("mask",), p=1.0)(
        Batch(image=image.clone(), image_lengths=lengths, mask=mask.clone(), mask_lengths=lengths),
        _gen(),
    )
    for i, (h, w) in enumerate(lengths.tolist()):
        assert torch.equal(flip["mask"][i, :h, :w], mask[i, :h, :w].flip(-1))
        assert torch.equal(flip["image"][i, :h, :w], image[i, :h, :w].flip(-2))
        assert (flip["mask"][i, :, w:] == 254).all()


def test_clips_share_one_geometry_across_frames_and_temporal_crop() -> None:
    image, mask = shapes(4, 32, 32, seed=5)
    clip = image[:, None].expand(4, 6, 32, 32, 3).clone()
    out = RandomResizedCrop(16, fields=("frames",), masks=("mask",), interpolation="nearest")(
        Batch(frames=clip, mask=mask), _gen(3)
    )
    assert out["frames"].shape == (4, 6, 16, 16, 3)
    for t in range(6):
        assert torch.equal(out["frames"][:, t], PALETTE[out["mask"].long()])
    numbered = torch.arange(10).view(1, 10, 1, 1, 1).expand(3, 10, 2, 2, 3).clone()
    lengths = torch.tensor([10, 4, 7])
    back = RandomTemporalCrop(frames=5, reverse=1.0)(
        Batch(frames=numbered, frames_lengths=lengths), _gen(4)
    )
    seq = back["frames"][:, :, 0, 0, 0]
    assert seq.shape == (3, 5)
    assert all((seq[0, :-1] - seq[0, 1:] == 1).tolist())  # a reversed run of 5 consecutive frames
    assert (
        seq[1, :4].tolist() == [3, 2, 1, 0] and seq[1, 4] == 0
    )  # short clip: reversed, then padding
    fwd = RandomTemporalCrop(frames=5)(
        Batch(frames=numbered.clone(), frames_lengths=lengths), _gen(4)
    )
    assert all((fwd["frames"][0, 1:, 0, 0, 0] - fwd["frames"][0, :-1, 0, 0, 0] == 1).tolist())


def test_normalize_to_channels_first() -> None:
    image = torch.full((2, 4, 5, 3), 255, dtype=torch.uint8)
    out = Normalize(mean=(0.5, 0.5, 0.5), std=(0.25, 0.5, 1.0))(Batch(image=image), _gen())["image"]
    assert out.shape == (2, 3, 4, 5) and out.dtype == torch.float32
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert out[:, 0].eq(2.0).all() and out[:, 1].eq(1.0).all() and out[:, 2].eq(0.5).all()
    clip = torch.zeros(2, 8, 4, 5, 3, dtype=torch.uint8)
    assert Normalize(field="frames")(Batch(frames=clip), _gen())["frames"].shape == (2, 3, 8, 4, 5)


@pytest.mark.gpu
def test_paired_crop_on_the_gpu() -> None:
    _aligned_exactly("cuda")


def test_loader_batches_of_variable_size_images_stay_aligned(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from PIL import Image

    from dlop.compiler.recipe import build_recipe
    from dlop.compiler.run.pipeline import compile_corpus
    from dlop.runtime import Loader, open_archive

    for i, (h, w) in enumerate([(30, 40), (24, 24), (50, 20), (16, 60), (33, 35)]):
        image, mask = shapes(1, h, w, seed=10 + i)
        (tmp_path / "c" / "images").mkdir(parents=True, exist_ok=True)
        (tmp_path / "c" / "annotator").mkdir(exist_ok=True)
        Image.fromarray(image[0].numpy()).save(tmp_path / "c" / "images" / f"s{i}.png")
        Image.fromarray(mask[0].numpy()).save(tmp_path / "c" / "annotator" / f"s{i}_mask.png")
    compile_corpus(build_recipe({"source": str(tmp_path / "c")}), tmp_path / "a", progress=False)
    ds = open_archive(tmp_path / "a")
    assert ds.fields["image"].shape == (None, None, 3)
    crop = RandomResizedCrop(20, masks=("annotator",), interpolation="nearest")
    loader = Loader(ds, batch_size=2, transforms=(crop,), seed=3)
    seen = 0
    for batch in loader:
        assert batch["image"].shape[1:] == (20, 20, 3)
        assert torch.equal(batch["image"], PALETTE[batch["annotator"].long()])
        seen += len(batch["key"])
    assert seen == 5

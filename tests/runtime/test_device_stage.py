"""The device stage: how far the producer runs ahead of the training loop on a GPU,
what reaches the side-stream copy, and augmentations equal on the CPU and a GPU."""

from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from dlop.runtime import Loader
from dlop.runtime.batch import Batch
from dlop.runtime.pipeline.device import DeviceStage

from .helpers import make_archive


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_archive(tmp_path_factory.mktemp("d") / "a", n=41)


class _Event:
    def synchronize(self) -> None:
        pass


class CountingStage(DeviceStage):
    """A CUDA-like device stage on the CPU: batches are cloned as a copy to a device
    would make them, and each copy is counted."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.cuda = True
        self.copies = 0
        self.lock = threading.Lock()

    def copy(self, batch: Batch) -> tuple[Batch, Any]:
        with self.lock:
            self.copies += 1
        moved = Batch(
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        )
        return moved, _Event()

    def use(self, batch: Batch, event: Any) -> None:
        pass


@pytest.mark.parametrize("prefetch", [1, 2, 4])
def test_device_batches_ahead_of_the_loop_stay_bounded(archive: Path, prefetch: int) -> None:
    """On a GPU a ring slot is free again once its copy is done; the producer must
    still not copy the whole epoch onto the device while the loop trains."""
    loader = Loader(archive, 2, seed=1, prefetch=prefetch, fields=["key", "label", "logmel"])
    stage = CountingStage()
    loader.to_device = stage
    reference = Loader(archive, 2, seed=1, prefetch=0, fields=["key", "label", "logmel"])
    try:
        it = iter(loader)
        first = next(it)
        time.sleep(0.5)  # a slow training step
        # the batch in use, and at most `prefetch` device batches waiting for the loop
        assert stage.copies <= 1 + prefetch
        got = [first["label"].clone()] + [b["label"].clone() for b in it]
        want = [b["label"].clone() for b in reference]
        assert len(got) == len(want) == 21
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    finally:
        loader.close()
        reference.close()


@pytest.mark.gpu
def test_every_tensor_copied_to_the_gpu_is_pinned(archive: Path) -> None:
    """Ring fields go from the ring's pinned buffers as they are; lengths and fields
    ragged in two axes (gathered into tensors of their own) are staged in pinned memory."""
    loader = Loader(archive, 4, seed=2, device="cuda")
    stage = loader.to_device
    ring = {t.untyped_storage().data_ptr() for s in loader.buffers() for t in s.values()}
    pageable: list[str] = []
    copied: list[str] = []
    original = stage.staged

    def staged(batch: Batch) -> Batch:
        out = original(batch)
        for k, v in out.items():
            if isinstance(v, torch.Tensor):
                if not v.is_pinned():
                    pageable.append(k)
                if batch[k].untyped_storage().data_ptr() in ring and v is not batch[k]:
                    copied.append(k)
        return out

    stage.staged = staged  # type: ignore[method-assign]
    try:
        batches = [
            {k: v.cpu() for k, v in b.items() if isinstance(v, torch.Tensor)} for b in loader
        ]
    finally:
        loader.close()
    reference = Loader(archive, 4, seed=2)
    want = [{k: v.clone() for k, v in b.items() if isinstance(v, torch.Tensor)} for b in reference]
    reference.close()
    assert len(batches) == 11 and not pageable and not copied, (pageable, copied)
    assert {"speech_lengths", "image", "image_lengths"} <= set(batches[0])
    for got, exp in zip(batches, want, strict=True):
        assert got.keys() == exp.keys() and all(torch.equal(got[k], exp[k]) for k in got)


@pytest.mark.gpu
def test_augmentations_on_the_gpu_equal_their_cpu_results() -> None:
    from dlop.tools.gpu_proof import augmentation_checks

    rows = augmentation_checks("cuda")
    bad = [r for r in rows if not r["ok"]]
    assert rows and not bad, bad


def test_augmentation_checks_run_on_the_cpu() -> None:
    """The comparison the GPU proof makes, CPU against CPU: every check runs and is exact."""
    from dlop.tools.gpu_proof import augmentation_checks

    rows = augmentation_checks("cpu")
    assert {r["name"] for r in rows} >= {"SpecAugment", "Mixup", "RandomResizedCrop bilinear"}
    assert all(r["ok"] and r["max_abs_diff"] == 0 for r in rows), rows


@pytest.mark.gpu
def test_the_training_loop_never_waits_for_the_device(archive: Path) -> None:
    """Taking batches, with every audio augmentation, queues work and returns: torch's
    sync debug mode raises on any host wait in the loop's thread."""
    from dlop.runtime import Mixup, SpecAugment

    transforms = [SpecAugment("logmel", freq_width=2, time_width=2), Mixup(num_classes=41)]
    loader = Loader(archive, 4, seed=3, device="cuda", transforms=transforms)
    try:
        batches = iter(loader)
        next(batches)  # the first batch sets up the stream and allocator
        torch.cuda.synchronize()
        with warnings.catch_warnings():  # "a prototype feature"
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        try:
            count = 1 + sum(1 for _ in batches)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        loader.close()
    torch.cuda.synchronize()
    assert count == 11

"""``dlop-bench --train``: a ResNet18-style CNN trained on log-mel batches, fed naively and by dlop.

Reports samples/s and the share of the run spent waiting for data: the time
the training loop is blocked asking for the next batch. On a GPU it uses
channels-last, bf16 autocast and cuDNN's autotuner, and never synchronizes
inside the loop (as a training script would not), so the loop may queue a
step while the previous one runs; the run ends with one synchronize. On the
CPU the model, not the data, is the limit, which the data-wait share makes
visible.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .common import Row


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.short(x))


class ResNet18(nn.Module):
    """ResNet18 (He et al. 2016) on one-channel [frames, mels] inputs."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            nn.Conv2d(1, 64, 7, 2, 3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        ]
        cin = 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(
            torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1)
        )
        return logits


def prepare(work: Path, clips: int, workers: int, distinct: int = 256) -> tuple[Path, Path]:
    """An ESC-50-shaped corpus of ``clips`` WAVs and its archive (the demo recipe:
    128-mel float16 log-mels of 5 s clips at 44.1 kHz, [431, 128] each). Past
    ``distinct`` clips, the files are hard links to the first ones (synthesizing
    a clip takes longer than decoding it); every file is still decoded and
    featurized on its own."""
    from dlop.compiler.demo import DEMO_RECIPE
    from dlop.compiler.recipe import build_recipe
    from dlop.compiler.run.pipeline import compile_corpus

    from .corpus import esc50_wavs, replicate

    if clips <= distinct:
        corpus = esc50_wavs(work / "esc", clips)
    else:
        times = -(-clips // distinct)
        corpus = replicate(esc50_wavs(work / "esc1", distinct), work / "esc", times)
    recipe = build_recipe({**DEMO_RECIPE, "source": str(corpus)})
    compile_corpus(recipe, work / "archive", workers=workers, progress=False)
    return corpus, work / "archive"


FIELDS = ["logmel", "label"]


def dlop_source(archive: Path, batch: int, device: str) -> Callable[[], Iterable[Any]]:
    """dlop's Loader as a training script makes it (batches onto ``device`` on CUDA)."""
    from dlop.runtime import Loader

    cuda = device.startswith("cuda")
    return lambda: Loader(
        archive, batch, seed=0, drop_last=True, fields=FIELDS, device=device if cuda else None
    )


def sources(
    corpus: Path, archive: Path, batch: int, workers: int, device: str
) -> dict[str, Callable[[], Iterable[Any]]]:
    """The naive DataLoader over the corpus (pinned and persistent, as a GPU training
    sets it) and dlop's Loader over its archive, by name."""
    from .naive import naive_loader

    cuda = device.startswith("cuda")
    return {
        f"naive DataLoader ({workers} workers)": lambda: naive_loader(
            corpus, batch, workers, persistent=True, pin_memory=cuda, drop_last=True
        ),
        "dlop Loader": dlop_source(archive, batch, device),
    }


def workload(batch: int, device: str) -> str:
    cuda = device.startswith("cuda")
    return f"train: ResNet18 on [431, 128] log-mels, batch {batch}, {device}" + (
        " (channels-last, bf16 autocast)" if cuda else ""
    )


def _pairs(batches: Iterable[Any]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for b in batches:
        if isinstance(b, dict):
            yield b["logmel"], b["label"]
        else:
            yield b[0], b[1]


def _endless(source: Iterable[Any]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Epoch after epoch of one loader (a new epoch number each pass where it takes one)."""
    epoch = 0
    while True:
        set_epoch = getattr(source, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)
        yield from _pairs(source)
        epoch += 1


def train_rows(
    workload: str,
    sources: dict[str, Callable[[], Iterable[Any]]],
    steps: int,
    device: str,
    num_classes: int,
    warmup: int = 1,
) -> list[Row]:
    """Trains a fresh ResNet18 on each source for ``warmup`` untimed steps, then
    ``steps`` timed ones; one Row per source."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.backends.cudnn.benchmark = True
    rows = []
    for name, make in sources.items():
        torch.manual_seed(0)
        model = ResNet18(num_classes).to(dev)
        if cuda:
            # Module.to takes memory_format, but torch's overloads do not list it.
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        source = make()
        it = _endless(source)
        waited = 0.0
        done = 0
        started = time.perf_counter()
        for step in range(warmup + steps):
            if step == warmup:  # the timed part starts with the device idle
                if cuda:
                    torch.cuda.synchronize(dev)
                waited, done, started = 0.0, 0, time.perf_counter()
            asked = time.perf_counter()
            x, y = next(it)
            waited += time.perf_counter() - asked
            x = x.to(dev, non_blocking=True).float().unsqueeze(1)
            if cuda:
                x = x.contiguous(memory_format=torch.channels_last)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                loss = nn.functional.cross_entropy(model(x), y.to(dev, non_blocking=True))
            opt.zero_grad(set_to_none=True)
            torch.autograd.backward(loss)  # loss.backward(), which torch leaves unannotated
            opt.step()
            done += len(y)
        if cuda:
            torch.cuda.synchronize(dev)
        wall = time.perf_counter() - started
        close = getattr(source, "close", None)
        if close is not None:
            close()
        rows.append(
            Row(
                workload,
                f"{name}: train step",
                done / wall,
                extra={
                    "data_wait_share": round(waited / wall, 4),
                    "steps": steps,
                    "warmup_steps": warmup,
                    "batch_size": len(y),
                    "device": str(dev),
                },
            )
        )
    return rows

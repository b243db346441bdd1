"""``dlop-bench --train``: a ResNet18-style CNN trained on log-mel batches, fed naively and by dlop.

Reports samples/s and the share of each step spent waiting for data. On a GPU
it uses channels-last and bf16 autocast; on the CPU the model, not the data,
is the limit, which the data-wait share makes visible.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
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


def _batches(source: Iterable[Any]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for b in source:
        if isinstance(b, dict):
            yield b["logmel"], b["label"]
        else:
            yield b[0], b[1]


def train_rows(
    workload: str, sources: dict[str, Any], steps: int, device: str, num_classes: int
) -> list[Row]:
    dev = torch.device(device)
    rows = []
    for name, make in sources.items():
        torch.manual_seed(0)
        model = ResNet18(num_classes).to(dev)
        if dev.type == "cuda":
            # Module.to takes memory_format, but torch's overloads do not list it.
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        waited = computed = 0.0
        done = 0
        it = _batches(make())
        t_wait = time.perf_counter()
        for step in range(steps + 1):  # step 0 warms up and is not counted
            try:
                x, y = next(it)
            except StopIteration:
                it = _batches(make())
                x, y = next(it)
            x = x.to(dev, non_blocking=True).float().unsqueeze(1)
            if dev.type == "cuda":
                x = x.contiguous(memory_format=torch.channels_last)
            t_step = time.perf_counter()
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                loss = nn.functional.cross_entropy(model(x), y.to(dev))
            opt.zero_grad(set_to_none=True)
            torch.autograd.backward(loss)  # loss.backward(), which torch leaves unannotated
            opt.step()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t_end = time.perf_counter()
            if step:
                waited += t_step - t_wait
                computed += t_end - t_step
                done += len(y)
            t_wait = t_end
        rate = done / (waited + computed)
        rows.append(
            Row(
                workload,
                f"{name}: train step",
                rate,
                extra={
                    "data_wait_share": round(waited / (waited + computed), 3),
                    "steps": steps,
                    "device": str(dev),
                },
            )
        )
    return rows

"""PyTorch Lightning trains through the Loader as docs/runtime.md shows: a
LightningDataModule returns the Loader itself, every epoch reads every sample once in
a new order without set_epoch, a checkpoint resumes the loader exactly (mid-epoch and at
an epoch's end), and under DDP each process's Loader takes its share from
torch.distributed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dlop.runtime import Loader

from .helpers import make_archive

L = pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    # torch deprecates the LeafSpec that Lightning 2.6 builds for every batch it
    # fetches; nothing of dlop's, and nothing a caller can avoid.
    pytest.mark.filterwarnings(
        r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"
    ),
]

N = 37  # not a multiple of the batch size: each epoch ends with a short batch
BATCH = 5
CLASSES = 64  # labels are sample numbers
TRAINER = {
    "accelerator": "cpu",
    "devices": 1,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}

# (trainer epoch, batch_idx, labels, the Loader's epoch) for each training step
Seen = list[tuple[int, int, list[int], int]]


class Data(L.LightningDataModule):
    """The DataModule of docs/runtime.md, on the test archive."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.train: Loader | None = None

    def setup(self, stage: str) -> None:
        # Here, not in __init__: under DDP torch.distributed is initialised by now.
        self.train = Loader(self.path, BATCH, seed=3, fields=["label", "logmel"])

    def train_dataloader(self) -> Loader:
        assert self.train is not None
        return self.train

    def state_dict(self) -> dict[str, Any]:
        assert self.train is not None
        return {"train": self.train.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.train is not None
        self.train.load_state_dict(state["train"])

    def teardown(self, stage: str) -> None:
        if self.train is not None:
            self.train.close()


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(20, CLASSES)
        self.seen: Seen = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loader = self.trainer.train_dataloader
        # tolist copies: the batch's tensors are views of a ring slot the Loader refills
        self.seen.append((self.current_epoch, batch_idx, batch["label"].tolist(), loader.epoch))
        logits = self.head(batch["logmel"].float().flatten(1))
        return torch.nn.functional.cross_entropy(logits, batch["label"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Crash(Exception):
    """Stands for a job killed right after it saved a checkpoint."""


class SaveThenCrash(L.Callback):
    """Saves a checkpoint after training step ``batch`` of ``epoch`` (None: at the end of
    ``epoch``, where ModelCheckpoint saves), then stops the run with Crash."""

    def __init__(self, path: Path, epoch: int, batch: int | None) -> None:
        self.path, self.epoch, self.batch = path, epoch, batch

    def on_train_batch_end(self, trainer: Any, module: Any, out: Any, batch: Any, i: int) -> None:
        if self.batch is not None and (trainer.current_epoch, i) == (self.epoch, self.batch):
            self.crash(trainer)

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        if self.batch is None and trainer.current_epoch == self.epoch:
            self.crash(trainer)

    def crash(self, trainer: Any) -> None:
        trainer.save_checkpoint(self.path)
        raise Crash


def epoch_labels(seen: Seen, epoch: int) -> list[int]:
    return [x for e, _, labels, _ in seen if e == epoch for x in labels]


def fit(path: Path, **kwargs: Any) -> Seen:
    model, data = Model(), Data(path)
    trainer = L.Trainer(max_epochs=2, **TRAINER)
    try:
        trainer.fit(model, datamodule=data, **kwargs)
    finally:
        data.teardown("fit")  # Lightning skips it when the run fails
    return model.seen


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_archive(tmp_path_factory.mktemp("lightning") / "a", n=N)


@pytest.fixture(scope="module")
def whole(archive: Path) -> Seen:
    """Two epochs, uninterrupted."""
    return fit(archive)


def test_each_epoch_reads_every_sample_once_in_a_new_order(archive: Path, whole: Seen) -> None:
    first, second = epoch_labels(whole, 0), epoch_labels(whole, 1)
    assert sorted(first) == sorted(second) == list(range(N))
    assert first != second
    # Lightning's iter() to check that the loader is iterable yields nothing and uses up
    # no epoch: trainer epoch e reads the Loader's epoch e, as docs/runtime.md says.
    assert {(e, loader_epoch) for e, _, _, loader_epoch in whole} == {(0, 0), (1, 1)}
    reference = Loader(archive, BATCH, seed=3, fields=["label"], prefetch=0)
    try:
        for e in (0, 1):
            reference.set_epoch(e)
            assert [b["label"].tolist() for b in reference] == [
                labels for te, _, labels, _ in whole if te == e
            ]
    finally:
        reference.close()


def test_lightning_leaves_the_loader_as_it_is(archive: Path) -> None:
    # No DistributedSampler, no re-created DataLoader: Lightning iterates the Loader
    # itself, whatever use_distributed_sampler says.
    data = Data(archive)
    trainer = L.Trainer(max_epochs=1, limit_train_batches=1, **TRAINER)
    try:
        trainer.fit(Model(), datamodule=data)
        assert trainer.train_dataloader is data.train
    finally:
        data.teardown("fit")


@pytest.mark.parametrize(("epoch", "batch"), [(1, 2), (0, None)], ids=["mid-epoch", "end-of-epoch"])
def test_a_checkpoint_resumes_the_loader_exactly(
    archive: Path, whole: Seen, tmp_path: Path, epoch: int, batch: int | None
) -> None:
    ckpt = tmp_path / "crash.ckpt"
    model, data = Model(), Data(archive)
    trainer = L.Trainer(max_epochs=2, callbacks=[SaveThenCrash(ckpt, epoch, batch)], **TRAINER)
    with pytest.raises(Crash):
        trainer.fit(model, datamodule=data)
    data.teardown("fit")
    before = model.seen
    # Resumed mid-epoch, Lightning itself gives the Loader the state it recorded in the
    # checkpoint (the Loader has state_dict/load_state_dict); at an epoch's end it does
    # not, and the DataModule's hooks are what keep the next epoch from repeating one.
    after = fit(archive, ckpt_path=ckpt)
    # The steps after the checkpoint are exactly those the uninterrupted run took after
    # it: the rest of that epoch (every sample of it once, with those before), then the
    # next epoch in the same new order.
    steps = [(e, i, labels) for e, i, labels, _ in before + after]
    assert steps == [(e, i, labels) for e, i, labels, _ in whole]
    for e in (0, 1):
        assert sorted(epoch_labels(before + after, e)) == list(range(N))
    assert after, "the resumed run trained on nothing"


class Shares(L.Callback):
    """Writes, per rank, the labels each epoch gave it and the Loader's rank and world."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: Any, module: Any) -> None:
        state = trainer.train_dataloader.state_dict()
        record = {"rank": state["rank"], "world": state["world_size"], "seen": module.seen}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


# The DDP run, in a fresh interpreter: a process forked from pytest after the tests above
# ran torch's OpenMP kernels hangs at its first parallel matrix product (libgomp's thread
# team does not survive fork); a fresh interpreter forks before running any.
DDP_RUN = """
import sys
from pathlib import Path

import lightning as L

from tests.runtime.test_lightning import TRAINER, Data, Model, Shares

out = Path(sys.argv[1])
trainer = L.Trainer(
    max_epochs=2, strategy="ddp_fork", callbacks=[Shares(out)], **{**TRAINER, "devices": 2}
)
trainer.fit(Model(), datamodule=Data(out / "a"))
"""


@pytest.mark.slow
def test_ddp_processes_share_each_epoch(tmp_path: Path) -> None:
    # ddp_fork starts the processes from the one that fits, so nothing is imported again;
    # strategy="ddp" runs the script once per process, and the Loader is made the same way.
    make_archive(tmp_path / "a", n=40)
    done = subprocess.run(
        [sys.executable, "-c", DDP_RUN, str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world"]) for r in records] == [(0, 2), (1, 2)]
    for e in (0, 1):
        shares = [[x for te, _, labels, _ in r["seen"] if te == e for x in labels] for r in records]
        assert not set(shares[0]) & set(shares[1])
        assert sorted(shares[0] + shares[1]) == list(range(40))
    orders = [[labels for te, _, labels, _ in records[0]["seen"] if te == e] for e in (0, 1)]
    assert orders[0] != orders[1]


# A DDP run that checkpoints and crashes mid-epoch on DEVICES processes, or resumes from
# that checkpoint on another number; each rank writes what it trained on.
DDP_RESHAPED = """
import json, sys
from pathlib import Path

import lightning as L

from tests.runtime.test_lightning import TRAINER, Crash, Data, Model, SaveThenCrash

out, devices, name = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
ckpt = out / "crash.ckpt"


class Record(L.Callback):
    def write(self, trainer, module):
        (out / f"{name}-{trainer.global_rank}.json").write_text(json.dumps(module.seen))

    def on_train_end(self, trainer, module):
        self.write(trainer, module)

    def on_train_batch_end(self, trainer, module, out_, batch, i):
        if name == "first" and (trainer.current_epoch, i) == (0, 2):
            self.write(trainer, module)


callbacks = [Record()] + ([SaveThenCrash(ckpt, 0, 2)] if name == "first" else [])
trainer = L.Trainer(
    max_epochs=2, strategy="ddp_fork", callbacks=callbacks, **{**TRAINER, "devices": devices}
)
try:
    trainer.fit(Model(), datamodule=Data(out / "a"), ckpt_path=None if name == "first" else ckpt)
except Crash:
    sys.exit(3)
"""


@pytest.mark.slow
def test_a_ddp_checkpoint_resumes_on_another_number_of_devices(tmp_path: Path) -> None:
    """Two DDP processes checkpoint mid-epoch and crash; three resume from the checkpoint:
    the epoch's samples are each read once over both runs, then the next epoch whole."""
    make_archive(tmp_path / "a", n=40)

    def run(devices: int, name: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", DDP_RESHAPED, str(tmp_path), str(devices), name],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=300,
        )

    crashed = run(2, "first")
    assert crashed.returncode != 0 and "Crash" in crashed.stderr, crashed.stderr[-4000:]
    before = [json.loads((tmp_path / f"first-{r}.json").read_text()) for r in (0, 1)]
    resumed = run(3, "again")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    after = [json.loads((tmp_path / f"again-{r}.json").read_text()) for r in (0, 1, 2)]
    first = [x for seen in before for e, _, labels, _ in seen if e == 0 for x in labels]
    rest = [x for seen in after for e, _, labels, _ in seen if e == 0 for x in labels]
    assert len(first) == 2 * 3 * BATCH  # three steps on each of two ranks
    assert set(first) | set(rest) == set(range(40)) and len(first + rest) - 40 < 3
    steps = {len([1 for e, _, _, _ in seen if e == 0]) for seen in after}
    assert len(steps) == 1, "every rank took as many steps"
    second = [x for seen in after for e, _, labels, _ in seen if e == 1 for x in labels]
    assert sorted(set(second)) == list(range(40)) and len(second) - 40 < 3

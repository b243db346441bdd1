"""The pipeline dlop replaces: decode and featurize every clip, every epoch, in a DataLoader."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import soundfile as sf
import torch
from torch.utils.data import DataLoader, Dataset

from dlop.compiler.audio.filterbanks import mel_filterbank
from dlop.compiler.audio.resample import resample


class NaiveLogmel(Dataset[tuple[torch.Tensor, int]]):
    """Per sample: soundfile.read, downmix, resample if needed, torch.stft, mel, dB (top_db 80), float16."""

    def __init__(
        self,
        corpus: Path,
        sample_rate: int = 44100,
        n_fft: int = 1024,
        hop_length: int = 512,
        n_mels: int = 128,
        seconds: float = 5.0,
    ) -> None:
        with open(corpus / "meta" / "esc50.csv") as fh:
            rows = list(csv.DictReader(fh))
        self.files = [corpus / "audio" / r["filename"] for r in rows]
        self.labels = [int(r["target"]) for r in rows]
        self.sr, self.n_fft, self.hop, self.samples = (
            sample_rate,
            n_fft,
            hop_length,
            int(seconds * sample_rate),
        )
        self.fb = torch.tensor(
            mel_filterbank(sample_rate, n_fft, n_mels, 0.0, sample_rate / 2, "slaney", "slaney"),
            dtype=torch.float32,
        )
        self.window = torch.hann_window(n_fft)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x, rate = sf.read(self.files[i], dtype="float32", always_2d=True)
        wave = torch.from_numpy(x.mean(axis=1))
        if rate != self.sr:
            wave = resample(wave, rate, self.sr)
        wave = torch.nn.functional.pad(wave[: self.samples], (0, max(0, self.samples - len(wave))))
        spec = torch.stft(
            wave,
            self.n_fft,
            self.hop,
            window=self.window,
            center=True,
            pad_mode="constant",
            return_complex=True,
        )
        mel = (spec.abs() ** 2).T @ self.fb
        db = 10 * torch.log10(mel.clamp_min(1e-10))
        return torch.maximum(db, db.max() - 80).half(), self.labels[i]


def naive_loader(
    corpus: Path,
    batch_size: int = 64,
    workers: int = 2,
    *,
    persistent: bool = False,
    pin_memory: bool = False,
    drop_last: bool = False,
    **kw: Any,
) -> DataLoader[Any]:
    """The DataLoader a training script writes (``persistent`` and ``pin_memory`` as a
    GPU training sets them). Once CUDA is initialized its workers start by forkserver:
    a forked worker that frees an inherited CUDA tensor aborts."""
    cuda_started = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    return DataLoader(
        NaiveLogmel(corpus, **kw),
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        persistent_workers=persistent and workers > 0,
        pin_memory=pin_memory,
        drop_last=drop_last,
        multiprocessing_context="forkserver" if cuda_started and workers > 0 else None,
    )


def epoch(loader: Any) -> int:
    n = 0
    for batch in loader:
        n += len(batch[0] if isinstance(batch, list | tuple) else next(iter(batch.values())))
    return n

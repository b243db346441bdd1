"""The compiled spectrum-to-filterbank step against the torch products it replaces.

Both paths compute |FFT|^p through the same filterbank; they round the sums
in different orders, so they agree to float32 rounding rather than bit for
bit. Each is row by row on its own (test_batched runs every preset through
both), so neither lets a clip's bytes depend on the clips beside it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dlop.compiler.audio import features
from dlop.compiler.audio.features import featurize_clips
from dlop.compiler.audio.options import feature_config

from .signals import make_signal

needs_native = pytest.mark.skipif(
    features._native is None, reason="the compiled kernels were not built (no C compiler)"
)

KINDS = [
    ("librosa", "logmel", {}),
    ("librosa", "mfcc", {}),
    ("librosa", "logmel", {"fft_dtype": "float64"}),
    ("whisper", "logmel", {}),
    ("panns", "logmel", {}),
    ("kaldi", "fbank", {}),
    ("ast", "fbank", {}),
    ("librosa", "logmel", {"power": 1.0}),
    ("librosa", "logmel", {"n_mels": 256, "n_fft": 512}),  # filters narrower than a bin: empty
]


def clips(rate: int) -> list[torch.Tensor]:
    return [
        torch.from_numpy(make_signal(rate, s, seed=i).astype(np.float32))
        for i, s in enumerate((0.9, 0.05, 1.7, 0.31))
    ]


@needs_native
@pytest.mark.parametrize(("preset", "kind", "options"), KINDS)
def test_compiled_and_torch_filterbanks_agree(
    preset: str, kind: str, options: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = feature_config(preset, kind, **options)
    waves = clips(cfg.sample_rate)
    native = featurize_clips(waves, cfg)
    monkeypatch.setattr(features, "_native", None)
    fallback = featurize_clips(waves, cfg)
    for a, b in zip(native, fallback, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype == torch.float32
        assert torch.isfinite(a).all()
        # dB (or log) values: a few float32 roundings of the mel energies apart
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-4)
    if cfg.features != "mfcc":  # the spectrogram itself differs (not only a rounding's worth)
        assert any(not torch.equal(a, b) for a, b in zip(native, fallback, strict=True)) or (
            cfg.n_mels > cfg.n_fft // 2
        )


@needs_native
def test_power_filterbank_matches_a_dense_product_in_float64() -> None:
    cfg = feature_config("librosa", n_mels=40, n_fft=256, hop_length=64)
    spec = torch.randn(37, 129, dtype=torch.complex64)  # rows not a multiple of the block
    out = torch.empty(37, 40)
    features._filterbank_into(spec, 2.0, cfg, out)
    fb = features._filterbank_tensor(cfg).double()
    want = (spec.abs().double() ** 2) @ fb
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    features._filterbank_into(spec, 1.0, cfg, out)
    torch.testing.assert_close(out.double(), spec.abs().double() @ fb, rtol=1e-5, atol=1e-6)


@needs_native
def test_power_filterbank_refuses_a_mismatched_spectrum_or_output() -> None:
    cfg = feature_config("librosa", n_mels=40, n_fft=256, hop_length=64)
    with pytest.raises(ValueError, match="expected 129 bins"):
        features._filterbank_into(
            torch.zeros(4, 100, dtype=torch.complex64), 2.0, cfg, torch.empty(4, 40)
        )
    with pytest.raises(ValueError, match=r"contiguous float32 \(4, 40\)"):
        features._filterbank_into(
            torch.zeros(4, 129, dtype=torch.complex64), 2.0, cfg, torch.empty(40, 4).T
        )
    with pytest.raises(ValueError, match="expected 129 bins"):
        features._filterbank_into(torch.zeros(4, 129), 2.0, cfg, torch.empty(4, 40))

"""Band-limited polyphase resampling with a Kaiser-windowed sinc kernel.

Quality target (REFERENCE §3): the default windowed-sinc resamplers of the
common audio libraries lose 10+ dB near Nyquist; this kernel (64 zero
crossings, roll-off 0.9476, Kaiser beta 14.77) keeps tones above 100 dB SNR up
to 0.8 of the lower Nyquist frequency.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ResampleConfig:
    zero_crossings: int = 64
    rolloff: float = 0.9475937167399596
    beta: float = 14.769656459379492


@functools.lru_cache(maxsize=16)
def _kernel(
    orig: int, new: int, cfg: ResampleConfig, dtype: torch.dtype
) -> tuple[torch.Tensor, int]:
    """Polyphase kernels ``[new, 1, taps]`` for rates already divided by their gcd."""
    base = min(orig, new) * cfg.rolloff
    width = math.ceil(cfg.zero_crossings * orig / base)
    taps = torch.arange(-width, width + orig, dtype=torch.float64) / orig
    phases = -torch.arange(new, dtype=torch.float64)[:, None] / new
    t = ((taps[None, :] + phases) * base).clamp(-cfg.zero_crossings, cfg.zero_crossings)
    window = torch.special.i0(
        cfg.beta * torch.sqrt(1 - (t / cfg.zero_crossings) ** 2)
    ) / torch.special.i0(torch.tensor(cfg.beta, dtype=torch.float64))
    t = t * math.pi
    sinc = torch.where(
        t == 0, torch.ones_like(t), torch.sin(t) / torch.where(t == 0, torch.ones_like(t), t)
    )
    kernel = (sinc * window * (base / orig)).to(dtype)
    return kernel[:, None, :], width


def resample(
    waveform: torch.Tensor, orig_rate: int, new_rate: int, cfg: ResampleConfig = ResampleConfig()
) -> torch.Tensor:
    """``(..., time) -> (..., ceil(time * new_rate / orig_rate))`` in the input's dtype."""
    if orig_rate <= 0 or new_rate <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_rate} -> {new_rate}")
    if orig_rate == new_rate:
        return waveform
    g = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // g, new_rate // g
    kernel, width = _kernel(orig, new, cfg, waveform.dtype)
    shape = waveform.shape
    length = shape[-1]
    out_len = math.ceil(new * length / orig)
    if length == 0 or waveform.numel() == 0:
        return waveform.new_zeros((*shape[:-1], out_len))
    x = waveform.reshape(math.prod(shape[:-1]), 1, length)
    x = F.pad(x, (width, width + orig))
    y = F.conv1d(x, kernel, stride=orig)  # [batch, new, blocks]
    y = y.transpose(1, 2).reshape(x.shape[0], -1)
    return y[:, :out_len].reshape(*shape[:-1], out_len)

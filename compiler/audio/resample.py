"""Band-limited polyphase resampling with a Kaiser-windowed sinc kernel.

Quality target: torchaudio's default windowed-sinc resampler (Hann window,
width 6, roll-off 0.99) loses 10+ dB near Nyquist; this kernel (64 zero
crossings, roll-off 0.9476, Kaiser beta 14.77) keeps tones above 100 dB SNR up
to 0.8 of the lower Nyquist frequency.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from .options import ResampleConfig


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


@functools.lru_cache(maxsize=16)
def _block_weights(
    orig: int, new: int, cfg: ResampleConfig, dtype: torch.dtype
) -> tuple[torch.Tensor, int, int]:
    """The kernels of ``group`` consecutive blocks as one matrix ``[taps', group * new]``.

    With few phases per block (48 kHz -> 16 kHz has one) each block's
    product would be a thin matrix-vector step over a window mostly shared
    with its neighbours; grouping blocks gives a wide product and a window
    read once per group. Entry ``[g * orig + t, g * new + p]`` is phase p's tap t.
    """
    kernel, width = _kernel(orig, new, cfg, dtype)
    group = -(-MIN_PHASES // new)
    taps = kernel.shape[-1]
    weights = torch.zeros((taps + (group - 1) * orig, group * new), dtype=dtype)
    for g in range(group):
        weights[g * orig : g * orig + taps, g * new : (g + 1) * new] = kernel[:, 0, :].T
    return weights, width, group


MIN_PHASES = 64  # output samples per kernel row, at least (blocks are grouped)
CHUNK_SAMPLES = 1 << 20  # input samples per step
ROW_BLOCK = 256  # output blocks per kernel product


def resample(
    waveform: torch.Tensor,
    orig_rate: int,
    new_rate: int,
    cfg: ResampleConfig = ResampleConfig(),
    chunk_samples: int | None = None,
) -> torch.Tensor:
    """``(..., time) -> (..., ceil(time * new_rate / orig_rate))`` in the input's dtype.

    The input is read about ``chunk_samples`` samples at a time (default
    CHUNK_SAMPLES), each step with its own margins, so the only full-length
    tensor made is the output. Every kernel product spans exactly ROW_BLOCK
    output blocks (the last zero-padded): BLAS rounds a short product
    differently, and a fixed size makes each output sample the same whatever
    the chunking or the input's length.
    """
    if orig_rate <= 0 or new_rate <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_rate} -> {new_rate}")
    if chunk_samples is not None and chunk_samples < 1:
        raise ValueError(f"chunk_samples must be positive, got {chunk_samples}")
    if orig_rate == new_rate:
        return waveform
    g = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // g, new_rate // g
    weights, width, group = _block_weights(orig, new, cfg, waveform.dtype)
    orig, new, taps = orig * group, new * group, weights.shape[0]
    shape = waveform.shape
    length = shape[-1]
    out_len = math.ceil(new * length / orig)
    if length == 0 or waveform.numel() == 0:
        return waveform.new_zeros((*shape[:-1], out_len))
    x = waveform.reshape(math.prod(shape[:-1]), length)
    # Output block b (samples b*new .. b*new + new) reads x[b*orig - width :][:taps].
    blocks = -(-out_len // new)
    step = max(1, (chunk_samples or CHUNK_SAMPLES) // orig)
    step = -(-step // ROW_BLOCK) * ROW_BLOCK
    out = x.new_empty((x.shape[0], blocks, new))
    for k0 in range(0, blocks, step):
        k1 = min(blocks, k0 + step)
        lo, hi = k0 * orig - width, (k1 - 1) * orig - width + taps
        span = x[:, max(lo, 0) : min(hi, length)]
        if lo < 0 or hi > length:
            span = F.pad(span, (max(0, -lo), max(0, hi - length)))
        frames = span.unfold(-1, taps, orig)  # [batch, k1 - k0, taps], a view
        for r0 in range(0, k1 - k0, ROW_BLOCK):
            rows = min(ROW_BLOCK, k1 - k0 - r0)
            block = frames[:, r0 : r0 + rows]
            if rows < ROW_BLOCK:
                block = F.pad(block, (0, 0, 0, ROW_BLOCK - rows))
            product = block.contiguous() @ weights
            out[:, k0 + r0 : k0 + r0 + rows] = product[:, :rows]
    return out.reshape(x.shape[0], -1)[:, :out_len].reshape(*shape[:-1], out_len)

"""Audio featurizers as pure torch functions (their options: ``compiler.audio.options``).

Every function maps ``(..., time)`` to ``(..., frames, bins)`` (time-major)
and treats each leading index as its own clip: per-clip clamps (``top_db``,
Whisper's max-8) are never computed across a batch.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from . import numerics
from .decode import PCM16_SCALE
from .filterbanks import dct_matrix, kaldi_filterbank, mel_filterbank
from .kernels import native as _native
from .options import FeatureConfig, kaldi_frame_sizes

# MKL's CPU-independent code path, asked for before anything here runs MKL (compiler.audio.numerics)
numerics.prefer()


def _dtype(cfg: FeatureConfig) -> torch.dtype:
    return torch.float64 if cfg.fft_dtype == "float64" else torch.float32


@functools.lru_cache(maxsize=32)
def make_window(kind: str, length: int, dtype: torch.dtype) -> torch.Tensor:
    """The analysis window (cached: callers only read it)."""
    n = np.arange(length, dtype=np.float64)
    if kind == "hann":
        w = 0.5 - 0.5 * np.cos(2 * math.pi * n / length)
    elif kind in ("hanning", "povey"):
        w = 0.5 - 0.5 * np.cos(2 * math.pi * n / max(length - 1, 1))
        if kind == "povey":
            w = w**0.85
    elif kind == "hamming":
        w = 0.54 - 0.46 * np.cos(2 * math.pi * n / max(length - 1, 1))
    elif kind == "rectangular":
        w = np.ones(length)
    else:
        raise ValueError(f"unknown window {kind!r}")
    return torch.from_numpy(w).to(dtype)


def _pad_edges(x: torch.Tensor, pad: int, mode: str) -> torch.Tensor:
    if mode == "constant" or pad == 0:
        return F.pad(x, (pad, pad))
    if x.shape[-1] > pad:
        return F.pad(x.reshape(-1, 1, x.shape[-1]), (pad, pad), mode="reflect").reshape(
            *x.shape[:-1], -1
        )
    # Shorter than the padding: numpy reflects repeatedly, as librosa does.
    arr = x.detach().cpu().numpy()
    if arr.shape[-1] == 0:
        return F.pad(x, (pad, pad))
    widths = [(0, 0)] * (arr.ndim - 1) + [(pad, pad)]
    return torch.from_numpy(np.pad(arr, widths, mode="reflect")).to(x.dtype)


def frame_signal(
    x: torch.Tensor, frame: int, hop: int, center: bool, pad_mode: str
) -> torch.Tensor:
    """``(..., time) -> (..., frames, frame)``, a strided view where possible."""
    if center:
        x = _pad_edges(x, frame // 2, pad_mode)
    if x.shape[-1] < frame:
        return x.new_zeros((*x.shape[:-1], 0, frame))
    return x.unfold(-1, frame, hop)


def frame_segments(
    x: torch.Tensor, frame: int, hop: int, center: bool, pad_mode: str
) -> list[torch.Tensor]:
    """``(time,)`` -> frame_signal's ``(frames, frame)`` rows as pieces to be laid end to end.

    With centring, only the few frames that reach into the padding are made
    from padded copies of the clip's ends; the frames between are a view of
    the clip itself, so the clip is never copied whole to pad it.
    """
    pad = frame // 2 if center else 0
    length = x.shape[-1]
    count = 0 if length + 2 * pad < frame else 1 + (length + 2 * pad - frame) // hop
    first = -(-pad // hop)  # the first frame lying wholly inside the clip
    last = (length + pad - frame) // hop  # and the last
    if not center or count == 0 or first > last or length <= 2 * pad + 1:
        return [frame_signal(x, frame, hop, center, pad_mode)]
    # The head's padded samples 0..span depend on x[:span - pad] and, when
    # reflecting, on x[1 : pad + 1]; the tail's on x from its first frame on
    # and on x[-pad - 1 :]. Each end is padded on its own, then cut to the
    # part that matches the padded clip.
    span = (first - 1) * hop + frame
    head = _pad_edges(x[: min(length, max(span - pad, pad + 1))], pad, pad_mode)[:span]
    pieces = [
        head.unfold(-1, frame, hop),
        x[first * hop - pad :].unfold(-1, frame, hop)[: last + 1 - first],
    ]
    if count > last + 1:
        begin = (last + 1) * hop - pad  # the tail's first frame, in clip samples
        cut = max(0, min(begin, length - pad - 1))
        tail = _pad_edges(x[cut:], pad, pad_mode)[pad + begin - cut :]
        pieces.append(tail.unfold(-1, frame, hop)[: count - last - 1])
    return pieces


def _stft_frames(x: torch.Tensor, cfg: FeatureConfig) -> list[torch.Tensor]:
    """float32 ``(time,)`` -> the (centred) signal's ``(frames, n_fft)`` rows, in pieces
    (frame_segments); views where possible."""
    pieces = frame_segments(x, cfg.n_fft, cfg.hop_length, cfg.center, cfg.pad_mode)
    if cfg.drop_last_frame:
        while pieces and pieces[-1].shape[-2] == 0:
            pieces.pop()
        if pieces:
            pieces[-1] = pieces[-1][:-1]
    return pieces


@functools.lru_cache(maxsize=32)
def _stft_window(kind: str, win_length: int, n_fft: int, dtype: torch.dtype) -> torch.Tensor:
    """The window centred in n_fft samples (zeros either side when win_length is shorter)."""
    window = make_window(kind, win_length, dtype)
    left = (n_fft - win_length) // 2
    return F.pad(window, (left, n_fft - win_length - left)) if win_length < n_fft else window


def _stft_spectrum(frames: torch.Tensor, cfg: FeatureConfig) -> torch.Tensor:
    """float32 ``(rows, n_fft) -> (rows, n_fft//2+1)`` complex64 FFT of the frames.

    With fft_dtype float32 the frames arrive windowed (gather_window: the
    window multiplies them as they are gathered, one pass fewer). With
    fft_dtype float64 the window multiply and FFT run in float64 and each
    output bin is rounded back to complex64 at once, an error relative to
    that bin alone (a float32 FFT's error is relative to the whole frame).
    """
    if frames.shape[-2] == 0:  # the FFT backend rejects empty batches
        return frames.new_zeros((*frames.shape[:-1], cfg.n_fft // 2 + 1), dtype=torch.complex64)
    if _dtype(cfg) != torch.float32:
        # float64: a cast copy then an in-place multiply, about twice as fast as
        # letting the multiply promote float32 frames.
        window = _stft_window(cfg.window, cfg.win_length or cfg.n_fft, cfg.n_fft, _dtype(cfg))
        frames = frames.to(_dtype(cfg)).mul_(window)
    spec = torch.fft.rfft(frames)
    del frames
    spectrum: torch.Tensor = spec if spec.dtype == torch.complex64 else spec.to(torch.complex64)
    return spectrum


def _power(spec: torch.Tensor, exponent: float) -> torch.Tensor:
    """complex64 -> float32 ``|spec| ** exponent`` (re^2 + im^2 for 2)."""
    if exponent == 2.0:
        power: torch.Tensor = spec.real.square()
        power.addcmul_(spec.imag, spec.imag)
        return power
    magnitude: torch.Tensor = spec.abs().pow(exponent)
    return magnitude


def _stft_power(frames: torch.Tensor, cfg: FeatureConfig) -> torch.Tensor:
    """float32 ``(rows, n_fft) -> (rows, n_fft//2+1)`` float32 |FFT|^power of the frames."""
    return _power(_stft_spectrum(frames, cfg), cfg.power)


def _kaldi_frames(x: torch.Tensor, cfg: FeatureConfig) -> torch.Tensor:
    """float32 ``(time,) -> (frames, frame_length)`` view (snip_edges framing)."""
    size, shift, _ = kaldi_frame_sizes(cfg)
    return frame_signal(x, size, shift, center=False, pad_mode="constant")


def _kaldi_spectrum(frames: torch.Tensor, cfg: FeatureConfig) -> torch.Tensor:
    """float32 ``(rows, frame_length or fft_length) -> (rows, fft_length//2+1)`` complex64:
    Kaldi's scaling, DC removal, pre-emphasis, window and FFT per frame (``frames`` is
    modified).

    Frames given ``fft_length`` wide (as featurize_clips gathers them) hold the
    frame in their first ``frame_length`` samples and zeros after, the FFT's
    padding. The time-domain steps round relative to the frame too, so they
    run in cfg.fft_dtype along with the FFT.
    """
    size, _, padded = kaldi_frame_sizes(cfg)
    if frames.shape[-2] == 0:
        return frames.new_zeros((*frames.shape[:-1], padded // 2 + 1), dtype=torch.complex64)
    if frames.shape[-1] == size and padded > size:
        frames = F.pad(frames, (0, padded - size))
    frames = frames.to(_dtype(cfg))
    frame = frames[..., :size]  # the samples; the rest stays zero
    if cfg.input_scale != 1.0:
        frame.mul_(cfg.input_scale)
    if cfg.remove_dc:
        # The mean as a matrix product (MKL, the same path on every CPU: compiler.audio.numerics),
        # not torch's mean, whose summation order follows the CPU's vector width.
        ones = torch.full((size, 1), 1.0 / size, dtype=frame.dtype)
        frame.sub_(torch.matmul(frame, ones))
    if cfg.preemphasis:
        # x[i] - p * x[i - 1], and x[0] - p * x[0]: the products are taken first
        previous = frame[..., :-1] * cfg.preemphasis
        frame[..., :1].sub_(frame[..., :1] * cfg.preemphasis)
        frame[..., 1:].sub_(previous)
        del previous
    frame.mul_(make_window(cfg.window, size, frames.dtype))
    spec = torch.fft.rfft(frames)
    del frames, frame
    spectrum: torch.Tensor = spec if spec.dtype == torch.complex64 else spec.to(torch.complex64)
    return spectrum


def _kaldi_power(frames: torch.Tensor, cfg: FeatureConfig) -> torch.Tensor:
    """float32 ``(rows, frame_length or fft_length) -> (rows, fft_length//2+1)``: Kaldi's
    |FFT|^2 per frame (_kaldi_spectrum; ``frames`` is modified)."""
    return _power(_kaldi_spectrum(frames, cfg), 2.0)


def _log_(x: torch.Tensor, cfg: FeatureConfig) -> None:
    """cfg.log of x, in place (no clamps that depend on the clip)."""
    if cfg.log == "none":
        return
    x.clamp_(min=cfg.amin)
    if cfg.log == "db":
        torch.log10(x, out=x)
        x.mul_(10.0)
    elif cfg.log == "log10":
        torch.log10(x, out=x)
    else:
        torch.log(x, out=x)


def _clip_below_clip_max_(x: torch.Tensor, floor: float) -> None:
    """x = max(x, max(x) - floor) in place, x being one clip's ``(frames, bins)``."""
    if x.numel():
        torch.maximum(x, x.amax() - floor, out=x)


def _fix_frames(x: torch.Tensor, num_frames: int) -> torch.Tensor:
    have = x.shape[-2]
    if have >= num_frames:
        return x[..., :num_frames, :]
    return F.pad(x, (0, 0, 0, num_frames - have))


@functools.lru_cache(maxsize=32)
def _filterbank_tensor(cfg: FeatureConfig) -> torch.Tensor:
    if cfg.features == "fbank":
        _, _, padded = kaldi_frame_sizes(cfg)
        f_max = cfg.f_max if cfg.f_max is not None else 0.0
        fb = kaldi_filterbank(cfg.sample_rate, padded, cfg.n_mels, cfg.f_min, f_max)
    else:
        f_max = cfg.sample_rate / 2 if cfg.f_max is None else cfg.f_max
        fb = mel_filterbank(
            cfg.sample_rate, cfg.n_fft, cfg.n_mels, cfg.f_min, f_max, cfg.mel_scale, cfg.norm
        )
    return torch.tensor(fb, dtype=torch.float32)


@functools.lru_cache(maxsize=8)
def _dct_tensor(n_mels: int, n_mfcc: int) -> torch.Tensor:
    return torch.tensor(dct_matrix(n_mels, n_mfcc), dtype=torch.float32)


Band = tuple[
    int, int, int, int, torch.Tensor
]  # filters [f0, f1) use bins [b0, b1): weights [b1-b0, f1-f0]


@functools.lru_cache(maxsize=32)
def _filterbank_bands(cfg: FeatureConfig, filters_per_band: int = 16) -> tuple[Band, ...]:
    """The filterbank cut into groups of adjacent filters, each with the bin range it touches.

    Triangular filters are narrow, so a dense ``[bins, n_mels]`` product is
    mostly multiplications by zero; per band only the touched bins are used.
    """
    fb = _filterbank_tensor(cfg)
    bands = []
    for f0 in range(0, fb.shape[1], filters_per_band):
        f1 = min(fb.shape[1], f0 + filters_per_band)
        rows = torch.nonzero(fb[:, f0:f1].any(dim=1)).flatten()
        b0, b1 = (int(rows[0]), int(rows[-1]) + 1) if len(rows) else (0, 0)
        bands.append((f0, f1, b0, b1, fb[b0:b1, f0:f1].contiguous()))
    return tuple(bands)


ROW_BLOCK = 32  # frames per matrix product; every clip's frames start on a block boundary


def _in_row_blocks(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` padded with zero rows to whole ROW_BLOCKs, at least two, and their count.

    Two at least: a batched product of one matrix takes the single-product path,
    which on some CPUs (AVX-512 under MKL) runs another kernel and rounds
    differently; two or more always take the batched one.
    """
    rows = x.shape[0]
    blocks = max(2, -(-rows // ROW_BLOCK))
    if blocks * ROW_BLOCK != rows:
        x = F.pad(x, (0, 0, 0, blocks * ROW_BLOCK - rows))
    return x, blocks


def _blocked_matmul(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``(rows, k) @ (k, n)`` as products of exactly ROW_BLOCK rows each (rows padded with zeros).

    BLAS picks kernels by matrix size and may round a row differently in a
    product of another size; a batch of fixed-size products makes each row's
    result the same whatever else is computed with it.
    """
    rows = x.shape[0]
    x, blocks = _in_row_blocks(x)
    product = torch.bmm(
        x.view(blocks, ROW_BLOCK, x.shape[1]), weights.expand(blocks, *weights.shape)
    )
    return product.flatten(0, 1)[:rows]


def apply_filterbank(
    power: torch.Tensor, bands: tuple[Band, ...], out: torch.Tensor | None = None
) -> torch.Tensor:
    """``(rows, bins) -> (rows, n_mels)``: the filterbank product, band by band, in fixed
    ROW_BLOCK-row products (see _blocked_matmul), written into ``out`` when given."""
    rows = power.shape[0]
    power, blocks = _in_row_blocks(power)
    if out is None:
        out = power.new_empty((rows, bands[-1][1]))
    for f0, f1, b0, b1, weights in bands:
        if b1 == b0:
            out[:, f0:f1] = 0.0
            continue
        x = power[:, b0:b1].reshape(blocks, ROW_BLOCK, b1 - b0)
        product = torch.bmm(x, weights.expand(blocks, *weights.shape))
        out[:, f0:f1] = product.view(blocks * ROW_BLOCK, f1 - f0)[:rows]
    return out


@dataclass(frozen=True)
class _FilterTable:
    """The filterbank as the compiled kernel takes it: filter f weighs bins [lo[f], hi[f])
    by weights[start[f] : start[f] + hi[f] - lo[f]]."""

    bins: int
    lo: torch.Tensor  # int32
    hi: torch.Tensor  # int32
    start: torch.Tensor  # int64
    weights: torch.Tensor  # float32


@functools.lru_cache(maxsize=32)
def _filter_table(cfg: FeatureConfig) -> _FilterTable:
    fb = _filterbank_tensor(cfg)
    lo, hi, start, pieces, at = [], [], [], [], 0
    for f in range(fb.shape[1]):
        touched = torch.nonzero(fb[:, f]).flatten()
        b0, b1 = (int(touched[0]), int(touched[-1]) + 1) if len(touched) else (0, 0)
        lo.append(b0)
        hi.append(b1)
        start.append(at)
        pieces.append(fb[b0:b1, f])
        at += b1 - b0
    return _FilterTable(
        fb.shape[0],
        torch.tensor(lo, dtype=torch.int32),
        torch.tensor(hi, dtype=torch.int32),
        torch.tensor(start, dtype=torch.int64),
        torch.cat(pieces).contiguous() if pieces else torch.zeros(1),
    )


def _filterbank_into(
    spec: torch.Tensor, exponent: float, cfg: FeatureConfig, out: torch.Tensor
) -> None:
    """complex64 ``(rows, bins)`` -> the filterbank of ``|spec| ** exponent`` in ``out``
    ``(rows, n_mels)`` float32: by the compiled kernel when it was built (power and
    filterbank in one pass over the spectrum), else by torch products."""
    if _native is None or exponent not in (1.0, 2.0):
        apply_filterbank(_power(spec, exponent), _filterbank_bands(cfg), out=out)
        return
    table = _filter_table(cfg)
    rows, bins = spec.shape
    if (
        spec.dtype != torch.complex64
        or bins != table.bins
        or out.dtype != torch.float32
        or tuple(out.shape) != (rows, table.lo.numel())
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"filterbank of a {tuple(spec.shape)} {spec.dtype} spectrum into a "
            f"{tuple(out.shape)} {out.dtype} output: expected {table.bins} bins and a "
            f"contiguous float32 ({rows}, {table.lo.numel()}) output"
        )
    spec = spec.contiguous()
    _native.power_filterbank(
        spec.data_ptr(),
        rows,
        bins,
        out.data_ptr(),
        table.lo.numel(),
        table.lo.data_ptr(),
        table.hi.data_ptr(),
        table.start.data_ptr(),
        table.weights.data_ptr(),
        exponent == 1.0,
    )


def as_float(wave: torch.Tensor) -> torch.Tensor:
    """A waveform in float32: int16 (16-bit PCM as read) times PCM16_SCALE, which is exact."""
    if wave.dtype == torch.int16:
        return wave.to(torch.float32).mul_(float(PCM16_SCALE))
    return wave.to(torch.float32)


def takes_pcm16(cfg: FeatureConfig) -> bool:
    """Whether featurize_clips frames int16 clips as they are, the 1/32768 folded into the
    window it multiplies frames by as it gathers them (float32 STFT features): no
    float32 copy of the clip is made. Elsewhere it converts them first (as_float)."""
    return cfg.features != "waveform" and _gather_window(cfg) is not None


def _gather_window(cfg: FeatureConfig, pcm16: bool = False) -> torch.Tensor | None:
    """The window _gather_rows multiplies the frames by: float32 STFT windows only (Kaldi
    windows after its time-domain steps, float64 after the cast); for int16 frames, that
    window times PCM16_SCALE."""
    if cfg.features == "fbank" or _dtype(cfg) != torch.float32:
        return None
    size = cfg.win_length or cfg.n_fft
    if pcm16:
        return _pcm16_window(cfg.window, size, cfg.n_fft)
    return _stft_window(cfg.window, size, cfg.n_fft, torch.float32)


@functools.lru_cache(maxsize=32)
def _pcm16_window(kind: str, win_length: int, n_fft: int) -> torch.Tensor:
    """The float32 STFT window times 2**-15. Scaling by a power of two is exact, so
    int16 x times it rounds once to the float32 nearest x * 2**-15 * w, which is
    (x * 2**-15) times the window: the bits float32 input gives."""
    return _stft_window(kind, win_length, n_fft, torch.float32) * float(PCM16_SCALE)


def _gather_rows(
    pieces: list[torch.Tensor],
    at: list[int],
    r0: int,
    r1: int,
    window: torch.Tensor | None,
    width: int = 0,
    pcm16_window: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``r0:r1`` of the frames laid out as piece k from row at[k] (ascending), zero
    rows wherever no piece lies: a new float32 ``(r1 - r0, max(width, frame_length))``
    tensor, zero after each frame's samples, each copied row multiplied by ``window``
    when one is given (rows of int16 pieces by ``pcm16_window``)."""
    frame = pieces[0].shape[-1]
    full = torch.empty((r1 - r0, max(width, frame)), dtype=torch.float32)
    if full.shape[1] > frame:
        full[:, frame:] = 0.0
    out = full[:, :frame]
    k = bisect.bisect_right(at, r0) - 1
    pos = r0
    while pos < r1:
        if k >= 0:
            start = at[k]
            end = min(start + pieces[k].shape[-2], r1)
            if pos < end:
                src, dst = pieces[k][pos - start : end - start], out[pos - r0 : end - r0]
                if src.dtype == torch.int16:
                    if pcm16_window is None:
                        raise ValueError("int16 frames need the window scaled for 16-bit PCM")
                    _pcm16_windowed(src, pcm16_window, dst)
                elif window is None:
                    dst.copy_(src)
                else:
                    torch.mul(src, window, out=dst)
                pos = end
        k += 1
        end = min(at[k], r1) if k < len(at) else r1
        if pos < end:
            out[pos - r0 : end - r0] = 0.0
            pos = end
    return full


def _pcm16_windowed(src: torch.Tensor, window: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst = src * window``, int16 rows (16-bit PCM) by a float32 window: by the compiled
    kernel when it was built and each row is contiguous, as framing lays them out, else by
    torch (twice as slow); both round each product once, alike."""
    if (
        _native is None
        or src.dtype != torch.int16
        or src.stride(-1) != 1
        or dst.stride(-1) != 1
        or window.dtype != torch.float32
        or not window.is_contiguous()
        or window.shape != src.shape[-1:]
        or dst.shape != src.shape
        or dst.dtype != torch.float32
    ):
        torch.mul(src, window, out=dst)
        return
    rows, frame = src.shape
    _native.pcm16_rows(
        src.data_ptr(), src.stride(0), rows, frame, window.data_ptr(), dst.data_ptr(), dst.stride(0)
    )


def _row_layout(
    frames: list[list[torch.Tensor]],
) -> tuple[list[int], list[int], list[torch.Tensor], list[int]]:
    """Each clip's frame pieces laid end to end, each clip from a ROW_BLOCK boundary:
    (frames per clip, first row per clip (and the total), every piece, its first row)."""
    counts = [sum(p.shape[-2] for p in clip) for clip in frames]
    starts, pieces, at = [0], list[torch.Tensor](), list[int]()
    for clip_pieces, count in zip(frames, counts, strict=True):
        row = starts[-1]
        for piece in clip_pieces:
            pieces.append(piece)
            at.append(row)
            row += piece.shape[-2]
        starts.append(starts[-1] + -(-count // ROW_BLOCK) * ROW_BLOCK)
    return counts, starts, pieces, at


# Frame samples per featurizer step (2 MiB in float32): a step's frames,
# spectrum and power stay in a core's cache from framing to filterbank; steps
# four times larger run up to three times slower, spilling each pass to memory.
CHUNK_SAMPLES = 1 << 19


def featurize_clips(
    waves: Sequence[torch.Tensor], cfg: FeatureConfig, chunk_frames: int | None = None
) -> list[torch.Tensor]:
    """Each ``(time,)`` clip at cfg.sample_rate -> float32 ``(frames, bins)`` (``(time,)`` for waveform).

    A clip is float (float32 or wider) or int16, 16-bit PCM as read (PCM16_SCALE):
    an int16 clip's features are byte-identical to those of its float32 form.

    The clips' frames are laid end to end, each clip starting on a ROW_BLOCK
    boundary (zero rows fill the rest of its last block), and go through the
    FFT and filterbank ``chunk_frames`` rows at a time (default: about
    CHUNK_SAMPLES samples of frames; rounded up to whole ROW_BLOCKs), so
    neither many clips nor one long recording is held as a whole
    spectrogram. Every frame is transformed alone and every product has a
    fixed shape over rows of one clip, so a clip's features are byte-identical
    whichever clips are featurized with it and however the rows are chunked.
    Log runs once on all mel rows; the per-clip clamps (top_db, Whisper's
    max - 8) and everything after on each clip's own rows.
    """
    if chunk_frames is not None and chunk_frames < 1:
        raise ValueError(f"chunk_frames must be positive, got {chunk_frames}")
    framed_pcm16 = takes_pcm16(cfg)
    xs = []
    for n, wave in enumerate(waves):
        if wave.ndim != 1:
            raise ValueError(
                f"clip {n}: expected a (time,) waveform, got shape {tuple(wave.shape)}"
            )
        xs.append(wave if framed_pcm16 and wave.dtype == torch.int16 else as_float(wave))
    if cfg.features == "waveform" or not xs:
        return xs
    if cfg.features == "fbank":  # rows gathered zero-padded to Kaldi's FFT length
        frames, spectrum_of = [[_kaldi_frames(x, cfg)] for x in xs], _kaldi_spectrum
        width, exponent = kaldi_frame_sizes(cfg)[2], 2.0
    else:
        frames, spectrum_of = [_stft_frames(x, cfg) for x in xs], _stft_spectrum
        width, exponent = 0, cfg.power
    counts, starts, pieces, at = _row_layout(frames)
    del frames
    total = starts[-1]
    step = chunk_frames or CHUNK_SAMPLES // pieces[0].shape[-1]
    step = -(-step // ROW_BLOCK) * ROW_BLOCK  # whole blocks
    window, pcm16_window = _gather_window(cfg), _gather_window(cfg, pcm16=True)
    mel = torch.empty((total, cfg.n_mels), dtype=torch.float32)
    for r0 in range(0, total, step):
        r1 = min(total, r0 + step)
        rows = _gather_rows(pieces, at, r0, r1, window, width, pcm16_window)
        _filterbank_into(spectrum_of(rows, cfg), exponent, cfg, mel[r0:r1])
    del pieces, xs
    _log_(mel, cfg)
    for start, count in zip(starts, counts, strict=False):
        clip = mel[start : start + count]
        if cfg.log != "none" and cfg.top_db is not None:
            _clip_below_clip_max_(clip, cfg.top_db)
        if cfg.post == "whisper":
            _clip_below_clip_max_(clip, 8.0)
            clip.add_(4.0).div_(4.0)
    out = (
        _blocked_matmul(mel, _dct_tensor(cfg.n_mels, cfg.n_mfcc)) if cfg.features == "mfcc" else mel
    )
    clips = []
    for start, count in zip(starts, counts, strict=False):
        clip = out[start : start + count]
        if cfg.num_frames is not None:
            clip = _fix_frames(clip, cfg.num_frames)
        if cfg.post == "ast":
            clip = (clip - cfg.norm_mean) / (2.0 * cfg.norm_std)
        clips.append(clip)
    return clips


def featurize(
    waveform: torch.Tensor, cfg: FeatureConfig, chunk_frames: int | None = None
) -> torch.Tensor:
    """``(..., time)`` at cfg.sample_rate -> float32 ``(..., frames, bins)`` (``(..., time)`` for waveform).

    Each leading index is a clip of its own (featurize_clips), so the result
    is byte-identical to featurizing the clips one by one. int16 is 16-bit PCM
    (PCM16_SCALE).
    """
    if cfg.features == "waveform":
        return as_float(waveform)
    lead, length = waveform.shape[:-1], waveform.shape[-1]
    clips = featurize_clips(list(waveform.reshape(math.prod(lead), length)), cfg, chunk_frames)
    if not clips:
        return torch.zeros((*lead, cfg.num_output_frames(length), cfg.bins), dtype=torch.float32)
    return torch.stack(clips).reshape(*lead, *clips[0].shape)

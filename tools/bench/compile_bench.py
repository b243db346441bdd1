"""dlop-compile against its own limit and one epoch of the naive per-sample DataLoader.

Per core: decode-only samples/s (the corpus's files through soundfile.read and
through the compiler's own decode), featurize-only samples/s on pre-decoded
audio (batched as the compiler does), measured in a fresh process whose heap is
set as a compiling process's is, their combined limit
1 / (1/decode + 1/featurize) with the faster decode, and the compile's samples/s
at 1 and N workers as a fraction of N x that limit, with its peak RSS and CPU
time; and compile memory at 10x scale. A second limit takes the two steps as the
compile takes this corpus's 16-bit PCM (left in int16 by the decoder, framed from
int16), which skips the float32 conversion the first limit's decode includes; the
compile's fraction of it is reported beside the first (``of_pcm16_limit``). The naive epoch, the limit's parts and
the compiles are timed in interleaved rounds (each in turn, ``repeats`` times):
rates are medians, and each ratio is the median of its rounds' ratios, with
their range, so that a slow spell of the machine falls on a round's baseline
and its compile alike.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import soundfile as sf
import torch

from dlop.compiler.audio.decode import decode_audio
from dlop.compiler.audio.features import featurize_clips
from dlop.compiler.audio.options import FeatureConfig
from dlop.compiler.demo import DEMO_RECIPE
from dlop.compiler.recipe import build_recipe
from dlop.compiler.run.items import GROUP_SAMPLES
from dlop.compiler.run.pipeline import CHUNK_ITEMS
from dlop.formats.heap import keep_freed_memory

from .common import Row
from .corpus import esc50_wavs, replicate
from .naive import epoch, naive_loader
from .procmem import PeakSampler, tree_rss_kib

FEATURIZE_SAMPLES = 200 * 5 * 44100  # pre-decoded samples the featurize-only rows hold (170 MiB)


def corpus_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "audio").iterdir())


@dataclass(frozen=True)
class Made:
    """What the compile section leaves for the runtime section."""

    corpus: Path
    archive: Path
    naive_rate: float  # samples/s of the naive per-sample DataLoader


_COMPILE = """
import json, sys, time
from dlop.compiler.run.pipeline import compile_corpus
from dlop.compiler.recipe import build_recipe
options, out, workers = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
recipe = build_recipe(options)
c0, t0 = time.process_time(), time.perf_counter()
index = compile_corpus(recipe, out, workers=workers, progress=False, overwrite=True)
print(index.num_samples, time.perf_counter() - t0, time.process_time() - c0)
"""


@dataclass(frozen=True)
class Timed:
    """One compile in a fresh process."""

    seconds: float  # from after its imports to the index written
    peak_kib: int  # peak RSS of the compile and its workers together
    samples: int
    cpu_s: float  # user + system CPU time of the compiling process itself (not its workers)


def timed_compile(options: dict[str, Any], out: Path, workers: int) -> Timed:
    """The recipe ``options`` compiled in a fresh process, as dlop-compile runs."""
    cmd = [sys.executable, "-c", _COMPILE, json.dumps(options), str(out), str(workers)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    with PeakSampler(lambda: tree_rss_kib(proc.pid), 0.1) as peak:
        stdout, _ = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"compile into {out} failed with exit status {proc.returncode}")
    samples, seconds, cpu = stdout.split()[-3:]
    return Timed(float(seconds), peak.peak, int(samples), float(cpu))


def _esc_options(corpus: Path) -> dict[str, Any]:
    return {**DEMO_RECIPE, "source": str(corpus), "shard_bytes": "4GiB"}


class _Clocks:
    """Wall and CPU time of one timed part: the CPU time (this process's, user and
    system) leaves out what other programs on a shared machine take from it."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def rates(self, count: int) -> tuple[float, float]:
        """``count`` per wall second and per CPU second since the clocks started."""
        wall, cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu
        return count / wall, count / max(cpu, 1e-9)


def _decode_rate(files: list[Path]) -> tuple[float, float]:
    """Clips/s of soundfile.read alone, one core (per wall and per CPU second)."""
    clocks = _Clocks()
    for f in files:
        sf.read(f, dtype="float32", always_2d=True)
    return clocks.rates(len(files))


def _dlop_decode_rate(files: list[Path], pcm16: bool = False) -> tuple[float, float]:
    """Clips/s of the compiler's own decode (its length and finiteness checks and
    downmix included), one core: it converts 16-bit PCM faster than soundfile.read,
    so the limit takes whichever decode is faster. With ``pcm16`` it leaves 16-bit PCM
    in int16, as the compile reads it for this recipe."""
    clocks = _Clocks()
    for f in files:
        decode_audio(f, f.name, mix="mean", pcm16=pcm16)  # the recipe's default downmix
    return clocks.rates(len(files))


def _featurize_rate(
    waves: list[torch.Tensor], cfg: FeatureConfig, group: int, min_s: float = 0.5
) -> tuple[float, float]:
    """Clips/s of featurization alone on pre-decoded audio, one torch thread, ``group``
    clips at a time (at most GROUP_SAMPLES samples, as a worker groups its inputs),
    float16 output included: passes over ``waves`` for at least ``min_s`` seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    done = 0
    try:
        clocks = _Clocks()
        while not done or time.perf_counter() - clocks.wall < min_s:
            for g in range(0, len(waves), group):
                clips = waves[g : g + group]
                held = sum(w.numel() for w in clips)
                step = max(1, len(clips) * GROUP_SAMPLES // max(held, 1))
                for k in range(0, len(clips), step):
                    for feat in featurize_clips(clips[k : k + step], cfg):
                        feat.to(torch.float16)
            done += len(waves)
        return clocks.rates(done)
    finally:
        torch.set_num_threads(threads)


_LIMIT = """
import json, sys
from pathlib import Path
from dlop.tools.bench.compile_bench import measure_limit
asked = json.load(sys.stdin)
print(json.dumps(measure_limit([Path(f) for f in asked["files"]], asked["options"])))
"""


def measure_limit(files: list[Path], options: dict[str, Any]) -> dict[str, float]:
    """Clips/s of each part of the limit of compiling ``files`` with the recipe ``options``,
    one core each, in this process: decode alone (soundfile.read and dlop's own) over
    the files, featurize alone over the first FEATURIZE_SAMPLES decoded samples' worth of
    them, pre-decoded, in the compiler's groups of CHUNK_ITEMS inputs (``featurize``)
    and in groups as large as it ever makes, GROUP_SAMPLES samples (``featurize_batched``),
    each after an untimed warm-up; ``NAME_cpu`` is each part per CPU second of this
    process, not per wall second. The process's heap is set as a compiling process sets
    its own (dlop.formats.heap), so the limit's parts run under the allocator the
    compile runs under."""
    keep_freed_memory()
    cfg = build_recipe(options).feature
    waves: list[torch.Tensor] = []
    held = 0
    for f in files:
        waves.append(torch.from_numpy(sf.read(f, dtype="float32")[0]))
        held += waves[-1].numel()
        if held >= FEATURIZE_SAMPLES:
            break
    chunk = CHUNK_ITEMS["audio"]
    # untimed: what a process does once (first decodes, FFT plans, the filterbank), which a
    # compile spreads over all its clips
    _decode_rate(files[:16])
    _dlop_decode_rate(files[:16])
    _featurize_rate(waves[:chunk], cfg, chunk, min_s=0.0)
    timed = {
        "soundfile": _decode_rate(files),
        "dlop": _dlop_decode_rate(files),
        "featurize": _featurize_rate(waves, cfg, chunk),
        "featurize_batched": _featurize_rate(waves, cfg, len(waves)),
    }
    # the same two steps as the compile takes them for this corpus: 16-bit PCM left in
    # int16 by the decoder and framed from int16 where the features allow it
    ints = [torch.from_numpy(sf.read(f, dtype="int16")[0]) for f in files[: len(waves)]]
    del waves
    _dlop_decode_rate(files[:16], pcm16=True)
    _featurize_rate(ints[:chunk], cfg, chunk, min_s=0.0)
    timed["dlop_pcm16"] = _dlop_decode_rate(files, pcm16=True)
    timed["featurize_pcm16"] = _featurize_rate(ints, cfg, chunk)
    rates = {name: wall for name, (wall, _) in timed.items()}
    rates.update({f"{name}_cpu": cpu for name, (_, cpu) in timed.items()})
    return rates


def limit_rates(files: list[Path], options: dict[str, Any]) -> dict[str, float]:
    """measure_limit in a fresh process, as each compile runs in one."""
    asked = json.dumps({"files": [str(f) for f in files], "options": options})
    cmd = [sys.executable, "-c", _LIMIT]
    out = subprocess.run(cmd, input=asked, stdout=subprocess.PIPE, text=True, check=True).stdout
    rates: dict[str, float] = json.loads(out.splitlines()[-1])
    return rates


def _spread(values: list[float]) -> list[float]:
    """A ratio's rounds, low to high, as the rows give them."""
    return sorted(round(v, 2) for v in values)


def run(
    work: Path, clips: int, scale: int, workers: int, repeats: int = 3
) -> tuple[list[Row], Made]:
    corpus = esc50_wavs(work / "esc", clips)
    raw = corpus_bytes(corpus)
    wl = (
        f"compile: ESC-50-shaped {clips} clips, 5 s 44.1 kHz WAV ({raw / 2**20:.0f} MiB) "
        "-> 128-mel log-mel"
    )
    counts = sorted({1, workers})
    naive_rates: list[float] = []
    sf_rates: list[float] = []
    own_rates: list[float] = []
    feat_rates: list[float] = []
    limits: list[float] = []
    cpu_limits: list[float] = []  # the same limit per CPU second of its process
    pcm16_limits: list[float] = []  # decode and featurize as the compile takes 16-bit PCM
    compiles: dict[int, list[Timed]] = {w: [] for w in counts}
    repeats = max(1, repeats)
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = epoch(naive_loader(corpus, batch_size=64, workers=workers))
        naive_rates.append(n / (time.perf_counter() - t0))
        # the limit, per core: decode alone and featurize alone, in this round
        limit = limit_rates(sorted((corpus / "audio").iterdir()), _esc_options(corpus))
        sf_rates.append(limit["soundfile"])
        own_rates.append(limit["dlop"])
        feat_rates.append(limit["featurize"])
        limits.append(1 / (1 / max(sf_rates[-1], own_rates[-1]) + 1 / feat_rates[-1]))
        fastest_cpu = max(limit["soundfile_cpu"], limit["dlop_cpu"])
        cpu_limits.append(1 / (1 / fastest_cpu + 1 / limit["featurize_cpu"]))
        pcm16_limits.append(1 / (1 / limit["dlop_pcm16"] + 1 / limit["featurize_pcm16"]))
        for w in counts:
            shutil.rmtree(work / f"esc-{w}", ignore_errors=True)  # every round compiles afresh
            compiles[w].append(timed_compile(_esc_options(corpus), work / f"esc-{w}", w))
    median = statistics.median
    naive_rate = median(naive_rates)
    naive = Row(
        wl, f"naive DataLoader epoch ({workers} workers)", naive_rate, extra={"rounds": repeats}
    )
    per_core = "1 core"
    rows = [
        naive,
        Row(wl, f"decode only: soundfile.read ({per_core})", median(sf_rates)),
        Row(wl, f"decode only: dlop decode_audio ({per_core})", median(own_rates)),
        Row(
            wl,
            f"featurize only: pre-decoded, groups of {CHUNK_ITEMS['audio']} ({per_core})",
            median(feat_rates),
        ),
        Row(
            wl,
            f"limit: 1 / (1/faster decode + 1/featurize) ({per_core})",
            median(limits),
            extra={"rounds": sorted(round(v) for v in limits)},
        ),
        Row(
            wl,
            f"limit, 16-bit PCM kept int16 as the compile reads it ({per_core})",
            median(pcm16_limits),
            extra={"rounds": sorted(round(v) for v in pcm16_limits)},
        ),
    ]
    archive = work / "esc-archive"
    for w in counts:
        timed = compiles[w]
        rates = [t.samples / t.seconds for t in timed]
        of_limit = [r / (w * lim) for r, lim in zip(rates, limits, strict=True)]
        of_pcm16 = [r / (w * lim) for r, lim in zip(rates, pcm16_limits, strict=True)]
        per_worker = [r / w / (nr / workers) for r, nr in zip(rates, naive_rates, strict=True)]
        rows.append(
            Row(
                wl,
                f"dlop-compile ({w} worker{'s' if w > 1 else ''})",
                median(rates),
                vs_baseline=median(r / nr for r, nr in zip(rates, naive_rates, strict=True)),
                baseline="naive epoch",
                extra={
                    "of_limit": round(median(of_limit), 2),
                    "of_limit_rounds": _spread(of_limit),
                    "of_pcm16_limit": round(median(of_pcm16), 2),
                    "of_pcm16_limit_rounds": _spread(of_pcm16),
                    "vs_naive_per_worker": round(median(per_worker), 2),
                    "vs_naive_per_worker_rounds": _spread(per_worker),
                    "peak_rss_MiB": round(max(t.peak_kib for t in timed) / 1024),
                    "seconds": round(median(t.seconds for t in timed), 2),
                },
            )
        )
        if w == 1:
            # clips per CPU second against the limit per CPU second, where all the work is in
            # one process: what share of a core's work is decode and featurize, whatever the
            # machine's other load did to the wall clock
            cpu = [t.samples / t.cpu_s / lim for t, lim in zip(timed, cpu_limits, strict=True)]
            rows[-1].extra.update(
                cpu_s=round(median(t.cpu_s for t in timed), 2),
                cpu_of_limit=round(median(cpu), 2),
                cpu_of_limit_rounds=_spread(cpu),
            )
        out = work / f"esc-{w}"
        if w == workers:
            out.rename(archive)
            size = sum(p.stat().st_size for p in archive.glob("*.dlop"))
            rows[-1].extra.update(
                archive_MiB=round(size / 2**20), vs_raw_bytes=round(size / raw, 2)
            )
        else:
            shutil.rmtree(out, ignore_errors=True)
    big = replicate(corpus, work / "esc-x", scale)
    out = work / "esc-x-archive"
    timed_big = timed_compile(_esc_options(big), out, workers)
    rows.append(
        Row(
            f"compile memory: {clips * scale} clips ({scale}x, {raw * scale / 2**30:.1f} GiB of WAV)",
            f"dlop-compile, {workers} workers, peak RSS of all processes",
            clips * scale / timed_big.seconds,
            extra={
                "peak_rss_MiB": round(timed_big.peak_kib / 1024),
                "seconds": round(timed_big.seconds, 1),
            },
        )
    )
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(big, ignore_errors=True)
    return rows, Made(corpus=corpus, archive=archive, naive_rate=naive_rate)

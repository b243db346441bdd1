"""Short utterances: the compile's cost per input, against its limit, and its start-up.

Speech corpora are mostly short inputs, where what a compile pays per input and
before its first input weighs more than on 5 s clips. A generated corpus of
16 kHz WAV utterances (speech_peers.short_corpus: two in five about one second,
the rest 0.5-8 s) is compiled with the kaldi preset to 80-bin fbank. In
interleaved rounds:

- the limit's parts, one core each, in a fresh process (compile_bench.measure_limit):
  decode alone (soundfile.read, and dlop's decoder leaving 16-bit PCM in int16
  as the compile reads it) and featurize alone on pre-decoded clips (in the
  compiler's groups, and batched in groups as large as it makes);
- dlop's compile with one worker in a fresh process, timed from after its
  imports; its rate against two limits: decode by soundfile plus batched
  featurize (``of_limit``), and the faster decode plus the faster featurize
  (``of_fastest_limit``, the stricter);
- ``dlop-compile`` with N workers, the whole command timed as a user waits for
  it (interpreter start, imports and exit included) beside its own figure.

Each ratio is the median of its rounds' ratios, with their range.
"""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path
from typing import Any

from .common import Row
from .compile_bench import limit_rates, timed_compile
from .speech_peers import N_MELS, Compiled, short_corpus, utterances, whole_process_row
from .speech_peers import timed_compile as timed_command


def run(work: Path, args: Any) -> list[Row]:
    utts, workers, repeats = args.short_utts, args.workers, max(1, args.repeats)
    manifest, seconds = short_corpus(work / "corpus", utts)
    files = [Path(path) for _, path, _ in utterances(manifest)]
    options = {"source": str(manifest), "preset": "kaldi", "n_mels": N_MELS}
    wl = (
        f"short utterances: {utts} 16 kHz WAV of 0.5-8 s, two in five about 1 s "
        f"({seconds / 3600:.2f} h) -> 80-bin Kaldi fbank"
    )
    limits: list[dict[str, float]] = []
    one: list[float] = []
    command: list[Compiled] = []
    for _ in range(repeats):
        limits.append(limit_rates(files, options))
        out = work / "out-1"
        shutil.rmtree(out, ignore_errors=True)
        timed = timed_compile(options, out, 1)
        one.append(timed.samples / timed.seconds)
        out = work / f"out-{workers}"
        shutil.rmtree(out, ignore_errors=True)
        command.append(timed_command("dlop", manifest, out, workers))
    median = statistics.median
    of_limit = [
        r / (1 / (1 / lim["soundfile"] + 1 / lim["featurize_batched"]))
        for r, lim in zip(one, limits, strict=True)
    ]
    strict = [
        1
        / (
            1 / max(lim["soundfile"], lim["dlop"], lim["dlop_pcm16"])
            + 1 / max(lim["featurize"], lim["featurize_batched"], lim["featurize_pcm16"])
        )
        for lim in limits
    ]
    of_strict = [r / s for r, s in zip(one, strict, strict=True)]

    def part(name: str) -> float:
        return median(lim[name] for lim in limits)

    rows = [
        Row(wl, "decode only: soundfile.read (1 core)", part("soundfile")),
        Row(wl, "decode only: dlop, 16-bit PCM kept int16 (1 core)", part("dlop_pcm16")),
        Row(wl, "featurize only: pre-decoded, the compiler's groups (1 core)", part("featurize")),
        Row(wl, "featurize only: pre-decoded, batched (1 core)", part("featurize_batched")),
        Row(
            wl,
            "limit: 1 / (1/soundfile + 1/batched featurize) (1 core)",
            median(1 / (1 / lim["soundfile"] + 1 / lim["featurize_batched"]) for lim in limits),
        ),
        Row(wl, "limit: fastest decode and featurize (1 core)", median(strict)),
        Row(
            wl,
            "dlop compile_corpus, 1 worker (from after its imports)",
            median(one),
            extra={
                "of_limit": f"{median(of_limit):.2f} (target >=0.8)",
                "of_limit_rounds": sorted(round(v, 2) for v in of_limit),
                "of_fastest_limit": round(median(of_strict), 2),
                "of_fastest_limit_rounds": sorted(round(v, 2) for v in of_strict),
            },
        ),
        whole_process_row(
            wl, f"dlop-compile, {workers} workers, the whole command", command, utts, seconds
        ),
    ]
    shutil.rmtree(work, ignore_errors=True)
    return rows

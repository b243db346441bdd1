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
  (``of_fastest_limit``, the stricter); and ``of_limit_cpu``, the same ratio per
  CPU second of each process instead of per wall second (on a shared machine a
  wall-clock round can lose a third of its time to other programs; the CPU
  ratio leaves out the compile's waits for the disk, which the wall ratio counts);
- ``dlop-compile`` with N workers, the whole command timed as a user waits for
  it (interpreter start, imports and exit included) beside its own figure;
- reading that archive back in batches of 32 utterances (``us_per_batch``: the
  time a batch costs): the Loader against
  ``DataLoader(IterableArchive(...), num_workers=2, persistent_workers=True)``, in
  a loop that only takes the batches and in one that reads a value of every page of
  the features, as a training step would; and with ``collate_fn=batch_as_is``, which
  spares the workers torch's walk over every string of the text fields.

Each ratio is the median of its rounds' ratios, with their range.
"""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from dlop.runtime import IterableArchive, Loader, batch_as_is, open_archive

from .common import Row, interleaved, loader_epoch, rate_row
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
    one_cpu: list[float] = []  # inputs per CPU second of the compiling process
    command: list[Compiled] = []
    for _ in range(repeats):
        limits.append(limit_rates(files, options))
        out = work / "out-1"
        shutil.rmtree(out, ignore_errors=True)
        timed = timed_compile(options, out, 1)
        one.append(timed.samples / timed.seconds)
        one_cpu.append(timed.samples / timed.cpu_s)
        out = work / f"out-{workers}"
        shutil.rmtree(out, ignore_errors=True)
        command.append(timed_command("dlop", manifest, out, workers))
    median = statistics.median
    of_limit = [
        r / (1 / (1 / lim["soundfile"] + 1 / lim["featurize_batched"]))
        for r, lim in zip(one, limits, strict=True)
    ]
    of_limit_cpu = [
        r / (1 / (1 / lim["soundfile_cpu"] + 1 / lim["featurize_batched_cpu"]))
        for r, lim in zip(one_cpu, limits, strict=True)
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
                "of_limit_cpu": round(median(of_limit_cpu), 2),
                "of_limit_cpu_rounds": sorted(round(v, 2) for v in of_limit_cpu),
                "of_fastest_limit": round(median(of_strict), 2),
                "of_fastest_limit_rounds": sorted(round(v, 2) for v in of_strict),
            },
        ),
        whole_process_row(
            wl, f"dlop-compile, {workers} workers, the whole command", command, utts, seconds
        ),
    ]
    rows += read_rows(work / f"out-{workers}", wl, 2 * repeats - 1)  # 5 rounds for 3 repeats
    shutil.rmtree(work, ignore_errors=True)
    return rows


READ_BATCH = 32  # utterances a batch: small batches, where a per-batch cost shows
PAGE = 4096


def touch_epoch(loader: Any) -> int:
    """An epoch that reads one value from every page of each batch's features."""
    samples = 0
    for b in loader:
        feats = b["fbank"]
        step = max(1, PAGE // feats.element_size())
        float(feats.view(-1)[::step].float().sum())
        samples += len(feats)
    return samples


def read_rows(path: Path, wl: str, rounds: int) -> list[Row]:
    """The compiled archive read back in bucketed batches of READ_BATCH: in this process
    (Loader) and in 2 persistent DataLoader workers, interleaved."""
    ds = open_archive(path)
    n = len(ds)
    loader = Loader(ds, READ_BATCH, seed=0, bucket_by="fbank")
    iterable = IterableArchive(path, READ_BATCH, seed=0, bucket_by="fbank")
    as_is = IterableArchive(path, READ_BATCH, seed=0, bucket_by="fbank")
    in_workers = [  # held in a list so they can be dropped after the timing
        DataLoader(iterable, batch_size=None, num_workers=2, persistent_workers=True),
        DataLoader(
            as_is,
            batch_size=None,
            num_workers=2,
            persistent_workers=True,
            collate_fn=batch_as_is,
        ),
    ]
    took = interleaved(
        {
            "loader": lambda: loader_epoch(loader),
            "workers": lambda: loader_epoch(in_workers[0]),
            "as_is": lambda: loader_epoch(in_workers[1]),
            "loader_touch": lambda: touch_epoch(loader),
            "workers_touch": lambda: touch_epoch(in_workers[0]),
        },
        rounds,
    )
    in_slots, fresh = iterable.buffer_counts()
    rwl = f"{wl}, read back in bucketed batches of {READ_BATCH}"
    batches = len(loader.batches())
    base = rate_row(
        rwl,
        "dlop Loader, bucket_by (batches taken)",
        n,
        took["loader"],
        us_per_batch=round(took["loader"] / batches * 1e6, 1),
    )
    touch = rate_row(rwl, "dlop Loader, bucket_by (every page read)", n, took["loader_touch"])
    workers = "DataLoader(IterableArchive(bucket_by), num_workers=2, persistent_workers=True)"
    rows = [
        base,
        rate_row(
            rwl,
            f"{workers} (batches taken)",
            n,
            took["workers"],
            None,
            base,
            target=">=0.8x",
            us_per_batch=round(took["workers"] / batches * 1e6, 1),
            batches_in_reused_buffers=in_slots,
            batches_in_fresh_memory=fresh,
        ),
        rate_row(
            rwl,
            f"{workers[:-1]}, collate_fn=batch_as_is) (batches taken)",
            n,
            took["as_is"],
            None,
            base,
        ),
        touch,
        rate_row(rwl, f"{workers} (every page read)", n, took["workers_touch"], None, touch),
    ]
    loader.close()
    in_workers.clear()  # its worker processes end
    return rows

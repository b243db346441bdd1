"""Raw text and bytes fields, planned by arrays: what a batch serves is what was written,
in any order and over any shards, whether a shard's samples are kept as the objects a
batch serves (``LISTED_BYTES``) or sliced from its copied values; a str sample that
is not UTF-8 is an error naming it, and only a batch holding it fails."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dlop.formats import ArchiveWriter, Field, FormatError
from dlop.runtime import Loader, open_archive
from dlop.runtime.gather import samples

from .helpers import not_utf8_in_copies

N = 90
# ASCII shards and shards with characters of two, three and four bytes; empty samples
WORDS = ["", "a", "key-01", "é", "naïve ✓", "😀 x", "日本語", "\x00nul"]


def text(i: int) -> str:
    # shards of about 200 bytes: runs of ASCII samples, then runs with wider characters
    return WORDS[i % 3] + f"{i}" if (i // 20) % 2 == 0 else WORDS[i % len(WORDS)] + f"{i}"


def blob(i: int) -> bytes:
    return bytes([i % 256, 0xFF, 0x80])[: i % 4]


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "a"
    fields = [Field.str_("s"), Field.bytes_("b"), Field("label", "i64", ())]
    with ArchiveWriter(path, fields, shard_bytes=200) as w:
        for i in range(N):
            w.write({"s": text(i), "b": blob(i), "label": i})
    return path


def check(batch: dict[str, Any], idx: list[int]) -> None:
    assert batch["label"].tolist() == idx
    assert batch["s"] == [text(i) for i in idx]
    assert batch["b"] == [blob(i) for i in idx]
    assert all(type(s) is str for s in batch["s"]) and all(type(b) is bytes for b in batch["b"])


@pytest.mark.parametrize(
    "listed", [samples.LISTED_BYTES, 1000, 0], ids=["listed", "partly listed", "sliced"]
)
def test_text_is_served_as_written_in_any_order(
    archive: Path, listed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(samples, "LISTED_BYTES", listed)
    ds = open_archive(archive)
    assert len(ds.shards) > 4
    starts = [0, *np.cumsum([s.num_samples for s in ds.shards]).tolist()]
    rng = np.random.default_rng(3)
    batches = [
        list(range(starts[2], starts[3])),  # one shard, ascending
        list(range(starts[3] - 1, starts[1] - 1, -1)),  # two shards, descending
        [starts[4], 0, starts[4], 0],  # repeated
        rng.permutation(N).tolist(),  # every shard, shuffled
        [],
    ]
    batches += [rng.choice(N, 9).tolist() for _ in range(20)]
    for idx in batches:
        check(ds.__getitems__(idx), idx)
        check(ds.__getitems__(torch.tensor(idx, dtype=torch.int64)), idx)
    for i in range(N):  # one by one, as ShardReader.get reads them
        assert (ds[i]["s"], ds[i]["b"]) == (text(i), blob(i))
    loader = Loader(ds, 8, seed=1, drop_last=False)
    for idx, batch in zip(loader.batches(), loader, strict=True):
        check(batch, idx.tolist())
    loader.close()


@pytest.mark.parametrize("listed", [samples.LISTED_BYTES, 0], ids=["listed", "sliced"])
def test_a_str_sample_not_utf8_is_named_and_only_its_batches_fail(
    archive: Path, listed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One byte of a sample made 0xFF in a shard's copied values (as a forged archive
    whose CRCs were forged along would hold it): a batch holding that sample is an
    error naming the shard, field and sample; every other batch reads as written."""
    monkeypatch.setattr(samples, "LISTED_BYTES", listed)
    shards = open_archive(archive).shards
    starts = np.cumsum([0] + [s.num_samples for s in shards]).tolist()
    wide = [any(not text(i).isascii() for i in range(a, b)) for a, b in itertools.pairwise(starts)]
    for k in (wide.index(False), wide.index(True)):  # a shard of ASCII, one of wider text
        ds = open_archive(archive)
        shard, first = ds.shards[k], starts[k]
        row = next(r for r in range(shard.num_samples) if text(first + r))
        not_utf8_in_copies(monkeypatch, shard, "s", row)
        bad = first + row
        others = [i for i in range(N) if i != bad]
        named = rf"{shard.path.name}: field 's' sample {row}: not UTF-8"
        for idx in ([bad], [0, bad, N - 1], [bad, *others]):
            with pytest.raises(FormatError, match=named):
                ds.__getitems__(idx)
        same = [first + r for r in range(shard.num_samples) if r != row]
        for idx in (others, others[::-1], same):
            check(ds.__getitems__(idx), idx)
        monkeypatch.undo()
        monkeypatch.setattr(samples, "LISTED_BYTES", listed)


def test_a_shard_first_read_by_two_threads_at_once_is_served_whole_to_both(
    archive: Path,
) -> None:
    """A gather shared by two readers (two Loaders of one archive, a Loader and
    ``__getitems__``): a shard counts as read only once all of it is in place, so a
    thread planning meanwhile copies it too, never slices it half made (here: its
    values not ASCII, and that not yet noted)."""
    started = threading.Event()

    class Slow(np.ndarray):  # the gather's note of which shards hold undecoded text
        def __setitem__(self, key: Any, value: Any) -> None:
            started.set()
            time.sleep(0.3)
            super().__setitem__(key, value)

    ds = open_archive(archive, fields=["s", "label"])
    gather = ds.gathers["s"]
    gather.undecoded = gather.undecoded.view(Slow)  # type: ignore[attr-defined]
    starts = np.cumsum([0] + [s.num_samples for s in ds.shards]).tolist()
    k = next(j for j in range(len(ds.shards)) if not text(starts[j]).isascii())
    idx = list(range(starts[k], starts[k + 1]))
    got: list[Any] = []
    first = threading.Thread(target=lambda: got.append(ds.__getitems__(idx)))
    first.start()
    assert started.wait(10)
    second = ds.__getitems__(idx)  # while the first thread is still making the shard's copy
    first.join()
    for batch in (*got, second):
        assert batch["s"] == [text(i) for i in idx]

"""Training goes on across an append: a Loader state saved before the archive grew continues
its epoch on the samples the archive held then, exactly as it would have without the
append; the next epoch reads the grown archive; a state saved in that continued epoch
continues again; a state of another archive is still refused."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch.utils.data import DataLoader

from dlop.compiler import add_fields, compile_map
from dlop.formats import FormatError
from dlop.runtime import IterableArchive, Loader, UsageError, batch_as_is, open_archive

OPTIONS: dict[str, Any] = {"unit_inputs": 8, "shard_bytes": "4KiB", "progress": False}


def sample(x: int) -> dict[str, Any]:
    return {"x": np.full(64, x, np.int32)}


def batches(it: Any, count: int | None = None) -> list[list[int]]:
    """The next ``count`` batches of iterator ``it`` (all that are left when None), as the
    samples' numbers; a Loader is iterated afresh (its next epoch, or a loaded state's)."""
    it = iter(it) if isinstance(it, Loader) else it
    out = []
    for batch in it:
        out.append(batch["x"][:, 0].tolist())
        if count is not None and len(out) == count:
            break
    return out


@pytest.mark.parametrize("order", ["global", "window"])
def test_an_epoch_begun_before_an_append_ends_as_it_began(tmp_path: Path, order: str) -> None:
    out, copy = tmp_path / "grows", tmp_path / "stays"
    for where in (out, copy):
        compile_map(sample, list(range(60)), where, workers=1, **OPTIONS)
    options: dict[str, Any] = {"batch_size": 7, "seed": 3, "order": order, "prefetch": 0}
    stays = Loader(copy, **options)
    stays.set_epoch(2)
    epoch = iter(stays)
    first = batches(epoch, 3)
    state = stays.state_dict()
    rest = batches(epoch)  # what the epoch holds after the state, without an append
    compile_map(sample, list(range(100)), out, workers=1, append=True, **OPTIONS)
    grown = Loader(out, **options)
    assert len(grown.archive) == 100
    grown.load_state_dict(state)
    assert grown.epoch == 2
    epoch = iter(grown)
    got = batches(epoch, 2)
    mid = grown.state_dict()  # saved inside the continued epoch: the archive as it was
    assert mid["num_samples"] == 60 and mid["archives"] == state["archives"]
    got += batches(epoch)
    assert got == rest
    assert sorted(x for b in first + got for x in b) == list(range(60))
    again = Loader(out, **options)
    again.load_state_dict(mid)
    assert batches(again) == rest[2:]
    grown.set_epoch(3)  # the next epoch reads every sample of the grown archive
    assert sorted(x for b in batches(grown) for x in b) == list(range(100))
    assert grown.state_dict()["num_samples"] == 100


def test_dataloader_workers_continue_an_epoch_begun_before_an_append(tmp_path: Path) -> None:
    """IterableArchive under DataLoader workers: a state saved before the append continues
    that epoch over the archive as it was, in the workers too; then the grown archive."""
    out, copy = tmp_path / "grows", tmp_path / "stays"
    for where in (out, copy):
        compile_map(sample, list(range(60)), where, workers=1, **OPTIONS)
    options: dict[str, Any] = {"seed": 3}

    def workers(ds: IterableArchive) -> DataLoader:
        return DataLoader(ds, batch_size=None, num_workers=2, collate_fn=batch_as_is)

    stays = IterableArchive(copy, 7, **options)
    stays.set_epoch(1)
    epoch = iter(workers(stays))
    first = batches(epoch, 3)
    state = stays.state_dict(batches_done=3)
    rest = batches(epoch)
    compile_map(sample, list(range(100)), out, workers=1, append=True, **OPTIONS)
    grown = IterableArchive(out, 7, **options)
    grown.load_state_dict(state)
    assert grown.state_dict(batches_done=3) == state  # the archive as it was, named so
    got = batches(iter(workers(grown)))
    assert got == rest and sorted(x for b in first + got for x in b) == list(range(60))
    grown.set_epoch(2)
    assert sorted(x for b in batches(iter(workers(grown))) for x in b) == list(range(100))


def test_a_state_of_another_archive_is_still_refused(tmp_path: Path) -> None:
    compile_map(sample, list(range(40)), tmp_path / "a", workers=1, **OPTIONS)
    compile_map(sample, list(range(1, 41)), tmp_path / "b", workers=1, **OPTIONS)
    state = Loader(tmp_path / "a", batch_size=5).state_dict()
    with pytest.raises(UsageError, match="archives"):
        Loader(tmp_path / "b", batch_size=5).load_state_dict(state)
    compile_map(sample, list(range(60)), tmp_path / "a", workers=1, append=True, **OPTIONS)
    chosen = Loader(tmp_path / "a", batch_size=5, indices=list(range(0, 60, 2)))
    with pytest.raises(UsageError, match="num_samples"):  # a selection of the grown archive
        chosen.load_state_dict(state)


def twice(s: dict[str, Any]) -> dict[str, Any]:
    return {"y": s["x"] * 2}


def thrice(s: dict[str, Any]) -> dict[str, Any]:
    return {"y": s["x"] * 3}


def test_an_archive_sent_to_a_process_reads_as_its_sender_opened_it(tmp_path: Path) -> None:
    """A DataLoader worker started by spawn gets the archive by pickle. It reopened the
    folder, so an append or a field group compiled again since the parent opened it made
    the worker serve another archive than the parent: other samples, other values."""
    out = tmp_path / "grows"
    compile_map(sample, list(range(60)), out, workers=1, **OPTIONS)
    add_fields(out, twice, "extra", workers=1, progress=False)
    opened = open_archive(out)
    zstd = tmp_path / "zstd"  # read through the shard cache (open_cached)
    compile_map(sample, list(range(60)), zstd, workers=1, compression="zstd", **OPTIONS)
    cached = open_archive(zstd, cache_dir=tmp_path / "cache")
    compile_map(sample, list(range(100)), out, workers=1, append=True, **OPTIONS)
    compile_map(
        sample, list(range(100)), zstd, workers=1, compression="zstd", append=True, **OPTIONS
    )
    add_fields(out, thrice, "extra", workers=1, progress=False, overwrite=True)
    assert len(open_archive(out)) == len(open_archive(zstd)) == 100
    for archive in (opened, cached):
        sent = pickle.loads(pickle.dumps(archive))
        assert len(sent) == 60
        assert sorted(int(sent[i]["x"][0]) for i in range(60)) == list(range(60))
    sent = pickle.loads(pickle.dumps(opened))
    assert all((sent[i]["y"] == sent[i]["x"] * 2).all() for i in range(60))


def plus(x: int) -> dict[str, Any]:
    return {"x": np.full(64, 1000 + x, np.int32)}


def test_iterable_archive_workers_by_spawn_read_the_archive_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each worker opened the folder for itself: an append landing before they started
    split the epoch over two archives (samples lost and others read twice). Nor may a
    link swapped to another archive, or the working directory changed, since the
    IterableArchive was made send its workers elsewhere (they opened the link's new
    target, or the relative path's new folder, under the first archive's index)."""
    out = tmp_path / "grows"
    compile_map(sample, list(range(60)), out, workers=1, **OPTIONS)
    other = tmp_path / "other" / "grows"  # same layout, other values
    compile_map(plus, list(range(60)), other, workers=1, **OPTIONS)
    (tmp_path / "current").symlink_to(out)
    monkeypatch.chdir(tmp_path)
    linked = IterableArchive("current", 8, seed=1)
    relative = IterableArchive("grows", 8, seed=1)
    opened = open_archive("current")
    compile_map(sample, list(range(100)), out, workers=1, append=True, **OPTIONS)
    (tmp_path / "swap").symlink_to(other)
    os.replace(tmp_path / "swap", tmp_path / "current")
    monkeypatch.chdir(tmp_path / "other")
    sent = pickle.loads(pickle.dumps(opened))
    assert sorted(int(sent[i]["x"][0]) for i in range(len(sent))) == list(range(60))
    for it in (linked, relative):
        loader = DataLoader(
            it, batch_size=None, num_workers=2, multiprocessing_context="spawn",
            collate_fn=batch_as_is,
        )  # fmt: skip
        got = [x for b in loader for x in b["x"][:, 0].tolist()]
        assert sorted(got) == list(range(60))


def test_a_process_sent_an_archive_whose_files_are_gone_is_told_why(tmp_path: Path) -> None:
    """The group files the sender's index lists are deleted by the group's next change:
    the process sent the archive is refused naming the file and what happened, where it
    said only that index.json lists a missing shard (while the folder's own did not)."""
    out = tmp_path / "a"
    compile_map(sample, list(range(20)), out, workers=1, **OPTIONS)
    add_fields(out, twice, "extra", workers=1, progress=False)
    opened = open_archive(out)
    for fn in (thrice, twice):  # the second change deletes the files the first kept
        add_fields(out, fn, "extra", workers=1, progress=False, overwrite=True)
    with pytest.raises(FormatError, match=r"group-extra-r0-000000\.dlop: .*changed since"):
        pickle.loads(pickle.dumps(opened))

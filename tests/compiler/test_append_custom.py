"""append=True for compile_dataset and compile_map: a Dataset that grew, or a function given
more inputs, appends what the archive does not hold; each sample reads back as the whole
compile's (the same seeds: a Dataset's item keeps its index); Dask and local workers write
the same bytes; changed code or options, and an item that would change the schema, are
refused with the archive left as it was."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dlop.compiler import compile_dataset, compile_map
from dlop.compiler.errors import CompileError
from dlop.formats import ArchiveReader, read_index
from dlop.runtime import open_archive

from .custom_data import Draws, Everything, Widening, cheap, fails_some
from .fixtures import dask_cluster
from .test_custom import files, same

OPTIONS = {"unit_inputs": 3, "shard_bytes": "8KB", "progress": False}


def test_a_grown_dataset_appends_its_new_items(tmp_path: Path) -> None:
    out = tmp_path / "grown"
    compile_dataset(Everything(7), out, workers=1, **OPTIONS)
    before = files(out)
    index = compile_dataset(Everything(16), out, workers=1, append=True, **OPTIONS)
    assert [g.inputs for g in index.generations] == [7, 9]
    assert {n: b for n, b in files(out).items() if n in before and n != "index.json"} == {
        n: b for n, b in before.items() if n != "index.json"
    }
    archive, ds = open_archive(out), Everything(16)
    assert len(archive) == len(ds)
    for i in range(len(ds)):  # the new items after the old, each as the Dataset gives it
        same(archive[i], ds[i], f"item {i}")
    with ArchiveReader(out) as r:
        assert r.verify() == []


def test_each_item_draws_the_numbers_of_its_index(tmp_path: Path) -> None:
    """Seeds go by the item's index in the Dataset, so an appended item draws what it would
    have drawn in a compile of the whole; the Dataset's attributes grew (its length), and
    the append computed some of the archive's samples again to see that they still hold."""
    compile_dataset(Draws(14), tmp_path / "whole", workers=1, **OPTIONS)
    out = tmp_path / "part"
    compile_dataset(Draws(5), out, workers=1, **OPTIONS)
    compile_dataset(Draws(14), out, workers=2, append=True, **OPTIONS)
    got, want = open_archive(out), open_archive(tmp_path / "whole")
    assert len(got) == len(want) == 14
    for i in range(14):
        same(got[i], want[i], f"item {i}")


def test_settings_that_change_the_archive_s_samples_are_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    compile_dataset(Draws(5), out, workers=1, **OPTIONS)
    listed = {p: os.stat(out / p).st_mtime_ns for p in os.listdir(out)}
    with pytest.raises(
        CompileError, match=r"Draws\[0\] is in the archive and it now gives another"
    ):
        compile_dataset(Draws(9, scale=2.0), out, workers=1, append=True, **OPTIONS)
    assert {p: os.stat(out / p).st_mtime_ns for p in os.listdir(out)} == listed


@pytest.mark.slow
def test_an_append_on_dask_writes_the_bytes_of_a_local_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")  # the indexes' creation times
    for name in ("local", "dask"):
        compile_map(fails_some, list(range(20)), tmp_path / name, workers=1, **OPTIONS)
    compile_map(fails_some, list(range(45)), tmp_path / "local", workers=2, append=True, **OPTIONS)
    with dask_cluster(2) as address:
        compile_map(
            fails_some, list(range(45)), tmp_path / "dask", dask=address, append=True, **OPTIONS
        )
    local = files(tmp_path / "local")
    assert "errors-0001.jsonl" in local and files(tmp_path / "dask") == local


def test_a_function_given_more_inputs_appends_the_new_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, whole = tmp_path / "out", tmp_path / "whole"
    compile_map(fails_some, [2, 9, 4, 13], out, workers=1, **OPTIONS)
    # new inputs before, between and after the archive's, one of them bad
    more = [1, 2, 3, 4, 5, 9, 10, 13, 20, 21]
    index = compile_map(fails_some, more, out, workers=1, append=True, **OPTIONS)
    compile_map(fails_some, more, whole, workers=1, **OPTIONS)
    first, second = index.generations
    assert (first.inputs, second.inputs) == (4, 6)  # 1, 3, 5, 10, 20, 21
    assert (first.skipped, second.skipped) == (0, 3)  # 3 and 10 raise, 5 gives None
    got, want = open_archive(out), open_archive(whole)
    assert sorted(int(got[i]["n"]) for i in range(len(got))) == sorted(
        int(want[i]["n"]) for i in range(len(want))
    )
    by_n = {int(got[i]["n"]): got[i] for i in range(len(got))}
    for i in range(len(want)):
        same(by_n[int(want[i]["n"])], {k: v for k, v in want[i].items()})
    listed = {p: os.stat(out / p).st_mtime_ns for p in os.listdir(out)}
    assert compile_map(fails_some, more, out, workers=1, append=True, **OPTIONS) == index
    assert "nothing to append" in capsys.readouterr().err
    assert {p: os.stat(out / p).st_mtime_ns for p in os.listdir(out)} == listed


def test_changed_code_or_options_are_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    compile_map(cheap, list(range(5)), out, workers=1, **OPTIONS)
    listed = sorted(os.listdir(out))
    with pytest.raises(CompileError, match=r"--append refused.*code"):
        compile_map(fails_some, list(range(9)), out, workers=1, append=True, **OPTIONS)
    with pytest.raises(CompileError, match=r"--append refused.*shard_bytes"):
        compile_map(cheap, list(range(9)), out, **{**OPTIONS, "shard_bytes": "16KB"}, append=True)
    with pytest.raises(CompileError, match="was not a compile_dataset"):
        compile_dataset(Everything(3), out, workers=1, append=True, **OPTIONS)
    assert sorted(os.listdir(out)) == listed


def test_an_item_that_would_change_the_schema_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    compile_dataset(Widening(10), out, workers=1, **OPTIONS)  # "x" holds 5 rows in all
    listed = {p: os.stat(out / p).st_mtime_ns for p in os.listdir(out)}
    with pytest.raises(CompileError, match=r"holds that axis fixed.*nothing was appended"):
        compile_dataset(Widening(24), out, workers=1, append=True, **OPTIONS)
    assert {p: os.stat(out / p).st_mtime_ns for p in os.listdir(out)} == listed
    assert len(read_index(out).generations) == 1


class Values:
    """A Dataset over a list of values, which grows by inserting as well as by adding."""

    def __init__(self, values: list[int]) -> None:
        self.values = values

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i: int) -> dict[str, int]:
        return {"v": self.values[i]}


def test_items_moved_to_other_indices_in_any_generation_are_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    compile_dataset(Values([0, 10, 20, 30]), out, workers=1, **OPTIONS)
    compile_dataset(Values([0, 10, 20, 30, 40, 50, 60]), out, workers=1, append=True, **OPTIONS)
    listed = {p: os.stat(out / p).st_mtime_ns for p in os.listdir(out)}
    moved = Values([0, 10, 20, 30, 40, 45, 50, 60, 70])  # the second generation's shift
    with pytest.raises(CompileError, match=r"Values\[5\] is in the archive and it now gives"):
        compile_dataset(moved, out, workers=1, append=True, **OPTIONS)
    assert {p: os.stat(out / p).st_mtime_ns for p in os.listdir(out)} == listed


def test_an_input_given_twice_is_two_inputs(tmp_path: Path) -> None:
    """A function's input given again (a second draw of an augmentation: each item is
    seeded by its place) is an input of its own: an append over a list that repeats an
    input was refused, even one the first compile took; it adds the repeats now."""
    out = tmp_path / "out"
    compile_map(cheap, [1, 2, 2], out, workers=1, **OPTIONS)
    compile_map(cheap, [1, 2, 2, 4, 2], out, workers=1, append=True, **OPTIONS)
    archive = open_archive(out)
    assert [int(archive[i]["n"]) for i in range(len(archive))] == [1, 2, 2, 4, 2]
    assert len(read_index(out).generations) == 2


def test_an_inputs_file_grown_past_its_identities_is_refused_unread(tmp_path: Path) -> None:
    """A generation's inputs file holds its identities, 16 bytes each: one grown past that
    (a sparse 4 GiB here) was read up to a 512 MiB cap before it was refused, with a bare
    FormatError; now it is refused at its own size, naming it, and nothing is appended."""
    out = tmp_path / "a"
    compile_map(cheap, list(range(5)), out, workers=1, **OPTIONS)
    compile_map(cheap, list(range(8)), out, workers=1, append=True, **OPTIONS)
    grown = out / "inputs-0001.bin"
    before = {k: v for k, v in files(out).items() if k != grown.name}
    with open(grown, "r+b") as f:
        f.truncate(4 << 30)
    with pytest.raises(CompileError, match=r"inputs-0001\.bin.* larger than its 48-byte cap"):
        compile_map(cheap, list(range(12)), out, workers=1, append=True, **OPTIONS)
    grown.unlink()  # not read back whole here either
    assert files(out) == before

"""Work units: the index's ``units`` entry as a reader checks it, --unit-inputs as the
compiler takes it, unit and shard boundaries, and archive bytes across worker counts."""

from __future__ import annotations

import json
from collections.abc import Callable
from itertools import groupby
from pathlib import Path

import numpy as np
import pytest

from dlop.compiler.output import merge
from dlop.compiler.run import driver
from dlop.formats import ArchiveReader, FormatError, read_index, unit_shard_name
from dlop.formats.constants import MAX_UNITS
from dlop.tools.compile_cli import main

from .media import write_image

EPOCH = "1700000000"
TILES = 64  # samples per image: 64x64 pixels in tiles of 8


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 inputs: 7 images of 64 tiles and, fourth in corpus order, an empty file (skipped)."""
    root = tmp_path_factory.mktemp("units") / "corpus"
    rng = np.random.default_rng(0)
    for n in range(7):
        write_image(root / "images" / f"im{n}.png", rng.integers(0, 256, (64, 64, 3), np.uint8))
    (root / "images" / "im2x.png").write_bytes(b"")
    return root


def args(corpus: Path, out: Path, *extra: str) -> list[str]:
    # 20 KiB shards hold two images' tiles; units of 3 inputs
    return [str(corpus), "--tile", "8", "--shard-bytes", "20KiB", "-q", "-o", str(out), *extra]


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.fixture(scope="module")
def archive(images: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("archive") / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SOURCE_DATE_EPOCH", EPOCH)
        assert main(args(images, out, "--unit-inputs", "3", "--workers", "1")) == 0
    return out


# -- the reader's checks of 'units' --------------------------------------------------


def _units_edit(how: str) -> Callable[[dict], None]:
    def edit(index: dict) -> None:
        units = index["units"]
        key, _, value = how.partition("=")
        if key == "units":
            index["units"] = json.loads(value)
        elif "[" in key:
            name, k = key.rstrip("]").split("[")
            units[name][int(k)] = json.loads(value)
        elif value:
            units[key] = json.loads(value)
        else:
            del units[key]

    return edit


@pytest.mark.parametrize(
    ("how", "said"),
    [
        ("units=[3, 8]", "'units' is list, expected an object"),
        ("unit_inputs", "'unit_inputs' is None"),
        ("unit_inputs=0", "'unit_inputs' is 0"),
        ("unit_inputs=-3", "'unit_inputs' is -3"),
        ('unit_inputs="3"', "'unit_inputs' is '3'"),
        ("unit_inputs=true", "'unit_inputs' is True"),
        ("unit_inputs=18446744073709551616", "expected an integer 1 ... 2^64-1"),
        ("num_inputs=-1", "'num_inputs' is -1"),
        ("num_inputs=8.0", "'num_inputs' is 8.0"),
        (f"num_inputs={3 * MAX_UNITS + 1}", f"at most {MAX_UNITS} units of 3 inputs"),
        ("num_inputs=10", "'shards' is 3, expected a list of 4 counts"),
        ("shards=[2, 2]", "'shards' is 2, expected a list of 3 counts"),
        ('skipped={"0": 0}', "'skipped' is dict, expected a list of 3"),
        ("shards[1]=-1", "'shards[1]' is -1"),
        ("shards[2]=3", "'shards[2]' is 3, expected 0 ... 2"),
        ("shards[0]=true", "'shards[0]' is True"),
        ("skipped[1]=4", "'skipped[1]' is 4, expected 0 ... 3"),
        ("skipped[0]=1", "'skipped' counts 2 skipped inputs in all, 'skipped.count' is 1"),
        ("shards[1]=2", "'shards' counts 5 shards in all, the index lists 4"),
        # counts past sys.maxsize: a unit's inputs are counted without len(range)
        (
            f'units={{"unit_inputs": {2**64 - 1}, "num_inputs": {2**64 - 1}, '
            '"shards": [1], "skipped": [0]}',
            "'shards' counts 1 shards in all, the index lists 4",
        ),
        (
            f'units={{"unit_inputs": {2**63}, "num_inputs": {2**63 + 5}, '
            '"shards": [0, 6], "skipped": [0, 0]}',
            "'shards[1]' is 6, expected 0 ... 5",
        ),
    ],
)
def test_the_reader_checks_units(archive: Path, tmp_path: Path, how: str, said: str) -> None:
    out = tmp_path / "a"
    out.mkdir()
    index = json.loads((archive / "index.json").read_text())
    assert index["units"] == {
        "unit_inputs": 3,
        "num_inputs": 8,
        "shards": [2, 1, 1],
        "skipped": [0, 1, 0],
    }
    _units_edit(how)(index)
    (out / "index.json").write_text(json.dumps(index))
    with pytest.raises(FormatError) as e:
        read_index(out)
    assert str(e.value).startswith(f"{out / 'index.json'}: 'units' "), e.value
    assert said in str(e.value) and "SPEC.md §6.1" in str(e.value), e.value


@pytest.mark.parametrize(
    ("entry", "name", "said"),
    [
        (1, "unit-000001-0001.dlop", "shard entry #1 shard 1 of unit 0, named 'unit-000000-0001"),
        (1, "unit-000000-0002.dlop", "shard entry #1 shard 1 of unit 0"),
        (2, "unit-000002-0001.dlop", "shard entry #2 shard 0 of unit 1"),
        (3, "unit-2-0.dlop", "shard entry #3 shard 0 of unit 2"),
        (0, "shard-00000.dlop", "shard entry #0 shard 0 of unit 0"),
    ],
)
def test_the_reader_checks_unit_shard_names(
    archive: Path, tmp_path: Path, entry: int, name: str, said: str
) -> None:
    out = tmp_path / "a"
    out.mkdir()
    index = json.loads((archive / "index.json").read_text())
    index["shards"][entry]["file"] = name
    (out / "index.json").write_text(json.dumps(index))
    with pytest.raises(FormatError, match="'units'") as e:
        read_index(out)
    assert said in str(e.value) and repr(name) in str(e.value), e.value


def test_an_index_without_units_reads_as_before(archive: Path, tmp_path: Path) -> None:
    index = json.loads((archive / "index.json").read_text())
    del index["units"]
    (tmp_path / "index.json").write_text(json.dumps(index))
    assert read_index(tmp_path).units is None


# -- --unit-inputs -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("0", "--unit-inputs 0: expected a positive number of inputs"),
        ("-2", "--unit-inputs -2: expected a positive number of inputs"),
        ("18446744073709551616", "at most 2^64-1 inputs per unit"),
    ],
)
def test_a_bad_unit_size_is_refused_before_out_is_touched(
    images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, said: str
) -> None:
    out = tmp_path / "out"
    assert main(args(images, out, "--unit-inputs", value, "--workers", "1")) == 1
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1, err
    assert not out.exists()


def test_too_many_units_are_refused_before_out_is_touched(
    images: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(driver, "MAX_UNITS", 3)  # 8 inputs in units of 2 make 4
    out = tmp_path / "out"
    assert main(args(images, out, "--unit-inputs", "2", "--workers", "1")) == 1
    err = capsys.readouterr().err
    assert "the 8 inputs make 4 units" in err and "give --unit-inputs 3 or more" in err, err
    assert not out.exists()
    assert main(args(images, out, "--unit-inputs", "3", "--workers", "1")) == 0


@pytest.mark.parametrize("unit_inputs", ["1", "5", "7", "100"])
def test_any_positive_unit_size_holds_the_same_samples(
    images: Path, archive: Path, tmp_path: Path, unit_inputs: str
) -> None:
    """Sizes that are no multiple of the chunk size (or of anything) cut the same samples."""
    out = tmp_path / "out"
    assert main(args(images, out, "--unit-inputs", unit_inputs, "--workers", "1")) == 0
    with ArchiveReader(out) as got, ArchiveReader(archive) as want:
        assert got.num_samples == want.num_samples == 7 * TILES
        for i in range(0, got.num_samples, 13):
            assert got.get("key", i) == want.get("key", i)
            assert np.array_equal(got.get("image", i), want.get("image", i))
        units = got.index.units
        assert units is not None and units.unit_inputs == int(unit_inputs)
        assert (out / "errors.jsonl").read_bytes() == (archive / "errors.jsonl").read_bytes()


# -- boundaries and bytes -----------------------------------------------------------------


def test_units_never_split_an_input_and_shards_never_span_units(archive: Path) -> None:
    names = ["im0", "im1", "im2", "im2x", "im3", "im4", "im5", "im6"]  # corpus order
    with ArchiveReader(archive) as r:
        units = r.index.units
        assert units is not None and units.shards == (2, 1, 1)
        first = 0
        for k, count in enumerate(units.shards):
            inputs = {
                f"images/{n}.png" for n in names[units.inputs_of(k).start :][: units.unit_inputs]
            }
            for j in range(count):
                info = r.index.shards[first + j]
                assert info.file == unit_shard_name(k, j)
                start = sum(s.num_samples for s in r.index.shards[: first + j])
                keys = [r.get("key", i) for i in range(start, start + info.num_samples)]
                assert set(keys) <= inputs  # only this unit's inputs
                # whole inputs only: every input's tiles, consecutive
                assert all(len(list(g)) == TILES for _, g in groupby(keys))
                assert len(set(keys)) * TILES == len(keys)
            first += count
        keys = [r.get("key", i) for i in range(r.num_samples)]
        # each input in one shard only
        shard_of = {key: r.locate(i)[0] for i, key in enumerate(keys)}
        assert all(shard_of[key] == r.locate(i)[0] for i, key in enumerate(keys))


def test_archive_bytes_do_not_depend_on_the_worker_count(
    images: Path, archive: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    out = tmp_path / "two"
    assert main(args(images, out, "--unit-inputs", "3", "--workers", "2")) == 0
    assert files(out) == files(archive)


# -- a unit publishes only for the compile its journal names -------------------------


@pytest.mark.parametrize("journal", ["taken over", "discarded"])
def test_a_unit_publishes_nothing_once_out_is_not_its_compiles(
    tmp_path: Path, journal: str
) -> None:
    """A Dask task may outlive its client: once OUT's journal names another run (or is gone),
    its shards and record stay out of OUT."""
    from dlop.compiler.errors import CompileError
    from dlop.compiler.output.commit import commit_name
    from dlop.compiler.output.journal import JOURNAL, Journal
    from dlop.compiler.output.store import LocalStore
    from dlop.compiler.run.items import CorpusShape
    from dlop.compiler.run.units import UnitTask, UnitWriter
    from dlop.formats import Field

    store = LocalStore(tmp_path)
    ours = Journal(str(tmp_path), "d" * 64, "f" * 64, 4, 8)
    ours.save(store)
    shape = CorpusShape(False, False, {})
    fields = (Field("x", "u8", (4,)),)
    task = UnitTask(
        {"shard_bytes": 1 << 20}, "d" * 64, shape, fields, 4, str(tmp_path), None, ours.run
    )
    first = UnitWriter(task, store, 0, range(4), "skip")
    assert first.commit().unit == 0 and (tmp_path / commit_name(0)).exists()  # still ours
    if journal == "discarded":
        (tmp_path / JOURNAL).unlink()
    else:
        Journal(str(tmp_path), "d" * 64, "f" * 64, 4, 8).save(store)  # another run
    second = UnitWriter(task, store, 1, range(4, 8), "skip")
    second.writer.write_group([{"x": np.arange(4, dtype=np.uint8)}])
    with pytest.raises(CompileError, match="another compile took this output over"):
        second.commit()
    assert not (tmp_path / commit_name(1)).exists()
    assert not list(tmp_path.glob("unit-000001-*"))


def test_archive_limits_stop_the_compile_at_the_first_unit_past_them(
    images: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """As if the archive's 2^17 shards were 2: the compile stops at the unit that passes the
    bound, not after the last unit."""
    from dlop.compiler.output.commit import commit_name
    from dlop.formats import archive as archive_module

    monkeypatch.setattr(merge, "MAX_SHARDS", 2)
    monkeypatch.setattr(archive_module, "MAX_SHARDS", 2)
    out = tmp_path / "out"
    # units of 2 inputs, each 1 shard: the third unit's record passes the bound
    assert main(args(images, out, "--unit-inputs", "2", "--workers", "1")) == 1
    err = capsys.readouterr().err
    assert "3 shards after unit 2" in err and "at most 2" in err and "--shard-bytes" in err, err
    assert not (out / commit_name(3)).exists()


@pytest.mark.parametrize("extra", [-1, 1])
def test_a_layout_stream_giving_other_than_asked_is_an_error(extra: int) -> None:
    """A unit takes its inputs from the stream by count: a layout's stream that gives one
    too few or too many inputs would shift later inputs into other units unseen."""
    from types import SimpleNamespace

    from dlop.compiler.corpus import layouts
    from dlop.compiler.corpus.records import Corpus, Item
    from dlop.compiler.errors import CompileError

    def stream(corpus: Corpus, start: int, stop: int | None) -> list[Item]:
        items = list(corpus.items[start:stop])
        return items[:extra] if extra < 0 else [*items, Item("one more")]

    module = SimpleNamespace(
        NAME="short-stream", MEDIA=("audio",), SIGNS="-", detect=lambda s: False
    )
    module.list_corpus, module.stream = None, stream  # type: ignore[attr-defined]
    layouts.register(module)  # type: ignore[arg-type]
    try:
        items = [Item(f"k{i}") for i in range(6)]
        corpus = Corpus("short-stream", "-", items, False, False, {}, {}, "f")
        with pytest.raises(CompileError, match=r"stream 4 inputs from input 2, it gave"):
            list(layouts.stream_items(corpus, 2))
    finally:
        layouts.unregister("short-stream")

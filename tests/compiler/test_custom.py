"""compile_dataset / compile_map: a user's own Dataset or function compiled with the
presets' guarantees. Samples read back exactly (every dtype, ragged and fixed, str,
bytes, scalars, dicts and tuples); the bytes do not depend on the engine or worker
count; a kill -9 at any moment resumes byte-identically; bad items are recorded; a
schema change midway names both items; changed code refuses --resume."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dlop.compiler import compile_dataset, compile_map
from dlop.compiler.errors import CompileError
from dlop.compiler.faults import KILL_AT
from dlop.runtime import Loader, open_archive
from dlop.tools.compile_cli import main

from . import custom_data
from .custom_data import Drifting, Everything, Randomized, Tuples, Widening, cheap, fails_some
from .fixtures import dask_cluster

EPOCH = "1700000000"
DATA_FILE = Path(custom_data.__file__)
ROOT = Path(__file__).resolve().parents[2]


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def same(read: Any, given: Any, where: str = "") -> None:
    """``read`` (from the archive) is exactly ``given`` (from the Dataset), as reading
    promises: tensors for arrays, Python values for scalars, str and bytes as they were."""
    if isinstance(given, dict):
        assert isinstance(read, dict) and list(read) == list(given), where
        for k in given:
            same(read[k], given[k], f"{where}.{k}")
    elif isinstance(given, tuple | list):
        assert isinstance(read, tuple) and len(read) == len(given), where
        for k, (r, g) in enumerate(zip(read, given, strict=True)):
            same(r, g, f"{where}.{k}")
    elif isinstance(given, torch.Tensor):
        assert isinstance(read, torch.Tensor) and read.dtype == given.dtype, where
        assert torch.equal(read, given), where
    elif isinstance(given, np.ndarray):
        assert isinstance(read, torch.Tensor), where
        assert torch.equal(read, torch.from_numpy(given)), where
    elif isinstance(given, np.generic):
        assert type(read) is type(given.item()) and read == given.item(), where
    else:
        assert type(read) is type(given) and read == given, (where, read, given)


@pytest.fixture(autouse=True)
def _epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)


@pytest.mark.parametrize("make", [Everything, Tuples], ids=["dicts", "tuples"])
def test_samples_read_back_exactly(make: Any, tmp_path: Path) -> None:
    ds = make()
    index = compile_dataset(ds, tmp_path / "a", workers=1, unit_inputs=4, progress=False)
    assert index.num_samples == len(ds) and index.skipped_count == 0
    archive = open_archive(tmp_path / "a")
    for i in range(len(ds)):
        same(archive[i], ds[i], f"item {i}")
    dtypes = {f.name: (f.dtype, f.shape) for f in index.fields}
    if make is Everything:
        assert dtypes["ragged"] == ("f32", (None, 4)) and dtypes["a_uint64"] == ("u64", (2, 3))
        assert dtypes["bf16"] == ("bf16", (3, 2)) and dtypes["meta.vec"] == ("i16", (3,))
    else:
        assert dtypes["0"] == ("i16", (None, 3)) and dtypes["3.1"] == ("u8", (None,))


def test_batches_keep_the_samples_shape(tmp_path: Path) -> None:
    ds = Tuples(10)
    compile_dataset(ds, tmp_path / "a", workers=1, progress=False)
    archive = open_archive(tmp_path / "a")
    loader = torch.utils.data.DataLoader(archive, batch_size=4)
    (frames, lengths), labels, texts, (weights, blobs) = next(iter(loader))
    assert frames.shape == (4, 5, 3) and lengths.tolist() == [2, 3, 4, 5]
    assert labels.tolist() == [0, 1, 2, 0] and texts == [f"utterance {i}" for i in range(4)]
    assert weights.dtype == torch.float64 and blobs[1] == bytes([1, 2])
    for (frames, _), labels, _, _ in Loader(tmp_path / "a", batch_size=5, shuffle=False):
        assert frames.shape[0] == 5 and labels.tolist() == [i % 3 for i in range(5)]
        break


@pytest.mark.slow
def test_the_bytes_do_not_depend_on_the_engine(tmp_path: Path) -> None:
    ds = Everything(20)
    options = {"unit_inputs": 6, "shard_bytes": "8KB", "progress": False}
    compile_dataset(ds, tmp_path / "one", workers=1, **options)
    compile_dataset(ds, tmp_path / "two", workers=2, **options)
    with dask_cluster(2) as address:
        compile_dataset(ds, tmp_path / "dask", dask=address, **options)
    whole = files(tmp_path / "one")
    assert len([n for n in whole if n.endswith(".dlop")]) >= 4
    assert files(tmp_path / "two") == whole and files(tmp_path / "dask") == whole
    archive = open_archive(tmp_path / "two")
    for i in range(len(ds)):
        same(archive[i], ds[i], f"item {i}")


def test_a_failing_item_is_recorded_and_the_rest_compiled(tmp_path: Path) -> None:
    index = compile_map(fails_some, list(range(40)), tmp_path / "a", workers=1, progress=False)
    bad = [x for x in range(40) if x % 7 == 3 or x % 11 == 5]
    assert index.skipped_count == len(bad) and index.num_samples == 40 - len(bad)
    records = [
        json.loads(line) for line in (tmp_path / "a" / "errors.jsonl").read_text().splitlines()
    ]
    assert [int(r["key"]) for r in records] == bad
    raised = records[0]
    assert raised["reason"].startswith("ValueError: input 3 is unlucky (at ")
    assert "custom_data.py" in raised["reason"] and "in fails_some" in raised["reason"]
    assert any(r["reason"].startswith("skipped: the code gave None") for r in records)
    archive = open_archive(tmp_path / "a")
    good = [x for x in range(40) if x not in bad]
    for n, x in enumerate(good):
        same(archive[n], fails_some(x))
    with pytest.raises(
        CompileError, match=r"input 3: ValueError: input 3 is unlucky.*on-error fail"
    ):
        compile_map(fails_some, list(range(40)), tmp_path / "b", on_error="fail", progress=False)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    "what, message",
    [
        ("dtype", r"field 'x': Drifting\[0\] gave f32 \[4, 2\], Drifting\[13\] gives f64"),
        ("rank", r"field 'x': Drifting\[0\] gave rank 2 \[4, 2\], Drifting\[13\] gives rank 1"),
    ],
)
def test_a_schema_change_midway_names_both_items(what: str, message: str, tmp_path: Path) -> None:
    """A sample that breaks the schema is a bad item: recorded under skip, naming both
    items; under fail the compile stops, and with no unit committed leaves nothing."""
    compile_dataset(Drifting(20, 13, what), tmp_path / "a", workers=1, progress=False)
    assert len(open_archive(tmp_path / "a")) == 13
    lines = (tmp_path / "a" / "errors.jsonl").read_text().splitlines()
    assert len(lines) == 7 and re.search(message.split(": ", 1)[1], lines[0])
    with pytest.raises(CompileError, match=message):
        compile_dataset(
            Drifting(20, 13, what), tmp_path / "b", workers=1, progress=False, on_error="fail"
        )
    assert not (tmp_path / "b").exists()  # nothing half-written is left


def test_an_axis_found_to_vary_later_makes_the_field_ragged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ds = Widening()  # the probe's items all hold 5 rows; item 13 holds 6
    index = compile_dataset(ds, tmp_path / "a", workers=1, unit_inputs=4, progress=False)
    err = capsys.readouterr().err
    assert "field 'x': axis 0 is 5 long in Widening[0], 6 in Widening[13]" in err
    assert "compiling again from the start with that axis ragged" in err
    assert {f.name: f.shape for f in index.fields}["x"] == (None, 2)
    archive = open_archive(tmp_path / "a")
    for i in range(len(ds)):
        same(archive[i], ds[i])
    compile_dataset(
        ds, tmp_path / "b", workers=2, unit_inputs=4, progress=False,
        schema={"x": {"shape": [None, 2]}},
    )  # fmt: skip
    assert "again" not in capsys.readouterr().err
    shards = {n: b for n, b in files(tmp_path / "a").items() if n.endswith(".dlop")}
    assert shards == {n: b for n, b in files(tmp_path / "b").items() if n.endswith(".dlop")}


def test_every_item_draws_the_same_random_numbers_on_any_engine(tmp_path: Path) -> None:
    ds = Randomized()
    state = (np.random.get_state()[1][:4].copy(), torch.get_rng_state().clone())
    compile_dataset(ds, tmp_path / "one", workers=1, progress=False, unit_inputs=5)
    compile_dataset(ds, tmp_path / "two", workers=2, progress=False, unit_inputs=3)
    assert (np.random.get_state()[1][:4] == state[0]).all()  # the caller's state is kept
    assert torch.equal(torch.get_rng_state(), state[1])
    one, two = open_archive(tmp_path / "one"), open_archive(tmp_path / "two")
    draws = [one[i]["py"] for i in range(len(ds))]
    assert len(set(draws)) == len(ds)  # seeded per item, not once
    for i in range(len(ds)):
        same(two[i], one[i])
    compile_dataset(ds, tmp_path / "other", workers=1, progress=False, seed=7)
    assert open_archive(tmp_path / "other")[0]["py"] != draws[0]
    assert json.loads((tmp_path / "other" / "index.json").read_text())["recipe"]["seed"] == 7


def test_schema_casts_and_refusals(tmp_path: Path) -> None:
    def to_f32(x: int) -> dict[str, Any]:
        return {"x": np.full(3, x / 3, np.float64), "n": np.array([x, 300], np.int64)}

    index = compile_map(
        to_f32,
        list(range(5)),
        tmp_path / "a",
        workers=1,
        progress=False,
        schema={"x": "float32", "n": "int16"},
    )
    assert {f.name: f.dtype for f in index.fields} == {"x": "f32", "n": "i16"}
    assert torch.equal(open_archive(tmp_path / "a")[2]["x"], torch.full((3,), 2 / 3).float())
    with pytest.raises(CompileError, match=r"input 0 holds values 0..300, outside u8's 0..255"):
        compile_map(to_f32, list(range(5)), tmp_path / "b", progress=False, schema={"n": "uint8"})
    with pytest.raises(CompileError, match="dlop casts floats to floats and integers to integers"):
        compile_map(to_f32, list(range(5)), tmp_path / "c", progress=False, schema={"x": "int32"})
    half = compile_map(to_f32, list(range(5)), tmp_path / "d", progress=False, dtype="float16")
    assert {f.name: f.dtype for f in half.fields} == {"x": "f16", "n": "i64"}

    def big(x: int) -> dict[str, Any]:
        return {"x": np.array([1e6])}

    with pytest.raises(CompileError, match="beyond f16's range"):
        compile_map(big, [0, 1], tmp_path / "e", workers=1, progress=False, dtype="float16")


@pytest.mark.parametrize(
    "sample, message",
    [
        ({"x": object()}, r"input 0: field 'x' is a builtins.object: a sample's values are"),
        ({"x": {"y": {"z": 1}}}, r"field 'x.y' is a dict inside a dict of a sample: samples nest"),
        ({"a b": 1}, r"key 'a b' is not a field name"),
        ({"x": None}, r"field 'x' is None: return None for the whole sample"),
        (np.zeros(3), r"a sample is a dict of fields or a tuple of them, not a single ndarray"),
        ({"x": np.array(["a"])}, r"dtype <U1 is not one an archive stores"),
    ],
)
def test_what_a_sample_cannot_be_is_refused_by_name(
    sample: Any, message: str, tmp_path: Path
) -> None:
    with pytest.raises(CompileError, match=message):
        compile_map(lambda x: sample, [0, 1], tmp_path / "a", progress=False)


def _compile_args(out: Path, *extra: str) -> list[str]:
    return [
        "--dataset", f"{DATA_FILE}:Everything", "--dataset-args", "[14]", "-o", str(out),
        "--unit-inputs", "3", "--shard-bytes", "6KB", "--workers", "1", "-q", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Every file of the uninterrupted compile of _compile_args."""
    out = tmp_path_factory.mktemp("custom") / "whole"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SOURCE_DATE_EPOCH", EPOCH)
        assert main(_compile_args(out)) == 0
    made = files(out)
    assert len([n for n in made if n.endswith(".dlop")]) >= 5
    return made


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["start", "input:4", "unit:2", "index"])
def test_kill_9_then_resume_is_byte_identical(
    moment: str, whole: dict[str, bytes], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "SOURCE_DATE_EPOCH": EPOCH, KILL_AT: moment}
    cmd = [sys.executable, "-m", "dlop.tools.compile_cli", *_compile_args(out)]
    proc = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert not (out / "index.json").exists()
    assert main([*_compile_args(out), "--resume"]) == 0
    assert files(out) == whole


def test_what_a_recipe_records_does_not_depend_on_modules_loaded_before(tmp_path: Path) -> None:
    """A file loaded where another module of its name was imported before (a notebook that
    loaded another mine.py) was recorded as dlop_user_mine: its resume from the command
    line, a fresh process, was refused as other code."""
    import types

    from dlop.compiler.custom.code import describe
    from dlop.compiler.custom.loading import load_target

    module = tmp_path / "mine.py"
    module.write_text(DATA_FILE.read_text())
    held = {name: sys.modules.pop(name, None) for name in ("mine", "dlop_user_mine")}
    try:
        alone = describe(load_target(f"{module}:Everything", [6], made=True), True)
        other = types.ModuleType("mine")
        other.__file__ = str(tmp_path / "elsewhere" / "mine.py")
        sys.modules["mine"] = other
        target = load_target(f"{module}:Everything", [6], made=True)
        assert type(target).__module__ == "dlop_user_mine"  # the other is not shadowed
        assert sys.modules["mine"] is other
        assert describe(target, True) == alone
        assert alone["module"] == "mine" and "mine" in alone["sources"]
    finally:
        for name, was in held.items():
            sys.modules.pop(name, None)
            if was is not None:
                sys.modules[name] = was


def test_resume_refuses_changed_code_or_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    module = tmp_path / "mine.py"
    module.write_text(DATA_FILE.read_text())
    out = tmp_path / "out"
    args = [
        "--dataset", f"{module}:Everything", "--dataset-args", "[14]", "-o", str(out),
        "--unit-inputs", "3", "--workers", "1", "-q",
    ]  # fmt: skip
    env = {**os.environ, "SOURCE_DATE_EPOCH": EPOCH, KILL_AT: "unit:1"}
    cmd = [sys.executable, "-m", "dlop.tools.compile_cli", *args]
    proc = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    changed = [*args[:3], "[15]", *args[4:], "--resume"]
    assert main(changed) == 1
    assert (
        "the arguments given changed; the inputs changed (14 inputs then, 15 now)"
        in capsys.readouterr().err
    )
    module.write_text(DATA_FILE.read_text() + "\n# an edit\n")
    err = subprocess.run(
        [*cmd, "--resume"], env={**os.environ}, stderr=subprocess.PIPE, timeout=300
    ).stderr.decode()
    assert (
        "--resume refused, since the interrupted compile began: the source of mine changed" in err
    )
    module.write_text(DATA_FILE.read_text())
    assert main([*args, "--resume"]) == 0
    assert main([*args[:5], str(tmp_path / "whole"), *args[6:]]) == 0
    assert files(out) == files(tmp_path / "whole")


def test_the_command_line_takes_a_module_on_the_path_or_a_file(tmp_path: Path) -> None:
    inputs = tmp_path / "inputs.jsonl"
    inputs.write_text("".join(f"{x}\n" for x in range(9)))
    env = {**os.environ, "PYTHONPATH": f"{DATA_FILE.parent}{os.pathsep}{ROOT}"}
    by_name = subprocess.run(
        [sys.executable, "-m", "dlop.tools.compile_cli", "--map", "custom_data:cheap",
         "--inputs", str(inputs), "-o", str(tmp_path / "name"), "-q", "--workers", "2"],
        env=env, capture_output=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert by_name.returncode == 0, by_name.stderr.decode()
    assert "wrote" in by_name.stdout.decode() and "9 samples" in by_name.stdout.decode()
    assert main(["--map", f"{DATA_FILE}:cheap", "--inputs", str(inputs), "-o",
                 str(tmp_path / "file"), "-q", "--workers", "1"]) == 0  # fmt: skip
    assert files(tmp_path / "name").keys() == files(tmp_path / "file").keys()
    archive = open_archive(tmp_path / "file")
    for x in range(9):
        same(archive[x], cheap(x))
    recipe = json.loads((tmp_path / "file" / "index.json").read_text())["recipe"]
    assert recipe["compile"] == "map" and recipe["code"]["qualname"] == "cheap"
    assert list(recipe["code"]["sources"]) == ["custom_data"]


def _name_and_size(path: str) -> dict[str, Any]:
    import fsspec

    with fsspec.open(path, "rb") as f:
        return {"path": path, "bytes": np.frombuffer(f.read(), np.uint8)}


def test_a_folder_or_url_prefix_lists_the_inputs(tmp_path: Path) -> None:

    folder = tmp_path / "inputs"
    for name in ("b.bin", "a.bin", "sub/c.bin"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(name.encode())
    (folder / ".hidden").write_bytes(b"x")
    compile_map(_name_and_size, str(folder), tmp_path / "local", workers=1, progress=False)
    local = open_archive(tmp_path / "local")
    assert [local[i]["path"] for i in range(len(local))] == [
        str(folder / n) for n in ("a.bin", "b.bin", "sub/c.bin")
    ]
    # memory:// lives in one process: the compile's worker sees it by being forked from a
    # process that runs no other thread (a fresh one)
    script = f"""
import fsspec
from dlop.compiler import compile_map
from tests.compiler.test_custom import _name_and_size
memory = fsspec.filesystem("memory")
for name in ("x/2.bin", "x/1.bin"):
    memory.pipe(f"/custom-inputs/{{name}}", name.encode())
compile_map(_name_and_size, "memory://custom-inputs/x", {str(tmp_path / "url")!r}, workers=1,
            progress=False)
"""
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True)
    url = open_archive(tmp_path / "url")
    assert [url[i]["path"] for i in range(2)] == [
        "memory://custom-inputs/x/1.bin",
        "memory://custom-inputs/x/2.bin",
    ]
    assert bytes(url[1]["bytes"].numpy()) == b"x/2.bin"
    recipe = json.loads((tmp_path / "url" / "index.json").read_text())["recipe"]
    assert recipe["inputs"]["source"] == "memory://custom-inputs/x"


def test_resume_keeps_the_schema_the_interrupted_compile_widened(tmp_path: Path) -> None:
    args = [
        "--dataset", f"{DATA_FILE}:Widening", "--unit-inputs", "4", "--workers", "1", "-q",
    ]  # fmt: skip
    assert main([*args, "-o", str(tmp_path / "whole")]) == 0
    env = {**os.environ, "SOURCE_DATE_EPOCH": EPOCH, KILL_AT: "index"}
    cmd = [sys.executable, "-m", "dlop.tools.compile_cli", *args, "-o", str(tmp_path / "out")]
    proc = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert b"compiling again from the start" in proc.stderr  # widened, then killed
    # the resume's own probe would find the axis fixed: it takes the journal's schema
    assert main([*args, "-o", str(tmp_path / "out"), "--resume"]) == 0
    assert files(tmp_path / "out") == files(tmp_path / "whole")


BIG_ROWS = 256 * 2**20 // (4 * 64)  # a 256 MiB float32 item, [rows, 64], ragged


def _big(x: int) -> dict[str, Any]:
    return {"x": np.full((BIG_ROWS + x, 64), x, np.float32)}


def _big_bytes(x: int) -> dict[str, Any]:
    return {"b": bytes([x]) * (BIG_ROWS * 64 * 4 + x)}


_PEAK = """
import resource, sys
from tests.compiler import test_custom
from dlop.compiler import compile_map
fn = getattr(test_custom, sys.argv[2])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
compile_map(fn, [0, 1], sys.argv[1], workers=2, progress=False, shard_bytes="64MiB",
            compression=sys.argv[3])
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fn", "codec"),
    [("_big", "raw"), ("_big_bytes", "raw"), ("_big", "zstd")],
    ids=["array", "bytes", "array-zstd"],
)
def test_a_large_item_is_written_through_not_held_twice(
    fn: str, codec: str, tmp_path: Path
) -> None:
    """The driver (this subprocess) takes each item from its worker through a mapped file and
    hands the writer views of it: its peak grows by about one item, never two (an item
    read into memory and copied again for the writer would be 512 MiB). Compressed, the
    block is encoded from that view, byte-shuffled once: about one item more (it grew
    by five before: the block, its bytes, the shuffle and the shuffle's bytes)."""
    item = BIG_ROWS * 64 * 4
    done = subprocess.run(
        [sys.executable, "-c", _PEAK, str(tmp_path / "a"), fn, codec],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    grew = int(done.stdout.strip().splitlines()[-1])
    held = 1 if codec == "raw" else 2  # the mapped item, and for zstd its shuffled copy
    assert grew < (held + 0.5) * item, f"the driver's peak grew by {grew / 2**20:.0f} MiB"
    archive = open_archive(tmp_path / "a")
    if fn == "_big":
        assert archive[1]["x"].shape == (BIG_ROWS + 1, 64)
        assert float(archive[1]["x"][-1, -1]) == 1.0
    else:
        assert len(archive[1]["b"]) == item + 1 and archive[1]["b"][-3:] == b"\x01" * 3


class Scaled:
    """A callable object: its attributes are its arguments."""

    def __init__(self, factor: int) -> None:
        self.factor = factor

    def __call__(self, x: int) -> dict[str, Any]:
        return {"n": np.int64(x * self.factor), "name": np.str_(f"x{x}")}


def test_an_interrupted_compile_resumes_with_a_declared_scalar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dlop.compiler.faults import SIGNAL

    options: dict[str, Any] = {"unit_inputs": 2, "workers": 1, "progress": False}
    schema = {"n": {"dtype": "int32", "shape": []}}
    monkeypatch.setenv(KILL_AT, "unit:1")
    monkeypatch.setenv(SIGNAL, "INT")  # a KeyboardInterrupt here, not a kill
    with pytest.raises(KeyboardInterrupt):
        compile_map(Scaled(3), list(range(6)), tmp_path / "a", schema=schema, **options)
    monkeypatch.delenv(KILL_AT)
    with pytest.raises(CompileError, match=r"its arguments .* changed"):
        compile_map(
            Scaled(4), list(range(6)), tmp_path / "a", schema=schema, resume=True, **options
        )
    compile_map(Scaled(3), list(range(6)), tmp_path / "a", schema=schema, resume=True, **options)
    archive = open_archive(tmp_path / "a")
    assert [archive[i]["n"] for i in range(6)] == [3 * i for i in range(6)]
    assert archive[5]["name"] == "x5" and type(archive[5]["name"]) is str


def _shifting(x: int) -> Any:
    return (np.zeros(2),) if x < 12 else {"0": np.zeros(2)}


def test_a_sample_of_another_shape_names_both_items(tmp_path: Path) -> None:
    compile_map(_shifting, list(range(20)), tmp_path / "a", workers=1, progress=False)
    lines = (tmp_path / "a" / "errors.jsonl").read_text().splitlines()
    assert len(lines) == 8 and "gives a sample of another shape than input 0" in lines[0]
    with pytest.raises(
        CompileError, match=r"input 12 gives a sample of another shape than input 0"
    ):
        compile_map(
            _shifting, list(range(20)), tmp_path / "b", workers=1, progress=False, on_error="fail"
        )


def test_a_reason_reads_the_same_on_every_run_and_host(tmp_path: Path) -> None:
    """An object's address and the folder of the failing file are left out of a reason."""
    from dlop.compiler.custom.work import reason

    def fails(x: int) -> None:
        raise ValueError(f"cannot read {object()!r}")

    with pytest.raises(CompileError, match=r"the first: input 0: ValueError: cannot read <object"):
        compile_map(fails, [0, 1], tmp_path / "a", progress=False)
    try:
        fails(0)
    except ValueError as e:
        text = reason(e)
    assert "object object at 0x...>" in text
    assert "(at test_custom.py:" in text and "/" not in text.split("(at ")[1]


def _with_lengths(x: int) -> dict[str, Any]:
    return {"x": np.zeros(x % 3 + 1), "x_lengths": x}


def test_a_field_named_as_a_ragged_fields_lengths_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CompileError, match=r"fields 'x' and 'x_lengths': 'x' varies in length"):
        compile_map(_with_lengths, list(range(6)), tmp_path / "a", workers=1, progress=False)


def test_damaged_inputs_journal_and_schema_files_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dlop.compiler.faults import SIGNAL
    from dlop.compiler.output.journal import JOURNAL

    lines = tmp_path / "in.jsonl"
    lines.write_text('1\n2\n{"half": \n')
    with pytest.raises(CompileError, match=r"in.jsonl:3: not a JSON value"):
        compile_map(cheap, str(lines), tmp_path / "a", progress=False)
    schema = tmp_path / "schema.json"
    schema.write_text('{"x": ')
    lines.write_text("1\n2\n")
    argv = ["--map", f"{DATA_FILE}:cheap", "--inputs", str(lines), "-o", str(tmp_path / "b")]
    assert main([*argv, "--schema", str(schema)]) == 1
    assert f"--schema {schema}" in capsys.readouterr().err
    options: dict[str, Any] = {"unit_inputs": 1, "workers": 1, "progress": False}
    monkeypatch.setenv(KILL_AT, "unit:1")
    monkeypatch.setenv(SIGNAL, "INT")
    with pytest.raises(KeyboardInterrupt):
        compile_map(cheap, [1, 2, 3], tmp_path / "c", **options)
    monkeypatch.delenv(KILL_AT)
    journal = json.loads((tmp_path / "c" / JOURNAL).read_text())
    journal["recipe"]["fields"][0]["shape"] = ["many"]
    (tmp_path / "c" / JOURNAL).write_text(json.dumps(journal))
    with pytest.raises(CompileError, match="the journal's schema is damaged"):
        compile_map(cheap, [1, 2, 3], tmp_path / "c", resume=True, **options)

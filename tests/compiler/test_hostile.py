"""A team's own code cannot break a compile: samples that outgrow a constant, items that
kill or hang their worker, a schema broken late, foreign exceptions. Each case names
what the compile must do instead: compile, record the item, or refuse clearly, and
never lose committed work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dlop.compiler import compile_dataset
from dlop.compiler.errors import CompileError
from dlop.compiler.run.faults import KILL_AT
from dlop.runtime import open_archive

from .hostile_data import Plain, TokenIds

EPOCH = "1700000000"
ROOT = Path(__file__).resolve().parents[2]


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def errors(out: Path) -> list[dict[str, object]]:
    path = out / "errors.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_list_of_numbers_is_one_array_field(tmp_path: Path) -> None:
    ds = TokenIds(20)
    compile_dataset(ds, tmp_path / "a", workers=1, progress=False)
    archive = open_archive(tmp_path / "a")
    assert sorted(archive.fields) == ["ids", "mask", "y"]  # not 512 + 5 fields
    assert archive.fields["ids"].dtype == "i64" and archive.fields["ids"].shape == (512,)
    assert archive.fields["mask"].dtype == "bool"
    for i in (0, 7, 19):
        got = archive[i]
        assert torch.equal(got["ids"], torch.tensor(ds[i]["ids"]))
        assert torch.equal(got["mask"], torch.tensor(ds[i]["mask"]))


RESUMED = """
import sys
from dlop.compiler import compile_dataset
from tests.compiler.hostile_data import ManyFields, Plain
ds = ManyFields(12, 400) if sys.argv[2] == "wide" else Plain(12)
args = {"note": "n" * 100_000} if sys.argv[2] == "args" else None
compile_dataset(ds, sys.argv[1], workers=1, unit_inputs=4, progress=False, arguments=args,
                resume=len(sys.argv) > 3)
"""


@pytest.mark.parametrize("what", ["wide", "args"])
def test_a_wide_schema_or_large_arguments_compile_and_resume(what: str, tmp_path: Path) -> None:
    """400 fields or 100 KB of arguments outgrew the journal's 64 KiB before: the first
    run said another compile took OUT over, and no resume could ever finish it."""
    env = {**os.environ, "SOURCE_DATE_EPOCH": EPOCH, "PYTHONPATH": str(ROOT)}
    whole = tmp_path / "whole"
    subprocess.run([sys.executable, "-c", RESUMED, str(whole), what], env=env, check=True)
    out = tmp_path / "out"
    killed = subprocess.run(
        [sys.executable, "-c", RESUMED, str(out), what],
        env={**env, KILL_AT: "unit:1"},
        stderr=subprocess.PIPE,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    resumed = [sys.executable, "-c", RESUMED, str(out), what, "resume"]
    subprocess.run(resumed, env=env, check=True)
    assert files(out) == files(whole)
    if what == "wide":
        assert len(open_archive(out).fields) == 400


def test_a_recipe_too_large_for_any_index_is_refused_before_any_work(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(CompileError, match=r"recipe .* bytes as JSON, more than the"):
        compile_dataset(
            Plain(4), out, workers=1, progress=False, arguments={"note": "n" * (40 << 20)}
        )
    assert not out.exists()

"""dlop-compile --recipe FILE|ARCHIVE reads through the formats layer's safe opening: regular
files only, a capped read, bounded JSON nesting; every failure is one line naming the file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dlop.compiler.errors import CompileError
from dlop.compiler.recipe import load_recipe_file
from dlop.tools.compile_cli import main


def refused(recipe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["--recipe", str(recipe), "-o", str(tmp_path / "out"), "-q"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dlop-compile: error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
    return err


def test_recipe_files_of_each_kind_load(tmp_path: Path) -> None:
    (tmp_path / "r.toml").write_text('source = "/data"\nshard_bytes = "1MiB"\n')
    (tmp_path / "r.json").write_text('{"source": "/data", "workers": 2}')
    archive = tmp_path / "archive"
    archive.mkdir()
    (archive / "index.json").write_text('{"format": "dlop-archive", "recipe": {"source": "/x"}}')
    assert load_recipe_file(tmp_path / "r.toml") == {"source": "/data", "shard_bytes": "1MiB"}
    assert load_recipe_file(tmp_path / "r.json") == {"source": "/data", "workers": 2}
    assert load_recipe_file(archive) == {"source": "/x"}
    assert load_recipe_file(archive / "index.json") == {"source": "/x"}


def test_a_deeply_nested_index_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    archive = tmp_path / "archive"
    archive.mkdir()
    (archive / "index.json").write_bytes(b"[" * 200_000 + b"]" * 200_000)
    err = refused(archive, tmp_path, capsys)
    assert str(archive / "index.json") in err and "nests" in err, err


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_a_recipe_that_is_not_utf8_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str
) -> None:
    recipe = tmp_path / f"r{suffix}"
    recipe.write_bytes(b'source = "caf\xe9"\n' if suffix == ".toml" else b'{"source": "caf\xe9"}')
    err = refused(recipe, tmp_path, capsys)
    assert str(recipe) in err and "UTF-8" in err, err


@pytest.mark.parametrize("text", [b"[[[[[[[[", b"source = " + b"[" * 100_000, b"a = 1\na = 2"])
def test_a_bad_toml_recipe_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: bytes
) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_bytes(text)
    err = refused(recipe, tmp_path, capsys)
    assert str(recipe) in err and "TOML" in err, err


def test_special_files_are_refused_without_blocking(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "r.toml"
    os.mkfifo(fifo)  # nobody writes: a plain open would wait forever
    err = refused(fifo, tmp_path, capsys)
    assert str(fifo) in err and "FIFO" in err, err
    (tmp_path / "zero.json").symlink_to("/dev/zero")  # a read without end
    err = refused(tmp_path / "zero.json", tmp_path, capsys)
    assert "zero.json" in err and "character device" in err, err
    archive = tmp_path / "archive"
    archive.mkdir()
    (archive / "index.json").symlink_to("/dev/zero")
    err = refused(archive, tmp_path, capsys)
    assert str(archive / "index.json") in err, err


def test_missing_and_odd_recipes_name_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(tmp_path / "missing.toml", tmp_path, capsys)
    assert "missing.toml" in err and "no such file" in err.lower(), err
    (tmp_path / "empty").mkdir()
    err = refused(tmp_path / "empty", tmp_path, capsys)
    assert "empty" in err and "index.json" in err, err
    (tmp_path / "list.json").write_text("[1, 2]")
    err = refused(tmp_path / "list.json", tmp_path, capsys)
    assert "list.json" in err and "table/object of options" in err, err
    with pytest.raises(CompileError, match=r"big\.json"):
        big = tmp_path / "big.json"
        with open(big, "wb") as f:
            f.truncate((256 << 20) + 1)  # sparse: past the cap without writing it
        load_recipe_file(big)

"""dlop-inspect cache: list what the shard cache holds, and --clear it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from dlop.runtime.storage.cache import CacheDir
from dlop.tools import cache_cli


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cache_cli.add_parser(p.add_subparsers(dest="command"))
    return p.parse_args(argv)


def test_lists_and_clears(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = CacheDir(tmp_path, max_bytes=1000)
    folder = cache.archive_dir("abc0000000000000000000ab")
    (folder / "source.txt").write_text("s3://b/a\n")
    held = cache.get(folder / "shard-00000.dlop", lambda: b"x" * 100)
    cache.let_go(cache.get(folder / "shard-00001.dlop", lambda: b"y" * 50))
    args = parse(["cache", str(tmp_path), "--json"])
    assert args.run(args) == 0
    listed = json.loads(capsys.readouterr().out)["archives"]
    assert listed == [
        {"archive": "abc0000000000000000000ab", "source": "s3://b/a", "shards": 2, "bytes": 150}
    ]
    args = parse(["cache", str(tmp_path), "--clear"])
    assert args.run(args) == 0
    assert (folder / "shard-00000.dlop").exists()  # held: kept
    assert not (folder / "shard-00001.dlop").exists()
    cache.let_go(held)
    args.run(args)
    assert not folder.exists()


def test_dlop_inspect_reaches_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dlop.tools import inspect_cli

    cache = CacheDir(tmp_path, max_bytes=1000)
    folder = cache.archive_dir("abc0000000000000000000ab")
    (folder / "source.txt").write_text("s3://b/a\n")
    cache.let_go(cache.get(folder / "shard-00000.dlop", lambda: b"x" * 100))
    assert inspect_cli.main(["cache", str(tmp_path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["archives"]
    assert listed == [
        {"archive": "abc0000000000000000000ab", "source": "s3://b/a", "shards": 1, "bytes": 100}
    ]
    assert inspect_cli.main(["cache", str(tmp_path), "--clear"]) == 0
    assert not folder.exists()

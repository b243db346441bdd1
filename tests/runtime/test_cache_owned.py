"""A cache only ever touches what it wrote: a folder holding anything else is not
adopted, names outside its archive folders are never listed, links are not followed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dlop.runtime.storage.cache import CacheDir
from dlop.runtime.storage.cache_folder import MARK, CacheError
from dlop.tools.inspect_cli import main as inspect_main

ARCHIVE = "0123456789abcdef01234567"  # an archive folder's name: 24 hex digits


def _user_files(root: Path) -> list[Path]:
    made = [root / "Docs" / "a.txt", root / "Photos" / "old.jpg", root / "proj" / "x.tmp-keep"]
    for p in made:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"the user's own")
    return made


def test_clear_refuses_a_folder_that_is_not_a_cache(tmp_path: Path) -> None:
    home = tmp_path / "home"
    made = _user_files(home)
    assert inspect_main(["cache", str(home), "--clear"]) != 0
    assert all(p.read_bytes() == b"the user's own" for p in made)


def test_opening_or_evicting_never_touches_a_users_files(tmp_path: Path) -> None:
    home = tmp_path / "home"
    made = _user_files(home)
    with pytest.raises(CacheError, match=r"not a dlop shard cache .* holds 'Docs' and 2 more"):
        CacheDir(home, max_bytes=1)
    assert all(p.exists() for p in made) and not (home / MARK).exists()


def test_a_new_or_empty_folder_becomes_a_cache_and_an_old_cache_is_adopted(
    tmp_path: Path,
) -> None:
    CacheDir(tmp_path / "new" / "cache", max_bytes=1 << 20)
    assert (tmp_path / "new" / "cache" / MARK).is_file()
    old = tmp_path / "old"
    (old / ARCHIVE).mkdir(parents=True)
    (old / ARCHIVE / "shard-00000.dlop").write_bytes(b"x" * 10)
    (old / ".budget.lock").write_bytes(b"")
    cache = CacheDir(old, max_bytes=1 << 20)  # what an earlier dlop wrote: adopted
    assert (old / MARK).is_file() and cache.used_bytes() == 10


def test_links_in_a_cache_are_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "shard-00000.dlop").write_bytes(b"keep me")
    cache_root = tmp_path / "cache"
    cache = CacheDir(cache_root, max_bytes=1 << 20)
    os.symlink(outside, cache_root / "fedcba9876543210fedcba98")  # a link named like a folder
    real = cache.archive_dir(ARCHIVE)
    (real / "shard-00001.dlop").write_bytes(b"y" * 100)
    os.symlink(outside / "shard-00000.dlop", real / "shard-00002.dlop")
    assert cache.used_bytes() == 100
    assert cache.make_room(1 << 20) == 0  # evicts its own shard only
    assert cache.clear() == 0
    assert (outside / "shard-00000.dlop").read_bytes() == b"keep me"


def test_a_cache_folder_that_is_a_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(CacheError, match="cannot make the cache folder"):
        CacheDir(tmp_path / "f", max_bytes=1)


def test_a_cache_folder_this_process_may_not_write_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    CacheDir(tmp_path / "c", max_bytes=1)  # a cache, marked
    (tmp_path / "c").chmod(0o555)
    if os.geteuid() == 0:  # root may write anywhere: answer as access(2) does for others
        import dlop.runtime.storage.cache_folder as folder

        monkeypatch.setattr(folder.os, "access", lambda path, mode: False)
    try:
        with pytest.raises(CacheError, match="cache folder is not writable by this process"):
            CacheDir(tmp_path / "c", max_bytes=1)
    finally:
        (tmp_path / "c").chmod(0o755)


def test_budgets_with_units_and_overflowing_sizes(tmp_path: Path) -> None:
    from dlop.runtime.storage.cache_folder import byte_budget, parse_bytes

    assert byte_budget("100MB", "cache_bytes") == 100 * 10**6  # as dlop-compile reads it
    assert byte_budget("50G", "cache_bytes") == 50 << 30
    assert byte_budget(5, "cache_bytes") == 5
    with pytest.raises(CacheError, match="not a byte budget"):
        byte_budget(True, "cache_bytes")
    with pytest.raises(CacheError, match=r"DLOP_CACHE_BYTES: '1e400' is not a number of bytes"):
        parse_bytes("1e400", "DLOP_CACHE_BYTES")
    with pytest.raises(CacheError, match="too large a number of bytes"):
        parse_bytes("9" * 400, "DLOP_CACHE_BYTES")

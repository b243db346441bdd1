"""``dlop-inspect cache [DIR]``: what the node-local shard cache holds, for which
archive, how much; ``--clear`` removes what no process holds."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# The runtime (and with it torch) loads when a cache command runs, not when dlop-inspect
# starts: `dlop-inspect info` and `--help` stay instant.


def summary(root: Path) -> list[dict[str, Any]]:
    """One entry per archive folder: its id, source URL, cached shards and bytes."""
    from dlop.runtime.storage.cache import is_shard
    from dlop.runtime.storage.cache_folder import archive_dirs

    out = []
    for sub in archive_dirs(root):
        source = sub / "source.txt"
        shards = [p for p in sub.iterdir() if p.is_file() and is_shard(p.name)]
        out.append(
            {
                "archive": sub.name,
                "source": source.read_text().strip() if source.is_file() else None,
                "shards": len(shards),
                "bytes": sum(p.stat().st_size for p in shards),
            }
        )
    return out


def run(args: argparse.Namespace) -> int:
    from dlop.runtime.storage.cache import CacheDir
    from dlop.runtime.storage.cache_folder import (
        MARK,
        archive_dirs,
        default_cache_bytes,
        default_cache_dir,
        is_cache,
    )

    root = Path(args.dir) if args.dir else default_cache_dir()
    if root.is_dir() and any(root.iterdir()) and not is_cache(root) and not archive_dirs(root):
        print(f"{root}: not a dlop shard cache (no {MARK} mark); nothing here is dlop's")
        return 1
    if args.clear:
        if not root.is_dir():
            print(f"{root}: no cache here")
            return 0
        freed = CacheDir(root, max_bytes=default_cache_bytes()).clear()
        print(f"{root}: freed {freed} bytes (shards other processes hold were kept)")
        return 0
    entries = summary(root)
    if args.json:
        print(json.dumps({"dir": str(root), "archives": entries}, indent=1))
        return 0
    print(f"{root}: {len(entries)} archive(s), {sum(e['bytes'] for e in entries)} bytes")
    for e in entries:
        print(f"  {e['archive']}  {e['shards']:5d} shards  {e['bytes']:14d} bytes  {e['source']}")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "cache", help="the node-local shard cache: what it holds, or --clear"
    )
    p.add_argument(
        "dir", nargs="?", help="cache folder (default: DLOP_CACHE_DIR, else ~/.cache/dlop/shards)"
    )
    p.add_argument("--clear", action="store_true", help="remove every shard no process holds")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(run=run)
    return p

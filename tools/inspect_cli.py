"""dlop-inspect: what an archive holds, whether it is intact, and one sample as a picture.

ARCHIVE is a folder or a URL (``s3://bucket/prefix``, ``gs://...``, ``https://...``).
An archive at a URL is fetched into a temporary folder first, under the same byte
caps as a local one (index.json, errors.jsonl, and each shard at most the size
its index entry gives), and read there; messages name the URL.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from dlop.compiler.urls import parse_storage_options
from dlop.formats import (
    INDEX_NAME,
    ArchiveReader,
    DlopError,
    Field,
    codec_from_json,
    storage,
)
from dlop.formats.archive import read_index
from dlop.formats.constants import MAX_ERRORS_BYTES, MAX_INDEX_BYTES
from dlop.formats.generations import IDENTITY_BYTES, inputs_name
from dlop.formats.urls import is_url, local_path

from . import cache_cli
from .output import exit_now, redacted_output
from .render import as_float, render_sample

# Skipped inputs listed by ``info`` (--json lists more); errors.jsonl holds them all.
SHOWN_SKIPPED = 20
JSON_SKIPPED = 1000


def archive_summary(reader: ArchiveReader, max_skipped: int = JSON_SKIPPED) -> dict[str, Any]:
    """Everything ``info`` prints, as a JSON-ready dict; at most ``max_skipped`` skipped inputs
    are read from errors.jsonl, the rest only counted (from the index)."""
    per_field: dict[str, dict[str, Any]] = {}
    for name, f in reader.fields.items():
        stored = raw = 0
        lengths: list[np.ndarray] = []
        for k in range(reader.num_shards):
            shard = reader.shard(k)
            layout = shard.layout_of(name)
            stored += sum(r.length for r in layout.regions.values())
            raw += shard.value_bytes(name)
            if f.ragged:
                axes = [i for i, d in enumerate(f.shape) if d is None]
                lengths.append(shard.shapes(name)[:, axes])
        entry: dict[str, Any] = {
            "kind": f.kind,
            "dtype": f.dtype,
            "shape": list(f.shape),
            "codec": f.codec.to_json(),
            "stored_bytes": stored,
            "raw_bytes": raw,
            "compression_ratio": round(raw / stored, 3) if stored else None,
            "meaning": f.meaning,
            "units": f.units,
            "group": reader.owners.get(name),  # the field group holding it, None: the archive
        }
        if f.ragged:
            all_lengths = np.concatenate(lengths) if lengths else np.zeros((0, 1), np.int64)
            if len(all_lengths):
                entry["ragged_lengths"] = {
                    "min": all_lengths.min(axis=0).tolist(),
                    "mean": np.round(all_lengths.mean(axis=0), 2).tolist(),
                    "max": all_lengths.max(axis=0).tolist(),
                }
        per_field[name] = entry
    total_bytes = sum(s.bytes for s in reader.index.shards)
    errors = reader.errors(limit=max_skipped)
    recorded = sum(s.header_crc32 is not None for s in reader.index.shards)
    return {
        "path": str(reader.directory),
        "format_version": 1,
        "num_samples": reader.num_samples,
        "num_shards": reader.num_shards,
        "bytes": total_bytes,
        # raw shards whose header the index records stream from object storage piece by
        # verified piece; the others are served once whole (runtime.storage.streamed)
        "headers_in_index": recorded,
        "fields": per_field,
        "shards": [s.to_json() for s in reader.index.shards],
        "recipe": reader.index.recipe,
        "provenance": reader.index.provenance,
        "metadata": reader.index.metadata,
        "skipped": {
            "count": reader.index.skipped_count,
            "inputs": errors,
            "not_listed": reader.index.skipped_count - len(errors),
            "files": [name for name, count in reader.index.errors_files() if count],
        },
        # what each compile into the archive added (SPEC.md §6.2); [] for an index without them
        "generations": [
            {
                "shards": g.shards,
                "num_samples": g.num_samples,
                "inputs": g.inputs,
                "skipped": g.skipped,
                "created": g.created,
                # the listing file it listed (an append lists the lines after it only)
                "listing": None if g.listed is None else g.listed.to_json(),
            }
            for g in reader.index.generations
        ],
        # fields added after the compile (SPEC.md §6.3); a group covering fewer shards than
        # the archive holds (an append since) is listed, its fields not read
        "field_groups": [
            {
                "name": g.name,
                "revision": g.revision,
                "fields": [f.name for f in g.fields],
                "covers": g.covers,
                "bytes": sum(sh.info.bytes for sh in g.shards),
                "created": g.provenance.get("created", ""),
            }
            for g in reader.index.field_groups
        ],
    }


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def print_info(s: dict[str, Any]) -> None:
    print(f"archive   {s['path']}")
    print(f"samples   {s['num_samples']} in {s['num_shards']} shard(s), {_fmt_bytes(s['bytes'])}")
    coded = any(not codec_from_json(f["codec"]).mappable for f in s["fields"].values())
    print(f"remote    {remote_reading(s['headers_in_index'], s['num_shards'], coded)}")
    print("fields")
    rows = [["name", "kind", "dtype", "shape", "codec", "stored", "ratio", "ragged min/mean/max"]]
    for name, f in s["fields"].items():
        codec = codec_from_json(f["codec"]).describe()
        shape = "[" + ", ".join("*" if d is None else str(d) for d in f["shape"]) + "]"
        rl = f.get("ragged_lengths")
        ragged = (
            ""
            if not rl
            else " ".join(
                f"{a}/{b}/{c}" for a, b, c in zip(rl["min"], rl["mean"], rl["max"], strict=True)
            )
        )
        ratio = "" if f["compression_ratio"] is None else f"{f['compression_ratio']:.2f}x"
        rows.append(
            [
                name,
                f["kind"],
                f["dtype"],
                shape,
                codec,
                _fmt_bytes(f["stored_bytes"]),
                ratio,
                ragged,
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    for section in ("recipe", "provenance", "metadata"):
        if s[section]:
            text = json.dumps(s[section], indent=2, sort_keys=True)
            if len(text) > 4000:
                text = text[:4000] + "\n  ... (truncated; use --json for all)"
            print(f"{section}\n  " + text.replace("\n", "\n  "))
    if len(s["generations"]) > 1:
        print(f"generations {len(s['generations'])} (the first compile, then each --append)")
        for g, gen in enumerate(s["generations"]):
            print(
                f"  {g}  {gen['created'] or '-'}  {gen['inputs']} input(s): "
                f"{gen['num_samples']} samples in {gen['shards']} shard(s), "
                f"{gen['skipped']} skipped"
                + (
                    f"; its listing file: {gen['listing']['inputs']} input(s) in "
                    f"{gen['listing']['bytes']} bytes"
                    if gen["listing"]
                    else ""
                )
            )
    if s["field_groups"]:
        print(f"field groups {len(s['field_groups'])} (added with add_fields)")
        for g in s["field_groups"]:
            covers = (
                "every shard"
                if g["covers"] == s["num_shards"]
                else f"{g['covers']} of {s['num_shards']} shards, not read: add_fields again "
                "for the shards appended since"
            )
            print(
                f"  {g['name']}  revision {g['revision']}  {g['created'] or '-'}  fields "
                f"{', '.join(g['fields'])}: {covers}, {_fmt_bytes(g['bytes'])}"
            )
    skipped = s["skipped"]
    files = ", ".join(skipped["files"])
    print(f"skipped   {skipped['count']} input(s)" + (f" ({files}):" if skipped["count"] else ""))
    shown = skipped["inputs"][:SHOWN_SKIPPED]
    for e in shown:
        print(f"  {e.get('path')}: {e.get('reason')}")
    if skipped["count"] > len(shown):
        print(f"  ... and {skipped['count'] - len(shown)} more in {files}")


def remote_reading(recorded: int, shards: int, coded: bool) -> str:
    """How the archive is read from object storage: by the shard headers its index
    records, and whether block-coded fields make every shard come whole."""
    if coded:
        return "shards served once whole and verified, then decoded into the cache (zstd)"
    if recorded == shards:
        return "raw shards stream piece by verified piece (every shard's header in index.json)"
    whole = "served once whole and verified: index.json was written before it recorded"
    if recorded == 0:
        return f"shards {whole} shard headers; recompile to stream the first epoch"
    return f"{shards - recorded} of {shards} shards {whole} their headers"


def describe_value(name: str, value: Any, f: Field) -> str:
    if isinstance(value, str):
        shown = value if len(value) <= 300 else value[:300] + "..."
        return f"{name}: str[{len(value)}] {shown!r}"
    if isinstance(value, bytes):
        return f"{name}: bytes[{len(value)}] {value[:32].hex()}{'...' if len(value) > 32 else ''}"
    arr = as_float(value, f)
    head = f"{name}: {f.dtype} {list(value.shape)}"
    if arr.size == 0:
        return head + " (empty)"
    if arr.size == 1:
        return head + f" = {arr.reshape(-1)[0].item()!r}"
    a = arr.astype(np.float64)
    finite = np.isfinite(a)
    stats = (
        f" min {a[finite].min():.6g} max {a[finite].max():.6g} mean {a[finite].mean():.6g}"
        if finite.any()
        else ""
    )
    if not finite.all():
        stats += f" ({int((~finite).sum())} non-finite)"
    return head + stats


# -- archives at URLs -------------------------------------------------------------------------


FETCH_CHUNK = 8 << 20  # what one fetch holds in memory at a time


def _fetch_into(
    store: storage.Storage, name: str, folder: Path, cap: int, *, exact: bool = False
) -> None:
    """OUT/name into folder/name, copied in chunks through the storage's retrying
    download, at most ``cap`` bytes. A shard (``exact``) is fetched up to one byte more
    than its index entry says, so that a longer object fails verification rather than
    filling memory or disk; a larger index or errors.jsonl is an error."""
    where = store.name_url(name)
    try:
        copied = store.download(name, folder / name, cap + 1, chunk=FETCH_CHUNK)
    except storage.FetchError as e:
        (folder / name).unlink(missing_ok=True)
        if isinstance(e.cause, FileNotFoundError):
            return  # the reader reports the missing file where it needs it
        raise
    if copied > cap and not exact:
        raise DlopError(
            f"{where}: larger than its {cap}-byte cap (SPEC.md §8); not a dlop archive's {name}"
        )


def fetch_archive(
    url: str, folder: Path, options: dict[str, Any], shards: Collection[int] | None = None
) -> None:
    """The archive at ``url`` into ``folder``: index.json (validated before anything else is
    fetched), errors.jsonl and the shards numbered in ``shards`` (all when None)."""
    store = storage.open_storage(url.rstrip("/"), options)
    _fetch_into(store, INDEX_NAME, folder, MAX_INDEX_BYTES)
    if not (folder / INDEX_NAME).exists():
        raise DlopError(
            f"{url.rstrip('/')}/{INDEX_NAME}: not found (its bucket or folder may not exist "
            "either): no dlop archive there, or its compile did not finish"
        )
    index = read_index(folder)  # the format's bounds, before any name in it is used
    for name, count in index.errors_files():
        if count:
            _fetch_into(store, name, folder, MAX_ERRORS_BYTES)
    for g, generation in enumerate(index.generations):
        _fetch_into(store, inputs_name(g), folder, generation.inputs * IDENTITY_BYTES)
    wanted = [s for k, s in enumerate(index.shards) if shards is None or k in shards]
    wanted += [  # each field group's shards beside them
        sh.info
        for g in index.field_groups
        for k, sh in enumerate(g.shards)
        if shards is None or k in shards
    ]
    with ThreadPoolExecutor(min(8, len(wanted)) or 1) as pool:
        for _ in pool.map(
            lambda s: _fetch_into(store, s.file, folder, s.bytes, exact=True), wanted
        ):
            pass


@contextlib.contextmanager
def open_reader(
    path: str, pairs: list[str] | None, shards: Collection[int] | None = None
) -> Iterator[ArchiveReader]:
    """An ArchiveReader of a folder, or of a URL's archive fetched into a temporary folder."""
    if not is_url(path):
        with ArchiveReader(local_path(path)) as reader:
            yield reader
        return
    with tempfile.TemporaryDirectory(prefix="dlop-inspect-") as tmp:
        fetch_archive(path, Path(tmp), parse_storage_options(pairs), shards)
        with ArchiveReader(tmp) as reader:
            yield reader


def _named(text: str, reader: ArchiveReader, path: str) -> str:
    """A message about a fetched archive's file, naming its URL rather than the temporary copy."""
    return text.replace(str(reader.directory), path.rstrip("/")) if is_url(path) else text


def _sample_shard(path: str, pairs: list[str] | None, index: int) -> set[int] | None:
    """The one shard ``show`` needs of a URL's archive (None: all of a local one)."""
    if not is_url(path):
        return None
    with tempfile.TemporaryDirectory(prefix="dlop-inspect-") as tmp:
        fetch_archive(path, Path(tmp), parse_storage_options(pairs), shards=())
        shards = read_index(tmp).shards
    total = sum(s.num_samples for s in shards)
    if not -total <= index < total:
        return set()
    index %= total
    for k, s in enumerate(shards):
        if index < s.num_samples:
            return {k}
        index -= s.num_samples
    return set()


def cmd_info(args: argparse.Namespace) -> int:
    with open_reader(args.path, args.storage_option) as reader:
        summary = archive_summary(reader, JSON_SKIPPED if args.json else SHOWN_SKIPPED)
        summary["path"] = _named(summary["path"], reader, args.path)
        if args.where:
            summary["where"] = _where_counts(reader, args.where)
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        print()
    else:
        print_info(summary)
        if args.where:
            _print_where(args.where, summary["where"])
    return 0


def _where_counts(reader: ArchiveReader, terms: list[str]) -> dict[str, Any]:
    """What ``--where FIELD=V,...`` keeps: the counts a Loader(where=...) would read."""
    from dlop.runtime.archive.opening import count_selected
    from dlop.runtime.archive.selection import parse_where

    counts = count_selected(str(reader.directory), parse_where(reader.fields, terms))
    # JSON object keys are strings; values keep their order of first appearance.
    counts["values"] = {
        name: {str(v): c for v, c in found.items()} for name, found in counts["values"].items()
    }
    return counts


def _print_where(terms: list[str], counts: dict[str, Any]) -> None:
    print(f"where {' '.join(terms)}: {counts['selected']} of {counts['samples']} samples")
    for name, found in counts["values"].items():
        print(f"  {name}: " + ", ".join(f"{v}: {c}" for v, c in found.items()))


def cmd_verify(args: argparse.Namespace) -> int:
    if args.cache is not None:
        if args.path is not None:
            raise DlopError("verify takes an archive or --cache DIR, not both")
        return _verify_cache(args)
    if args.path is None:
        raise DlopError("verify needs an archive (folder or URL), or --cache DIR")
    with open_reader(args.path, args.storage_option) as reader:
        return _verify(args, reader)


def _verify_cache(args: argparse.Namespace) -> int:
    """Every shard of a node's shard cache read and checked (CacheDir.verify)."""
    from dlop.runtime.storage.cache import CacheDir
    from dlop.runtime.storage.cache_folder import MARK, default_cache_bytes, is_cache

    root = Path(args.cache)
    if not root.is_dir() or not is_cache(root):
        raise DlopError(f"{root}: not a dlop shard cache (no {MARK} mark)")

    def progress(done: int) -> None:
        if not args.quiet:
            print(f"\rverified {done} cached shards", end="", file=sys.stderr, flush=True)

    checked, problems = CacheDir(root, max_bytes=default_cache_bytes()).verify(progress)
    if not args.quiet and checked:
        print(file=sys.stderr)
    for p in problems:
        print(f"FAIL {p}")
    if problems:
        print(f"{len(problems)} problem(s) in the cache {root}")
        return 1
    print(f"OK {root}: {checked} cached shard(s), every byte as verified when cached")
    return 0


def _verify(args: argparse.Namespace, reader: ArchiveReader) -> int:
    total = reader.num_shards

    def progress(done: int) -> None:
        if not args.quiet:
            print(f"\rverified {done}/{total} shards", end="", file=sys.stderr, flush=True)

    # Shards are checked in parallel: CRCs of page-cached files run near memory speed per core.
    with ThreadPoolExecutor(min(total, os.cpu_count() or 1) or 1) as pool:
        problems = reader.verify(progress=progress, map_shards=pool.map)
    if not args.quiet and total:
        print(file=sys.stderr)
    for p in problems:
        print(_named(f"FAIL {p}", reader, args.path))
    if problems:
        print(f"{len(problems)} problem(s) in {args.path}")
        return 1
    size = sum(s.bytes for s in reader.index.shards)
    print(
        f"OK {args.path}: {total} shard(s), {reader.num_samples} samples, {_fmt_bytes(size)}: every checksum and offset verified"
    )
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    shards = _sample_shard(args.path, args.storage_option, args.index)
    with open_reader(args.path, args.storage_option, shards) as reader:
        return _show(args, reader)


def _show(args: argparse.Namespace, reader: ArchiveReader) -> int:
    if not -len(reader) <= args.index < len(reader):
        raise DlopError(
            f"{args.path}: sample {args.index} out of range (archive has {len(reader)})"
        )
    index = args.index % len(reader)
    sample = reader.sample(index)
    print(f"sample {index} of {len(reader)} in {args.path}")
    for name, value in sample.items():
        print("  " + describe_value(name, value, reader.fields[name]))
    if args.png:
        title = f"sample {index}"
        for key in ("key", "category", "text"):
            if isinstance(text := sample.get(key), str):
                title += f" · {text[:80]}"
        drawn = render_sample(
            sample,
            reader.fields,
            args.png,
            title=title,
            recipe=reader.index.recipe,
            metadata=reader.index.metadata,
        )
        print(f"wrote {args.png} ({', '.join(drawn)})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dlop-inspect", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    info = sub.add_parser(
        "info", help="shards, samples, fields, compression, recipe, provenance, skipped inputs"
    )
    info.add_argument("path", help="archive folder or URL (s3://, gs://, https://)")
    info.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="fsspec option for a URL (endpoint_url=..., anon=true); repeatable",
    )
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    info.add_argument(
        "--where",
        nargs="+",
        default=[],
        metavar="FIELD=V[,V...]",
        help="also count the samples these values select, as Loader(where=...) would "
        "(e.g. fold=1,2,3,4 category=dog); several fields must all match",
    )
    info.set_defaults(run=cmd_info)
    verify = sub.add_parser("verify", help="check every checksum and offset; exit 1 on any failure")
    verify.add_argument("path", nargs="?", help="archive folder or URL (s3://, gs://, https://)")
    verify.add_argument(
        "--cache",
        metavar="DIR",
        help="check a node's shard cache instead: every cached shard against the CRC "
        "recorded when it was verified",
    )
    verify.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="fsspec option for a URL (endpoint_url=..., anon=true); repeatable",
    )
    verify.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    verify.set_defaults(run=cmd_verify)
    show = sub.add_parser("show", help="one sample's fields, optionally drawn to a PNG")
    show.add_argument("path", help="archive folder or URL (s3://, gs://, https://)")
    show.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="fsspec option for a URL (endpoint_url=..., anon=true); repeatable",
    )
    show.add_argument("index", type=int)
    show.add_argument(
        "--png", type=Path, help="draw the sample (spectrogram, frame grid, image + masks)"
    )
    show.set_defaults(run=cmd_show)
    cache_cli.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    with redacted_output("dlop-inspect"):
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except BrokenPipeError:  # output piped into head and the like
        return 0
    except (DlopError, ValueError, OSError) as e:
        # An archive that cannot even be opened has failed verification too: exit 1.
        print(f"dlop-inspect: error: {e}", file=sys.stderr)
        return 1


def run() -> NoReturn:
    """The ``dlop-inspect`` command: main, then the process ends at once (exit_now)."""
    exit_now(main())


if __name__ == "__main__":
    run()

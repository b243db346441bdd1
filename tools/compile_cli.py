"""dlop-compile: decode and featurize a corpus once into a dlop archive.

dlop-compile SOURCE -o OUT [options]
dlop-compile --recipe FILE.toml -o OUT [options]
dlop-compile --demo OUT
dlop-compile --dataset MODULE:FACTORY [--dataset-args JSON] -o OUT [options]
dlop-compile --map MODULE:FN --inputs INPUTS -o OUT [options]

MODULE is a module on PYTHONPATH (pkg.module) or a .py file's path.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any, NoReturn

from dlop.compiler.audio import options as feature_options
from dlop.compiler.errors import CompileError, CompileWarning
from dlop.compiler.recipe import (
    CHOICES,
    FEATURE_OPTIONS,
    RECIPE_OPTIONS,
    VISION_OPTIONS,
    build_recipe,
    load_recipe_file,
)
from dlop.compiler.urls import parse_storage_options
from dlop.compiler.vision import options as vision
from dlop.formats import DlopError
from dlop.formats.generations import errors_name
from dlop.formats.urls import local_path
from dlop.tools.output import exit_now, redacted_output


def _none_or_float(text: str) -> float | None:
    return None if text.lower() in ("none", "off") else float(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dlop-compile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "source", nargs="?", help="corpus folder, manifest .jsonl, or .tar shard(s) / brace pattern"
    )
    p.add_argument(
        "-o", "--out", help="archive directory to create, or a URL prefix (s3://bucket/archive)"
    )
    p.add_argument(
        "--recipe", type=Path, help="TOML or JSON recipe, or an archive whose recipe to repeat"
    )
    p.add_argument(
        "--demo", type=Path, metavar="OUT", help="generate the demo corpus under OUT and compile it"
    )
    _custom_options(p.add_argument_group("your own Dataset or function (docs/custom.md)"))
    _corpus_options(p.add_argument_group("corpus"))
    _vision_options(p.add_argument_group("video and images"))
    _feature_options(p.add_argument_group("features"))
    _output_options(p.add_argument_group("output"))
    p.epilog = textwrap.fill(
        'Options only a recipe file sets (--recipe FILE.toml; docs/compile.md, "Recipe '
        f'files"): {", ".join(recipe_only(p))}.',
        width=78,
    )
    return p


def recipe_only(parser: argparse.ArgumentParser) -> list[str]:
    """The recipe options no command-line flag sets."""
    flags = {a.dest for a in parser._actions}
    every = {*RECIPE_OPTIONS, *FEATURE_OPTIONS, *VISION_OPTIONS} - {"feature_codec", "vision"}
    return sorted(every - flags)


def _custom_options(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--dataset",
        metavar="MODULE:FACTORY",
        help="compile ds[i] for i in range(len(ds)), ds = FACTORY(*ARGS or **ARGS)",
    )
    g.add_argument("--dataset-args", metavar="JSON", help="FACTORY's arguments: a list or object")
    g.add_argument("--map", metavar="MODULE:FN", help="compile FN(x) for each input x")
    g.add_argument(
        "--inputs",
        help="--map's inputs: a .jsonl file (one JSON value a line), or a folder or URL "
        "prefix whose files (as path strings) are the inputs",
    )
    g.add_argument("--schema", type=Path, help="JSON: field -> dtype or {dtype, shape}")
    g.add_argument("--seed", type=int, help="seeds random, numpy and torch per item (default 0)")
    g.add_argument("--compression", help="the same as --codec")
    g.add_argument(
        "--item-timeout",
        type=float,
        metavar="SECONDS",
        help="an item running longer (with --workers 2 or more, or --dask) has its worker "
        "killed and is recorded as bad (default: no limit)",
    )


_CUSTOM = {"dataset", "dataset_args", "map", "inputs", "schema", "seed", "compression"}
_CUSTOM |= {"item_timeout"}
# what a --dataset or --map compile takes besides its own options
_CUSTOM_TOO = {"out", "codec", "shard_bytes", "workers", "unit_inputs", "dask", "on_error"}
_CUSTOM_TOO |= {"resume", "overwrite", "append", "quiet", "storage_option", "dtype"}


def _corpus_options(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--layout", choices=CHOICES["layout"], help="default: detected from SOURCE")
    g.add_argument(
        "--duration", type=float, help="crop or zero-pad every clip to SECONDS (0: native lengths)"
    )
    g.add_argument(
        "--downmix", choices=CHOICES["downmix"], help="how channels become one (default mean)"
    )
    g.add_argument("--media", choices=CHOICES["media"], help="default: told by layout and files")
    g.add_argument(
        "--text-column", help="hf: the transcript column (default: text, sentence, transcription)"
    )
    g.add_argument(
        "--label-column", help="hf: the class column (default: label, or the first ClassLabel)"
    )
    g.add_argument("--keep-columns", help="hf: scalar columns carried as fields, e.g. speaker,age")
    g.add_argument(
        "--allow-path",
        dest="allow_paths",
        action="append",
        metavar="DIR",
        help="a folder or URL prefix outside SOURCE that the corpus's own paths (manifest "
        "lines, table cells) may name; repeatable (default: only inside SOURCE)",
    )


def _vision_options(v: argparse._ArgumentGroup) -> None:
    v.add_argument("--size", type=int, help="resize so the short side is N pixels (antialiased)")
    v.add_argument("--crop", help="centre crop N or HxW after --size (default: keep all)")
    v.add_argument(
        "--clip",
        choices=vision.CLIP_MODES,
        help="uniform: one clip of segment centres over the video (default); dense: consecutive frames",
    )
    v.add_argument("--clip-frames", type=int, help="frames per clip (default 16)")
    v.add_argument(
        "--clip-fps", type=float, help="dense: the rate the stride counts in (default: the video's)"
    )
    v.add_argument(
        "--clip-stride", type=int, help="dense: every Nth frame at --clip-fps (default 1)"
    )
    v.add_argument("--clips", type=int, help="dense: clips per video, spread evenly (default 1)")
    _switch(v, "--audio", "video: store the audio track's features beside the frames")
    v.add_argument("--images", help="segmentation: the images folder (default: detected)")
    v.add_argument("--masks", nargs="+", help="segmentation: mask folders (default: detected)")
    v.add_argument(
        "--tile", help="cut images into N or HxW patches (edges that do not fill one are dropped)"
    )
    v.add_argument(
        "--mask-fill", type=int, help="value of an annotator's missing mask (default 255)"
    )
    v.add_argument(
        "--missing-mask",
        choices=vision.MISSING_MASK_RULES,
        help="an image lacking some annotator's mask: store it filled (default) or skip the image",
    )
    v.add_argument("--mask-remap", help="mask label table, e.g. 0:0,1:1,3:2,4:3,5:4,6:5")
    _switch(v, "--consensus", "add a per-pixel majority-vote mask")
    v.add_argument(
        "--max-image-pixels",
        type=int,
        help="images or masks with more pixels are bad inputs (default 150000000)",
    )


# Feature flags without choices: (flag, type, help). A flag left out keeps the preset's value.
_FEATURE_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("--sample-rate", int, "Hz every input is resampled to (default: the preset's)"),
    ("--n-fft", int, "FFT size in samples (default: the preset's)"),
    ("--hop-length", int, "samples between frames (default: the preset's)"),
    ("--win-length", int, "window length in samples (default: n-fft)"),
    ("--n-mels", int, "mel bands (default: the preset's)"),
    ("--n-mfcc", int, "cepstral coefficients, with --features mfcc (default 20)"),
    ("--f-min", float, "lowest filterbank frequency in Hz (default: the preset's)"),
    ("--f-max", float, "highest filterbank frequency in Hz (default: Nyquist)"),
    ("--input-scale", float, "multiply the waveform by this before featurizing (default 1)"),
)


def _switch(g: argparse._ArgumentGroup, flag: str, text: str) -> None:
    """``--flag``/``--no-flag``; neither leaves the recipe's (or the default's) value."""
    g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)


def _feature_options(f: argparse._ArgumentGroup) -> None:
    f.add_argument(
        "--features",
        choices=feature_options.CHOICES["features"],
        help="what is stored (default: the preset's; waveform stores the resampled audio)",
    )
    f.add_argument(
        "--preset", choices=CHOICES["preset"], help="feature convention (default librosa)"
    )
    for flag, typ, text in _FEATURE_FLAGS:
        f.add_argument(flag, type=typ, help=text)
    f.add_argument("--top-db", type=_none_or_float, help="per-clip dynamic range in dB, or none")
    f.add_argument("--mel-scale", choices=feature_options.CHOICES["mel_scale"], help="mel formula")
    f.add_argument(
        "--norm", choices=feature_options.CHOICES["norm"], help="mel filter normalization"
    )
    _switch(f, "--center", "pad so frames are centred on their time (default: the preset's)")
    f.add_argument(
        "--pad-mode", choices=feature_options.CHOICES["pad_mode"], help="how --center pads the ends"
    )
    f.add_argument(
        "--fft-dtype",
        choices=feature_options.CHOICES["fft_dtype"],
        help="FFT precision: float32 (default) as the references compute, float64 exact in deep bands",
    )
    f.add_argument("--dtype", choices=CHOICES["dtype"], help="stored dtype (default float16)")


def _output_options(o: argparse._ArgumentGroup) -> None:
    o.add_argument("--codec", help="raw (default), zstd, zstd:LEVEL")
    o.add_argument(
        "--shard-bytes",
        help="target shard size: bytes, or with KB/MB/GB or KiB/MiB/GiB (default 256MiB)",
    )
    o.add_argument("--workers", type=int, help="worker processes (default: all cores)")
    o.add_argument(
        "--unit-inputs",
        type=int,
        help="inputs per work unit (default by media: 8192 audio, 256 video or images; "
        "see docs/compile.md)",
    )
    o.add_argument(
        "--dask",
        metavar="ADDRESS",
        help="run the units on Dask: a scheduler (tcp://host:8786) or local:N worker processes",
    )
    o.add_argument(
        "--on-error",
        choices=CHOICES["on_error"],
        help="bad inputs: record and go on (default), or stop",
    )
    o.add_argument("--resume", action="store_true", help="finish an interrupted compile in OUT")
    o.add_argument(
        "--append",
        action="store_true",
        help="add the inputs of SOURCE that the archive in OUT does not hold yet, as new "
        "shards; its files are not rewritten (same recipe or refused)",
    )
    o.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the dlop archive (or interrupted compile) in OUT; nothing else is deleted",
    )
    o.add_argument(
        "-q", "--quiet", action="store_true", help="no progress (the summary line is kept)"
    )
    o.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="fsspec option for URL SOURCE and OUT (endpoint_url=..., anon=true); repeatable; "
        "credentials otherwise come from the environment",
    )


_NOT_RECIPE = {"out", "recipe", "demo", "resume", "overwrite", "quiet", "unit_inputs", "dask"}
_NOT_RECIPE.add("append")
_NOT_RECIPE |= _CUSTOM
_NOT_RECIPE.add("storage_option")  # credentials and endpoints never go into the archive


def demo_progress(done: int, total: int) -> None:
    """A line every 100 clips while the demo corpus is generated (it takes a few seconds)."""
    if done % 100 == 0 or done == total:
        print(f"  {done}/{total} clips written", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    with redacted_output("dlop-compile"):
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always", CompileWarning)  # the tool's own: always a line
            warnings.showwarning = _warning_line
            return _run(parser, args)
    except KeyboardInterrupt:
        return 130
    except (DlopError, OSError) as e:
        print(f"dlop-compile: error: {e}", file=sys.stderr)
        return 1


def _warning_line(message: Warning | str, *args: Any, **kwargs: Any) -> None:
    """A warning as one line of the tool's own (not Python's file:line form)."""
    print(f"dlop-compile: warning: {message}", file=sys.stderr, flush=True)


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.dataset or args.map:
        return _run_custom(parser, args)
    stray = [k for k in sorted(_CUSTOM) if getattr(args, k) is not None]
    if stray:
        parser.error(f"--{stray[0].replace('_', '-')} goes with --dataset or --map")
    options: dict[str, Any] = {}
    if args.recipe:
        options.update(load_recipe_file(args.recipe))
    # OUT stays text: a URL (s3://b/x) goes to the object store; Path would make it s3:/b/x
    out: str | None = None if args.out is None else local_path(args.out)
    if args.demo:
        from dlop.compiler.demo import DEMO_RECIPE, make_demo_corpus

        corpus = args.demo / "corpus"
        if not (corpus / "meta" / "esc50.csv").exists():
            print(f"generating demo corpus in {corpus}", file=sys.stderr)
            make_demo_corpus(corpus, on_clip=None if args.quiet else demo_progress)
        options.update(DEMO_RECIPE, source=str(corpus))
        out = out or str(args.demo / "archive")
    given = {k: v for k, v in vars(args).items() if v is not None and k not in _NOT_RECIPE}
    options.update(given)
    if "source" not in options:
        parser.error("give SOURCE, --recipe or --demo")
    if out is None:
        parser.error("give -o OUT")
    workers = options.pop("workers", None)
    storage_options = parse_storage_options(args.storage_option)
    recipe = build_recipe(options, storage_options)
    if not args.quiet:
        print(f"compiling {recipe.source}: {recipe.choices()}", file=sys.stderr, flush=True)
    from dlop.compiler.run.processes import start_fork_server

    # Where workers will come from a fork server, it imports while this process does.
    start_fork_server(recipe.source, workers, args.dask)
    # torch and the media libraries load here, not at start-up: --help stays instant
    from dlop.compiler import compile_corpus

    before = _generations(out, args.append and not args.resume, storage_options)
    started = time.perf_counter()
    index = compile_corpus(
        recipe,
        out,
        workers=workers,
        resume=args.resume,
        overwrite=args.overwrite or bool(args.demo),
        progress=not args.quiet,
        storage_options=storage_options,
        unit_inputs=args.unit_inputs,
        dask=args.dask,
        append=args.append,
    )
    _summary(out, index, time.perf_counter() - started, recipe.choices(), before)
    return 0


def _generations(out: str, append: bool, storage_options: dict[str, Any] | None) -> int:
    """How many generations the archive in OUT holds before an --append (0: none read)."""
    if not append:
        return 0
    from dlop.compiler.output.store import open_store
    from dlop.formats import FormatError, parse_index

    try:
        data = open_store(out, storage_options).read("index.json")
        return 0 if data is None else len(parse_index(out, data).generations)
    except (DlopError, OSError, FormatError):
        return 0  # the compile itself names what is wrong


def _summary(out: str, index: Any, took: float, what: str, before: int = 0) -> None:
    """The command's last line: what the archive holds (for an --append, what it added,
    or that it added nothing: ``before`` generations were there before it ran)."""
    grew = None if not before else len(index.generations) > before
    size = sum(s.bytes for s in index.shards)
    inputs = index.units.num_inputs if index.units is not None else index.num_samples
    if grew is False:  # an --append that found every input in the archive
        print(
            f"{out}: nothing appended; {index.num_samples} samples in {len(index.shards)} "
            f"shard(s), {len(index.generations)} generation(s)"
        )
        return
    if len(index.generations) > 1:
        last = index.generations[-1]
        print(
            f"{out}: {index.num_samples} samples in {len(index.shards)} shard(s), "
            f"{size / 2**20:.1f} MiB, {len(index.generations)} generations; the last added "
            f"{last.num_samples} samples of {last.inputs} inputs, {last.skipped} skipped"
            f"{' (see ' + errors_name(len(index.generations) - 1) + ')' if last.skipped else ''}; "
            f"{took:.1f} s; {what}"
        )
        return
    print(
        f"wrote {out}: {index.num_samples} samples in {len(index.shards)} shard(s), {size / 2**20:.1f} MiB, "
        f"{index.skipped_count} skipped{' (see errors.jsonl)' if index.skipped_count else ''}; "
        f"{took:.1f} s, {inputs / max(took, 1e-9):.0f} inputs/s; {what}"
    )


def _run_custom(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """--dataset or --map: a user's own code compiled (dlop.compiler.custom)."""
    import json

    if args.dataset and args.map:
        parser.error("give --dataset or --map, not both")
    extra = [
        k
        for k, v in vars(args).items()
        if v not in (None, False) and k not in _CUSTOM | _CUSTOM_TOO
    ]
    if extra:
        flag = "SOURCE" if extra[0] == "source" else "--" + extra[0].replace("_", "-")
        parser.error(f"{flag} does not apply to --dataset or --map (a preset option)")
    if args.out is None:
        parser.error("give -o OUT")
    if args.map and args.inputs is None:
        parser.error("--map needs --inputs")
    if args.dataset and args.inputs is not None:
        parser.error("--inputs goes with --map; a --dataset's inputs are its indices")
    if args.map and args.dataset_args is not None:
        parser.error("--dataset-args goes with --dataset")
    if args.codec and args.compression and args.codec != args.compression:
        parser.error("--codec and --compression are the same option; give one")
    from dlop.compiler.custom.loading import load_target, parse_arguments

    schema = None
    if args.schema is not None:
        try:
            schema = json.loads(args.schema.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise CompileError(f"--schema {args.schema}: {e}") from None
    arguments = parse_arguments(args.dataset_args)
    target = load_target(args.dataset or args.map, arguments, made=bool(args.dataset))
    out = local_path(args.out)
    options: dict[str, Any] = {
        "workers": args.workers,
        "dask": args.dask,
        "resume": args.resume,
        "overwrite": args.overwrite,
        "append": args.append,
        "on_error": args.on_error or "skip",
        "shard_bytes": args.shard_bytes or (256 << 20),
        "compression": args.compression or args.codec or "raw",
        "unit_inputs": args.unit_inputs,
        "schema": schema,
        "seed": 0 if args.seed is None else args.seed,
        "dtype": args.dtype,
        "progress": not args.quiet,
        "storage_options": parse_storage_options(args.storage_option),
        "arguments": arguments,
        "item_timeout": args.item_timeout,
    }
    from dlop.compiler.custom import compile_dataset, compile_map

    what = f"{'--dataset' if args.dataset else '--map'} {args.dataset or args.map}"
    if not args.quiet:
        print(f"compiling {what}", file=sys.stderr, flush=True)
    before = _generations(out, args.append and not args.resume, options["storage_options"])
    started = time.perf_counter()
    if args.dataset:
        index = compile_dataset(target, out, **options)
    else:
        index = compile_map(target, args.inputs, out, **options)
    _summary(out, index, time.perf_counter() - started, what, before)
    return 0


def run() -> NoReturn:
    """The ``dlop-compile`` command: main, then the process ends at once (exit_now)."""
    exit_now(main())


if __name__ == "__main__":
    run()

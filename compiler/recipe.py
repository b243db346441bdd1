"""The compile recipe: every option explicit, loadable from TOML/JSON, stored in the index."""

from __future__ import annotations

import hashlib
import json
import math
import os
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from dlop.formats import INDEX_NAME, Codec, FormatError, SchemaError, parse_codec, sizes
from dlop.formats.constants import ARCHIVE_FORMAT, MAX_INDEX_BYTES
from dlop.formats.files import loads_bounded, read_capped
from dlop.formats.redact import redact
from dlop.formats.urls import is_url

from .audio.decode import DOWNMIX_POLICIES
from .audio.options import (
    FEATURES,
    PRESETS,
    FeatureConfig,
    ResampleConfig,
    feature_config,
    with_options,
)
from .corpus.layouts import detect_layout, layout_media, names
from .corpus.listing import MEDIA
from .corpus.place import source_place
from .errors import CompileError
from .vision.options import VisionConfig

LAYOUTS = names()  # the built-in layouts, in detection order
DTYPES = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}
FEATURE_OPTIONS = {f.name for f in fields(FeatureConfig)} - {"preset", "features"}
VISION_OPTIONS = {f.name for f in fields(VisionConfig)}


def parse_size(text: str | int) -> int:
    """``1000``, ``256MiB``, ``1.5GB`` -> bytes (dlop.formats.sizes)."""
    try:
        return sizes.parse_size(text)
    except ValueError as e:
        raise CompileError(f"size {e}") from None


@dataclass(frozen=True)
class Recipe:
    source: str
    layout: str | None
    feature: FeatureConfig
    dtype: str = "float16"
    duration: float | None = None  # seconds: crop or zero-pad; None keeps native lengths (ragged)
    downmix: str = "mean"
    codec: str = "raw"
    shard_bytes: int = 256 << 20
    on_error: str = "skip"
    resampler: ResampleConfig = field(default_factory=ResampleConfig)
    media: str = "audio"
    vision: VisionConfig = field(default_factory=VisionConfig)
    images: str | None = None  # segmentation: the images folder (default: detected)
    masks: tuple[str, ...] | None = None  # segmentation: mask folders (default: detected)
    text_column: str | None = None  # hf: the transcript column (default: detected)
    label_column: str | None = None  # hf: the class column (default: detected)
    keep_columns: tuple[str, ...] = ()  # hf: scalar columns carried as fields
    # folders and URL prefixes outside SOURCE that the corpus's own paths may name
    allow_paths: tuple[str, ...] = ()
    # What the compile chose because the user did not ("layout": detected, "sample_rate":
    # the preset's), for its messages; not an option (never stored, never compared).
    guessed: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.media not in MEDIA:
            raise CompileError(f"media {self.media!r} must be one of {MEDIA}")
        if self.dtype not in DTYPES:
            raise CompileError(f"dtype {self.dtype!r} must be one of {sorted(DTYPES)}")
        if self.on_error not in ON_ERROR_POLICIES:
            raise CompileError(f"on_error {self.on_error!r} must be one of {ON_ERROR_POLICIES}")
        if self.downmix not in DOWNMIX_POLICIES:
            raise CompileError(f"downmix {self.downmix!r} must be one of {DOWNMIX_POLICIES}")
        if self.layout is not None and self.layout not in LAYOUTS:
            raise CompileError(f"layout {self.layout!r} must be one of {LAYOUTS}")
        given = [name for name, value in self.columns().items() if value]
        if given and self.layout != "hf":
            raise CompileError(
                f"{', '.join(given)} choose columns of a table corpus (layout hf), not of "
                f"layout {self.layout}; drop them or pass --layout hf"
            )
        if self.duration is not None and self.duration <= 0:
            raise CompileError(f"duration {self.duration} must be positive seconds")
        self.feature_codec()  # validates

    def choices(self) -> str:
        """What is compiled, in words: the layout (and whether it was detected), the media,
        and for audio the features and their sample rate (and whether it is the preset's)."""
        parts = [f"layout {self.layout}" + (" (detected)" if "layout" in self.guessed else "")]
        parts.append(self.media)
        if self.media == "audio":
            rate = f"{self.feature.sample_rate} Hz"
            if "sample_rate" in self.guessed:
                rate += f" (the {self.feature.preset} preset's; --sample-rate to choose)"
            parts.append(f"{self.feature.features} at {rate}")
        return ", ".join(parts)

    @property
    def feature_name(self) -> str:
        return self.feature.features

    def feature_codec(self) -> Codec:
        """The feature field's codec; zstd byte-shuffles multi-byte values (smaller and faster to decode)."""
        try:
            codec = parse_codec(self.codec)
        except SchemaError as e:
            raise CompileError(str(e)) from None
        return codec.shuffled()

    def to_json(self) -> dict[str, Any]:
        """The options that made this archive, and only those (``build_recipe`` reads it back).

        Audio options (features, stored dtype, downmix, resampler) appear only
        where audio is compiled: audio media, or video with its audio track;
        vision options only for video and images.
        """
        # never a URL's credentials (its user, password and query values)
        source = redact(self.source)
        out: dict[str, Any] = {"source": source, "layout": self.layout, "media": self.media}
        if self.media != "audio":
            out["vision"] = self.vision.to_json()
        if self.media == "image":
            out["images"] = self.images
            out["masks"] = list(self.masks) if self.masks is not None else None
        # Column choices are recorded only when given, so other recipes keep their digest.
        for name, value in self.columns().items():
            if value:
                out[name] = list(value) if isinstance(value, tuple) else value
        if self.allow_paths:  # recorded only when given, as the column choices are
            out["allow_paths"] = list(self.allow_paths)
        if self.media == "audio" or (self.media == "video" and self.vision.audio):
            out["features"] = self.feature.to_json()
            out["dtype"] = self.dtype
            if self.media == "audio":
                out["duration"] = self.duration
            out["downmix"] = self.downmix
            out["resampler"] = asdict(self.resampler)
        out.update(
            codec=self.codec,
            feature_codec=self.feature_codec().to_json(),
            shard_bytes=self.shard_bytes,
            on_error=self.on_error,
        )
        return out

    def columns(self) -> dict[str, Any]:
        """The column choices a table layout (hf) lists with, as open_corpus takes them."""
        return {
            "text_column": self.text_column,
            "label_column": self.label_column,
            "keep_columns": self.keep_columns,
        }

    def digest(self) -> str:
        """Hash of everything that determines the archive's bytes."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()


def load_recipe_file(path: str | Path) -> dict[str, Any]:
    """Options from a .toml or .json recipe, or from an archive's index.json.

    Read as an archive's files are (formats/files.py): a regular file only (a FIFO
    or a device is refused without blocking), at most MAX_INDEX_BYTES, JSON nested
    at most MAX_JSON_DEPTH deep; every failure is a CompileError naming the file.
    """
    p = Path(path)
    root = None
    if p.is_dir():
        root, p = p, p / INDEX_NAME  # an archive: its index's links must stay inside it
    try:
        data = read_capped(p, MAX_INDEX_BYTES, root=root, what="recipe")
    except FileNotFoundError:
        no_index = " (a folder given as a recipe must be a dlop archive)" if root else ""
        raise CompileError(f"{p}: cannot read recipe: no such file{no_index}") from None
    except FormatError as e:
        raise CompileError(f"{p}: cannot read recipe: {e.problem}") from None
    except OSError as e:
        raise CompileError(f"{p}: cannot read recipe: {e.strerror or e}") from None
    try:
        if p.suffix == ".toml":
            obj: Any = tomllib.loads(data.decode("utf-8"))
        else:
            obj = loads_bounded(p, data, "recipe")
    except FormatError as e:
        raise CompileError(f"{p}: {e.problem}") from None
    except UnicodeDecodeError as e:
        raise CompileError(f"{p}: a TOML recipe must be UTF-8 text: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise CompileError(f"{p}: not valid TOML: {e}") from None
    except RecursionError:
        raise CompileError(f"{p}: not valid TOML: arrays or tables nested too deep") from None
    if isinstance(obj, dict) and obj.get("format") == ARCHIVE_FORMAT:
        obj = obj.get("recipe", {})
    if not isinstance(obj, dict):
        raise CompileError(f"{p}: a recipe must be a table/object of options")
    return obj


RECIPE_OPTIONS = (
    "source",
    "layout",
    "media",
    "features",
    "preset",
    "dtype",
    "duration",
    "downmix",
    "codec",
    "feature_codec",
    "shard_bytes",
    "on_error",
    "resampler",
    "workers",
    "vision",
    "images",
    "masks",
    "text_column",
    "label_column",
    "keep_columns",
    "allow_paths",
)
MAX_DURATION_S = 24 * 3600.0
MIN_SHARD_BYTES, MAX_SHARD_BYTES = 4 << 10, 1 << 40
MAX_WORKERS = 1024
ON_ERROR_POLICIES = ("skip", "fail")
# The recipe options that take one of a fixed set of words (the CLI offers the same sets).
CHOICES: dict[str, tuple[str, ...]] = {
    "layout": LAYOUTS,
    "media": MEDIA,
    "preset": tuple(sorted(PRESETS)),
    "dtype": tuple(DTYPES),
    "downmix": DOWNMIX_POLICIES,
    "on_error": ON_ERROR_POLICIES,
}
# name: (type, lowest, highest)
_RESAMPLER: dict[str, tuple[type, float, float]] = {
    "zero_crossings": (int, 1, 1024),
    "rolloff": (float, 0.5, 1.0),
    "beta": (float, 0.0, 100.0),
}
_SIMPLE = {"int": "an integer", "int | None": "an integer", "bool": "true or false"}
_SIMPLE |= {"str": "a string", "float | None": "a number"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return ok and math.isfinite(value)


def _fits(kind: str, value: Any) -> bool:
    if kind.startswith("int"):
        return _is_int(value)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    return _is_number(value)


def _column_names(value: Any) -> tuple[str, ...] | None:
    """``"a,b"`` or ``["a", "b"]`` -> ("a", "b"); None when it is neither (or names none)."""
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        return None
    names = tuple(v.strip() for v in value)
    if not names or not all(names) or len(set(names)) != len(names):
        return None
    return names


def _check_columns(opts: dict[str, Any]) -> None:
    expected = {"text_column": "a column name", "label_column": "a column name"}
    expected["keep_columns"] = "column names: a list, or one string separated by commas"
    for key, what in expected.items():
        value = opts.get(key)
        ok = _column_names(value) if key == "keep_columns" else isinstance(value, str) and value
        if key in opts and not ok:
            raise CompileError(f"recipe option {key}: expected {what}, got {value!r}")


def check_options(opts: dict[str, Any]) -> None:
    """Names, types and ranges of the recipe's options, before any work.

    Feature options are checked by FeatureConfig and vision options by
    VisionConfig as they are built; this covers the rest, and the types of
    the plain vision options. Every message names the option.
    """
    known = set(RECIPE_OPTIONS) | FEATURE_OPTIONS | VISION_OPTIONS
    unknown = sorted(set(opts) - known)
    if unknown:
        raise CompileError(
            f"unknown recipe option(s) {', '.join(unknown)}; valid options: {', '.join(sorted(known))}"
        )

    def bad(key: str, expected: str) -> CompileError:
        return CompileError(f"recipe option {key}: expected {expected}, got {opts[key]!r}")

    for key, allowed in CHOICES.items():
        if key in opts and (not isinstance(opts[key], str) or opts[key] not in allowed):
            raise bad(key, f"one of {', '.join(allowed)}")
    features = opts.get("features")
    if features is not None and not isinstance(features, dict) and features not in FEATURES:
        raise bad("features", f"one of {', '.join(FEATURES)} (or a resolved table of options)")
    if "source" in opts and not isinstance(opts["source"], str | os.PathLike):
        raise bad("source", "a path")
    for key in ("codec", "images"):
        if key in opts and not isinstance(opts[key], str):
            raise bad(key, "a string")
    _check_columns(opts)
    for key in ("resampler", "vision", "feature_codec"):
        if key in opts and not isinstance(opts[key], dict):
            raise bad(key, "a table of options")
    if "duration" in opts:
        duration = opts["duration"]
        if not _is_number(duration) or not 0 <= duration <= MAX_DURATION_S:
            raise bad("duration", f"seconds from 0 (native lengths) to {MAX_DURATION_S:g}")
    if "shard_bytes" in opts:
        value = opts["shard_bytes"]
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise bad("shard_bytes", "a number of bytes, or a size such as 256MiB")
        try:
            size = parse_size(value)
        except CompileError as e:
            raise CompileError(f"recipe option shard_bytes: {e}") from None
        if not MIN_SHARD_BYTES <= size <= MAX_SHARD_BYTES:
            raise bad("shard_bytes", f"{MIN_SHARD_BYTES} bytes (4KiB) to {MAX_SHARD_BYTES} (1TiB)")
    if "workers" in opts and (
        not _is_int(opts["workers"]) or not 1 <= opts["workers"] <= MAX_WORKERS
    ):
        raise bad("workers", f"an integer from 1 to {MAX_WORKERS}")
    if "masks" in opts:
        masks = opts["masks"]
        if not isinstance(masks, str) and not (
            isinstance(masks, list | tuple) and all(isinstance(m, str) for m in masks)
        ):
            raise bad("masks", "a folder name or a list of them")
    allow = opts.get("allow_paths")
    if allow is not None and not (
        isinstance(allow, list | tuple) and all(isinstance(a, str) and a for a in allow)
    ):
        raise bad("allow_paths", "a list of folders or URL prefixes")
    _check_resampler(opts.get("resampler") or {})
    _check_vision_types(opts)


def _check_resampler(resampler: dict[str, Any]) -> None:
    for key, value in resampler.items():
        if key not in _RESAMPLER:
            raise CompileError(
                f"recipe option resampler.{key}: unknown; valid: {', '.join(_RESAMPLER)}"
            )
        kind, lo, hi = _RESAMPLER[key]
        ok = _is_int(value) if kind is int else _is_number(value)
        if not ok or not lo <= value <= hi:
            raise CompileError(
                f"recipe option resampler.{key}: expected {'an integer' if kind is int else 'a number'} "
                f"from {lo:g} to {hi:g}, got {value!r}"
            )


def _check_vision_types(opts: dict[str, Any]) -> None:
    """The types of the plain vision options, given flat or in a ``vision`` table."""
    vision = {**(opts.get("vision") or {}), **{k: opts[k] for k in VISION_OPTIONS if k in opts}}
    for f in fields(VisionConfig):
        declared = str(f.type)
        value = vision.get(f.name)
        if value is not None and declared in _SIMPLE and not _fits(declared, value):
            raise CompileError(
                f"recipe option {f.name}: expected {_SIMPLE[declared]}, got {value!r}"
            )


def build_recipe(options: dict[str, Any], storage_options: dict[str, Any] | None = None) -> Recipe:
    """Options (recipe file merged with command-line flags) -> Recipe; unknown keys are errors.

    Every option is checked (check_options, FeatureConfig, VisionConfig)
    before the source is looked at (a URL SOURCE through ``storage_options``).
    """
    # A key given as null (as a resolved recipe stores "duration": null) counts as given.
    explicit_duration = "duration" in options
    opts = {k.replace("-", "_"): v for k, v in options.items() if v is not None}
    check_options(opts)
    if "source" not in opts:
        raise CompileError("no SOURCE: give the corpus path (or 'source' in the recipe)")
    cfg = _feature_config(opts)
    vision_opts = dict(opts["vision"]) if isinstance(opts.get("vision"), dict) else {}
    vision_opts.update({k: opts[k] for k in VISION_OPTIONS if k in opts})
    try:
        vision = VisionConfig.from_options(vision_opts)
    except (TypeError, ValueError) as e:
        raise CompileError(str(e)) from None
    resampler = opts.get("resampler")
    source = source_place(str(opts["source"]), storage_options)
    layout = opts.get("layout") or detect_layout(source)
    media = opts.get("media") or layout_media(layout, source)
    masks = opts.get("masks")
    if isinstance(masks, str):
        masks = [masks]
    allow: list[str] = opts.get("allow_paths") or []
    # ESC-50 defines 5 s clips, so its features are fixed-size unless told otherwise;
    # duration 0 asks for native lengths (ragged) explicitly.
    duration = opts.get("duration") if explicit_duration else (5.0 if layout == "esc50" else None)
    return Recipe(
        source=str(opts["source"]),
        layout=layout,
        feature=cfg,
        dtype=opts.get("dtype", "float16"),
        duration=None if duration in (None, 0, 0.0) else float(duration),
        downmix=opts.get("downmix", "mean"),
        codec=str(opts.get("codec", "raw")),
        shard_bytes=parse_size(opts.get("shard_bytes", 256 << 20)),
        on_error=opts.get("on_error", "skip"),
        resampler=ResampleConfig(**resampler) if isinstance(resampler, dict) else ResampleConfig(),
        media=media,
        vision=vision,
        images=None if opts.get("images") is None else str(opts["images"]),
        masks=None if masks is None else tuple(str(m) for m in masks),
        allow_paths=tuple(a if is_url(a) else os.path.abspath(a) for a in allow or ()),
        guessed=frozenset(
            name
            for name, given in (
                ("layout", "layout" in opts),
                # a resolved recipe (from an archive) states its rate
                ("sample_rate", "sample_rate" in opts or isinstance(opts.get("features"), dict)),
            )
            if not given
        ),
        **_columns(opts),
    )


def _feature_config(opts: dict[str, Any]) -> FeatureConfig:
    """The features of checked options: a preset with overrides, or a resolved table."""
    features = opts.get("features")
    overrides = {k: opts[k] for k in FEATURE_OPTIONS if k in opts}
    try:
        if isinstance(features, dict):  # a resolved recipe from an index
            cfg = FeatureConfig.from_json(features)
            if opts.get("preset", cfg.preset) != cfg.preset:
                raise ValueError(
                    f"preset: {opts['preset']!r} differs from the resolved features' "
                    f"{cfg.preset!r}; drop one of them"
                )
            return with_options(cfg, overrides) if overrides else cfg
        return feature_config(opts.get("preset", "librosa"), features, **overrides)
    except (TypeError, ValueError) as e:
        raise CompileError(f"recipe option {e}") from None


def _columns(opts: dict[str, Any]) -> dict[str, Any]:
    """The hf column choices of checked options, as Recipe takes them."""
    keep = _column_names(opts.get("keep_columns", ())) or ()
    return {
        "text_column": opts.get("text_column"),
        "label_column": opts.get("label_column"),
        "keep_columns": keep,
    }

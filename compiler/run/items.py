"""One input -> its archive samples: the schema per media, and the per-item work workers run.

Audio: decode, downmix, resample, crop/pad, featurize. Video: sample clips by
frame time, rotate, resize, crop (and the audio track's features). Images:
decode with EXIF orientation, resize and crop the image and its masks alike,
tile. Bad input never raises here: it comes back as an Outcome with a reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dlop.formats import Field
from dlop.formats.heap import keep_freed_memory

from ..audio.decode import decode_audio, downmix
from ..audio.features import as_float, featurize_clips, takes_pcm16
from ..audio.resample import resample
from ..corpus.layouts.webdataset import webdataset_fields
from ..corpus.records import MAX_LABEL, Corpus, Item, input_source
from ..errors import InputError
from ..recipe import DTYPES, Recipe


@dataclass(frozen=True)
class CorpusShape:
    """What every item of a corpus carries besides its media (sent to the workers)."""

    has_label: bool
    has_text: bool
    extra: dict[str, str]
    media: str = "audio"
    num_labels: int = 0
    mask_names: tuple[str, ...] = ()

    @classmethod
    def of(cls, corpus: Corpus) -> CorpusShape:
        return cls(
            corpus.has_label,
            corpus.has_text,
            dict(corpus.extra_fields),
            corpus.media,
            corpus.num_labels,
            corpus.mask_names,
        )


@dataclass
class Outcome:
    """One input's samples, or the reason it is skipped (``path`` names it then)."""

    key: str
    samples: list[dict[str, Any]] = field(default_factory=list)
    reason: str | None = None
    path: str | None = None
    # the compile cannot go on whatever --on-error says (a sample that breaks the schema
    # other inputs set); ``widen``: the (field, axis) that varies, when only that broke it
    stop: str | None = None
    widen: tuple[str, int] | None = None


def _audio_field(recipe: Recipe, fixed: bool) -> Field:
    cfg = recipe.feature
    if cfg.features == "waveform":
        frames = round(recipe.duration * cfg.sample_rate) if recipe.duration is not None else None
        shape: tuple[int | None, ...] = (frames if fixed else None,)
        units = "amplitude in [-1, 1]"
    else:
        frames = (
            cfg.num_output_frames(round(recipe.duration * cfg.sample_rate))
            if recipe.duration
            else None
        )
        frames = cfg.num_frames if cfg.num_frames is not None else frames
        shape = (frames if fixed else None, cfg.bins)
        units = {"db": "dB", "log10": "log10", "ln": "natural log", "none": "power"}[cfg.log]
        if cfg.post == "whisper":
            units = "(log10 + 4) / 4"
        elif cfg.post == "ast":
            units = "normalised ln fbank"
    meaning = f"{cfg.preset} {cfg.features} at {cfg.sample_rate} Hz, time-major [frames, bins]"
    return Field(
        cfg.features,
        DTYPES[recipe.dtype],
        shape,
        codec=recipe.feature_codec(),
        meaning=meaning,
        units=units,
    )


def schema_for(recipe: Recipe, corpus: CorpusShape) -> list[Field]:
    cfg = recipe.feature
    vision = recipe.vision
    hw: tuple[int | None, int | None] = vision.output_hw() or (None, None)
    codec = recipe.feature_codec()
    fields = [Field.str_("key", meaning="input path relative to the corpus root, or manifest id")]
    if corpus.media == "audio":
        fields.append(
            _audio_field(recipe, recipe.duration is not None or cfg.num_frames is not None)
        )
    elif corpus.media == "video":
        fields += [
            Field(
                "frames",
                "u8",
                (vision.clip_frames, *hw, 3),
                codec=codec,
                meaning=f"{vision.clip} clip of {vision.clip_frames} RGB frames, [T, H, W, C]",
                units="0-255",
            ),
            Field("clip_start", "f64", (), meaning="time of the clip's first frame", units="s"),
            Field("clip_end", "f64", (), meaning="end of the clip's last frame", units="s"),
        ]
        if vision.audio:
            audio = _audio_field(recipe, fixed=False)
            meaning = f"audio track over the clip's span: {audio.meaning}; 0 frames when the video has none"
            fields.append(dataclasses.replace(audio, meaning=meaning))
    else:
        fields.append(
            Field(
                "image", "u8", (*hw, 3), codec=codec, meaning="RGB image, [H, W, C]", units="0-255"
            )
        )
        for name in corpus.mask_names:
            fields.append(
                Field(
                    name,
                    "u8",
                    hw,
                    codec=codec,
                    meaning=f"annotator mask [H, W]; {vision.mask_fill} where this annotator gave none",
                )
            )
        if corpus.mask_names:
            fields.append(
                Field(
                    "masks_present",
                    "bool",
                    (len(corpus.mask_names),),
                    meaning=f"which of {list(corpus.mask_names)} exist for this image",
                )
            )
        if vision.consensus:
            fields.append(
                Field(
                    "consensus",
                    "u8",
                    hw,
                    codec=codec,
                    meaning="per-pixel majority vote of the present masks (ties: smaller label)",
                )
            )
        if vision.tile is not None:
            fields.append(
                Field("origin", "i64", (2,), meaning="tile's top-left (y, x) in the resized image")
            )
    if corpus.has_label:
        fields.append(Field("label", "i64", (), meaning="class index (see metadata.classes)"))
    if corpus.num_labels:
        fields.append(
            Field(
                "labels",
                "u8",
                (corpus.num_labels,),
                meaning="multi-hot classes (see metadata.label_classes)",
            )
        )
    if corpus.has_text:
        fields.append(Field.str_("text", meaning="transcript"))
    for name, kind in corpus.extra.items():
        fields.append(Field.str_(name) if kind == "str" else Field(name, kind, ()))
    return fields


def process_item(item: Item, recipe: Recipe, shape: CorpusShape) -> Outcome:
    """Every archive sample of one input; never raises for bad input."""
    return process_items([item], recipe, shape)[0]


GROUP_SAMPLES = 1 << 23  # decoded audio samples featurized together (32 MiB of float32)


def process_items(items: Sequence[Item], recipe: Recipe, shape: CorpusShape) -> list[Outcome]:
    """Every archive sample of each input, in order; never raises for bad input.

    Audio inputs are decoded one at a time and featurized in groups of about
    GROUP_SAMPLES decoded samples, so the FFT, filterbank and log run on
    large tensors; featurize_clips makes each input's bytes the same as
    featurizing it alone, so groups may be cut anywhere. The process keeps the
    memory a group frees for the next one (dlop.formats.heap).
    """
    keep_freed_memory()
    outcomes: list[Outcome | None] = [None] * len(items)
    group: list[tuple[int, str, torch.Tensor, dict[str, Any]]] = []
    held = 0
    for n, item in enumerate(items):
        name = item.key if item.path is None else item.path
        try:
            if item.data is not None:
                webdataset_fields(item)
            if item.error:
                raise InputError(name, item.error)
            common = _labels(item, shape, name)
            if shape.media == "audio":
                name, wave = _audio(item, recipe, name)
                group.append((n, name, wave, common))
                held += wave.numel()
                if held >= GROUP_SAMPLES:
                    _featurize_group(group, items, recipe, outcomes)
                    group, held = [], 0
                continue
            if shape.media == "video":
                samples = _video(item, recipe, name)
            else:
                samples = _image(item, recipe, shape, name)
            for s in samples:
                s["key"] = item.key
                s.update(common)
            outcomes[n] = Outcome(item.key, samples=samples)
        except InputError as e:
            outcomes[n] = Outcome(item.key, reason=e.reason, path=e.path)
    _featurize_group(group, items, recipe, outcomes)
    return [o for o in outcomes if o is not None]


def _featurize_group(
    group: list[tuple[int, str, torch.Tensor, dict[str, Any]]],
    items: Sequence[Item],
    recipe: Recipe,
    outcomes: list[Outcome | None],
) -> None:
    """Featurizes decoded audio inputs together; fills their outcomes (the group is emptied)."""
    feats = featurize_clips([wave for _, _, wave, _ in group], recipe.feature)
    kind = recipe.feature.features
    together = _stored_together(feats, recipe)
    for j, ((n, name, _, common), feat) in enumerate(zip(group, feats, strict=True)):
        key = items[n].key
        try:
            stored = together[j] if together is not None else _stored(feat, recipe, name)
            sample = {kind: stored, "key": key, **common}
            outcomes[n] = Outcome(key, samples=[sample])
        except InputError as e:
            outcomes[n] = Outcome(key, reason=e.reason, path=e.path)
    group.clear()


def _labels(item: Item, shape: CorpusShape, name: str) -> dict[str, Any]:
    """The item's label, multi-hot labels, text and extra fields, each checked as stored."""
    out: dict[str, Any] = {}
    if shape.has_label:
        if item.label is None:
            raise InputError(name, "no label")
        if type(item.label) is not int or not 0 <= item.label <= MAX_LABEL:
            raise InputError(
                name, f"label {item.label!r} is not a class index (an integer 0 to {MAX_LABEL})"
            )
        out["label"] = item.label
    if shape.num_labels:
        bad = [v for v in item.labels or [] if type(v) is not int or not 0 <= v < shape.num_labels]
        if bad:
            raise InputError(
                name, f"labels {bad[:5]} are not class indices from 0 to {shape.num_labels - 1}"
            )
        hot = np.zeros(shape.num_labels, np.uint8)
        hot[item.labels or []] = 1
        out["labels"] = hot
    if shape.has_text:
        if item.text is None:
            raise InputError(name, "no transcript")
        out["text"] = item.text
    for field_name in shape.extra:
        if field_name not in item.extras:
            raise InputError(name, f"no {field_name}")
        out[field_name] = item.extras[field_name]
    return out


def _stored(feat: torch.Tensor, recipe: Recipe, name: str) -> np.ndarray:
    """float32 features in the recipe's stored dtype, refused when they would not be finite."""
    dtype = getattr(torch, recipe.dtype)
    if not _fits(feat, dtype):
        raise InputError(name, f"features are not finite in {recipe.dtype}")
    return _store(feat.to(dtype))


def _fits(feat: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``feat``'s values stay finite stored as ``dtype``. One float32 pass (no
    temporary): NaN propagates through aminmax, and anything beyond the stored type's
    largest value would round to infinity."""
    if not feat.numel():
        return True
    low, high = torch.aminmax(feat)
    largest = torch.finfo(dtype).max
    return -largest <= float(low) <= float(high) <= largest


def _stored_together(feats: list[torch.Tensor], recipe: Recipe) -> list[np.ndarray] | None:
    """``_stored`` of every clip, checked and converted in one pass over the tensor whose
    rows they are (featurize_clips lays clips out in one): the same values as clip by
    clip, without a few small torch calls per input. None where the clips are not
    contiguous views of one float32 tensor, or where a value of that tensor would not
    be finite in the stored type (then each clip is checked alone, naming its input)."""
    base = feats[0]._base if feats else None
    if base is None or base.dtype != torch.float32 or not base.is_contiguous():
        return None
    if any(f._base is not base or not f.is_contiguous() for f in feats):
        return None
    dtype = getattr(torch, recipe.dtype)
    if not _fits(base, dtype):
        return None
    flat = _store(base.to(dtype)).reshape(-1)
    first = base.storage_offset()
    return [flat[f.storage_offset() - first :][: f.numel()].reshape(tuple(f.shape)) for f in feats]


def _waveform(
    source: Any,
    name: str,
    recipe: Recipe,
    offset: float = 0.0,
    duration: float | None = None,
    *,
    pcm16: bool = False,
) -> torch.Tensor:
    """Decoded, downmixed and resampled to the recipe's rate: [time] float32, or with
    ``pcm16`` int16 where 16-bit PCM is already at that rate (decode_audio's contract)."""
    # mixed block by block as decoded: all channels of a long recording are never held
    audio, rate = decode_audio(source, name, offset, duration, mix=recipe.downmix, pcm16=pcm16)
    wave = torch.from_numpy(downmix(audio, recipe.downmix))
    del audio  # the channels, once mixed (a long recording holds no second copy)
    if rate == recipe.feature.sample_rate:
        return wave
    return resample(as_float(wave), rate, recipe.feature.sample_rate, recipe.resampler)


def _audio(item: Item, recipe: Recipe, name: str) -> tuple[str, torch.Tensor]:
    """(the name errors give, the decoded waveform cropped or padded to the recipe's duration)."""
    if item.data is not None and item.member is not None:
        name = f"{item.member[0]}:{item.key}.{item.member[1]}"
        source: Any = item.data[item.member[1]]
    else:
        source = item.path if item.path is None else input_source(item, item.path)
    cfg = recipe.feature
    # 16-bit PCM stays int16 to the featurizer where it folds the 1/32768 into its window
    wave = _waveform(source, name, recipe, item.offset, item.duration, pcm16=takes_pcm16(cfg))
    if recipe.duration is not None:
        n = round(recipe.duration * cfg.sample_rate)
        wave = (
            wave[:n]
            if wave.shape[0] >= n
            else torch.nn.functional.pad(wave, (0, n - wave.shape[0]))
        )
    return name, wave


def _video(item: Item, recipe: Recipe, name: str) -> list[dict[str, Any]]:
    from ..vision.video import decode_clips

    if item.path is None:  # video layouts list files on disk; tars hold audio only
        raise InputError(name, "video inputs must be files")
    clips, info = decode_clips(input_source(item, item.path), name, recipe.vision)
    samples: list[dict[str, Any]] = [
        {"frames": c.frames, "clip_start": c.start, "clip_end": c.end} for c in clips
    ]
    if recipe.vision.audio:
        cfg = recipe.feature
        if info.has_audio:
            wave = _waveform(input_source(item, item.path), name, recipe)
            spans = []
            for c in clips:
                a = max(0, round((c.start - info.start) * cfg.sample_rate))
                spans.append(wave[a : max(a, round((c.end - info.start) * cfg.sample_rate))])
            for s, feat in zip(samples, featurize_clips(spans, cfg), strict=True):
                s[cfg.features] = _stored(feat, recipe, name)
        else:
            empty = np.zeros((0, cfg.bins), dtype=_STORED[recipe.dtype])
            for s in samples:
                s[cfg.features] = empty
    return samples


def _image(item: Item, recipe: Recipe, shape: CorpusShape, name: str) -> list[dict[str, Any]]:
    from ..vision.image import consensus, load_image, load_mask, remap, shape_sample

    source: Any
    if item.data is not None and item.member is not None:  # bytes a layout read (Parquet rows)
        name = f"{item.member[0]}:{item.key}.{item.member[1]}"
        source = item.data[item.member[1]]
    elif item.path is not None:
        source = input_source(item, item.path)
    else:
        raise InputError(name, "the image input holds neither a file nor bytes")
    vision = recipe.vision
    image = load_image(source, name, vision, masked=bool(shape.mask_names))
    masks: dict[str, Any] = {}
    present = []
    for mask_name in shape.mask_names:
        path = (item.masks or {}).get(mask_name)
        if path is None:
            if vision.missing_mask == "skip":
                raise InputError(name, f"no {mask_name} mask (--missing-mask skip)")
            masks[mask_name] = vision.mask_fill
            present.append(False)
            continue
        mask = load_mask(input_source(item, path), path, vision)
        masks[mask_name] = remap(mask, vision.mask_remap, path)
        present.append(True)
    try:
        patches = shape_sample(image, masks, vision)
    except ValueError as e:
        raise InputError(name, str(e)) from None
    if not patches:
        raise InputError(
            name, f"{image.width}x{image.height} image holds no whole {vision.tile} tile"
        )
    samples = []
    for p in patches:
        sample: dict[str, Any] = {"image": p.image, **p.masks}
        if shape.mask_names:
            sample["masks_present"] = np.array(present, dtype=bool)
        if vision.consensus:
            voters = [p.masks[n] for n, ok in zip(shape.mask_names, present, strict=True) if ok]
            sample["consensus"] = (
                consensus(voters, vision.mask_fill)
                if voters
                else np.full(p.image.shape[:2], vision.mask_fill, np.uint8)
            )
        if vision.tile is not None:
            sample["origin"] = np.array(p.origin, dtype=np.int64)
        samples.append(sample)
    return samples


_STORED = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}


def _store(feat: torch.Tensor) -> np.ndarray:
    """numpy for the shard writer; bfloat16 travels as its uint16 bit pattern."""
    if feat.dtype == torch.bfloat16:
        return feat.view(torch.int16).numpy().view(np.uint16)
    return feat.numpy()

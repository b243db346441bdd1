"""dlop-compile's word choices are the compiler's own sets, never a second copy."""

from __future__ import annotations

import argparse

from dlop.compiler.audio import options as feature_options
from dlop.compiler.recipe import CHOICES
from dlop.compiler.vision import options as vision
from dlop.tools.compile_cli import build_parser


def _choices(parser: argparse.ArgumentParser) -> dict[str, tuple[str, ...]]:
    return {
        a.dest: tuple(a.choices)
        for a in parser._actions  # argparse keeps no public list of actions
        if a.choices is not None
    }


def test_every_choice_comes_from_the_module_that_checks_it() -> None:
    owners = {
        **{
            key: CHOICES[key]
            for key in ("layout", "downmix", "media", "preset", "dtype", "on_error")
        },
        **{
            key: feature_options.CHOICES[key]
            for key in ("features", "mel_scale", "norm", "pad_mode", "fft_dtype")
        },
        "clip": vision.CLIP_MODES,
        "missing_mask": vision.MISSING_MASK_RULES,
    }
    assert _choices(build_parser()) == owners


def test_help_explains_every_flag_and_names_the_recipe_only_options() -> None:
    from dlop.compiler.recipe import FEATURE_OPTIONS, RECIPE_OPTIONS, VISION_OPTIONS
    from dlop.tools.compile_cli import build_parser

    parser = build_parser()
    unexplained = [a.option_strings[-1] for a in parser._actions if a.option_strings and not a.help]
    assert unexplained == []
    flags = {a.dest for a in parser._actions}
    text = parser.format_help()
    named = " ".join(text[text.index("Options only a recipe file sets") :].split())
    for option in {*RECIPE_OPTIONS, *FEATURE_OPTIONS, *VISION_OPTIONS} - {
        "feature_codec",
        "vision",
    }:
        assert option in flags or f" {option}," in named or f" {option}." in named, option

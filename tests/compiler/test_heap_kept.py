"""A compiling process keeps the memory each group of inputs frees (dlop.formats.heap)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .fixtures import esc50_corpus

GLIBC = (getattr(os, "confstr", lambda _: "")("CS_GNU_LIBC_VERSION") or "").startswith("glibc")

_COMPILE = """
import sys
from dlop.formats import heap
from dlop.compiler.pipeline import compile_corpus
from dlop.compiler.recipe import build_recipe
assert "kept" not in heap._state
recipe = build_recipe({"preset": "librosa", "source": sys.argv[1], "layout": "esc50"})
compile_corpus(recipe, sys.argv[2], workers=1, progress=False)
print(heap._state["kept"])
"""


def test_a_compiling_process_keeps_freed_memory(tmp_path: Path, malloc_env: dict[str, str]) -> None:
    corpus = esc50_corpus(tmp_path / "esc", [("wav", 22050, 1)] * 2)
    for tuning, kept in (("1", GLIBC), ("0", False)):
        out = subprocess.run(
            [sys.executable, "-c", _COMPILE, str(corpus), str(tmp_path / f"out{tuning}")],
            capture_output=True,
            text=True,
            env={**malloc_env, "DLOP_MALLOC_TUNING": tuning},
        )
        assert out.stdout.split() == [str(kept)], out.stderr

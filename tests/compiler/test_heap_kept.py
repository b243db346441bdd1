"""A compiling process keeps the memory each group of inputs frees (dlop.formats.heap)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from dlop.formats.heap import is_glibc

from .fixtures import esc50_corpus

GLIBC = is_glibc()

_COMPILE = """
import sys
from dlop.formats import heap
from dlop.compiler.run.pipeline import compile_corpus
from dlop.compiler.recipe import build_recipe
assert heap.keep_freed_memory.cache_info().currsize == 0  # not at import
recipe = build_recipe({"preset": "librosa", "source": sys.argv[1], "layout": "esc50"})
compile_corpus(recipe, sys.argv[2], workers=1, progress=False)
# applied by the compile (the cache holds its answer), and what it answered
print(heap.keep_freed_memory.cache_info().currsize, heap.keep_freed_memory())
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
        assert out.stdout.split() == ["1", str(kept)], out.stderr

"""mypy, strict, over every module of the dlop package under its import name.

mypy finds a module by its folders (``dlop.formats.reader`` in dlop/formats/reader.py)
and knows nothing of setuptools' package-dir, which maps the top-level folders
formats/, compiler/, runtime/ and tools/ to dlop.formats and the rest. This script
reads that mapping from pyproject.toml and hands mypy each file with its module name,
so errors name the real files; the settings are pyproject's [tool.mypy]. ``make lint``
runs it. Arguments are mypy's: options, and files to check with the package (a script
that calls it, its path from the repository root):
``python .ci/typecheck.py --pretty tests/typing/spelt.py``.
"""

from __future__ import annotations

import os
import sys
import time
import tomllib
from pathlib import Path

from mypy import util
from mypy.fscache import FileSystemCache
from mypy.main import process_options, run_build
from mypy.modulefinder import BuildSource

ROOT = Path(__file__).resolve().parents[1]


def package_modules(root: Path) -> dict[str, Path]:
    """Module name -> file for every module of the mapped packages: each .py file in a
    mapped folder or a subfolder that holds an ``__init__.py`` (a folder without one,
    like the benchmark's stand-in packages, is no part of the package)."""
    mapping: dict[str, str] = tomllib.loads((root / "pyproject.toml").read_text())["tool"][
        "setuptools"
    ]["package-dir"]
    found: dict[str, Path] = {}
    for package, folder in mapping.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(base).parts
            if not all(
                (base.joinpath(*parts[:i]) / "__init__.py").is_file() for i in range(len(parts))
            ):
                continue
            names = [package, *parts[:-1]]
            if path.stem != "__init__":
                names.append(path.stem)
            found[".".join(names)] = path
    return found


def main(argv: list[str]) -> int:
    os.chdir(ROOT)  # mypy reads its settings from the pyproject.toml where it runs
    fscache = FileSystemCache()
    given, options = process_options(argv, require_targets=False, fscache=fscache)
    modules = {**package_modules(ROOT), "typecheck": Path(__file__).resolve()}  # and this file
    sources = [BuildSource(str(path.relative_to(ROOT)), name) for name, path in modules.items()]
    sources += given
    _, messages, blockers = run_build(
        sources, options, fscache, time.time(), sys.stdout, sys.stderr
    )
    formatter = util.FancyFormatter(sys.stdout, sys.stderr, options.hide_error_codes)
    n_errors, _, n_files = util.count_stats(messages)
    if n_errors:
        print(formatter.format_error(n_errors, n_files, len(sources), blockers=blockers))
        return 2 if blockers else 1
    print(formatter.format_success(len(sources), options.color_output))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

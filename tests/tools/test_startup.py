"""The tools start without torch: `dlop-compile --help` and `dlop-inspect info` load
only what they use (their wall time is measured by `dlop-bench --only startup`, not
here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dlop.formats import ArchiveWriter, Field

HEAVY = ("torch", "soundfile", "av", "PIL", "matplotlib", "dask", "s3fs", "pyarrow")

PROBE = """
import contextlib, io, json, sys
from dlop.tools import {module} as tool
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
    try:
        code = tool.main({argv!r})
    except SystemExit as stop:
        code = stop.code
heavy = {heavy!r}
print(json.dumps({{"code": code, "loaded": sorted(m for m in heavy if m in sys.modules)}}))
"""


def _loaded(module: str, argv: list[str]) -> list[str]:
    code = PROBE.format(module=module, argv=argv, heavy=HEAVY)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["code"] in (0, None), done.stderr
    loaded: list[str] = report["loaded"]
    return loaded


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    with ArchiveWriter(tmp_path / "a", [Field("x", "f32", (4,)), Field("label", "i64", ())]) as w:
        for i in range(3):
            w.write({"x": np.full(4, i, np.float32), "label": i})
    return tmp_path / "a"


def test_compile_help_loads_no_heavy_module() -> None:
    assert _loaded("compile_cli", ["--help"]) == []


def test_inspect_info_and_help_load_no_heavy_module(archive: Path) -> None:
    assert _loaded("inspect_cli", ["--help"]) == []
    assert _loaded("inspect_cli", ["info", str(archive)]) == []
    assert _loaded("inspect_cli", ["info", "--json", str(archive)]) == []


def test_inspect_cache_loads_no_heavy_module(tmp_path: Path) -> None:
    assert _loaded("inspect_cli", ["cache", str(tmp_path / "cache")]) == []


def test_every_runtime_name_loads_on_first_use() -> None:
    import dlop.runtime as runtime

    assert sorted(runtime.__all__) == sorted(runtime._WHERE)
    for name in runtime.__all__:
        value = getattr(runtime, name)
        assert value.__module__.startswith("dlop.runtime"), name
    with pytest.raises(AttributeError, match="no attribute 'Lodaer'"):
        runtime.Lodaer  # noqa: B018

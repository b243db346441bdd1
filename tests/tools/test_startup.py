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


EXIT = """
import atexit, sys, threading, time
from dlop.tools.output import exit_now
atexit.register(lambda: print("atexit ran"))
print("before exit", end="")  # no newline: a pipe holds it in stdout's buffer
sys.stderr.write("on stderr")
if sys.argv[1] == "thread":
    threading.Thread(target=lambda: (time.sleep(0.3), print(" thread done"))).start()
exit_now(int(sys.argv[2]))
"""


@pytest.mark.parametrize("thread", ["none", "thread"])
def test_exit_now_flushes_runs_atexit_and_waits_for_threads(thread: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", EXIT, thread, "3"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 3
    assert done.stderr == "on stderr"
    if thread == "thread":  # a thread still running: a normal exit, which waits for it
        assert done.stdout == "before exit thread done\natexit ran\n"
    else:
        assert done.stdout == "before exitatexit ran\n"


def test_the_commands_end_through_exit_now(tmp_path: Path) -> None:
    """The installed commands' entry points (pyproject) run main, then exit_now: exit
    status and every line of output as main leaves them."""
    import tomllib

    from dlop.tools import compile_cli, inspect_cli

    scripts = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    entry = scripts["project"]["scripts"]
    assert entry["dlop-compile"] == "dlop.tools.compile_cli:run"
    assert entry["dlop-inspect"] == "dlop.tools.inspect_cli:run"
    assert compile_cli.run and inspect_cli.run
    missing = tmp_path / "nothing-here"
    for module, argv, code, says in (
        ("compile_cli", [str(missing), "-o", str(tmp_path / "o")], 1, "dlop-compile: error:"),
        ("inspect_cli", ["info", str(missing)], 1, "dlop-inspect"),
        ("compile_cli", ["--no-such-option"], 2, "unrecognized arguments"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", f"dlop.tools.{module}", *argv],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == code, done.stderr
        assert says in done.stderr

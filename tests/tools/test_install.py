"""A non-editable install into a fresh environment gives working CLIs and imports from anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(ROOT),
        ],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("dlop-*.whl")
    venv = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # Dependencies come from the test environment; a .pth line adds its
    # site-packages without running its .pth files, so the editable dlop stays out.
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        check=True,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [
            str(py),
            "-c",
            "import dlop.runtime, dlop.formats, dlop.compiler, dlop.tools; print(dlop.formats.__file__)",
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=elsewhere,
        env=env,
    ).stdout
    assert out.startswith(str(venv)), out
    assert (Path(out.strip()).parent / "SPEC.md").exists()
    for tool in ("dlop-inspect", "dlop-compile", "dlop-bench"):
        res = subprocess.run(
            [str(venv / "bin" / tool), "--help"],
            capture_output=True,
            text=True,
            cwd=elsewhere,
            env=env,
        )
        assert res.returncode == 0, res.stderr
        assert "usage" in res.stdout

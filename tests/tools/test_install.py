"""`import dlop.X` resolves to the same files from the checkout, an editable
install and a wheel; a non-editable install gives working CLIs and imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUBPACKAGES = ("formats", "compiler", "runtime", "tools")
MODULES = ("dlop.formats", "dlop.compiler", "dlop.runtime", "dlop.tools", "dlop.tools.bench")

# Run in a fresh interpreter: import every subpackage and report where each
# came from and whether the compiled copier loaded.
PROBE = f"""
import importlib, json
mods = {{m: importlib.import_module(m).__file__ for m in {MODULES!r}}}
import dlop.runtime.gather.engine as engine
print(json.dumps({{"files": mods, "native": engine.compiled() is not None}}))
"""


def test_dlop_subpackages_are_relative_links_to_the_top_level_folders() -> None:
    for name in SUBPACKAGES:
        link = ROOT / "dlop" / name
        assert link.is_symlink(), f"{link} should be a symlink to ../{name}"
        assert os.readlink(link) == f"../{name}", os.readlink(link)
        assert link.resolve() == ROOT / name


def probe(py: Path, cwd: Path, env: dict[str, str]) -> dict[str, object]:
    res = subprocess.run([str(py), "-c", PROBE], capture_output=True, text=True, cwd=cwd, env=env)
    assert res.returncode == 0, f"imports failed with cwd={cwd}:\n{res.stderr}"
    found: dict[str, object] = json.loads(res.stdout)
    return found


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
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        # The links are followed: the wheel holds the real files.
        for mod in MODULES:
            init = mod.replace(".", "/") + "/__init__.py"
            assert init in names, f"{init} missing from {wheel.name}"
        assert "dlop/formats/SPEC.md" in names
        assert not any(i.external_attr >> 28 == 0o12 for i in zf.infolist()), "symlink in wheel"
        has_native = any(
            n.startswith("dlop/runtime/gather/_copy") and n.endswith(".so") for n in names
        )
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

    # Away from the checkout every subpackage comes from the installed copies.
    installed = probe(py, elsewhere, env)
    files = installed["files"]
    assert isinstance(files, dict)
    for mod, file in files.items():
        path = Path(file)
        assert path.is_relative_to(venv), f"{mod} came from {file}, not the venv"
        assert not path.parent.is_symlink(), f"{mod}: installed as a link, not files"
    assert (Path(files["dlop.formats"]).parent / "SPEC.md").exists()
    assert installed["native"] == has_native

    # In the repository root the checkout comes first on sys.path: its dlop/
    # must then hold every subpackage (through the links), not shadow the install.
    checkout = probe(py, ROOT, env)
    files = checkout["files"]
    assert isinstance(files, dict)
    for mod, file in files.items():
        path = Path(file)
        assert path.is_relative_to(ROOT / "dlop"), f"{mod} came from {file}"
        rel = mod.split(".", 1)[1].replace(".", "/")
        assert path.resolve() == ROOT / rel / "__init__.py", f"{mod} came from {file}"

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


def test_every_package_folder_is_listed_for_the_wheel() -> None:
    """A subpackage missing from pyproject's list would be left out of a wheel (its
    imports fail only after a non-editable install)."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(["dlop", *init.parent.relative_to(ROOT).parts])
        for name in SUBPACKAGES
        for init in (ROOT / name).rglob("__init__.py")
        if "peers-env" not in init.parts  # the benchmark's stand-in, never installed
    }
    assert found | {"dlop"} == listed

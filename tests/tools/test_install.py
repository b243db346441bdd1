"""The package-dir mapping of pyproject.toml: `import dlop.X` finds the top-level
folders through an editable install, and a wheel holds them as dlop/X with working
CLIs and imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
MAPPED = {"dlop.formats": "formats", "dlop.compiler": "compiler", "dlop.runtime": "runtime"}
# Subpackages and nested modules, each from its folder.
MODULES = {
    "dlop.formats": "formats/__init__.py",
    "dlop.formats.reader": "formats/reader.py",
    "dlop.compiler.corpus.layouts.folder": "compiler/corpus/layouts/folder.py",
    "dlop.runtime.gather.engine": "runtime/gather/engine.py",
    "dlop.tools.inspect_cli": "tools/inspect_cli.py",
    "dlop.tools.bench.cli": "tools/bench/cli.py",
}
# The compiled extensions (optional: an install without a C compiler has none), built
# in place by an editable install.
EXTENSIONS = {
    "dlop.formats._crc32": "formats",
    "dlop.compiler.audio._kernels": "compiler/audio",
    "dlop.runtime.gather._copy": "runtime/gather",
}

# Run in a fresh interpreter: where each module came from (None: not importable).
PROBE = """
import importlib, json, sys
found = {}
for name in sys.argv[1:]:
    try:
        found[name] = importlib.import_module(name).__file__
    except ImportError:
        found[name] = None
print(json.dumps(found))
"""


def probe(py: Path | str, cwd: Path, names: list[str]) -> dict[str, str | None]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(
        [str(py), "-c", PROBE, *names], capture_output=True, text=True, cwd=cwd, env=env
    )
    assert res.returncode == 0, f"the probe failed with cwd={cwd}:\n{res.stderr}"
    found: dict[str, str | None] = json.loads(res.stdout)
    return found


def package_folder(package: str) -> Path:
    """The folder of a listed package under the package-dir mapping (setuptools' rule: the
    longest mapped prefix, then one folder per further name)."""
    mapping: dict[str, str] = SETUPTOOLS["package-dir"]
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        base = mapping.get(".".join(parts[:n]))
        if base is not None:
            return ROOT.joinpath(base, *parts[n:])
    raise AssertionError(f"{package} is under no mapped folder")


def test_the_package_holds_no_links() -> None:
    """dlop/ is the top package's own folder; the subpackages are mapped, not linked."""
    assert [p.name for p in (ROOT / "dlop").iterdir() if p.is_symlink()] == []
    for package, folder in MAPPED.items():
        assert package_folder(package) == ROOT / folder


def test_every_package_folder_is_listed_for_the_wheel() -> None:
    """A subpackage missing from pyproject's list would be left out of a wheel (its
    imports fail only after a non-editable install)."""
    listed = set(SETUPTOOLS["packages"])
    for package in listed:
        assert (package_folder(package) / "__init__.py").is_file(), package
    found = {
        ".".join([package, *init.parent.relative_to(ROOT / folder).parts])
        for package, folder in SETUPTOOLS["package-dir"].items()
        for init in (ROOT / folder).rglob("__init__.py")
        if "peers-env" not in init.parts  # the benchmark's stand-in, never installed
    }
    assert found == listed


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_the_editable_install_imports_the_top_level_folders(where: str, tmp_path: Path) -> None:
    """The test environment's editable install (make env): from the repository root (which
    comes first on sys.path, so dlop/ is the checkout's) and from anywhere else, every
    module comes from its top-level folder, the compiled extensions built in place."""
    found = probe(sys.executable, ROOT if where == "root" else tmp_path, [*MODULES, *EXTENSIONS])
    for name, rel in MODULES.items():
        assert found[name] == str(ROOT / rel), f"{name} came from {found[name]}"
    for name, folder in EXTENSIONS.items():
        built = sorted((ROOT / folder).glob(name.rpartition(".")[2] + ".*.so"))
        assert found[name] == (str(built[0]) if built else None), f"{name}: {found[name]}"


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
        for package in SETUPTOOLS["packages"]:
            init = package.replace(".", "/") + "/__init__.py"
            assert init in names, f"{init} missing from {wheel.name}"
        assert "dlop/formats/SPEC.md" in names
        assert not any(i.external_attr >> 28 == 0o12 for i in zf.infolist()), "symlink in wheel"
        compiled = {
            name.split(".")[0].replace("/", ".")
            for name in names
            if name.endswith(".so") and name.startswith("dlop/")
        }
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

    # Away from the checkout every module comes from the installed copies.
    found = probe(py, elsewhere, [*MODULES, *compiled])
    for name, file in found.items():
        assert file is not None, f"{name} did not import"
        assert Path(file).is_relative_to(Path(site) / "dlop"), f"{name} came from {file}"
    assert (Path(site) / "dlop" / "formats" / "SPEC.md").is_file()

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
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

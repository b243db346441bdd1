"""How dlop installs. The package-dir mapping of pyproject.toml: `import dlop.X` finds
the top-level folders through an editable install, and a wheel holds them as dlop/X.
The wheel with its base dependencies only (a training node's install) reads archives,
and each feature behind an extra, called there, names the extra to install."""

from __future__ import annotations

import email
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
MAPPED = {
    "dlop.formats": "formats",
    "dlop.compiler": "compiler",
    "dlop.runtime": "runtime",
    "dlop.tools": "tools",
}
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
    "dlop.runtime.order._shuffle": "runtime/order",
}


def built_in_place(name: str) -> list[Path]:
    """The editable install's build of extension ``name``: none without a C compiler."""
    return sorted((ROOT / EXTENSIONS[name]).glob(name.rpartition(".")[2] + ".*.so"))


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
    for name in EXTENSIONS:
        built = built_in_place(name)
        assert found[name] == (str(built[0]) if built else None), f"{name}: {found[name]}"


def test_every_extension_is_built_where_a_compiler_is() -> None:
    """The extensions are optional, so a C file that fails to compile is skipped without
    a word at install: where this machine has a C compiler, each must be there."""
    assert sorted(e["name"] for e in SETUPTOOLS["ext-modules"]) == sorted(EXTENSIONS)
    compiler = sysconfig.get_config_var("CC") or "cc"
    if shutil.which(compiler.split()[0]) is None:
        pytest.skip(f"no C compiler here ({compiler})")
    missing = [name for name in EXTENSIONS if not built_in_place(name)]
    assert not missing, f"not built (a compile error at install?): {missing}"


# -- the wheel, installed with the reading dependencies only ----------------------------

PIP = (sys.executable, "-m", "pip")
# Modules that only an extra installs: none may be importable in the reading install.
EXTRA_MODULES = (
    "soundfile", "av", "PIL", "matplotlib", "tqdm", "webdataset", "cloudpickle",  # compile
    "distributed", "s3fs", "gcsfs", "aiohttp", "pyarrow",  # dask, s3, gcs, http, hf
)  # fmt: skip


def base_requirements(wheel: Path) -> list[Requirement]:
    """The wheel's Requires-Dist outside every extra: what `pip install dlop` installs."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(zf.read(name))
    needed = [Requirement(line) for line in meta.get_all("Requires-Dist") or []]
    return [r for r in needed if r.marker is None or r.marker.evaluate({"extra": ""})]


def closure(requirements: list[Requirement]) -> list[metadata.Distribution]:
    """The distributions of this environment that ``requirements`` install, with their
    own dependencies, transitively (markers as pip evaluates them here)."""
    found: dict[str, metadata.Distribution] = {}
    todo = list(requirements)
    while todo:
        req = todo.pop()
        key = canonicalize_name(req.name)
        if key in found:
            continue
        dist = found[key] = metadata.distribution(req.name)
        assert dist.version in req.specifier, f"{req} is not satisfied here ({dist.version})"
        todo += [
            r
            for r in map(Requirement, dist.requires or [])
            if r.marker is None or r.marker.evaluate({"extra": ""})
        ]
    return list(found.values())


def linked_site(dists: list[metadata.Distribution], folder: Path) -> Path:
    """A folder of links to the installed files of ``dists`` and nothing else (each
    top-level module, package and .dist-info they record), to put on a fresh venv's
    path: their dependencies without installing a second copy of torch."""
    folder.mkdir()
    for dist in dists:
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in sorted(tops - {"__pycache__"}):
            target = Path(str(dist.locate_file(top)))
            if target.exists() and not (folder / top).exists():
                (folder / top).symlink_to(target)
    return folder


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    wheels = tmp_path_factory.mktemp("wheels")
    subprocess.run(
        [*PIP, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(ROOT)],
        check=True,
        cwd=wheels,
    )
    (found,) = wheels.glob("dlop-*.whl")
    return found


@pytest.fixture(scope="module")
def reading_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel and its base dependencies only (numpy, zstandard,
    torch and theirs, linked from this environment): a training node's install."""
    base = tmp_path_factory.mktemp("reading")
    deps = linked_site(closure(base_requirements(wheel)), base / "deps")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(site, "deps.pth").write_text(f"{deps}\n")
    subprocess.run(
        [*PIP, "--python", str(py), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
    )
    return venv


def run_in(venv: Path, argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """A command of the venv (its python or a dlop-* script), away from the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        [str(venv / "bin" / argv[0]), *argv[1:]],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=240,
    )


@pytest.mark.slow
def test_the_wheel_holds_the_mapped_folders(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        assert not any(i.external_attr >> 28 == 0o12 for i in zf.infolist()), "symlink in wheel"
    for package in SETUPTOOLS["packages"]:
        assert package.replace(".", "/") + "/__init__.py" in names, package
    assert {"dlop/formats/SPEC.md", "dlop/formats/py.typed", "dlop/runtime/py.typed"} <= names
    for name in EXTENSIONS:  # built here, so built into the wheel too
        if built_in_place(name):
            assert any(n.startswith(name.replace(".", "/") + ".") for n in names), name
    assert base_requirements(wheel) == [
        Requirement("numpy>=1.24"),
        Requirement("zstandard>=0.22"),
        Requirement("torch>=2.1"),
    ]


READ = """
import importlib.util, json, sys
import numpy as np
from dlop.formats import ArchiveWriter, Field
from dlop.runtime import Loader, open_archive

with ArchiveWriter("a.dlop", [Field("x", "f32", (3,)), Field("label", "i64", ())]) as w:
    for i in range(10):
        w.write({"x": np.full(3, i, np.float32), "label": i})
seen = []
for batch in Loader("a.dlop", batch_size=4, shuffle=True, seed=0):
    assert (batch["x"][:, 0] == batch["label"]).all()
    seen += batch["label"].tolist()
print(json.dumps({
    "seen": sorted(seen),
    "item": open_archive("a.dlop")[7]["label"].item(),
    "extras": [m for m in sys.argv[1:] if importlib.util.find_spec(m) is not None],
    "file": sys.modules["dlop.runtime"].__file__,
}))
"""


@pytest.mark.slow
def test_a_reading_install_reads_archives(reading_venv: Path, tmp_path: Path) -> None:
    """pip install dlop, no extra: write an archive, open it, iterate a Loader, and
    inspect and verify it with dlop-inspect; no extra's module is there to help."""
    done = run_in(reading_venv, ["python", "-c", READ, *EXTRA_MODULES], tmp_path)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["extras"] == []
    assert got["seen"] == list(range(10))
    assert got["item"] == 7
    assert Path(got["file"]).is_relative_to(reading_venv)
    built = [name for name in EXTENSIONS if built_in_place(name)]
    for name, file in probe(reading_venv / "bin" / "python", tmp_path, [*MODULES, *built]).items():
        assert file is not None and Path(file).is_relative_to(reading_venv), (name, file)
    for argv in (["info", "a.dlop"], ["verify", "a.dlop"]):
        done = run_in(reading_venv, ["dlop-inspect", *argv], tmp_path)
        assert done.returncode == 0, done.stderr
    for tool in ("dlop-compile", "dlop-bench"):
        done = run_in(reading_venv, [tool, "--help"], tmp_path)
        assert done.returncode == 0 and "usage" in done.stdout, done.stderr


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One input of each kind a feature behind an extra takes, made here (this
    environment has every extra)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dlop.formats import ArchiveWriter, Field
    from tests.compiler.fixtures import webdataset_corpus, write_audio
    from tests.compiler.media import write_image, write_video
    from tests.compiler.signals import make_signal

    root = tmp_path_factory.mktemp("inputs")
    for label in ("a", "b"):
        write_audio(root / "audio" / label / "1.flac", make_signal(16000, 0.3, seed=1), 16000)
        write_video(root / "video" / label / "1.mp4", frames=4)
        write_image(root / "image" / label / "1.png", np.zeros((8, 8, 3), np.uint8))
    webdataset_corpus(root / "tars", shards=1, per_shard=2)
    (root / "parquet").mkdir()
    pq.write_table(pa.table({"label": [0]}), root / "parquet" / "train-0000.parquet")
    (root / "samples.py").write_text(
        "def dataset():\n    return [{'label': i} for i in range(4)]\n"
    )
    with ArchiveWriter(root / "a.dlop", [Field("image", "u8", (8, 8, 3))]) as w:
        w.write({"image": np.zeros((8, 8, 3), np.uint8)})
    return root


# (what the feature is, its command, the extra named, the missing module named)
WITHOUT_EXTRA = [
    ("audio", ["dlop-compile", "{i}/audio", "-o", "o.dlop"], "compile", "soundfile"),
    ("video", ["dlop-compile", "{i}/video", "-o", "o.dlop", "--workers", "1"], "compile", "av"),
    ("image", ["dlop-compile", "{i}/image", "-o", "o.dlop", "--workers", "1"], "compile", "PIL"),
    ("webdataset", ["dlop-compile", "{i}/tars", "-o", "o.dlop"], "compile", "webdataset"),
    ("demo corpus", ["dlop-compile", "--demo", "demo"], "compile", "soundfile"),
    ("drawing", ["dlop-inspect", "show", "{i}/a.dlop", "0", "--png", "s.png"], "compile", "matplotlib"),
    ("bench", ["dlop-bench", "--only", "format"], "compile", "soundfile"),
    ("parquet", ["dlop-compile", "{i}/parquet", "-o", "o.dlop"], "hf", "pyarrow"),
    ("dask", ["dlop-compile", "--dataset", "samples:dataset", "-o", "o.dlop", "--dask", "local:1"], "dask", "distributed"),
    ("s3", ["dlop-inspect", "info", "s3://bucket/a.dlop"], "s3", "s3fs"),
    ("gcs", ["dlop-inspect", "info", "gs://bucket/a.dlop"], "gcs", "gcsfs"),
    ("http", ["dlop-inspect", "info", "http://127.0.0.1:9/a.dlop"], "http", "aiohttp"),
    ("s3 loader", ["python", "-c", "from dlop.runtime import Loader; Loader('s3://bucket/a.dlop', batch_size=1)"], "s3", "s3fs"),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "extra", "module"),
    [pytest.param(argv, extra, module, id=what) for what, argv, extra, module in WITHOUT_EXTRA],
)
def test_a_feature_without_its_extra_names_the_extra(
    reading_venv: Path, inputs: Path, tmp_path: Path, argv: list[str], extra: str, module: str
) -> None:
    """In the reading install each feature behind an extra fails at the call, in a message
    that names the missing module and the extra to install, without a traceback."""
    shutil.copy(inputs / "samples.py", tmp_path)  # --dataset imports it from the working folder
    done = run_in(reading_venv, [a.format(i=inputs) for a in argv], tmp_path)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert f"pip install 'dlop[{extra}]'" in last, done.stderr
    assert module in last, done.stderr
    assert "Traceback" not in done.stderr or argv[0] == "python", done.stderr

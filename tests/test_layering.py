"""The package layering, checked on the import statements: formats needs neither torch
nor the other packages, compiler and runtime never import each other (both import
formats; tools may import all), every folder is imported as dlop.X only, formats starts
no threads, and no module imports another around a circle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FORBIDDEN = {
    "formats": {"torch", "dlop.compiler", "dlop.runtime", "dlop.tools"},
    "compiler": {"dlop.runtime", "dlop.tools"},
    "runtime": {"dlop.compiler", "dlop.tools"},
}
RELATIVE_PARENT = {"compiler": "..runtime", "runtime": "..compiler"}


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names.add(base)
    return names


def violations(package: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in imports_of(path):
            for banned in FORBIDDEN[package]:
                if name == banned or name.startswith(banned + "."):
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
            rel = RELATIVE_PARENT.get(package)
            if (
                rel
                and name.lstrip(".").split(".")[0] in {"runtime", "compiler"} - {package}
                and name.startswith("..")
            ):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    return bad


def test_formats_is_standalone() -> None:
    assert violations("formats") == []


def test_compiler_and_runtime_do_not_import_each_other() -> None:
    assert violations("compiler") == []
    assert violations("runtime") == []


TOP_LEVEL = ("formats", "compiler", "runtime", "tools")


def top_level_imports(path: Path) -> set[str]:
    """Imports of a top-level folder by its folder name: from the repository
    root they would load a second copy of the package beside ``dlop.X``."""
    return {name for name in imports_of(path) if name.split(".")[0] in TOP_LEVEL}


def test_packages_are_imported_as_dlop_only() -> None:
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for folder in (*TOP_LEVEL, "tests")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name in top_level_imports(path)
    ]
    assert bad == []


def test_the_check_catches_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "x.py"
    bad.write_text("import torch\nfrom dlop.runtime import Loader\nfrom ..compiler import x\n")
    assert {"torch", "dlop.runtime", "..compiler"} <= imports_of(bad)
    bad.write_text("from runtime.loader import Loader\nimport dlop.runtime\nfrom .tools import x\n")
    assert top_level_imports(bad) == {"runtime.loader"}


# Calls that start threads or processes; the format layer owns none (runtime.gather.engine
# runs the batch copies).
THREAD_STARTERS = {"Thread", "ThreadPoolExecutor", "ProcessPoolExecutor", "Pool", "Process"}


def thread_starts(path: Path) -> list[str]:
    """Calls of THREAD_STARTERS (as names or attributes) in a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            name = (
                f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            )
            if name in THREAD_STARTERS:
                found.append(f"{path.name}:{node.lineno} calls {name}")
    return found


def test_formats_starts_no_threads() -> None:
    bad = [hit for path in sorted((ROOT / "formats").rglob("*.py")) for hit in thread_starts(path)]
    assert bad == []


def test_the_thread_check_catches_a_pool(tmp_path: Path) -> None:
    bad = tmp_path / "x.py"
    bad.write_text(
        "import threading\nfrom concurrent.futures import ThreadPoolExecutor\n"
        "ThreadPoolExecutor(2)\nthreading.Thread(target=print)\n"
    )
    assert len(thread_starts(bad)) == 2


# -- no import circles -------------------------------------------------------------


def module_files(root: Path) -> dict[str, Path]:
    """``dlop.<dotted name>`` -> file, for every module of the four packages under root."""
    out = {}
    for package in TOP_LEVEL:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(["dlop", *parts])] = path
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Which of the project's modules each module imports, anywhere in it: at the top,
    inside functions (lazy imports) and under TYPE_CHECKING alike. ``from P import n``
    counts as importing P, and P.n too where that is a module."""
    files = module_files(root)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1])
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                found |= {base, *(f"{base}.{a.name}" for a in node.names)}
        graph[name] = {m for m in found if m in files and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or around a loop
    (strongly connected components of more than one module)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        order[v] = low[v] = len(order)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return found


def test_no_module_imports_itself_around_a_circle() -> None:
    assert circles(import_graph(ROOT)) == []


def test_the_circle_check_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    for package in TOP_LEVEL:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "runtime" / "a.py").write_text("from .b import thing\n")
    (tmp_path / "runtime" / "b.py").write_text("def f():\n    from . import c\n")
    (tmp_path / "runtime" / "c.py").write_text("import dlop.runtime.a\n")
    (tmp_path / "formats" / "d.py").write_text("from dlop.formats import e\n")
    (tmp_path / "formats" / "e.py").write_text("x = 1\n")
    graph = import_graph(tmp_path)
    assert graph["dlop.runtime.b"] == {"dlop.runtime", "dlop.runtime.c"}
    assert circles(graph) == [["dlop.runtime.a", "dlop.runtime.b", "dlop.runtime.c"]]


# -- flows run one way ---------------------------------------------------------------

# (lower, upper): no module of the lower package imports one of the upper, at the top,
# lazily or for typing alike: flows run one way. A compile's run
# (compiler/run) drives what it writes and how (compiler/output), which never reaches
# back up into the run.
ONE_WAY = (("dlop.compiler.output", "dlop.compiler.run"),)


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def reaches_back(graph: dict[str, set[str]]) -> list[str]:
    """The imports of ``graph`` that go against ONE_WAY, as 'module imports name'."""
    return sorted(
        f"{module} imports {name}"
        for lower, upper in ONE_WAY
        for module, names in graph.items()
        if _inside(module, lower)
        for name in names
        if _inside(name, upper)
    )


def test_a_compile_s_output_never_imports_its_run() -> None:
    assert reaches_back(import_graph(ROOT)) == []


def test_the_one_way_check_catches_a_planted_import(tmp_path: Path) -> None:
    for package in (*TOP_LEVEL, "compiler/output", "compiler/run"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "compiler" / "run" / "units.py").write_text("from ..output.store import put\n")
    (tmp_path / "compiler" / "output" / "store.py").write_text("def put():\n    pass\n")
    (tmp_path / "compiler" / "output" / "guard.py").write_text(
        "def f():\n    from ..run.units import x\n"
    )
    (tmp_path / "compiler" / "output" / "merge.py").write_text("import dlop.compiler.run\n")
    assert reaches_back(import_graph(tmp_path)) == [
        "dlop.compiler.output.guard imports dlop.compiler.run.units",
        "dlop.compiler.output.merge imports dlop.compiler.run",
    ]

"""House rules for the runtime: no private runtime names used by tests or tools (what
they need is public). Module and function sizes follow their concepts, not a cap."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def private_runtime_names(path: Path) -> list[str]:
    """Names starting with ``_`` imported from, or read as attributes of, the runtime."""
    tree = ast.parse(path.read_text())
    runtime_aliases = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dlop.runtime"):
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{path.name}: imports {alias.name}")
                runtime_aliases.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            runtime_aliases |= {
                a.asname or a.name for a in node.names if a.name.startswith("dlop.runtime")
            }
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            base = node.value
            if isinstance(base, ast.Name) and (
                base.id in runtime_aliases or base.id in RUNTIME_OBJECTS
            ):
                found.append(f"{path.name}:{node.lineno}: {base.id}.{node.attr}")
    return found


# Variable names tests and tools give runtime objects.
RUNTIME_OBJECTS = {"loader", "ds", "archive", "engine", "c", "gather", "it", "first", "resumed"}


def test_tests_and_tools_use_public_runtime_names_only() -> None:
    paths = [
        *sorted((ROOT / "tests" / "runtime").glob("*.py")),
        *sorted((ROOT / "tools").rglob("*.py")),
    ]
    bad = [hit for p in paths for hit in private_runtime_names(p)]
    assert bad == []
    # Code inside strings (subprocess scripts) too: no "._" on runtime modules there.
    for p in paths:
        if p.name == Path(__file__).name:
            continue  # the markers themselves
        text = p.read_text()
        for marker in ("copier._", "threads._", "engine._", "loader._"):
            assert marker not in text, f"{p.name} uses {marker}"


def test_the_checks_catch_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "x.py"
    bad.write_text(
        "from dlop.runtime.gather.engine import _compiled\n"
        "from dlop.runtime import engine\n"
        "engine._helpers\nloader._ring()\n"
    )
    assert len(private_runtime_names(bad)) == 3

"""The layout registry: one module per layout, detected and listed in one place."""

from __future__ import annotations

import ast
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from dlop.compiler import recipe
from dlop.compiler.corpus import layouts
from dlop.compiler.corpus.place import LocalPlace
from dlop.compiler.errors import CompileError

from .fixtures import esc50_corpus

COMPILER = Path(__file__).resolve().parents[2] / "compiler"
LAYOUTS = COMPILER / "corpus" / "layouts"
LAYOUT_FILES = sorted(p for p in LAYOUTS.glob("*.py") if p.name != "__init__.py")
BUILT_IN = {"esc50", "folder", "librispeech", "manifest", "webdataset", "charades", "segmentation"}
BUILT_IN |= {"hf", "peoples-speech", "lhotse"}

# A whole layout, as a file: a folder holding ``items.lst`` whose lines name inputs.
FAKE_LAYOUT = """
from dlop.compiler.corpus.place import Place
from dlop.compiler.corpus.records import Corpus, Item, ListOptions, fingerprint

NAME = "fakelist"
MEDIA = ("audio",)
SIGNS = "items.lst"


def detect(source: Place) -> bool:
    return (source / "items.lst").is_file()


def list_corpus(source: Place, options: ListOptions) -> Corpus:
    raw = (source / "items.lst").read_bytes()
    items = [Item(key=k, path=str(source / k)) for k in raw.decode().split()]
    return Corpus(NAME, str(source), items, False, False, {}, {}, fingerprint(items, raw))
"""


def imports_of(path: Path) -> list[tuple[int, str, list[str]]]:
    """(relative level, module, imported names) of every import statement in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(0, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module or "", [a.name for a in node.names]))
    return found


def imported_modules(path: Path, root: Path = COMPILER) -> set[str]:
    """The dlop.compiler modules a file below ``root`` (the compiler folder) imports, named
    relative to it (``corpus.layouts.esc50``, ``corpus.listing``)."""
    package = path.parent.relative_to(root).parts  # () for compiler/, ("corpus", "layouts")
    names = set()
    for level, module, imported in imports_of(path):
        if level:
            base = list(package[: len(package) - (level - 1)])
        elif module.startswith("dlop.compiler"):
            base, module = [], module.removeprefix("dlop.compiler").lstrip(".")
        else:
            continue
        target = ".".join([*base, *filter(None, [module])])
        names.add(target)
        names |= {f"{target}.{n}".lstrip(".") for n in imported}  # `from . import esc50`
    return names


@pytest.fixture
def fake_layout(tmp_path: Path) -> Iterator[ModuleType]:
    """FAKE_LAYOUT imported from its own file and registered, as a new layout module would be."""
    path = tmp_path / "fakelist.py"
    path.write_text(FAKE_LAYOUT)
    spec = importlib.util.spec_from_file_location("fakelist", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    layouts.register(module)
    yield module
    layouts.unregister("fakelist")
    sys.modules.pop("fakelist", None)


def test_the_registry_holds_every_layout_module() -> None:
    assert {p.stem.replace("_", "-") for p in LAYOUT_FILES} == BUILT_IN  # peoples_speech
    assert set(layouts.names()) == BUILT_IN
    assert layouts.names() == recipe.LAYOUTS
    # detection order: the layouts that say yes or no in name order, then the fallbacks
    assert layouts.names() == (*sorted(BUILT_IN - {"folder"}), "folder")
    for name in BUILT_IN:
        layout = layouts.get(name)
        assert layout.name == name and layout.media and layout.signs
    assert layouts.get("charades").media == ("video",)
    assert layouts.get("segmentation").media == ("image",)
    assert layouts.get("folder").media == ("audio", "video", "image")
    with pytest.raises(CompileError, match="unknown layout 'nope'"):
        layouts.get("nope")


def test_a_new_layout_module_is_detected_and_listed(
    tmp_path: Path, fake_layout: ModuleType
) -> None:
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "items.lst").write_text("a.wav\nb.wav\n")
    assert "fakelist" in layouts.names()
    assert layouts.detect_layout(LocalPlace(root)) == "fakelist"
    assert layouts.layout_media("fakelist", LocalPlace(root)) == "audio"
    corpus = layouts.open_corpus(str(root), None)
    assert corpus.layout == "fakelist"
    assert [it.key for it in corpus.items] == ["a.wav", "b.wav"]
    with pytest.raises(CompileError, match="holds audio, not video"):
        layouts.open_corpus(str(root), "fakelist", media="video")
    # its signs join the message when nothing matches, and it can be ambiguous like any other
    with pytest.raises(CompileError, match=r"cannot tell the layout.*items\.lst"):
        layouts.detect_layout(LocalPlace(tmp_path))
    both = esc50_corpus(tmp_path / "esc", [("wav", 16000, 1)])
    (both / "items.lst").write_text("audio/x.wav\n")
    with pytest.raises(CompileError, match=r"ambiguous.*esc50 and fakelist"):
        layouts.detect_layout(LocalPlace(both))


def test_a_layout_module_must_define_its_names() -> None:
    bare = ModuleType("bare")
    bare.NAME = "bare"  # type: ignore[attr-defined]
    with pytest.raises(CompileError, match="lacks MEDIA, SIGNS, detect, list_corpus"):
        layouts.register(bare)
    esc50 = importlib.import_module("dlop.compiler.corpus.layouts.esc50")
    with pytest.raises(CompileError, match="registered already"):
        layouts.register(esc50)
    assert "bare" not in layouts.names()


def test_a_layout_refuses_media_it_cannot_hold(tmp_path: Path) -> None:
    root = tmp_path / "ch"
    root.mkdir()
    (root / "Charades_v1_train.csv").write_text("id,actions\nAB12,\n")
    assert layouts.open_corpus(str(root), None).media == "video"
    with pytest.raises(CompileError, match="layout charades holds video, not audio"):
        layouts.open_corpus(str(root), "charades", media="audio")


def test_no_layout_module_imports_another() -> None:
    others = {f"corpus.layouts.{p.stem}" for p in LAYOUT_FILES}
    for path in LAYOUT_FILES:
        got = imported_modules(path)
        assert not (got & (others | {"corpus.layouts"})), f"{path.name} imports {got & others}"
        # only the shared place, listing, records and errors of the compiler
        shared = ("corpus.records", "corpus.listing", "corpus.place", "errors")
        assert all(m.startswith(shared) for m in got), (path.name, got)


def test_the_import_check_sees_a_layout_importing_another(tmp_path: Path) -> None:
    probe = tmp_path / "compiler" / "corpus" / "layouts" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text(
        "from . import esc50\nfrom .folder import x\nfrom ..layouts.manifest import y\n"
        "from dlop.compiler.corpus.layouts.charades import z\nfrom ..listing import name_key\n"
    )
    got = imported_modules(probe, tmp_path / "compiler")
    assert {
        "corpus.layouts.esc50",
        "corpus.layouts.folder",
        "corpus.layouts.manifest",
        "corpus.layouts.charades",
    } <= got
    assert "corpus.listing" in got


def test_the_listing_modules_never_import_the_runtime() -> None:
    for path in [
        COMPILER / "corpus" / "listing.py",
        COMPILER / "corpus" / "place.py",
        COMPILER / "corpus" / "records.py",
        *LAYOUT_FILES,
    ]:
        for level, module, _ in imports_of(path):
            top = module.split(".")[0] if not level else ""
            full = module if not level else "." * level + module
            assert not full.startswith(("dlop.runtime", "dlop.tools")), path.name
            assert top not in {"runtime", "tools", "torch"}, path.name
            assert not (level >= 2 and module.split(".")[0] in {"runtime", "tools"}), path.name

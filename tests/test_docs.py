"""Every code block of README.md and docs/*.md runs, as written, against small generated
corpora; the test fails when a block fails.

How a page runs: its blocks in order, in one working folder that holds what the page
names (an ``ESC-50-master`` corpus, ``esc50.dlop``, ``/data/Charades``, ...), Python
blocks in one namespace per page (as a reader pastes them into one session), shell
blocks with bash (``-e``: any failing command fails the block) and this environment's
``dlop-*`` commands on the PATH. What is not literally as written, and why:

- ``pip install`` and ``make`` lines are not run: they make the environment this test
  runs in (and ``make test`` would run this test again).
- absolute ``/data/...`` paths point to the folder the corpora are made in.
- ``device="cuda"`` is ``device="cpu"`` where no CUDA device is present.
- names a page leaves to the reader (their model, training step, epoch count) are
  given stand-ins, listed in ``READER``; each takes what the page hands it and checks it.

A block marked ``<!-- file: NAME -->`` on the line before its fence is a file the page
asks the reader to save: it is written as NAME into the working folder, not run. A
block marked ``<!-- needs: gpu -->`` or ``<!-- needs: cloud -->`` on the line before
its fence is skipped (a CUDA device or a storage account); every other block has a
language this test knows: python and sh run, json is parsed, toml is read as a recipe
file, text (synopses, diagrams) is prose.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dlop.formats import ArchiveWriter, Field

REPO = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))]
RUN = {"python", "sh"}
CHECKED = {"json", "toml", "text"}
_FENCE = re.compile(r"^```(\S*)\s*$")
_NEEDS = re.compile(r"^<!-- needs: (gpu|cloud) -->$")
_FILE = re.compile(r"^<!-- file: ([\w.-]+) -->$")
_SETUP = re.compile(r"^\s*(pip install|make)\b")
_ABSOLUTE_DATA = re.compile(r"(?<![\w./-])/data/")


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    needs: str | None
    file: str | None = None  # save as this file in the working folder, not run


def blocks(page: str) -> list[Block]:
    lines = (REPO / page).read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        assert end < len(lines), f"{page}:{i + 1}: a code block is never closed"
        mark = _NEEDS.match(lines[i - 1]) if i else None
        saved = _FILE.match(lines[i - 1]) if i else None
        text = "\n".join(lines[i + 1 : end])
        out.append(
            Block(
                page,
                i + 1,
                m.group(1),
                text,
                mark and mark.group(1),
                saved and saved.group(1),
            )
        )
        i = end + 1
    return out


def test_every_block_has_a_language_this_test_knows() -> None:
    unknown = [
        f"{b.page}:{b.line} ({b.lang or 'no language'})"
        for page in PAGES
        for b in blocks(page)
        if b.lang not in RUN | CHECKED
    ]
    assert not unknown, f"code blocks neither run nor checked: {unknown}"


# -- what the pages name, made small ------------------------------------------------


def _wav(path: Path, seconds: float, rate: int, seed: int) -> None:
    import soundfile as sf

    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    sf.write(path, rng.uniform(-0.3, 0.3, int(seconds * rate)).astype(np.float32), rate)


def _esc50_corpus(root: Path, clips: int) -> None:
    """ESC-50's layout: audio/*.wav and meta/esc50.csv (fold, target, category)."""
    import csv

    categories = ("dog", "rain", "crying_baby", "clock_tick", "helicopter")
    rows = []
    for n in range(clips):
        fold, target = 1 + n % 5, n % len(categories)
        name = f"{fold}-{100000 + n}-A-{target}.wav"
        _wav(root / "audio" / name, 0.2, 44100, n)
        rows.append([name, fold, target, categories[target], "False", 100000 + n, "A"])
    (root / "meta").mkdir(parents=True, exist_ok=True)
    with open(root / "meta" / "esc50.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["filename", "fold", "target", "category", "esc10", "src_file", "take"])
        w.writerows(rows)


def _esc50_archive(path: Path, samples: int) -> None:
    """What ``dlop-compile`` makes of the full ESC-50 (2000 clips, log-mel [431, 128] f16,
    label, fold, category), written directly: the pages index it by sample number up to
    2000, and compiling 2000 clips here would cost more than the rest of the test."""
    fields = [
        Field.str_("key"),
        Field("logmel", "f16", (431, 128)),
        Field("label", "i64", ()),
        Field("fold", "i64", ()),
        Field.str_("category"),
    ]
    categories = ("dog", "rain", "crying_baby", "clock_tick", "helicopter")
    block = np.random.default_rng(0).standard_normal((8, 431, 128)).astype(np.float16)
    with ArchiveWriter(path, fields, metadata={"classes": list(categories)}) as w:
        for n in range(samples):
            w.write(
                {
                    "key": f"audio/{1 + n % 5}-{100000 + n}-A-{n % 50}.wav",
                    "logmel": block[n % 8],
                    "label": n % 50,
                    "fold": 1 + n % 5,
                    "category": categories[n % 5],
                }
            )


def _speech_archive(path: Path, samples: int, seed: int) -> None:
    """A compiled speech corpus's shape: ragged fbank [*, 80] f16, a transcript and the
    subset it comes from (People's Speech's clean/dirty)."""
    fields = [
        Field.str_("key"),
        Field("fbank", "f16", (None, 80)),
        Field.str_("text"),
        Field.str_("split"),
    ]
    rng = np.random.default_rng(seed)
    with ArchiveWriter(path, fields) as w:
        for n in range(samples):
            frames = int(rng.integers(5, 60))
            w.write(
                {
                    "key": f"utt-{seed}-{n}",
                    "fbank": rng.standard_normal((frames, 80)).astype(np.float16),
                    "text": f"utterance {n}",
                    "split": ("clean", "dirty")[n % 2],
                }
            )


def _gleason(root: Path) -> None:
    from tests.compiler.media import write_image

    rng = np.random.default_rng(0)
    for n in (1, 2):
        stem = f"slide001_core00{n}"
        write_image(
            root / "Train Imgs" / f"{stem}.jpg", rng.integers(0, 255, (48, 64, 3), np.uint8)
        )
        for annotator in ("Maps1_T", "Maps2_T"):
            mask = np.zeros((48, 64), np.uint8)
            mask[8 * n : 24 + 8 * n, 10:40] = 3 if annotator == "Maps1_T" else 4
            write_image(root / annotator / f"{stem}_classimg_nonconvex.png", mask)


def _lhotse_cuts(data: Path) -> None:
    """Cuts whose recordings are named by absolute path, outside the manifests' folder."""
    from lhotse import CutSet, Recording, RecordingSet

    recordings = []
    for n in range(3):
        audio = data / "LibriSpeech" / "dev-clean" / f"84-121123-000{n}.wav"
        _wav(audio, 0.5, 16000, n)
        recordings.append(Recording.from_file(str(audio), recording_id=f"84-121123-000{n}"))
    (data / "manifests").mkdir(parents=True)
    CutSet.from_manifests(recordings=RecordingSet.from_recordings(recordings)).to_file(
        data / "manifests" / "cuts_train.jsonl.gz"
    )


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Everything the pages name, made once; each page copies what it uses."""
    from tests.compiler.media import charades_corpus

    root = tmp_path_factory.mktemp("corpora")
    _esc50_corpus(root / "ESC-50-master", 40)
    _esc50_archive(root / "esc50.dlop", 2000)
    for name, seed in (
        ("librispeech-2023", 1),
        ("librispeech-2024", 2),
        ("librispeech", 3),
        ("peoples_speech", 4),
        ("cv-en", 5),
        ("cv-de", 6),
        ("a", 7),
        ("b", 8),
    ):
        _speech_archive(root / f"{name}.dlop", 40, seed)
    charades_corpus(root / "data" / "Charades")
    _gleason(root / "data" / "Gleason2019")
    _lhotse_cuts(root / "data")
    return root


# What a page makes itself, so its working folder starts without it.
MADE_BY = {"README.md": ("esc50.dlop",)}


def _workdir(corpora: Path, work: Path, page: str) -> Path:
    """A page's working folder: the corpora, hard-linked (nothing a page runs writes into
    an input), less what the page makes itself."""
    made = MADE_BY.get(page, ())
    shutil.copytree(
        corpora,
        work,
        copy_function=os.link,
        ignore=lambda d, names: [n for n in names if Path(d) == corpora and n in made],
    )
    return work


# -- the reader's own code, as small stand-ins --------------------------------------


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.LazyLinear(50)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(x.float().mean(dim=1))
        return out


def _step(*args: Any) -> torch.Tensor:
    """One training step (a model, if given, then a batch's tensors): checks that the
    tensors are one batch."""
    tensors = [a for a in args if not isinstance(a, torch.nn.Module)]
    assert tensors and all(isinstance(t, torch.Tensor) for t in tensors), args
    assert len({len(t) for t in tensors}) == 1, [t.shape for t in tensors]
    return torch.zeros(())


def _make_model() -> torch.nn.Module:
    return _Model()


def _evaluate(model: torch.nn.Module, loader: Any) -> float:
    right = seen = 0
    with torch.no_grad():
        for batch in loader:
            right += int((model(batch["logmel"]).argmax(1) == batch["label"]).sum())
            seen += len(batch["label"])
    assert seen > 0
    return right / seen


def reader_namespace() -> dict[str, Any]:
    """READER: the names pages leave to the reader, bound to stand-ins."""
    return {
        "__name__": "__docs__",
        "epochs": 1,
        "train_step": _step,
        "step": _step,
        "make_model": _make_model,
        "evaluate": _evaluate,
        "accuracy": {},
        "checkpoint": {},
    }


READER = sorted(set(reader_namespace()) - {"__name__"})


# -- running a page -----------------------------------------------------------------


def _as_run_here(text: str, corpora: Path) -> str:
    text = _ABSOLUTE_DATA.sub(f"{corpora}/data/", text)
    if not torch.cuda.is_available():
        text = text.replace('device="cuda"', 'device="cpu"')
    return text


def _run_python(block: Block, text: str, namespace: dict[str, Any]) -> None:
    code = compile(text, f"{block.page}:{block.line}", "exec")
    here = os.getcwd()
    try:
        exec(code, namespace)
    finally:
        os.chdir(here)  # a block that changes folder and fails on the way leaves it here


def _run_shell(block: Block, text: str, work: Path) -> None:
    lines = [line for line in text.split("\n") if not _SETUP.match(line)]
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", "\n".join(lines)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (
        f"{block.page}:{block.line}: the shell block failed (exit {done.returncode})\n"
        f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )


def _check(block: Block, text: str, work: Path) -> None:
    if block.lang == "json":
        json.loads(text)
    elif block.lang == "toml":
        from dlop.compiler.recipe import check_options, load_recipe_file

        recipe = work / f"recipe-{block.line}.toml"
        recipe.write_text(text)
        check_options(load_recipe_file(recipe))


@pytest.mark.parametrize("page", PAGES)
# torch's advice for this machine's core count, not a fault of the page (4 workers on 2 cores)
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
# torch deprecates the tree spec Lightning 2.6 builds for every batch: nothing a page can change
@pytest.mark.filterwarnings(
    r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"
)
def test_the_page_runs_as_written(
    page: str, corpora: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workdir = _workdir(corpora, tmp_path / "work", page)
    monkeypatch.chdir(workdir)
    namespace = reader_namespace()
    for block in blocks(page):
        if block.needs is not None:
            continue
        text = _as_run_here(block.text, corpora)
        if block.file is not None:
            (workdir / block.file).write_text(text + "\n")
        elif block.lang == "python":
            _run_python(block, text, namespace)
        elif block.lang == "sh":
            _run_shell(block, text, workdir)
        else:
            _check(block, text, workdir)


def test_a_failing_block_fails_the_page(tmp_path: Path) -> None:
    """The runner is not lenient: a block that raises or exits non-zero is a failure."""
    bad_python = Block("x.md", 1, "python", "raise ValueError('as written')", None)
    with pytest.raises(ValueError, match="as written"):
        _run_python(bad_python, bad_python.text, reader_namespace())
    bad_shell = Block("x.md", 1, "sh", "true\nfalse\ntrue", None)
    with pytest.raises(AssertionError, match=r"x\.md:1: the shell block failed"):
        _run_shell(bad_shell, bad_shell.text, tmp_path)

"""An archive's ``metadata.structure`` comes from the archive: whatever it holds, opening
either gives samples in a checked shape or a FormatError naming it, never a crash."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlop.compiler import compile_map
from dlop.formats import FormatError
from dlop.runtime import open_archive


def _sample(x: int) -> tuple[Any, ...]:
    return np.arange(3, dtype=np.int16) + x, {"label": x, "name": f"n{x}"}


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("structure") / "a"
    compile_map(_sample, list(range(4)), out, workers=1, progress=False)
    return out


def _with_structure(archive: Path, tmp_path: Path, structure: Any) -> Path:
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in archive.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    index = json.loads((copy / "index.json").read_text())
    index["metadata"]["structure"] = structure
    (copy / "index.json").write_text(json.dumps(index))
    return copy


def test_samples_come_back_in_their_shape(archive: Path) -> None:
    ds = open_archive(archive)
    x, rest = ds[2]
    assert x.tolist() == [2, 3, 4] and rest == {"label": 2, "name": "n2"}
    assert isinstance(open_archive(archive, fields=["0"])[0], dict)  # a part: by field


LEAF = {"key": "0", "field": "0", "value": "array"}


@pytest.mark.parametrize(
    "structure, problem",
    [
        ([1, 2], "a node is a list"),
        ({"type": "tuple", "fields": [{"key": "0", "field": "nope", "value": "array"}]}, "nope"),
        ({"type": "tuple", "fields": [{**LEAF, "value": "pickle"}]}, "reads back as 'pickle'"),
        ({"type": "tuple", "fields": [LEAF, {**LEAF, "key": "1"}]}, "names field '0' twice"),
        ({"type": "tuple", "fields": [{**LEAF, "key": "5"}]}, "key '5' at position 0"),
        ({"type": "set", "fields": [LEAF]}, "a node of type 'set'"),
        ({"type": "tuple", "fields": []}, "a node of type 'tuple'"),
        (
            {
                "type": "tuple",
                "fields": [
                    {
                        "key": "0",
                        "type": "tuple",
                        "fields": [{"key": "0", "type": "tuple", "fields": [LEAF]}],
                    }
                ],
            },
            "nested more than one level",
        ),
        ({"type": "leaf"}, "the top is a single field"),
        ({"type": "tuple", "fields": [{**LEAF, "value": "int"}]}, "reads back as int, but"),
        (
            {"type": "tuple", "fields": [LEAF, {"key": "1", "field": "1.name", "value": "array"}]},
            "field '1.name' reads back as array, but it holds str",
        ),
    ],
)
def test_a_bad_structure_is_refused_by_name(
    archive: Path, tmp_path: Path, structure: Any, problem: str
) -> None:
    copy = _with_structure(archive, tmp_path, structure)
    with pytest.raises(FormatError, match=f"metadata.structure: .*{problem}"):
        open_archive(copy)

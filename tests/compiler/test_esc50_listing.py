"""ESC-50's CSV is listed column by column when it is plain (listing.plain_csv, every row
good): that listing is the row-by-row one's, item for item, on any CSV the fast way takes,
and any other CSV (a bad row, an unusual name or file) is listed row by row."""

from __future__ import annotations

import gc
import random
from pathlib import Path

import pytest

from dlop.compiler.corpus.layouts import esc50, open_corpus
from dlop.compiler.corpus.listing import path_key, plain_csv, plain_names
from dlop.compiler.corpus.place import LocalPlace
from dlop.compiler.errors import CompileError

HEADERS = [
    ["filename", "fold", "target", "category"],
    ["filename", "fold", "target", "category", "esc10", "src_file", "take"],
    ["category", "target", "filename", "fold"],
    ["filename", "fold", "target", "category", "target"],  # the last "target" counts
    ["filename", "fold", "target"],  # no category: refused
    ["filename", "fold", "target", " category"],
]
NAMES = ["a.wav", "b c.wav", "1-100038-A-14.wav", "dup.wav", "dup.wav", "x-y_z.ogg"]
ODD_NAMES = [".hidden.wav", "x/y.wav", "../up.wav", "", "back\\slash.wav", "é.wav", "./a.wav"]
FOLDS = ["1", "2", "5", " 3", "+4", "1_0", "-7"]
ODD_FOLDS = ["x", "", "99999999999999999999", "1.5"]
TARGETS = ["0", "1", "2", "49", " 1", "+2"]
ODD_TARGETS = ["50", "-1", "a", "1000"]
CATEGORIES = ["dog", "rooster", "rain", "sea waves"]


def _csv(rng: random.Random, odd: bool) -> bytes:
    header = rng.choice(HEADERS) if odd else rng.choice(HEADERS[:4])
    lines = [",".join(header)]
    labels = dict(zip(["0", "1", "2", "49"], CATEGORIES, strict=True))
    for _ in range(rng.randint(0 if odd else 1, 12)):
        target = rng.choice(TARGETS)
        category = labels.get(target.strip(" +"), rng.choice(CATEGORIES))
        row = {
            "filename": rng.choice(NAMES),
            "fold": rng.choice(FOLDS),
            "target": target,
            "category": category,
        }
        if odd and rng.random() < 0.3:
            column = rng.choice(list(row))
            odd_values = {
                "filename": ODD_NAMES,
                "fold": ODD_FOLDS,
                "target": ODD_TARGETS,
                "category": CATEGORIES,  # a category that disagrees with its target's
            }
            row[column] = rng.choice(odd_values[column])
        values = [row.get(name, str(rng.randint(0, 9))) for name in header]
        if odd and rng.random() < 0.1:
            values.append("extra")
        if odd and rng.random() < 0.1:
            values[0] = f'"{values[0]}"'
        lines.append(",".join(values))
    if odd and rng.random() < 0.2:
        lines.insert(rng.randint(1, len(lines)), "")
    end = rng.choice(["\n", "\r\n"]) if not odd else rng.choice(["\n", "\r\n", "\r"])
    text = end.join(lines) + rng.choice([end, ""])
    if odd and rng.random() < 0.1:
        text = text.replace("a.wav", "a\0.wav")
    data = text.encode("utf-8", "surrogateescape")
    return (b"\xef\xbb\xbf" if rng.random() < 0.2 else b"") + data


def _listed(tmp_path: Path, raw: bytes, plain: bool) -> object:
    """What a listing made of ``raw``: its items' columns and class names, or the error."""
    root = LocalPlace(tmp_path)
    meta = root / "meta" / "esc50.csv"
    items = esc50.Esc50Items(root, ())
    try:
        classes = esc50._plain_rows(raw, items) if plain else esc50._rows(raw, meta, items)
    except CompileError as e:
        return str(e)
    if classes is None:
        return None
    return classes, items.names, items.row_keys, items.lines, items.facts, items.bad


def test_the_plain_listing_is_the_row_by_row_one_wherever_it_is_taken(tmp_path: Path) -> None:
    rng = random.Random(20261201)
    (tmp_path / "meta").mkdir()
    taken = 0
    for n in range(600):
        raw = _csv(rng, odd=n % 2 == 1)
        fast = _listed(tmp_path, raw, plain=True)
        if fast is None:
            continue
        taken += 1
        slow = _listed(tmp_path, raw, plain=False)
        assert fast == slow, raw
        assert slow[-1] == {}, raw  # type: ignore[index]
    assert taken >= 250  # the plain half and some of the other


@pytest.mark.parametrize(
    "raw",
    [
        b"filename,fold,target,category\n",  # no rows
        b"filename,fold,target,category\na.wav,1,0,dog\n\nb.wav,1,0,dog\n",  # a blank line
        b'filename,fold,target,category\n"a.wav",1,0,dog\n',  # a quote
        b"filename,fold,target,category\ra.wav,1,0,dog\r",  # lone carriage returns
        b"filename,fold,target,category\na.wav,1,0,dog,x\n",  # a row too wide
        b"filename,fold,target,category\n\xc3\xa9.wav,1,0,dog\n",  # not ASCII
        b"filename,fold,target,category\na\0.wav,1,0,dog\n",  # a NUL
        b"filename,fold,target,category\na.wav,1,0,dog\nb.wav,1,0,cat\n",  # target 0 twice
        b"filename,fold,target,category\na.wav,1,0,dog\nb.wav,1,1,dog\n",  # dog twice
        b"filename,fold,target,category\nsub/a.wav,1,0,dog\n",  # a name with a folder
    ],
)
def test_a_csv_with_anything_unusual_is_listed_row_by_row(tmp_path: Path, raw: bytes) -> None:
    assert _listed(tmp_path, raw, plain=True) is None


def test_a_plain_csv_is_split_as_the_csv_module_reads_it() -> None:
    raw = b"\xef\xbb\xbfa,b, c\r\n1,,3 \r\n x,y,z"
    assert plain_csv(raw) == (["a", "b", " c"], [["1", "", "3 "], [" x", "y", "z"]])
    assert plain_csv(b"a,b\n" + b"1," + b"x" * 200_000 + b"\n") is None  # past the field limit


def test_plain_names_are_their_own_keys() -> None:
    """plain_names answers for a whole column what path_key would for each name."""
    rng = random.Random(7)
    pieces = ["a", "B.wav", ".", "..", "/", "\\", " ", "é", "\udcff", ":", "//", "x://y", "-"]
    said = []
    for _ in range(3000):
        name = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 4)))
        if plain_names([name]):
            said.append(name)
            assert path_key(f"audio/{name}") == f"audio/{name}", name
    assert len(said) > 100
    assert plain_names(said) and not plain_names([*said, ".x"]) and not plain_names([""])


def test_the_collector_is_off_while_a_corpus_is_listed_and_back_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "meta").mkdir()
    (tmp_path / "meta" / "esc50.csv").write_text(
        "filename,fold,target,category\na.wav,1,0,dog\nb.wav,2,1,rooster\n"
    )
    seen: list[bool] = []  # whether the collector ran as the CSV was read
    read = esc50.plain_csv

    def reading(raw: bytes) -> tuple[list[str], list[list[str]]] | None:
        seen.append(gc.isenabled())
        return read(raw)

    monkeypatch.setattr(esc50, "plain_csv", reading)
    assert len(open_corpus(str(tmp_path), "esc50").items) == 2
    assert seen == [False] and gc.isenabled()
    (tmp_path / "meta" / "esc50.csv").unlink()  # a listing that fails: it is back all the same
    with pytest.raises(CompileError, match=r"needs meta/esc50\.csv"):
        open_corpus(str(tmp_path), "esc50")
    assert gc.isenabled()
    gc.disable()  # a caller that turned it off keeps it off
    try:
        with pytest.raises(CompileError):
            open_corpus(str(tmp_path), "esc50")
        assert not gc.isenabled()
    finally:
        gc.enable()

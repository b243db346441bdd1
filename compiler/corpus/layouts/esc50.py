"""ESC-50: ``audio/`` clips listed by ``meta/esc50.csv`` (filename, fold, target, category)."""

from __future__ import annotations

from collections.abc import Iterator

from dlop.formats.generations import Listed, listed_file

from ...errors import CompileError
from ..listing import (
    I64,
    CsvRow,
    bytes_fingerprint,
    path_key,
    plain_csv,
    plain_names,
    read_csv,
)
from ..place import Place
from ..records import Corpus, Item, Known, ListOptions, OnDemand

NAME = "esc50"
MEDIA = ("audio",)
SIGNS = "meta/esc50.csv"
ESC50_CLASSES = 50


def detect(source: Place) -> bool:
    return (source / "meta" / "esc50.csv").is_file()


class Esc50Items(OnDemand):
    """The CSV's rows, each input's Item made when asked for: its clip's path is confined
    (Place.confine) then, so an append pays a row's parse and key for each clip the
    archive holds, and a path check only for those it compiles. A name whose path climbs
    out of the corpus (``..``) is checked as the CSV is read: such a row is bad and sets
    no class. One whose way out is a link is bad when its Item is made; its target and
    category count with the other rows'."""

    def __init__(self, root: Place, allow_paths: tuple[str, ...]) -> None:
        self.root, self.allow_paths = root, allow_paths
        self.names: list[str] = []  # per row: its filename
        self.row_keys: list[str] = []
        self.lines: list[int] = []
        self.facts: list[tuple[int, int, str]] = []  # (target, fold, category); -1: bad
        self.bad: dict[int, str] = {}  # row -> why it is bad

    def __len__(self) -> int:
        return len(self.row_keys)

    def keys(self) -> Iterator[str]:
        return iter(self.row_keys)

    def item(self, i: int) -> Item:
        key, error = self.row_keys[i], self.bad.get(i)
        if error is None:
            path, error = _confined(self.root, self.names[i], self.lines[i], self.allow_paths)
        if error is not None:
            return Item(key=key, error=error)
        target, fold, category = self.facts[i]
        return Item(key=key, path=path, label=target, extras={"fold": fold, "category": category})


def list_corpus(root: Place, options: ListOptions) -> Corpus:
    """The CSV's rows in file order; targets and categories checked against each other.
    For an append (``options.known``) whose archive listed the CSV as it begins now, the
    rows after those only (_tail)."""
    meta = root / "meta" / "esc50.csv"
    if not meta.is_file():
        raise CompileError(f"{root}: esc50 layout needs meta/esc50.csv")
    raw = meta.read_bytes()
    if options.known is not None:
        tail = _tail(root, raw, options)
        if tail is not None:
            return tail
    items = Esc50Items(root, options.allow_paths)
    classes = _plain_rows(raw, items)
    if classes is None:  # a CSV with anything unusual in it: read row by row
        classes = _rows(raw, meta, items)
    return _corpus(root, raw, items, classes, listed_file(raw, len(items)))


def _corpus(
    root: Place,
    raw: bytes,
    items: Esc50Items,
    classes: list[str],
    listed: Listed | None,
    after: Listed | None = None,
) -> Corpus:
    return Corpus(
        "esc50",
        str(root),
        items,
        True,
        False,
        {"fold": "i64", "category": "str"},
        {"classes": classes},
        # the CSV names every clip and all that is said of it; the clips' sizes are taken
        # by the work units that read them (Corpus.unit_sizes), not by the listing
        bytes_fingerprint(raw, "esc50"),
        unit_sizes=True,
        listed=listed,
        after=after,
    )


def _tail(root: Place, raw: bytes, options: ListOptions) -> Corpus | None:
    """The rows after those the archive appended to listed (Corpus.after), when the CSV
    begins with the very bytes it listed and the rows after them are plain and good
    (_plain_rows), their classes those of the archive or new ones. None otherwise, and the
    whole CSV is listed: what a row means may then hang on the rows before it (a class
    named twice, a bad row, a quote left open), which only the whole listing tells."""
    known = options.known
    assert known is not None
    size = known.listed.size
    head = known.listed.head_of(raw)
    if head is None:
        return None
    body = head.removeprefix(b"\xef\xbb\xbf")
    header_end = raw.find(b"\n") + 1
    if (
        not 0 < header_end <= size
        # the earlier rows as plain as the new ones (plain_csv): no quote to carry on
        # into the new rows, no line end but \n (and \r\n)
        or not body.isascii()
        or b'"' in body
        or b"\0" in body
        or body.count(b"\r") != body.count(b"\r\n")
        # no blank line: each line after the header is a row, and each row an input, so
        # the record's count is checked against its bytes (an index may come from anywhere)
        or b"\n\n" in body
        or b"\n\r\n" in body
        or body.count(b"\n") - 1 != known.listed.inputs
    ):
        return None
    items = Esc50Items(root, options.allow_paths)
    before = known.listed.inputs
    new: list[str] = []  # the new rows' class names by target: none when no rows
    if size < len(raw):
        plain = _plain_rows(raw[:header_end] + raw[size:], items)
        # a category "" would read as a gap in the class names (_grown)
        if plain is None or not all(category for _, _, category in items.facts):
            return None
        new = plain
        items.lines = [line + before for line in items.lines]  # after the earlier rows
    classes = _grown(known, new)
    if classes is None:
        return None
    listed = listed_file(raw, before + len(items))
    return _corpus(root, raw, items, classes, listed, after=known.listed)


def _grown(known: Known, new: list[str]) -> list[str] | None:
    """The archive's class names (known.metadata) grown by the new rows' (``new``, by
    target): None where a new row's target or category is one of the archive's with
    another partner, or names a class the archive holds none of ("" marks a gap), or adds
    a category to an archive that skipped inputs (a row the earlier listing found bad for
    its target may be good once there are more categories, and only the whole listing
    tells)."""
    classes = known.metadata.get("classes")
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        return None
    targets = {c: t for t, c in enumerate(classes) if c}
    grown = list(classes)
    for target, category in enumerate(new):
        if not category:
            continue  # no row of the new ones has this target
        if target < len(classes):
            if classes[target] != category:
                return None
            continue
        if category in targets or known.skipped:
            return None
        grown.extend([""] * (target - len(grown)))
        grown.append(category)
    return grown


def _rows(raw: bytes, meta: Place, items: Esc50Items) -> list[str]:
    """Lists the CSV into ``items`` row by row, each row's faults its own; returns the
    class names by target."""
    root = items.root
    _, rows = read_csv(meta, root, set(COLUMNS), raw)
    categories = {row.fields.get("category") for row in rows if row.error is None}
    num_classes = max(ESC50_CLASSES, len(categories))
    by_target: dict[int, tuple[str, int]] = {}  # target -> (category, line that set it)
    by_category: dict[str, tuple[int, int]] = {}  # category -> (target, line that set it)
    for row in rows:
        name = row.fields.get("filename", "")
        key = path_key(f"audio/{name}") if name else _at(row.line)
        category = row.fields.get("category", "")
        facts: tuple[int, int] | str = (
            row.error
            or (None if name else _at(row.line, "no filename"))
            or _climbs_out(root, key, name, row.line, items.allow_paths)
            or _facts(row, num_classes, len(categories), by_target, by_category)
        )
        if isinstance(facts, str):  # why the row is bad
            items.bad[len(items.row_keys)] = facts
            facts = (-1, -1)
        else:
            by_target.setdefault(facts[0], (category, row.line))
            by_category.setdefault(category, (facts[0], row.line))
        items.names.append(name)
        items.row_keys.append(key)
        items.lines.append(row.line)
        items.facts.append((*facts, category))
    return [by_target.get(i, ("", 0))[0] for i in range(max(by_target) + 1)] if by_target else []


COLUMNS = ("filename", "fold", "target", "category")


def _at(line: int, why: str = "") -> str:
    """Where a row is in the CSV (its key when it names no clip), and why it is bad."""
    return f"meta/esc50.csv line {line}: {why}" if why else f"meta/esc50.csv line {line}"


def _plain_rows(raw: bytes, items: Esc50Items) -> list[str] | None:
    """Lists the CSV into ``items`` column by column, when it is plain (listing.plain_csv)
    and every row is good: the listing _rows makes of it, at a fraction of its cost (an
    append lists every row to find the few it adds). None, with ``items`` as it was, for
    any other CSV (a bad row, an unusual name), which _rows lists."""
    table = plain_csv(raw)
    if table is None or not table[1]:
        return None
    header, records = table
    if not set(COLUMNS) <= set(header):
        return None  # _rows names the columns missing
    # a column named twice: the last one counts, as in read_csv's fields
    at = {name: len(header) - 1 - header[::-1].index(name) for name in COLUMNS}
    columns = list(zip(*records, strict=True))
    names, categories = columns[at["filename"]], columns[at["category"]]
    if not plain_names(names):  # each its own key under audio/
        return None
    try:
        targets = list(map(int, columns[at["target"]]))
        folds = list(map(int, columns[at["fold"]]))
    except ValueError:
        return None
    classes = dict(zip(targets, categories, strict=True))
    num_classes = max(ESC50_CLASSES, len(set(categories)))
    if (
        min(targets) < 0
        or max(targets) >= num_classes
        or min(folds) < I64.start
        or max(folds) >= I64.stop
        # each target one category and each category one target
        or len(set(zip(targets, categories, strict=True))) != len(classes)
        or len(classes) != len(set(categories))
    ):
        return None
    items.names = list(names)
    items.row_keys = [f"audio/{name}" for name in names]
    items.lines = list(range(2, len(names) + 2))
    items.facts = list(zip(targets, folds, categories, strict=True))
    return [classes.get(i, "") for i in range(max(targets) + 1)]


def _climbs_out(
    root: Place, key: str, name: str, line: int, allow_paths: tuple[str, ...]
) -> str | None:
    """Why a row's clip lies outside the corpus, for a name whose path climbs out of it
    (its key, the path normalized, starts with ``..``): checked now, like a row's other
    faults, so that it sets no class. Other names are checked when their Item is made."""
    if key != ".." and not key.startswith("../"):
        return None
    return _confined(root, name, line, allow_paths)[1]


def _confined(
    root: Place, name: str, line: int, allow_paths: tuple[str, ...]
) -> tuple[str, str | None]:
    """The clip a row names, confined to the corpus (Place.confine): (its path, None), or
    ("", why it lies outside)."""
    try:
        return root.confine(f"audio/{name}", allow_paths), None
    except ValueError as e:
        return "", _at(line, str(e))


def _facts(
    row: CsvRow,
    num_classes: int,
    num_categories: int,
    by_target: dict[int, tuple[str, int]],
    by_category: dict[str, tuple[int, int]],
) -> tuple[int, int] | str:
    """A row's (target, fold), or why the row is bad: its fold or target, or a target and
    category that disagree with an earlier row's."""
    category = row.fields.get("category", "")
    try:
        target, fold = int(row.fields["target"]), int(row.fields["fold"])
    except ValueError:
        return _at(row.line, "fold/target not integers")
    if not 0 <= target < num_classes:
        return _at(
            row.line,
            f"target {target} is not a class index (0 to {num_classes - 1}: the CSV names "
            f"{num_categories} categories, ESC-50 has {ESC50_CLASSES})",
        )
    if fold not in I64:
        return _at(row.line, f"fold {fold} does not fit a 64-bit integer")
    if target in by_target and by_target[target][0] != category:
        first, line = by_target[target]
        return _at(row.line, f"target {target} is {category!r} here but {first!r} on line {line}")
    if category in by_category and by_category[category][0] != target:
        first_target, line = by_category[category]
        return _at(
            row.line,
            f"category {category!r} is target {target} here but {first_target} on line {line}",
        )
    return target, fold

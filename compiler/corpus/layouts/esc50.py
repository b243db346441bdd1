"""ESC-50: ``audio/`` clips listed by ``meta/esc50.csv`` (filename, fold, target, category)."""

from __future__ import annotations

from ...errors import CompileError
from ..listing import I64, path_key, read_csv
from ..place import Place
from ..records import Corpus, Item, ListOptions, fingerprint

NAME = "esc50"
MEDIA = ("audio",)
SIGNS = "meta/esc50.csv"
ESC50_CLASSES = 50


def detect(source: Place) -> bool:
    return (source / "meta" / "esc50.csv").is_file()


def list_corpus(root: Place, options: ListOptions) -> Corpus:
    """The CSV's rows in file order; targets and categories checked against each other."""
    meta = root / "meta" / "esc50.csv"
    if not meta.is_file():
        raise CompileError(f"{root}: esc50 layout needs meta/esc50.csv")
    raw, rows = read_csv(meta, root, {"filename", "fold", "target", "category"})
    categories = {row.fields.get("category") for row in rows if row.error is None}
    num_classes = max(ESC50_CLASSES, len(categories))
    items: list[Item] = []
    by_target: dict[int, tuple[str, int]] = {}  # target -> (category, line that set it)
    by_category: dict[str, tuple[int, int]] = {}  # category -> (target, line that set it)
    for row in rows:
        name = row.fields.get("filename", "")
        key = path_key(f"audio/{name}") if name else f"meta/esc50.csv line {row.line}"
        where = f"meta/esc50.csv line {row.line}"
        error = row.error
        target = fold = -1
        category = row.fields.get("category", "")
        if error is None:
            try:
                target, fold = int(row.fields["target"]), int(row.fields["fold"])
            except ValueError:
                error = f"{where}: fold/target not integers"
        if error is None and not 0 <= target < num_classes:
            error = (
                f"{where}: target {target} is not a class index (0 to {num_classes - 1}: the "
                f"CSV names {len(categories)} categories, ESC-50 has {ESC50_CLASSES})"
            )
        elif error is None and fold not in I64:
            error = f"{where}: fold {fold} does not fit a 64-bit integer"
        elif error is None and target in by_target and by_target[target][0] != category:
            first, line = by_target[target]
            error = f"{where}: target {target} is {category!r} here but {first!r} on line {line}"
        elif error is None and category in by_category and by_category[category][0] != target:
            first_target, line = by_category[category]
            error = (
                f"{where}: category {category!r} is target {target} here but {first_target} "
                f"on line {line}"
            )
        path = ""
        if error is None:
            try:
                path = root.confine(f"audio/{name}", options.allow_paths)
            except ValueError as e:
                error = f"{where}: {e}"
        if error is not None:
            items.append(Item(key=key, error=error))
            continue
        by_target.setdefault(target, (category, row.line))
        by_category.setdefault(category, (target, row.line))
        items.append(
            Item(
                key=key,
                path=path,
                label=target,
                extras={"fold": fold, "category": category},
            )
        )
    names = [by_target.get(i, ("", 0))[0] for i in range(max(by_target) + 1)] if by_target else []
    return Corpus(
        "esc50",
        str(root),
        items,
        True,
        False,
        {"fold": "i64", "category": "str"},
        {"classes": names},
        fingerprint(items, raw, root),
    )

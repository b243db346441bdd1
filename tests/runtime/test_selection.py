"""Selections (where=, indices=): ESC-50 5-fold cross-validation with the Loader, every
order feature on a selection, exact resume, and the errors."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch

from dlop.formats import ArchiveWriter, Field, ShardReader, Zstd
from dlop.runtime import Loader, UsageError, UsageTypeError, count_selected, open_archive
from tests.compiler.fixtures import esc50_row, write_esc50_csv

from .helpers import make_archive

CLIPS = 60  # 12 per fold: every selection divides by world sizes 1..3, so none is padded


@pytest.fixture(scope="module")
def esc50(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, str]]]:
    """An ESC-50-shaped archive (key, fold, label, category, logmel), written in a
    shuffled order over small shards, and the esc50.csv it came from."""
    root = tmp_path_factory.mktemp("esc50")
    names = [f"{1 + n % 5}-{1000 + n}-A-{n % 3}.wav" for n in range(CLIPS)]
    write_esc50_csv(root, [esc50_row(name, n) for n, name in enumerate(names)])
    with open(root / "meta" / "esc50.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    fields = [
        Field.str_("key"),
        Field("fold", "i64", ()),
        Field("label", "i64", ()),
        Field.str_("category"),
        Field("logmel", "f16", (4, 3)),
    ]
    order = np.random.default_rng(7).permutation(CLIPS)
    with ArchiveWriter(root / "archive", fields, shard_bytes=400) as w:
        for n in order.tolist():
            row = rows[n]
            w.write(
                {
                    "key": row["filename"],
                    "fold": int(row["fold"]),
                    "label": int(row["target"]),
                    "category": row["category"],
                    "logmel": np.full((4, 3), n, np.float16),
                }
            )
    return root / "archive", rows


def epoch_keys(loader: Loader) -> list[str]:
    return [k for batch in loader for k in batch["key"]]


def test_five_fold_cross_validation(esc50: tuple[Path, list[dict[str, str]]]) -> None:
    path, rows = esc50
    everything = {r["filename"] for r in rows}
    for fold in range(1, 6):
        others = [k for k in range(1, 6) if k != fold]
        train = open_archive(path, fields="key", where={"fold": others})
        test = open_archive(path, fields="key", where={"fold": fold})
        train_keys = {train[i]["key"] for i in range(len(train))}
        test_keys = {test[i]["key"] for i in range(len(test))}
        assert test_keys == {r["filename"] for r in rows if int(r["fold"]) == fold}
        assert train_keys == {r["filename"] for r in rows if int(r["fold"]) != fold}
        assert not train_keys & test_keys and train_keys | test_keys == everything
        for world in (1, 2, 3):
            for where, keys in (({"fold": others}, train_keys), ({"fold": [fold]}, test_keys)):
                seen = []
                for rank in range(world):
                    loader = Loader(
                        path, 5, seed=fold, rank=rank, world_size=world, where=where, prefetch=0
                    )
                    loader.set_epoch(1)
                    seen += epoch_keys(loader)
                assert sorted(seen) == sorted(keys)  # each selected sample exactly once


@pytest.mark.parametrize("order", ["global", "window"])
def test_selection_resumes_exactly(esc50: tuple[Path, list[dict[str, str]]], order: str) -> None:
    path, _ = esc50
    where = {"fold": [1, 2, 3, 4]}
    kw = dict(seed=3, rank=1, world_size=2, where=where, order=order, window_shards=2)
    loader = Loader(path, 5, **kw)  # type: ignore[arg-type]
    loader.set_epoch(2)
    full = epoch_keys(loader)
    loader.set_epoch(2)
    it = iter(loader)
    head = [k for _, batch in zip(range(2), it, strict=False) for k in batch["key"]]
    state = loader.state_dict()
    del it
    resumed = Loader(path, 5, **kw)  # type: ignore[arg-type]
    resumed.load_state_dict(state)
    resumed.set_epoch(2)
    assert head + epoch_keys(resumed) == full
    # another selection of the same size is another order: its state is refused
    other = Loader(path, 5, **{**kw, "where": {"fold": [2, 3, 4, 5]}})  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="selection"):
        other.load_state_dict(state)


def test_window_order_and_shuffle_off_on_a_selection(
    esc50: tuple[Path, list[dict[str, str]]],
) -> None:
    path, rows = esc50
    keys = sorted(r["filename"] for r in rows if r["target"] == "1")
    window = Loader(path, 4, where={"label": 1}, order="window", window_shards=1, prefetch=0)
    assert sorted(epoch_keys(window)) == keys
    plain = Loader(path, 4, where={"label": 1}, shuffle=False, prefetch=0)
    sel = open_archive(path, where={"label": 1}).selection
    assert sel is not None
    assert np.concatenate(plain.batches(0)).tolist() == sel.tolist()  # archive order


def test_bucketing_and_drop_last_on_a_selection(tmp_path: Path) -> None:
    path = make_archive(tmp_path / "a", n=37, shard_bytes=600)
    indices = np.arange(0, 37, 3)  # 13 samples
    for world in (1, 2, 3):
        got = []
        for rank in range(world):
            loader = Loader(
                path, 2, indices=indices, bucket_by="speech", rank=rank, world_size=world
            )
            batches = [b["label"].tolist() for b in loader]
            got += [x for b in batches for x in b]
        assert set(got) == set(indices.tolist())
        assert len(got) - len(indices) < 2 * world  # at most the padding of whole batches
        loader = Loader(path, 2, indices=indices, drop_last=True, rank=0, world_size=world)
        assert all(len(b["label"]) == 2 for b in loader)


def test_getitems_and_len_count_the_selection(tmp_path: Path) -> None:
    path = make_archive(tmp_path / "a", n=37)
    ds = open_archive(path, where={"label": [5, 9, 30]}, indices=[9, 30, 31])
    assert len(ds) == 2 and ds[-1]["label"] == 30 and ds[0]["key"] == "k009"
    assert ds.__getitems__([1, 0])["label"].tolist() == [30, 9]
    text = open_archive(path, where={"text": ["ttt"]})
    assert [text[i]["label"].item() for i in range(len(text))] == list(range(3, 37, 4))


def test_count_selected(esc50: tuple[Path, list[dict[str, str]]]) -> None:
    path, rows = esc50
    got = count_selected(path, {"fold": [1, 2], "category": "class0"})
    want = [r for r in rows if r["fold"] in "12" and r["category"] == "class0"]
    assert got["samples"] == CLIPS and got["selected"] == len(want)
    assert sum(got["values"]["fold"].values()) == len(want)
    assert got["values"]["category"] == {"class0": len(want)}


def test_a_zstd_text_column_is_chosen_and_counted_block_by_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # where= on a zstd str field decoded it sample by sample at open (in every DataLoader
    # worker too), and count_selected did so for every str field: 200x a raw column's time
    fields = [Field.str_("cat", Zstd(block_bytes=64)), Field.str_("raw"), Field("i", "i64", ())]
    with ArchiveWriter(tmp_path / "a", fields, shard_bytes=700) as w:
        for i in range(300):
            cat = ["dog", "cat", "", "dögs"][i % 4]
            w.write({"cat": cat, "raw": cat, "i": i})

    def per_sample(*args: object) -> None:
        raise AssertionError("a str column read sample by sample")

    monkeypatch.setattr(ShardReader, "get", per_sample)
    where = {"cat": ["dögs", "", "cow"]}
    ds = open_archive(tmp_path / "a", fields="i", where=where)
    want = [i for i in range(300) if i % 4 in (2, 3)]
    assert ds.selection is not None and ds.selection.tolist() == want
    raw = open_archive(tmp_path / "a", fields="i", where={"raw": where["cat"]})
    assert raw.selection is not None and raw.selection.tolist() == want
    got = count_selected(tmp_path / "a", {"cat": ["dögs", "", "cow", ""], "i": list(range(100))})
    assert got["selected"] == 50 and got["values"]["cat"] == {"": 25, "dögs": 25}
    assert got["values"]["i"] == {i: 1 for i in want if i < 100}


def test_selection_errors(esc50: tuple[Path, list[dict[str, str]]]) -> None:
    path, _ = esc50
    with pytest.raises(UsageError, match="no field 'split'"):
        open_archive(path, where={"split": "train"})
    with pytest.raises(UsageError, match=r"'logmel'.*scalar"):
        open_archive(path, where={"logmel": 1})
    with pytest.raises(UsageTypeError, match="must be int; got '1'"):
        open_archive(path, where={"fold": "1"})
    with pytest.raises(UsageTypeError, match="must be str"):
        open_archive(path, where={"category": 1})
    with pytest.raises(UsageError, match="selects no sample of 60"):
        Loader(path, 4, where={"fold": 9})
    with pytest.raises(UsageError, match="more than once"):
        open_archive(path, indices=[1, 1])
    for value in (-(2**63) - 1, 2**63):
        with pytest.raises(UsageError, match=r"'fold' \(i64\) cannot hold"):
            open_archive(path, where={"fold": [1, value]})
    with pytest.raises(UsageError, match=r"outside 0\.\.59"):
        open_archive(path, indices=[60])
    with pytest.raises(UsageTypeError, match="integer sample numbers"):
        open_archive(path, indices=[0.5])
    with pytest.raises(UsageError, match="open Archive and where="):
        Loader(open_archive(path), 4, where={"fold": 1})


def test_a_where_value_outside_the_dtype_is_refused(tmp_path: Path) -> None:
    with ArchiveWriter(tmp_path / "u8", [Field("lab", "u8", ()), Field("w", "f16", ())]) as w:
        for i in range(10):
            w.write({"lab": np.uint8(i), "w": np.float16(i)})
    for value in (300, -1):
        with pytest.raises(UsageError, match=r"'lab' \(u8\) cannot hold: its values are 0\.\.255"):
            open_archive(tmp_path / "u8", where={"lab": value})
    with pytest.raises(UsageError, match=r"'w' \(f16\) cannot hold"):
        open_archive(tmp_path / "u8", where={"w": 1e6})
    assert len(open_archive(tmp_path / "u8", where={"lab": [3, 255], "w": [1.0, 3.0]})) == 1


@pytest.fixture(scope="module")
def folds2000(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2000 clips in 5 folds of 400, as ESC-50: folds of 1600 train / 400 test clips,
    both 1 more than a multiple of 3."""
    path = tmp_path_factory.mktemp("folds2000") / "a"
    fields = [Field("clip", "i64", ()), Field("fold", "i64", ())]
    with ArchiveWriter(path, fields, shard_bytes=4000) as w:
        for i in range(2000):
            w.write({"clip": i, "fold": 1 + i % 5})
    return path


def read_once(path: Path, world: int, **kw: object) -> list[list[int]]:
    """Every rank's clips of an epoch, in the order read."""
    got = []
    for rank in range(world):
        loader = Loader(path, 64, rank=rank, world_size=world, even_shares=False, **kw)  # type: ignore[arg-type]
        loader.set_epoch(1)
        got.append([c for b in loader for c in b["clip"].tolist()])
        loader.close()
    return got


@pytest.mark.parametrize("world", [1, 2, 3])
def test_uneven_shares_read_each_fold_once_per_epoch(folds2000: Path, world: int) -> None:
    for where, count in (({"fold": [1, 2, 3, 4]}, 1600), ({"fold": 5}, 400)):
        shares = read_once(folds2000, world, where=where, prefetch=0)
        clips = sorted(c for share in shares for c in share)
        selected = [i for i in range(2000) if i % 5 in ((0, 1, 2, 3) if count == 1600 else (4,))]
        assert clips == selected  # each exactly once: no padding, nothing dropped
        assert [len(s) for s in shares] == [len(range(r, count, world)) for r in range(world)]
    window = read_once(folds2000, world, where={"fold": 5}, order="window", window_shards=2)
    assert sorted(c for share in window for c in share) == list(range(4, 2000, 5))


def test_uneven_shares_resume_exactly_and_states_keep_to_them(folds2000: Path) -> None:
    kw = dict(seed=2, rank=2, world_size=3, where={"fold": 5}, even_shares=False)
    full = read_once(folds2000, 3, where={"fold": 5}, seed=2)[2]  # rank 2: 133 of 400
    loader = Loader(folds2000, 64, **kw)  # type: ignore[arg-type]
    loader.set_epoch(1)
    it = iter(loader)
    head = [c for _, batch in zip(range(1), it, strict=False) for c in batch["clip"].tolist()]
    state = loader.state_dict()
    del it
    resumed = Loader(folds2000, 64, **kw)  # type: ignore[arg-type]
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    assert head + [c for b in resumed for c in b["clip"].tolist()] == full
    even = Loader(folds2000, 64, **{**kw, "even_shares": True})  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="even_shares=False"):
        even.load_state_dict(state)
    with pytest.raises(UsageError, match="even_shares=True"):
        resumed.load_state_dict(even.state_dict())
    legacy = {k: v for k, v in even.state_dict().items() if k != "even_shares"}
    even.load_state_dict(legacy)  # saved before the setting was recorded: even shares
    with pytest.raises(UsageError, match="drop_last=True drops samples"):
        Loader(folds2000, 64, **{**kw, "drop_last": True})  # type: ignore[arg-type]
    for loader in (resumed, even):
        loader.close()


def test_plans_and_gathers_of_a_mixture_name_sources_alike(tmp_path: Path) -> None:
    a, b = make_archive(tmp_path / "a", n=5), make_archive(tmp_path / "b", n=6)
    loader = Loader({"a": a, "b": b}, 4, fields=["label"], prefetch=0)
    indices = np.array([1, 4, 5, 10])  # two of each source
    planned, _ = loader.choice.plan(indices, loader.buffers()[0])
    gathered = loader.choice.gather(torch.from_numpy(indices))
    assert planned["source"].tolist() == gathered["source"].tolist() == [0, 0, 1, 1]
    assert loader.plan(indices, loader.buffers()[0])[0]["source"].tolist() == [0, 0, 1, 1]
    loader.close()


def test_a_local_path_holding_a_scheme_separator_is_no_url(tmp_path: Path) -> None:
    make_archive(tmp_path / "x:" / "a", n=3)
    ds = open_archive(f"{tmp_path}/x://a")  # no scheme at its start: a local path
    assert len(ds) == 3

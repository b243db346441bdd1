"""Archive-level behaviour: atomic index, abort, hostile index.json, verify."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dlop.formats import ArchiveReader, ArchiveWriter, DlopError, Field, FormatError, SchemaError


def make(path: Path, n: int = 20, shard_bytes: int = 200) -> None:
    with ArchiveWriter(
        path,
        [Field("x", "i64", (4,)), Field.str_("k")],
        shard_bytes=shard_bytes,
        recipe={"r": 1},
        provenance={"source": {"kind": "test"}},
        metadata={"classes": ["a"]},
    ) as w:
        for i in range(n):
            w.write({"x": np.arange(4) + i, "k": str(i)})


def test_abort_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "a"
    with (
        pytest.raises(RuntimeError),
        ArchiveWriter(out, [Field("x", "i64", ())], shard_bytes=16) as w,
    ):
        for i in range(10):
            w.write({"x": i})
        raise RuntimeError("boom")
    assert list(out.iterdir()) == []


def test_bad_sample_names_field_and_sample(tmp_path: Path) -> None:
    with (
        pytest.raises(SchemaError, match=r"sample 1 field 'x'.*shape"),
        ArchiveWriter(tmp_path / "a", [Field("x", "f32", (3,))]) as w,
    ):
        w.write({"x": np.zeros(3)})
        w.write({"x": np.zeros(4)})
    assert not (tmp_path / "a" / "index.json").exists()


def test_refuses_to_overwrite_an_archive(tmp_path: Path) -> None:
    make(tmp_path / "a")
    with pytest.raises(DlopError, match="already holds an archive"):
        ArchiveWriter(tmp_path / "a", [Field("x", "i64", ())])


def test_index_records_everything(tmp_path: Path) -> None:
    make(tmp_path / "a")
    r = ArchiveReader(tmp_path / "a")
    idx = r.index
    assert idx.recipe == {"r": 1} and idx.metadata == {"classes": ["a"]}
    assert idx.provenance["source"] == {"kind": "test"} and idx.provenance["created"].endswith("Z")
    assert idx.provenance["dlop_version"]
    assert sum(s.num_samples for s in idx.shards) == 20 == idx.num_samples
    assert all(s.bytes == (tmp_path / "a" / s.file).stat().st_size for s in idx.shards)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda o: o["shards"][0].update(file="../../etc/passwd"), "plain file name"),
        (lambda o: o["shards"][0].update(file=".hidden"), "plain file name"),
        (lambda o: o.update(num_samples=999), "num_samples"),
        (lambda o: o.update(version=9), "version 9 .*written by a newer dlop: upgrade dlop"),
        (lambda o: o.update(version=0), "version 0 .*damaged or not a dlop archive's"),
        (lambda o: o["schema"][0].update(dtype="complex"), "dtype"),
        (lambda o: o["shards"][0].update(bytes=-1), "non-negative"),
    ],
)
def test_hostile_index(tmp_path: Path, edit, match: str) -> None:
    make(tmp_path / "a")
    p = tmp_path / "a" / "index.json"
    obj = json.loads(p.read_text())
    edit(obj)
    p.write_text(json.dumps(obj))
    with pytest.raises(FormatError, match=match):
        ArchiveReader(tmp_path / "a")


def test_index_not_json_or_missing(tmp_path: Path) -> None:
    make(tmp_path / "a")
    (tmp_path / "a" / "index.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(FormatError, match="JSON"):
        ArchiveReader(tmp_path / "a")
    with pytest.raises(FormatError, match=r"no index\.json"):
        ArchiveReader(tmp_path)


def test_verify_reports_missing_resized_and_corrupt_shards(tmp_path: Path) -> None:
    make(tmp_path / "a")
    r = ArchiveReader(tmp_path / "a")
    assert r.verify() == []
    files = [tmp_path / "a" / s.file for s in r.index.shards]
    files[0].unlink()
    with open(files[1], "ab") as fh:
        fh.write(b"x")
    data = bytearray(files[2].read_bytes())
    data[-1] ^= 1  # trailing padding: only the whole-file CRC covers it
    files[2].write_bytes(bytes(data))
    problems = {p.path: p.message for p in ArchiveReader(tmp_path / "a").verify()}
    assert "missing" in problems[str(files[0])]
    assert "the file has" in problems[str(files[1])]
    assert "whole-file CRC-32" in problems[str(files[2])]
    with pytest.raises(FormatError, match="missing"):
        ArchiveReader(tmp_path / "a").get("x", 0)


def test_writer_continues_from_completed_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    fields = [Field("x", "i64", (4,))]
    seen = []
    first = ArchiveWriter(tmp_path / "a", fields, shard_bytes=64, on_shard=seen.append)
    for i in range(5):
        first.write({"x": np.arange(4) + i})
    first.skip("bad.wav", "empty file")
    first.abort(keep_completed=True)  # interrupted: the shard in progress goes, completed ones stay
    assert [s.file for s in seen] == ["shard-00000.dlop", "shard-00001.dlop"]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "shard-00000.dlop",
        "shard-00001.dlop",
    ]
    second = ArchiveWriter(
        tmp_path / "a", fields, shard_bytes=64, shards=first.shards, skipped=first.skipped
    )
    second.write({"x": np.arange(4) + 4})
    index = second.close()
    assert [s.file for s in index.shards] == [
        "shard-00000.dlop",
        "shard-00001.dlop",
        "shard-00002.dlop",
    ]
    assert index.skipped_count == 1 and index.provenance["created"] == "2023-11-14T22:13:20Z"
    r = ArchiveReader(tmp_path / "a")
    assert [int(r.get("x", i)[0]) for i in range(5)] == [0, 1, 2, 3, 4]

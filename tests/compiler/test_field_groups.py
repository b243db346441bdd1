"""add_fields and drop_fields: a field group computed from an archive's samples reads back
as the function applied to every sample, beside the archive's own fields, whose files are
never touched; its shards are tied to the archive's (a broken tie is a clear error); it
resumes after kill -9 to the same bytes, follows an append, is compiled again or dropped;
and a function that fails, exits, or gives the wrong thing publishes nothing."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dlop.compiler import add_fields, compile_map, drop_fields
from dlop.compiler.errors import CompileError
from dlop.formats import ArchiveReader, FormatError, SchemaError, read_index
from dlop.runtime import Loader, Source, open_archive

from .fixtures import dask_cluster
from .group_data import (
    base_sample,
    clashes,
    double,
    embed,
    embed_expected,
    exits,
    fails_at_37,
    lengths_later,
    lengths_of_wave,
    longer_later,
    not_a_dict,
    quadruple,
    slow_embed,
    spoken,
    spoken_again,
    widens,
)
from .test_custom import files

OPTIONS = {"shard_bytes": "4KiB", "progress": False}
REPO = Path(__file__).resolve().parents[2]


def base(out: Path, count: int = 1000) -> None:
    compile_map(base_sample, list(range(count)), out, workers=1, **OPTIONS)


def own_files(out: Path) -> dict[str, bytes]:
    """The archive's own files: everything but the index and field groups' shards."""
    return {n: b for n, b in files(out).items() if n != "index.json" and not n.startswith("group-")}


def killed_at(moment: str, code: str, out: Path) -> None:
    """``code`` (its ``sys.argv[1]``: ``out``) run in a fresh interpreter that kills itself
    with SIGKILL at ``moment`` (compiler.faults)."""
    env = {**os.environ, "DLOP_TEST_KILL_AT": moment}
    argv = [sys.executable, "-c", f"import sys; sys.path.insert(0, sys.argv[2]); {code}"]
    done = subprocess.run([*argv, str(out), str(REPO)], env=env)
    assert done.returncode == -signal.SIGKILL


def check_group(out: Path, count: int) -> None:
    """Every sample reads back as embed gives it, beside its own fields."""
    archive = open_archive(out)
    assert len(archive) == count
    for i in range(count):
        got, want = archive[i], embed_expected(i)
        assert torch.equal(got["x"], torch.from_numpy(base_sample(i)["x"])), i
        assert torch.equal(got["emb"], torch.from_numpy(want["emb"])), i
        assert torch.equal(got["pitch"], torch.from_numpy(want["pitch"])), i
        assert got["tag"] == want["tag"], i


def test_a_group_reads_back_as_the_function_of_every_sample(tmp_path: Path) -> None:
    out = tmp_path / "a"
    base(out)
    before = own_files(out)
    index = add_fields(out, embed, "emb", workers=2, progress=False)
    assert own_files(out) == before  # not a byte of the archive's own files rewritten
    (group,) = index.field_groups
    assert group.covers == len(index.shards) > 3
    assert [f.name for f in group.fields] == ["emb", "pitch", "tag", "noise"]
    check_group(out, 1000)
    with ArchiveReader(out) as r:
        assert r.verify() == []
    # the draws are the sample's own (seeded by its number), whatever the worker count
    first = files(out)
    add_fields(out, embed, "emb", workers=1, overwrite=True, progress=False)
    again = files(out)
    assert {
        n[len("group-emb-r1") :]: b for n, b in again.items() if n.startswith("group-emb-r1")
    } == {n[len("group-emb-r0") :]: b for n, b in first.items() if n.startswith("group-")}


def test_a_reader_that_predates_groups_reads_the_archive_as_compiled(tmp_path: Path) -> None:
    out = tmp_path / "a"
    base(out, 200)
    before = [open_archive(out)[i] for i in range(200)]
    add_fields(out, embed, "emb", workers=1, progress=False)
    obj = json.loads((out / "index.json").read_text())
    obj.pop("field_groups")  # what a reader that ignores the key sees
    (tmp_path / "old").mkdir()
    for name, data in own_files(out).items():
        (tmp_path / "old" / name).write_bytes(data)
    (tmp_path / "old" / "index.json").write_text(json.dumps(obj))
    old = open_archive(tmp_path / "old")
    assert list(old.fields) == ["x", "wave", "label", "name"]
    for i in range(200):
        assert old[i].keys() == before[i].keys()
        for k in ("x", "wave"):
            assert torch.equal(old[i][k], before[i][k])
        assert (old[i]["label"], old[i]["name"]) == (before[i]["label"], before[i]["name"])
    with ArchiveReader(out, field_groups=False) as r:
        assert list(r.fields) == ["x", "wave", "label", "name"]


def test_a_broken_tie_between_a_group_and_its_shards_is_a_clear_error(tmp_path: Path) -> None:
    out = tmp_path / "a"
    base(out, 400)
    add_fields(out, lambda s: {"y": s["x"] * 3}, "tri", workers=1, progress=False)
    index = json.loads((out / "index.json").read_text())
    group = index["field_groups"][0]["shards"]
    # an index whose group entry names another shard's bytes
    broken = json.loads(json.dumps(index))
    broken["field_groups"][0]["shards"][1]["base_crc32"] ^= 1
    (tmp_path / "b").mkdir()
    for name, data in files(out).items():
        (tmp_path / "b" / name).write_bytes(data)
    (tmp_path / "b" / "index.json").write_text(json.dumps(broken))
    with pytest.raises(FormatError, match="not aligned with the archive's shard"):
        read_index(tmp_path / "b")
    # a group shard whose sample count differs from its archive shard's
    broken = json.loads(json.dumps(index))
    broken["field_groups"][0]["shards"][0]["num_samples"] += 1
    (tmp_path / "b" / "index.json").write_text(json.dumps(broken))
    with pytest.raises(FormatError, match=r"holds \d+ samples computed from a shard of CRC-32"):
        read_index(tmp_path / "b")
    # two group shard files swapped on disk (same size): each header tied to its entry
    sizes = {s["file"]: s["bytes"] for s in group}
    pair = [n for n in sizes if sizes[n] == sizes[group[0]["file"]]][:2]
    assert len(pair) == 2, sizes
    a, b = (out / pair[0]).read_bytes(), (out / pair[1]).read_bytes()
    (out / pair[0]).write_bytes(b)
    (out / pair[1]).write_bytes(a)
    archive = open_archive(out, fields=["x"])  # the archive's own fields read as before
    assert torch.equal(archive[0]["x"], torch.from_numpy(base_sample(0)["x"]))
    with pytest.raises(FormatError, match=f"{pair[0]}: header CRC-32 .* not field group 'tri'"):
        open_archive(out, fields=["x", "y"])
    with ArchiveReader(out) as r:
        assert any("header CRC-32" in p.message for p in r.verify())


def test_kill_9_then_resume_writes_the_uninterrupted_bytes(tmp_path: Path) -> None:
    whole, out = tmp_path / "whole", tmp_path / "out"
    base(whole, 600)
    base(out, 600)
    add_fields(whole, slow_embed, "emb", workers=1, progress=False)
    code = (
        "import sys; sys.path.insert(0, sys.argv[2]);"
        "from dlop.compiler import add_fields;"
        "from tests.compiler.group_data import slow_embed;"
        "add_fields(sys.argv[1], slow_embed, 'emb', workers=1, progress=False)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(out), str(REPO)])
    try:
        deadline = time.monotonic() + 120
        while not (out / "group-emb-r0-000001.dlop").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no second shard"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert read_index(out).field_groups == ()  # nothing published: the archive as it was
    with pytest.raises(CompileError, match="pass resume=True to finish it"):
        add_fields(out, slow_embed, "emb", workers=1, progress=False)
    with pytest.raises(CompileError, match="function and options it began with"):
        add_fields(out, embed, "emb", workers=1, resume=True, progress=False)
    add_fields(out, slow_embed, "emb", workers=2, resume=True, progress=False)
    assert files(out) == files(whole) | {"index.json": files(out)["index.json"]}
    strip = lambda d: {**d, "field_groups": [{**g, "provenance": {}} for g in d["field_groups"]]}  # noqa: E731
    assert (
        strip(json.loads((out / "index.json").read_text()))["field_groups"]
        == strip(json.loads((whole / "index.json").read_text()))["field_groups"]
    )


def test_a_group_follows_an_append(tmp_path: Path) -> None:
    out = tmp_path / "a"
    compile_map(base_sample, list(range(300)), out, workers=1, **OPTIONS)
    add_fields(out, embed, "emb", workers=1, progress=False)
    groups_before = {n: b for n, b in files(out).items() if n.startswith("group-")}
    index = compile_map(base_sample, list(range(500)), out, workers=1, append=True, **OPTIONS)
    assert index.field_groups[0].covers < len(index.shards)  # kept: the earlier shards
    assert open_archive(out, fields=["x"])[450]["x"][0] == 450
    with pytest.raises(
        SchemaError,
        match=r"covers \d+ of the archive's \d+ shards \(shards were appended since\); add_fields",
    ):
        open_archive(out, fields=["x", "emb"])
    with ArchiveReader(out) as r:
        assert "emb" not in r.fields and r.verify() == []
    add_fields(out, embed, "emb", workers=2, progress=False)  # only the new shards computed
    after = files(out)
    assert {n: after[n] for n in groups_before} == groups_before
    check_group(out, 500)


def test_compiled_again_and_dropped_without_touching_the_rest(tmp_path: Path) -> None:
    out = tmp_path / "a"
    base(out, 300)
    add_fields(out, embed, "emb", workers=1, progress=False)
    add_fields(out, double, "two", workers=1, progress=False)
    own = own_files(out)
    reading = open_archive(out)  # holds the first revision's files mapped
    with pytest.raises(CompileError, match=r"already holds field group .two.*overwrite=True"):
        add_fields(out, quadruple, "two", workers=1, progress=False)
    add_fields(out, quadruple, "two", workers=1, overwrite=True, progress=False)
    assert any(n.startswith("group-two-r0") for n in os.listdir(out))  # kept for readers
    assert torch.equal(open_archive(out)[5]["double"], reading[5]["x"] * 4)
    assert torch.equal(reading[5]["double"], reading[5]["x"] * 2)  # the old index, read to its end
    index = drop_fields(out, "emb")
    assert [g.name for g in index.field_groups] == ["two"]
    assert any(n.startswith("group-emb") for n in os.listdir(out))  # until the next change
    assert own_files(out) == own
    assert "emb" not in open_archive(out).fields
    drop_fields(out, "emb")  # dropped again: its files go now
    assert not any(n.startswith("group-emb") for n in os.listdir(out))
    with pytest.raises(CompileError, match="no field group 'emb' to drop; its groups are"):
        drop_fields(out, "emb")


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (fails_at_37, r"sample 37 \(unit-000000-.* the function failed: ValueError: no pitch"),
        (not_a_dict, "gave a Tensor; it gives a dict of the new fields"),
        (clashes, r"field\(s\) \['label'\], which the archive .* holds already"),
        (exits, "a worker process ended while computing"),
    ],
)
def test_a_function_that_fails_publishes_nothing(tmp_path: Path, fn: object, message: str) -> None:
    out = tmp_path / "a"
    base(out, 100)
    before = files(out)
    with pytest.raises(CompileError, match=message):
        add_fields(out, fn, "bad", workers=1, progress=False)  # type: ignore[arg-type]
    assert (out / "index.json").read_bytes() == before["index.json"]
    assert open_archive(out).fields.keys() == {"x", "wave", "label", "name"}
    assert len(open_archive(out)) == 100


def test_bad_names_and_places_are_refused(tmp_path: Path) -> None:
    out = tmp_path / "a"
    base(out, 20)
    for name in ("", "Emb", "9x", "a/b", "x" * 33):
        with pytest.raises(CompileError, match="field group name"):
            add_fields(out, embed, name, progress=False)
    with pytest.raises(CompileError, match="holds no archive"):
        add_fields(tmp_path / "none", embed, "emb", progress=False)
    with pytest.raises(CompileError, match="no interrupted compile of field group"):
        add_fields(out, embed, "emb", resume=True, progress=False)


def test_an_axis_that_varies_later_is_made_ragged(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "a"
    base(out, 60)
    add_fields(out, widens, "w", workers=1, progress=False)
    err = capfd.readouterr().err
    assert "with that axis ragged" in err
    archive = open_archive(out)
    assert archive.fields["y"].ragged
    assert archive[10]["y"].shape == (2,) and archive[40]["y"].shape == (3,)


def test_dask_writes_the_local_bytes(tmp_path: Path) -> None:
    local, on_dask = tmp_path / "local", tmp_path / "dask"
    base(local, 400)
    base(on_dask, 400)
    add_fields(local, embed, "emb", workers=2, progress=False)
    with dask_cluster(2) as address:
        add_fields(on_dask, embed, "emb", dask=address, progress=False)
    assert files(on_dask).keys() == files(local).keys()
    assert {n: b for n, b in files(on_dask).items() if n.startswith("group-")} == {
        n: b for n, b in files(local).items() if n.startswith("group-")
    }


def test_the_loader_reads_group_fields_with_the_archive_s(tmp_path: Path) -> None:
    out = tmp_path / "a"
    base(out, 500)
    add_fields(out, embed, "emb", workers=1, progress=False)
    seen = []
    for batch in Loader(
        out, batch_size=64, fields=["x", "label", "emb", "pitch"], shuffle=True, seed=3
    ):
        x = batch["x"]
        assert torch.equal(batch["emb"][:, :4], x * 2)
        assert torch.equal(batch["emb"][:, 4], x.sum(1))
        seen += (x[:, 0].to(torch.int64)).tolist()
    assert sorted(seen) == list(range(500))
    chosen = open_archive(out, fields=["x", "emb"], where={"label": 3})
    assert len(chosen) == len([i for i in range(500) if i % 7 == 3])
    assert all(int(chosen[j]["emb"][0]) == 2 * int(chosen[j]["x"][0]) for j in range(len(chosen)))
    lengths = open_archive(out, fields=["pitch"]).lengths("pitch")
    assert np.array_equal(
        lengths, [1 + i % 7 if 1 + i % 7 <= 3 + i % 5 else 3 + i % 5 for i in range(500)]
    )


def test_a_mixture_reads_group_fields_from_each_source(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    base(a, 120)
    base(b, 80)
    for out in (a, b):
        add_fields(out, double, "two", workers=1, progress=False)
    loader = Loader(
        {"a": a, "b": Source(b)}, 20, fields=["x", "double"], seed=1, allow_recipe_mismatch=True
    )
    count = 0
    for batch in loader:
        assert torch.equal(batch["double"], batch["x"] * 2)
        count += len(batch["x"])
    assert count == 200


def test_inspect_lists_groups_and_verify_finds_a_changed_byte(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dlop.tools.inspect_cli import main

    out = tmp_path / "a"
    base(out, 300)
    add_fields(out, embed, "emb", workers=1, progress=False)
    compile_map(base_sample, list(range(400)), out, workers=1, append=True, **OPTIONS)
    add_fields(out, double, "two", workers=1, progress=False)
    assert main(["info", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "field groups 2" in shown
    assert "emb  revision 0" in shown and "not read: add_fields again" in shown
    assert "two  revision 0" in shown and "fields double: every shard" in shown
    assert main(["info", "--json", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["fields"]["double"]["group"] == "two" and summary["fields"]["x"]["group"] is None
    assert main(["verify", str(out)]) == 0
    capsys.readouterr()
    victim = out / read_index(out).field_groups[0].shards[1].info.file
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF  # a value byte of the last field, in place
    victim.write_bytes(bytes(data))
    assert main(["verify", str(out)]) != 0
    assert victim.name in capsys.readouterr().out


def test_groups_added_to_and_read_from_an_archive_in_object_storage(
    tmp_path: Path,
    s3: Any,
) -> None:
    out = tmp_path / "a"
    base(out, 300)
    url = s3.make_bucket("groups") + "/a"
    fs = s3.filesystem()
    for name in os.listdir(out):
        fs.put_file(str(out / name), f"{url}/{name}")
    add_fields(out, embed, "emb", workers=1, progress=False)  # the same, locally
    add_fields(url, embed, "emb", workers=2, progress=False)
    add_fields(url, double, "two", workers=1, progress=False)
    groups = sorted(n for n in os.listdir(out) if n.startswith("group-"))
    assert groups and all(fs.cat_file(f"{url}/{n}") == (out / n).read_bytes() for n in groups)
    assert not [n for n in fs.ls(url, detail=False) if ".dlop-group" in n]  # tidied
    add_fields(out, double, "two", workers=1, progress=False)
    cache = tmp_path / "cache"
    own = open_archive(url, fields=["x"], cache_dir=cache)
    assert torch.equal(own[7]["x"], torch.from_numpy(base_sample(7)["x"]))
    own.close()
    # only the archive's shards fetched: no group was read
    cached = [p.name for p in cache.rglob("*.dlop")]
    assert cached and not [n for n in cached if n.startswith("group-")]
    seen = []
    loader = Loader(
        url, batch_size=32, fields=["x", "emb", "pitch", "tag"], cache_dir=cache, seed=2
    )
    for batch in loader:
        for j, i in enumerate((batch["x"][:, 0]).to(torch.int64).tolist()):
            want = embed_expected(i)
            assert torch.equal(batch["emb"][j], torch.from_numpy(want["emb"]))
            assert batch["tag"][j] == want["tag"]
            seen.append(i)
    assert sorted(seen) == list(range(300))
    loader.close()
    assert not [p for p in cache.rglob("group-two-*.dlop")]  # not read: not fetched
    whole = open_archive(url, cache_dir=cache)  # every field, both groups
    assert torch.equal(whole[5]["double"], whole[5]["x"] * 2)
    # as a DataLoader worker started by spawn gets it: reopened from what it was opened with
    sent = pickle.loads(pickle.dumps(whole))
    assert list(sent.fields) == list(whole.fields)
    assert torch.equal(sent[9]["emb"], torch.from_numpy(embed_expected(9)["emb"]))
    sent.close()
    whole.close()
    from dlop.tools.inspect_cli import main

    assert main(["verify", url]) == 0  # the groups' shards fetched and checked with the rest
    # a group shard changed in the bucket is never served
    name = read_index(out).field_groups[1].shards[0].info.file
    data = bytearray((out / name).read_bytes())
    data[-3] ^= 0xFF
    fs.pipe_file(f"{url}/{name}", bytes(data))
    fresh = open_archive(url, fields=["double"], cache_dir=tmp_path / "fresh")
    with pytest.raises(Exception, match="CRC") as caught:
        fresh[0]
    assert name in str(caught.value)
    fresh.close()
    assert main(["verify", url]) != 0
    folders = {p.parent for p in cache.rglob("unit-*.dlop")}
    index = drop_fields(url, "two")
    assert [g.name for g in index.field_groups] == ["emb"]
    # its files stay for readers of the earlier index, until the group changes again
    assert [n for n in fs.ls(url, detail=False) if "group-two" in n]
    again = open_archive(url, fields=["x", "emb"], cache_dir=cache)  # another index.json
    assert torch.equal(again[4]["x"], torch.from_numpy(base_sample(4)["x"]))
    again.close()
    assert {p.parent for p in cache.rglob("unit-*.dlop")} == folders  # nothing fetched again


def test_hostile_group_entries_and_files(tmp_path: Path) -> None:
    out = tmp_path / "a"
    base(out, 200)
    add_fields(out, double, "two", workers=1, progress=False)
    index = json.loads((out / "index.json").read_text())

    def refused(change: Any, message: str) -> None:
        broken = json.loads(json.dumps(index))
        change(broken)
        (out / "index.json").write_text(json.dumps(broken))
        with pytest.raises(FormatError, match=message):
            read_index(out)

    def rename_field(d: dict[str, Any]) -> None:
        d["field_groups"][0]["schema"][0]["name"] = "x"

    def name_a_base_file(d: dict[str, Any]) -> None:
        d["field_groups"][0]["shards"][0]["file"] = d["shards"][0]["file"]

    def more_shards(d: dict[str, Any]) -> None:
        d["field_groups"][0]["shards"].append(d["field_groups"][0]["shards"][0])

    def twice(d: dict[str, Any]) -> None:
        d["field_groups"].append(d["field_groups"][0])

    refused(rename_field, "field name 'x' appears twice")
    refused(name_a_base_file, "expected an entry for file 'group-two-r0-000000.dlop'")
    refused(more_shards, "lists .* shards; the archive has")
    refused(twice, "group 'two' is listed twice")
    (out / "index.json").write_text(json.dumps(index))
    # a group shard gone: the archive's own fields still read, the group's name the file
    (out / index["field_groups"][0]["shards"][0]["file"]).unlink()
    assert len(open_archive(out, fields=["x"])) == 200
    with pytest.raises(FormatError, match=r"group-two-r0-000000\.dlop: shard listed in index"):
        open_archive(out, fields=["double"])
    # --overwrite of the archive removes its groups' files with the rest
    compile_map(base_sample, list(range(50)), out, workers=1, overwrite=True, **OPTIONS)
    assert not [n for n in os.listdir(out) if n.startswith(("group-", ".dlop-group"))]
    assert read_index(out).field_groups == ()


def test_an_axis_that_varies_only_in_appended_shards_compiles_the_group_again(
    tmp_path: Path,
) -> None:
    out = tmp_path / "a"
    base(out, 300)
    first = add_fields(out, longer_later, "y", workers=1, progress=False).field_groups[0]
    assert not first.fields[0].ragged
    compile_map(base_sample, list(range(400)), out, workers=1, append=True, **OPTIONS)
    group = add_fields(out, longer_later, "y", workers=2, progress=False).field_groups[0]
    assert group.fields[0].ragged and group.revision > first.revision
    assert group.covers == len(read_index(out).shards)
    archive = open_archive(out, fields=["x", "y"])
    assert archive[10]["y"].shape == (2,) and archive[350]["y"].shape == (3,)
    # the revision the earlier index listed stays until the group changes again
    assert {n for n in os.listdir(out) if n.startswith(f"group-y-r{first.revision}-")}


def test_a_field_named_as_a_batch_s_lengths_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "a"
    base(out, 60)
    before = (out / "index.json").read_bytes()
    with pytest.raises(CompileError, match=r"'wave' varies in length.*'wave_lengths'"):
        add_fields(out, lengths_of_wave, "w", workers=1, progress=False)
    with pytest.raises(CompileError, match=r"'y' varies in length.*'y_lengths'"):
        add_fields(out, lengths_later, "w", workers=1, progress=False)
    assert (out / "index.json").read_bytes() == before


def test_a_reader_of_the_earlier_index_reads_to_its_end(tmp_path: Path) -> None:
    """A text field (read batch by batch) of a group compiled again, then dropped, while a
    reader of the first index reads on; the files go at the next change after."""
    out = tmp_path / "a"
    base(out, 200)
    add_fields(out, spoken, "said", workers=1, progress=False)
    reading = open_archive(out, fields=["x", "said"])
    add_fields(out, spoken_again, "said", workers=1, overwrite=True, progress=False)
    assert open_archive(out)[3]["said"] == "again 3"
    drop_fields(out, "said")
    got = [reading[i]["said"] for i in range(200)]
    assert got == [f"sample {i}" for i in range(200)]
    assert any(n.startswith("group-said-r1-") for n in os.listdir(out))  # the dropped one
    assert not any(n.startswith("group-said-r0-") for n in os.listdir(out))
    again = add_fields(out, spoken, "said", workers=1, progress=False).field_groups[0]
    assert again.revision == 2  # past every revision written, never reusing a name
    assert not any(n.startswith("group-said-r1-") for n in os.listdir(out))


def test_drop_fields_clears_an_interrupted_group(tmp_path: Path) -> None:
    out = tmp_path / "a"
    base(out, 100)
    with pytest.raises(CompileError, match="the function failed"):
        add_fields(out, fails_at_37, "bad", workers=1, progress=False)
    assert [n for n in os.listdir(out) if "bad" in n]  # its journal and first shards
    with pytest.raises(CompileError, match="was being added when its compile stopped"):
        add_fields(out, double, "bad", workers=1, progress=False)
    drop_fields(out, "bad")
    assert not [n for n in os.listdir(out) if "bad" in n]
    add_fields(out, double, "bad", workers=1, progress=False)


def test_killed_after_publishing_then_run_again(tmp_path: Path) -> None:
    """kill -9 between the new index and its tidying: the next call (resume=True or not)
    finds the work done, keeps the revision the earlier index listed, and deletes what a
    compile interrupted before that one left."""
    out = tmp_path / "a"
    base(out, 150)
    add_fields(out, double, "two", workers=1, progress=False)  # r0
    r0 = sorted(n for n in os.listdir(out) if n.startswith("group-two-r0-"))
    (out / "group-two-r1-000000.dlop").write_bytes((out / r0[0]).read_bytes())  # r1, cut short
    killed_at(
        "group published",
        "from dlop.compiler import add_fields;"
        "from tests.compiler.group_data import quadruple;"
        "add_fields(sys.argv[1], quadruple, 'two', workers=1, overwrite=True, progress=False)",
        out,
    )
    assert read_index(out).field_groups[0].revision == 2  # published: past r1's file
    assert (out / ".dlop-group-two.json").exists()
    index = add_fields(out, quadruple, "two", workers=1, resume=True, progress=False)
    assert index.field_groups[0].revision == 2
    left = sorted(n for n in os.listdir(out) if "two" in n)
    assert left == sorted(r0 + [s.info.file for s in index.field_groups[0].shards])
    assert torch.equal(open_archive(out)[7]["double"], open_archive(out)[7]["x"] * 4)


def test_an_interrupted_append_keeps_the_groups_files(tmp_path: Path) -> None:
    """--append killed, then --resume: the kept revision of a group and an interrupted
    group's files stay (add_fields and drop_fields own them)."""
    out = tmp_path / "a"
    base(out, 150)
    add_fields(out, double, "two", workers=1, progress=False)
    add_fields(out, quadruple, "two", workers=1, overwrite=True, progress=False)
    with pytest.raises(CompileError):
        add_fields(out, fails_at_37, "bad", workers=1, progress=False)
    groups = sorted(n for n in os.listdir(out) if n.startswith(("group-", ".dlop-group")))
    assert any("-r0-" in n for n in groups) and ".dlop-group-bad.json" in groups
    killed_at(
        "unit:1",
        "from dlop.compiler import compile_map;"
        "from tests.compiler.group_data import base_sample;"
        "compile_map(base_sample, list(range(300)), sys.argv[1], workers=1, append=True,"
        " shard_bytes='4KiB', progress=False)",
        out,
    )
    compile_map(base_sample, list(range(300)), out, workers=1, append=True, resume=True, **OPTIONS)
    assert sorted(n for n in os.listdir(out) if n.startswith(("group-", ".dlop-group"))) == groups
    assert len(open_archive(out, fields=["x"])) == 300


def test_a_function_that_hangs_is_stopped_at_the_item_time_limit(tmp_path: Path) -> None:
    from .group_data import hangs

    out = tmp_path / "a"
    base(out, 60)
    before = (out / "index.json").read_bytes()
    with pytest.raises(CompileError, match="ran past item_timeout; nothing was published"):
        add_fields(out, hangs, "h", workers=1, item_timeout=1, progress=False)
    assert (out / "index.json").read_bytes() == before


def test_a_groups_text_that_is_not_utf8_is_named_in_the_groups_own_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A str field of a group whose bytes are not UTF-8 (as a forged group shard whose
    CRCs were forged along would hold them): the batch's error names the group's shard
    file that holds the field, as ``ds[i]`` does, not the archive's own shard."""
    from tests.runtime.helpers import not_utf8_in_copies

    out = tmp_path / "a"
    base(out, 60)
    add_fields(out, embed, "emb", workers=1, progress=False)
    ds = open_archive(out, fields=["tag", "label"])
    shard = ds.shards[0]
    held = shard.field_path("tag")
    assert held != shard.path and held.exists()  # the group's own file
    not_utf8_in_copies(monkeypatch, shard, "tag", 2)
    with pytest.raises(FormatError, match=rf"{held}: field 'tag' sample 2: not UTF-8"):
        ds.__getitems__([2])
    assert ds.__getitems__([1, 3])["tag"] == ["CLIP-0001", "CLIP-0003"]

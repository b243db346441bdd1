"""Paths a corpus names resolve inside SOURCE: absolute paths, ``..`` and links out are bad
inputs unless the user allows the folder (--allow-path), and the message never tells
whether an outside path exists."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from dlop.compiler.corpus.place import LocalPlace, Place, source_place
from dlop.compiler.recipe import build_recipe
from dlop.formats import ArchiveReader
from dlop.tools.compile_cli import main

from .fixtures import esc50_row, write_audio, write_esc50_csv
from .signals import make_signal


def _confined(root: Path | Place, text: str, allowed: tuple[str, ...] = ()) -> str:
    return (root if isinstance(root, Place) else LocalPlace(root)).confine(text, allowed)


def outside_files(tmp_path: Path) -> tuple[Path, Path]:
    """A secret file outside the corpus, and a path next to it that does not exist."""
    secret = write_audio(tmp_path / "home" / "secret.wav", make_signal(16000, 0.5, seed=1), 16000)
    return secret, secret.with_name("absent.wav")


def reasons(out: Path) -> list[str]:
    return [e["reason"] for e in ArchiveReader(out).errors()]


def compile_ok(*args: str) -> Path:
    assert main([*args, "-q", "--workers", "1"]) == 0
    return Path(args[args.index("-o") + 1])


def test_a_file_or_folder_linked_out_since_an_earlier_listing_is_refused(tmp_path: Path) -> None:
    """Folders' real paths are remembered within one listing only: a folder swapped for a
    link after an earlier compile in the same process is seen, and so is a file that is
    itself a link out."""
    from dlop.compiler.corpus.layouts import open_corpus, stream_items

    root, outside = tmp_path / "corpus", tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    (root / "a" / "x.wav").write_bytes(b"")
    (outside / "x.wav").write_bytes(b"")
    os.symlink(outside / "x.wav", root / "b.wav")  # a file that is a link out
    manifest = root / "m.jsonl"
    manifest.write_text(
        "".join(
            json.dumps({"audio_filepath": p, "duration": 1.0}) + "\n" for p in ("a/x.wav", "b.wav")
        )
    )

    def errors() -> list[str | None]:
        return [item.error for item in stream_items(open_corpus(str(manifest), "manifest"))]

    first = errors()
    assert first[0] is None and "leads out of the corpus through a link" in str(first[1])
    (root / "a" / "x.wav").unlink()
    (root / "a").rmdir()
    os.symlink(outside, root / "a")  # the folder now leads out
    assert all("leads out of the corpus through a link" in str(e) for e in errors())


def test_confined_resolves_inside_and_refuses_the_rest(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    (root / "a").mkdir(parents=True)
    (tmp_path / "out").mkdir()
    os.symlink(tmp_path / "out", root / "out-link")
    os.symlink(root / "a", root / "in-link")
    assert _confined(root, "a/x.wav") == str(root / "a" / "x.wav")
    assert _confined(root, "a/../a/x.wav") == str(root / "a/../a/x.wav")
    assert _confined(root, "in-link/x.wav") == str(root / "in-link" / "x.wav")  # a link inside
    for text in ("../out/x.wav", "/etc/passwd", "a/../../out/x.wav", "s3://bucket/x.wav"):
        with pytest.raises(ValueError, match="lies outside the corpus; pass --allow-path"):
            _confined(root, text)
    with pytest.raises(ValueError, match="leads out of the corpus through a link"):
        _confined(root, "out-link/x.wav")
    allowed = (str(tmp_path / "out"), "s3://bucket/audio")
    assert _confined(root, "out-link/x.wav", allowed) == str(root / "out-link" / "x.wav")
    assert _confined(root, "../out/x.wav", allowed) == str(root / "../out/x.wav")
    assert _confined(root, "s3://bucket/audio/x.wav", allowed) == "s3://bucket/audio/x.wav"
    with pytest.raises(ValueError, match="outside"):
        _confined(root, "s3://bucket/audio/../private/x.wav", allowed)
    with pytest.raises(ValueError, match="outside"):
        _confined(root, "s3://bucket/audiobook/x.wav", allowed)


def test_a_url_source_reads_no_local_file(tmp_path: Path) -> None:
    root = source_place("memory://corpus/ds", {})
    assert _confined(root, "clips/a.wav") == "memory://corpus/ds/clips/a.wav"
    assert _confined(root, "memory://corpus/ds/clips/a.wav") == "memory://corpus/ds/clips/a.wav"
    for text in ("/etc/passwd", "../other/a.wav", "memory://corpus/other/a.wav"):
        with pytest.raises(ValueError, match="outside the corpus"):
            _confined(root, text)


def test_manifest_paths_out_of_the_corpus_are_bad_inputs(tmp_path: Path) -> None:
    secret, absent = outside_files(tmp_path)
    root = tmp_path / "corpus"
    write_audio(root / "wav" / "a.wav", make_signal(16000, 0.5, seed=2), 16000)
    (root / "linked").symlink_to(secret.parent)
    names = [
        "wav/a.wav",
        str(secret),
        str(absent),
        "../home/secret.wav",
        "../home/absent.wav",
        "linked/secret.wav",
    ]
    manifest = root / "train.jsonl"
    manifest.write_text("".join(json.dumps({"audio_filepath": n}) + "\n" for n in names))
    out = compile_ok(str(manifest), "-o", str(tmp_path / "a"))
    assert len(ArchiveReader(out)) == 1
    why = reasons(out)
    assert len(why) == 5 and all("--allow-path" in r for r in why)
    # the same words whether the outside file exists or not
    assert why[0].replace("secret", "absent") == why[1]
    assert why[2].replace("secret", "absent") == why[3]
    allowed = compile_ok(
        str(manifest), "--allow-path", str(secret.parent), "-o", str(tmp_path / "b")
    )
    assert len(ArchiveReader(allowed)) == 4  # the absent file is then a missing input
    assert build_recipe({"source": str(manifest), "allow_paths": ["x"]}).allow_paths == (
        os.path.abspath("x"),
    )


def test_esc50_csv_names_cannot_climb_out(tmp_path: Path) -> None:
    outside_files(tmp_path)
    root = tmp_path / "esc"
    write_audio(root / "audio" / "1-1-A-0.wav", make_signal(16000, 0.5, seed=3), 16000)
    rows = [esc50_row("1-1-A-0.wav", 0), esc50_row("../../home/secret.wav", 1)]
    write_esc50_csv(root, rows)
    out = compile_ok(str(root), "-o", str(tmp_path / "a"))
    assert len(ArchiveReader(out)) == 1
    (why,) = reasons(out)
    assert "meta/esc50.csv line 3" in why and "lies outside the corpus" in why
    # found as the CSV is read: the row sets no class, so a later row may give its
    # target another category
    write_audio(root / "audio" / "2-2-A-1.wav", make_signal(16000, 0.5, seed=4), 16000)
    write_esc50_csv(root, [*rows, {**esc50_row("2-2-A-1.wav", 1), "category": "other"}])
    out = compile_ok(str(root), "-o", str(tmp_path / "b"))
    assert len(ArchiveReader(out)) == 2 and len(reasons(out)) == 1
    assert ArchiveReader(out).index.metadata["classes"] == ["class0", "other"]


def test_an_esc50_clip_linked_out_is_a_bad_input_when_it_is_compiled(tmp_path: Path) -> None:
    """A clip whose way out is a link is found when its Item is made (as the clip is
    compiled), not as the CSV is read: it is a bad input, nothing of the file outside is
    read, and an append whose archive holds it never looks at it."""
    secret, _ = outside_files(tmp_path)
    root = tmp_path / "esc"
    write_audio(root / "audio" / "1-1-A-0.wav", make_signal(16000, 0.5, seed=3), 16000)
    os.symlink(secret, root / "audio" / "2-2-A-1.wav")
    write_esc50_csv(root, [esc50_row("1-1-A-0.wav", 0), esc50_row("2-2-A-1.wav", 1)])
    out = compile_ok(str(root), "-o", str(tmp_path / "a"))
    assert len(ArchiveReader(out)) == 1
    (why,) = reasons(out)
    assert "meta/esc50.csv line 3" in why and "leads out of the corpus through a link" in why
    write_audio(root / "audio" / "3-3-A-2.wav", make_signal(16000, 0.5, seed=5), 16000)
    rows = [esc50_row("1-1-A-0.wav", 0), esc50_row("2-2-A-1.wav", 1), esc50_row("3-3-A-2.wav", 2)]
    write_esc50_csv(root, rows)
    assert main([str(root), "-q", "--workers", "1", "--append", "-o", str(out)]) == 0
    assert len(ArchiveReader(out)) == 2 and len(reasons(out)) == 1


def test_a_listed_path_with_a_nul_byte_or_no_name_is_a_bad_input(tmp_path: Path) -> None:
    """A name with a NUL byte names no file (the system's calls refuse it, each its own
    way: reading a header for the rate check stopped the compile); an ESC-50 row with no
    filename named the audio folder. Both are bad inputs, named, and the rest compile."""
    root = tmp_path / "esc"
    write_audio(root / "audio" / "1-1-A-0.wav", make_signal(16000, 0.5, seed=3), 16000)
    rows = [esc50_row("1-1-A-0.wav", 0), esc50_row("a\x00.wav", 1), esc50_row("", 2)]
    write_esc50_csv(root, rows)
    out = compile_ok(str(root), "-o", str(tmp_path / "a"))
    assert len(ArchiveReader(out)) == 1
    nul, empty = reasons(out)
    assert "meta/esc50.csv line 3" in nul and "holds a NUL byte" in nul
    assert empty == "meta/esc50.csv line 4: no filename"
    manifest = tmp_path / "m" / "train.jsonl"
    write_audio(manifest.parent / "a.wav", make_signal(16000, 0.5, seed=4), 16000)
    manifest.write_text('{"audio_filepath": "a.wav"}\n{"audio_filepath": "a\\u0000.wav"}\n')
    out = compile_ok(str(manifest), "-o", str(tmp_path / "b"))
    assert len(ArchiveReader(out)) == 1
    (nul,) = reasons(out)
    assert "holds a NUL byte" in nul


def test_hf_cells_naming_outside_files_are_bad_inputs(tmp_path: Path) -> None:
    from datasets import Audio, Value

    from .test_layout_hf import write_parquet

    secret, absent = outside_files(tmp_path)
    root = tmp_path / "ds"
    write_audio(root / "clips" / "a.wav", make_signal(16000, 0.5, seed=4), 16000)
    paths = ["clips/a.wav", str(secret), str(absent), "../home/secret.wav"]
    cells = [{"bytes": None, "path": p} for p in paths]
    columns = {"audio": cells, "text": ["t"] * len(paths)}
    features = {"audio": Audio(sampling_rate=16000), "text": Value("string")}
    write_parquet(root / "data" / "train-00000-of-00001.parquet", columns, features)
    out = compile_ok(str(root), "--layout", "hf", "-o", str(tmp_path / "a"))
    assert len(ArchiveReader(out)) == 1
    why = reasons(out)
    assert len(why) == 3 and all("lies outside the corpus" in r for r in why)
    assert why[0].replace("secret", "absent").replace("row 1", "row 2") == why[1]


def test_peoples_speech_and_lhotse_names_cannot_climb_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from .test_layout_lhotse import lhotse_corpus
    from .test_layout_peoples_speech import ps_corpus

    source = ps_corpus(tmp_path / "ps", tars=False)
    line = {
        "audio_document_id": "x",
        "training_data": {"duration_ms": [1], "label": ["x"], "name": ["../../../etc/x.flac"]},
    }
    with (source / "clean.json").open("a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
    out = compile_ok(str(source), "-o", str(tmp_path / "a"))
    assert len(ArchiveReader(out)) == 5
    assert any("lies outside the corpus" in r for r in reasons(out))

    root = lhotse_corpus(tmp_path / "lh", monkeypatch)
    cuts = root / "cuts"  # its recordings name clips/ from the working directory, outside it
    assert main([str(cuts), "-q", "--workers", "1", "-o", str(tmp_path / "b")]) == 1
    allowed = compile_ok(str(cuts), "--allow-path", str(root), "-o", str(tmp_path / "c"))
    assert len(ArchiveReader(allowed)) == 4


def test_the_roots_links_are_resolved_once_not_per_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "many"
    root.mkdir()
    real, asked = os.path.realpath, []

    def counted(path: Any, *args: Any, **kwargs: Any) -> str:
        asked.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os.path, "realpath", counted)
    for n in range(100):
        _confined(root, f"a/{n}.wav")
    assert asked.count(str(root)) <= 1 and len(asked) <= 101


def test_a_listed_path_reads_as_its_folder_joined_with_the_name(tmp_path: Path) -> None:
    """The path a listing resolves a name to is the one pathlib gives (``root / name``),
    for plain names, which are joined as strings, and for every other spelling."""
    root = tmp_path / "corpus"
    (root / "wav").mkdir(parents=True)
    names = [
        "a.wav", "wav/b.wav", "wav//c.wav", "./wav/d.wav", "wav/./e.wav", "wav/", "wav/.",
        ".hidden.wav", "wav/../f.wav", "x y.wav", "é.wav", "a.", "..b",
    ]  # fmt: skip
    for name in names:
        assert _confined(root, name) == str(root / name), name
    assert _confined(Path("."), "a.wav") == "a.wav"  # a relative root as pathlib spells it

"""A corpus Place, local or in a storage: the same answers from either, from one listing."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlop.compiler.corpus.place import LocalPlace, Place, StoredPlace, is_archive, source_place

NAMES = ["a/b.wav", "a-b.wav", "a.wav", "ab/c.wav", "a/b/c.parquet", "x/y/z/deep.parquet", "B.wav"]


@pytest.fixture
def both(tmp_path: Path) -> Iterator[tuple[Place, Place]]:
    """The same files as a local folder and as a memory:// prefix."""
    fsspec = pytest.importorskip("fsspec")
    mem = fsspec.filesystem("memory")
    prefix = f"corpus-{uuid.uuid4().hex}"
    for name in NAMES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(name.encode())
        mem.pipe_file(f"/{prefix}/{name}", name.encode())
    yield LocalPlace(tmp_path), source_place(f"memory://{prefix}", {})
    mem.rm(f"/{prefix}", recursive=True)


def _rel(places: list[Place], base: Place) -> list[str]:
    return [str(p.relative_to(base)) for p in places]


def test_a_stored_place_answers_as_a_local_one(both: tuple[Place, Place]) -> None:
    local, stored = both
    assert isinstance(stored, StoredPlace) and stored.local is None
    for place in (local, stored):
        assert _rel(place.files_below(), place) == _rel(local.files_below(), local)
        assert _rel(place.files_below((".wav",)), place) == _rel(
            local.files_below((".wav",)), local
        )
        assert _rel(place.subfolders(), place) == ["a", "ab", "x"]
        assert _rel(sorted(place.glob("*/*.parquet")), place) == []
        assert _rel(sorted(place.glob("*/*/*.parquet")), place) == ["a/b/c.parquet"]
        assert _rel(sorted(place.glob("*.wav")), place) == ["B.wav", "a-b.wav", "a.wav"]
        f = place / "a" / "b.wav"
        assert f.is_file() and not f.is_dir() and f.parent.is_dir()
        assert f.read_bytes() == b"a/b.wav" and f.size() == 7 == f.asked_size()
        with f.open("rb") as handle:
            assert handle.read() == b"a/b.wav"
        with f.open() as text:
            assert text.read() == "a/b.wav"
        missing = place / "nothing.wav"
        assert not missing.exists() and missing.size() == -1
        with pytest.raises(FileNotFoundError):
            missing.asked_size()
        assert (f.name, f.stem, f.suffix) == ("b.wav", "b", ".wav")
        assert place in f.parents and f.is_relative_to(place)
        assert not is_archive(place / "a")


def test_places_sort_as_paths_do(both: tuple[Place, Place]) -> None:
    """Part by part ("a/b.wav" before "a-b.wav"), as pathlib sorts: the order of a listing,
    so of an archive's samples, is the same for a folder and a bucket."""
    local, stored = both
    want = [
        str(p.relative_to(Path())) for p in sorted(Path(n) for n in NAMES if n.endswith(".wav"))
    ]
    for place in (local, stored):
        got = [str(p.relative_to(place)) for p in place.files_below((".wav",))]
        assert got == want
    assert want.index("a/b.wav") < want.index("a-b.wav")


def test_a_place_is_no_local_path(both: tuple[Place, Place]) -> None:
    for place in both:
        with pytest.raises(TypeError):
            open(place / "a.wav")  # type: ignore[call-overload]  # noqa: SIM115
        with pytest.raises(Exception, match="read only"):
            (place / "a.wav").open("wb")  # type: ignore[call-overload]


def test_a_url_of_the_same_storage_is_a_place_beside_it(both: tuple[Place, Place]) -> None:
    _, stored = both
    other = stored.at(f"{stored}/a/b.wav")
    assert other == stored / "a" / "b.wav" and other.read_bytes() == b"a/b.wav"
    assert isinstance(stored.at("/data/x.wav"), LocalPlace)  # a local path stays one
    assert stored.size_of("/data/x.wav") == -1  # not asked of the storage

"""Streamed layouts (hf, webdataset, peoples-speech) read any slice of their items alike: a
unit's task carries only its slice, so a Dask compile in small units equals the plain one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from dlop.compiler.corpus.layouts import open_corpus, stream_items
from dlop.compiler.corpus.records import Corpus, Item
from dlop.formats import ArchiveReader
from dlop.tools.compile_cli import main

from .fixtures import dask_cluster, webdataset_corpus
from .test_layout_hf import hf_corpus
from .test_layout_peoples_speech import ps_corpus

EPOCH = "1700000000"


def hf_source(root: Path) -> tuple[Path, str]:
    return hf_corpus(root), "hf"


def wds_source(root: Path) -> tuple[Path, str]:
    return webdataset_corpus(root, shards=2, per_shard=3), "webdataset"


def ps_source(root: Path) -> tuple[Path, str]:
    return ps_corpus(root), "peoples-speech"


SOURCES: dict[str, Callable[[Path], tuple[Path, str]]] = {
    "hf": hf_source,
    "webdataset": wds_source,
    "peoples-speech": ps_source,
}


def seen(items: list[Item]) -> list[tuple[str, object, object, object]]:
    return [(it.key, it.data, it.path, it.error) for it in items]


@pytest.mark.parametrize("layout", list(SOURCES))
def test_every_slice_of_the_items_streams_like_the_whole(tmp_path: Path, layout: str) -> None:
    source, name = SOURCES[layout](tmp_path / "c")
    corpus = open_corpus(str(source), name)
    whole = seen(list(stream_items(corpus)))
    n = len(corpus.items)
    assert n == 5 or n == 6
    for a in range(n):
        for b in range(a + 1, n + 1):
            part: Corpus = dataclasses.replace(corpus, items=corpus.items[a:b])
            assert seen(list(stream_items(part))) == whole[a:b], (a, b)
            assert seen(list(stream_items(corpus, a, b))) == whole[a:b], (a, b)
    assert all(it.data is None for it in corpus.items)  # the listing's items stay light


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def compile_in_units(source: Path, name: str, tmp_path: Path, dask: str | None) -> None:
    """Plain, in units on local processes, and (given a scheduler address) on Dask."""
    common = [str(source), "--layout", name, "--duration", "0.5", "-q"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SOURCE_DATE_EPOCH", EPOCH)
        assert main([*common, "--workers", "1", "-o", str(tmp_path / "plain")]) == 0
        units = ["--unit-inputs", "2"]
        assert main([*common, *units, "--workers", "1", "-o", str(tmp_path / "local")]) == 0
        if dask:
            assert main([*common, *units, "--dask", dask, "-o", str(tmp_path / "dask")]) == 0
    assert samples(tmp_path / "local") == samples(tmp_path / "plain")
    if dask:
        assert files(tmp_path / "dask") == files(tmp_path / "local")


def samples(out: Path) -> list[dict[str, object]]:
    """Every sample's fields (arrays as bytes) and the skipped inputs, in order."""
    with ArchiveReader(out) as r:
        got: list[dict[str, object]] = [
            {
                k: np.asarray(v).tobytes() if not isinstance(v, str | int) else v
                for k, v in s.items()
            }
            for s in (r.sample(i) for i in range(len(r)))
        ]
        got.append({"errors": [e.get("key") for e in r.errors()]})
    return got


@pytest.mark.parametrize("layout", list(SOURCES))
def test_small_units_on_the_local_engine_equal_the_plain_compile(
    tmp_path: Path, layout: str
) -> None:
    source, name = SOURCES[layout](tmp_path / "c")
    compile_in_units(source, name, tmp_path, dask=None)


@pytest.mark.slow
def test_small_units_on_dask_equal_the_plain_compile(tmp_path: Path) -> None:
    pytest.importorskip("distributed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SOURCE_DATE_EPOCH", EPOCH)  # before the workers start: they take it
        with dask_cluster() as address:
            for layout, make in SOURCES.items():
                source, name = make(tmp_path / layout / "c")
                compile_in_units(source, name, tmp_path / layout, dask=address)


def test_tar_members_webdataset_passes_over_are_not_listed(tmp_path: Path) -> None:
    """A README or a ``__meta__`` member is no sample to webdataset's reader: listing it as
    one threw the stream off (every compile of the tar failed, 'the tar changed')."""
    import io
    import tarfile

    root = webdataset_corpus(tmp_path / "c", shards=1, per_shard=3)
    tar = root / "train-000.tar"
    with tarfile.open(tar) as tf:
        members = [(m.name, tf.extractfile(m).read()) for m in tf]  # type: ignore[union-attr]
    members[3:3] = [("README", b"about"), ("__index__", b"{}")]
    with tarfile.open(tar, "w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    corpus = open_corpus(str(root), "webdataset")
    assert [it.key for it in corpus.items] == ["s0_000", "s0_001", "s0_002"]
    whole = list(stream_items(corpus))
    assert [it.error for it in whole] == [None] * 3 and all(it.data for it in whole)
    for a in range(3):
        assert seen(list(stream_items(corpus, a, None))) == seen(whole[a:])

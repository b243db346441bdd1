"""The peers section's S3 rows, run without the peers (only make bench-peers installs
them): dlop's rows over moto, a peer that does not import said not run, and a stand-in
peer measured against dlop with the server's endpoint in its environment."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from dlop.formats import ArchiveWriter, Field
from dlop.tools.bench import peer_rows
from dlop.tools.bench.format_bench import FRAMES, MELS


def small(path: Path, n: int = 6) -> Path:
    fields = [Field("logmel", "f16", (FRAMES, MELS)), Field("label", "i64", ())]
    with ArchiveWriter(path, fields) as w:
        for i in range(n):
            w.write({"logmel": np.full((FRAMES, MELS), i, np.float16), "label": i})
    return path


class StandIn:
    """A peer's loader: one batch of every sample, and the endpoints it was opened with."""

    seen: ClassVar[list[dict[str, str | None]]] = []

    def __init__(self, url: str, cache: Path, workers: int) -> None:
        self.url = url
        StandIn.seen.append({k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "S3_ENDPOINT_URL")})

    def __iter__(self) -> Iterator[dict[str, Any]]:
        yield {"label": torch.arange(6)}


@pytest.mark.slow
def test_s3_rows_without_the_peers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("moto.server")
    monkeypatch.setitem(sys.modules, "litdata", None)  # not installed here, as in .venv
    monkeypatch.setitem(sys.modules, "streaming", None)
    monkeypatch.delenv("S3_ENDPOINT_URL", raising=False)
    written: list[Path] = []

    def write(archive: Path, out: Path, n: int) -> float:
        out.mkdir()
        (out / "index.json").write_text("{}")
        written.append(out)
        return 0.0

    monkeypatch.setattr(peer_rows, "_streaming_write", write)
    monkeypatch.setattr(peer_rows, "streaming_s3", StandIn)
    rows = peer_rows.s3_rows(small(tmp_path / "esc"), tmp_path, 6, workers=1, repeats=1)
    names = [r.pipeline for r in rows]
    assert names[:2] == [
        "dlop Loader over s3://, warm cache",
        "dlop Loader over s3://, cold first epoch",
    ]
    assert all(r.samples_per_s and r.samples_per_s > 0 for r in rows[:2])
    assert list((tmp_path / "dlop-cache").rglob("shard-*.dlop"))  # read through the cache
    assert names[2].startswith("LitData") and "not run" in names[2]
    streaming = [r for r in rows if r.pipeline.startswith("MosaicML Streaming")]
    assert [r.pipeline.rsplit(", ", 1)[1] for r in streaming] == ["warm cache", "cold first epoch"]
    assert [r.baseline for r in streaming] == names[:2]
    assert all(r.vs_baseline and r.vs_baseline > 0 for r in streaming)
    # opened once for the warm epochs, then once a round for the interleaved cold epochs
    assert len(StandIn.seen) == 1 + peer_rows.COLD_ROUNDS
    for endpoints in StandIn.seen:
        assert endpoints["S3_ENDPOINT_URL"] == endpoints["AWS_ENDPOINT_URL"]
        assert str(endpoints["AWS_ENDPOINT_URL"]).startswith("http://127.0.0.1:")
    rounds = streaming[1].extra["dlop_over_streaming"]
    assert len(rounds["each"]) == peer_rows.COLD_ROUNDS
    assert rounds["range"][0] <= rounds["median"] <= rounds["range"][1]
    assert [len(v) for v in streaming[1].extra["seconds"].values()] == [peer_rows.COLD_ROUNDS] * 2
    assert not list(tmp_path.glob("cold-*"))  # each round's cache removed after it
    assert written and "S3_ENDPOINT_URL" not in os.environ  # restored after

"""dlop-inspect on archives made here: info, verify, show and --png."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dlop.formats import ArchiveWriter, Field, Zstd
from dlop.tools.inspect_cli import main


@pytest.fixture
def audio_archive(tmp_path: Path) -> Path:
    out = tmp_path / "audio"
    fields = [
        Field.str_("key"),
        Field("label", "i64", ()),
        Field("logmel", "f16", (None, 64), codec=Zstd(block_bytes=4096, shuffle=True), units="dB"),
    ]
    rng = np.random.default_rng(0)
    with ArchiveWriter(
        out, fields, shard_bytes=20000, recipe={"sample_rate": 16000, "hop_length": 160}
    ) as w:
        for i in range(12):
            frames = 20 + 10 * i
            w.write(
                {"key": f"clip{i}.wav", "label": i % 3, "logmel": rng.normal(-40, 10, (frames, 64))}
            )
        w.skip("bad.wav", "zero-byte file")
    return out


@pytest.fixture
def image_archive(tmp_path: Path) -> Path:
    out = tmp_path / "img"
    fields = [
        Field.str_("key"),
        Field("image", "u8", (None, None, 3)),
        Field("mask_a", "u8", (None, None)),
        Field("clip", "u8", (5, 16, 16, 3)),
    ]
    with ArchiveWriter(out, fields) as w:
        for i in range(2):
            img = np.zeros((40, 60, 3), np.uint8)
            img[..., 0] = np.linspace(0, 255, 60, dtype=np.uint8)
            mask = np.zeros((40, 60), np.uint8)
            mask[10:30, 20:40] = 3
            clip = np.stack([np.full((16, 16, 3), 50 * t, np.uint8) for t in range(5)])
            w.write({"key": f"core{i}.jpg", "image": img, "mask_a": mask, "clip": clip})
    return out


def test_info_text_and_json(audio_archive: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(audio_archive)]) == 0
    text = capsys.readouterr().out
    assert "12 in" in text and "logmel" in text and "zstd:3+shuffle" in text
    assert "20/75.0/130" in text  # ragged frames min/mean/max
    assert "bad.wav: zero-byte file" in text
    assert main(["info", str(audio_archive), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_samples"] == 12 and info["skipped"]["count"] == 1
    f = info["fields"]["logmel"]
    assert f["ragged_lengths"]["max"] == [130] and f["compression_ratio"] > 1.0
    assert f["raw_bytes"] == sum(20 + 10 * i for i in range(12)) * 64 * 2
    assert info["recipe"]["hop_length"] == 160


def test_verify_ok_then_names_the_corrupt_block(
    audio_archive: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", "-q", str(audio_archive)]) == 0
    assert "OK" in capsys.readouterr().out
    index = json.loads((audio_archive / "index.json").read_text())
    shard = audio_archive / index["shards"][1]["file"]
    from dlop.formats import ShardReader

    with ShardReader(shard) as r:
        offset = r.layout_of("logmel").regions["data"].offset + int(r.blocks("logmel")[1, 0]) + 5
    data = bytearray(shard.read_bytes())
    data[offset] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["verify", "-q", str(audio_archive)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {shard} field 'logmel' block 1: block CRC-32 mismatch" in out


def test_verify_unreadable_archive_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", str(tmp_path)]) == 1
    assert "no index.json" in capsys.readouterr().err


def test_show_prints_stats_and_draws_spectrogram(
    audio_archive: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "s.png"
    assert main(["show", str(audio_archive), "3", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert (
        "key: str[9] 'clip3.wav'" in out
        and "logmel: f16 [50, 64] min" in out
        and "label: i64 [] = 0" in out
    )
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size[0] > 500


def test_show_draws_image_mask_overlay_and_frame_grid(
    image_archive: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "i.png"
    assert main(["show", str(image_archive), "-1", "--png", str(png)]) == 0
    assert "(clip, image, mask_a)" in capsys.readouterr().out
    with Image.open(png) as im:
        im.verify()


def test_show_out_of_range(image_archive: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(image_archive), "7"]) == 1
    assert "out of range" in capsys.readouterr().err


def test_info_where_counts_what_a_selection_keeps(
    audio_archive: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # labels are i % 3 over 12 clips: 4 each
    assert main(["info", str(audio_archive), "--where", "label=0,2"]) == 0
    out = capsys.readouterr().out
    assert "where label=0,2: 8 of 12 samples" in out
    assert "label: 0: 4, 2: 4" in out
    assert main(["info", str(audio_archive), "--json", "--where", "label=1"]) == 0
    where = json.loads(capsys.readouterr().out)["where"]
    assert where == {"samples": 12, "selected": 4, "values": {"label": {"1": 4}}}


def test_info_where_names_a_bad_field(
    audio_archive: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["info", str(audio_archive), "--where", "logmel=1"]) != 0
    assert "logmel" in capsys.readouterr().err
    assert main(["info", str(audio_archive), "--where", "label=x"]) != 0
    assert "label holds int values" in capsys.readouterr().err

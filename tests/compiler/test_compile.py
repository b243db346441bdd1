"""dlop-compile end to end on generated corpora."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from dlop.compiler.output.journal import JOURNAL
from dlop.formats import ArchiveReader
from dlop.tools.compile_cli import main

from .bounds import librosa_logmel
from .fixtures import (
    esc50_corpus,
    librispeech_corpus,
    manifest_corpus,
    webdataset_corpus,
    write_audio,
    write_esc50_csv,
)
from .signals import make_signal

MIXED = [
    ("wav", 44100, 2),
    ("flac", 48000, 1),
    ("ogg", 22050, 2),
    ("mp3", 44100, 1),
    ("m4a", 48000, 2),
    ("wav", 16000, 1),
]


def compile_ok(*args: str) -> None:
    assert main([*args, "-q"]) == 0


def shard_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.glob("*.dlop"))}


@pytest.fixture(scope="module")
def mixed_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return esc50_corpus(tmp_path_factory.mktemp("esc") / "corpus", MIXED, seconds=1.0)


def test_esc50_parity_through_the_whole_pipeline(mixed_corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "a"
    compile_ok(
        str(mixed_corpus), "-o", str(out), "--dtype", "float32", "--duration", "0", "--workers", "1"
    )
    r = ArchiveReader(out)
    assert len(r) == len(MIXED) and r.index.skipped_count == 0
    assert r.fields["logmel"].shape == (None, 128)
    assert r.index.metadata["classes"] == ["class0", "class1", "class2"]
    from dlop.compiler.audio.decode import decode_audio, downmix
    from dlop.compiler.audio.resample import resample

    for i in range(len(r)):
        s = r.sample(i)
        path = mixed_corpus / s["key"]
        # the reference: librosa on the same decoded, downmixed, resampled waveform
        audio, rate = decode_audio(path, s["key"])
        wave = (
            resample(torch.from_numpy(downmix(audio, "mean")), rate, 22050)
            .numpy()
            .astype(np.float64)
        )
        want, bound = librosa_logmel(wave, 22050, 2048, 512, 128, "constant")
        assert s["logmel"].shape == want.shape, s["key"]
        # float32 FFT (the default, as librosa on decoded audio): within the float32
        # pipeline's error bound (tests/compiler/bounds.py) in every band
        assert (np.abs(s["logmel"] - want) <= bound).all(), s["key"]
        assert s["label"] == int(s["key"].split("-")[-1].split(".")[0])
        assert s["category"] == f"class{s['label']}" and 1 <= s["fold"] <= 5
    # decoding itself agrees with soundfile on a plain file
    x, rate = sf.read(mixed_corpus / r.sample(0)["key"], dtype="float32", always_2d=True)
    audio, rate2 = decode_audio(mixed_corpus / r.sample(0)["key"], "x")
    assert rate == rate2 and np.array_equal(audio, x.T)


def test_one_and_two_workers_give_identical_shards(mixed_corpus: Path, tmp_path: Path) -> None:
    for w in ("1", "2"):
        compile_ok(
            str(mixed_corpus),
            "-o",
            str(tmp_path / w),
            "--workers",
            w,
            "--shard-bytes",
            "200KiB",
            "--codec",
            "zstd:3",
        )
    one, two = shard_bytes(tmp_path / "1"), shard_bytes(tmp_path / "2")
    assert len(one) > 1 and one == two


def test_recipe_in_the_index_reproduces_the_archive(
    mixed_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    compile_ok(
        str(mixed_corpus),
        "-o",
        str(tmp_path / "a"),
        "--preset",
        "whisper",
        "--codec",
        "zstd",
        "--workers",
        "1",
    )
    compile_ok(
        "--recipe", str(tmp_path / "a" / "index.json"), "-o", str(tmp_path / "b"), "--workers", "2"
    )
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "b")
    assert (tmp_path / "a" / "index.json").read_bytes() == (
        tmp_path / "b" / "index.json"
    ).read_bytes()


def test_librispeech_layout(tmp_path: Path) -> None:
    root = librispeech_corpus(tmp_path / "ls")
    compile_ok(str(root), "-o", str(tmp_path / "a"), "--preset", "kaldi", "--n-mels", "80")
    r = ArchiveReader(tmp_path / "a")
    assert r.index.recipe["layout"] == "librispeech" and len(r) == 5
    s = r.sample(0)
    assert s["key"] == "dev-clean/19/198/19-198-0000.flac" and s["text"] == "WORDS OF UTTERANCE 0"
    assert (s["speaker"], s["chapter"]) == (19, 198)
    assert r.fields["fbank"].shape == (None, 80)
    frames = [r.sample(i)["fbank"].shape[0] for i in range(5)]
    assert len(set(frames)) > 1  # native lengths: ragged


def test_manifest_layout_honours_offsets_and_durations(tmp_path: Path) -> None:
    manifest = manifest_corpus(tmp_path / "m")
    compile_ok(
        str(manifest),
        "-o",
        str(tmp_path / "a"),
        "--features",
        "waveform",
        "--preset",
        "torchaudio",
        "--dtype",
        "float32",
    )
    r = ArchiveReader(tmp_path / "a")
    assert r.index.metadata["classes"] == ["no", "yes"]
    s0, s1, s2 = (r.sample(i) for i in range(3))
    assert s0["key"] == "wav/long.wav@0.5" and s0["label"] == 1 and s1["label"] == 0
    assert s0["waveform"].shape == (16000,) and s1["waveform"].shape == (12800,)
    full, _ = sf.read(tmp_path / "m" / "wav" / "long.wav", dtype="float32")
    assert np.array_equal(s0["waveform"], full[8000:24000])
    assert s2["waveform"].shape == (16000,)  # 8 kHz upsampled
    assert s2["text"] == "other"


def test_webdataset_layout_with_brace_pattern(tmp_path: Path) -> None:
    root = webdataset_corpus(tmp_path / "wds")
    compile_ok(
        str(root / "train-{000..001}.tar"), "-o", str(tmp_path / "a"), "--preset", "torchaudio"
    )
    r = ArchiveReader(tmp_path / "a")
    assert r.index.recipe["layout"] == "webdataset" and len(r) == 6
    s = r.sample(4)
    assert s["key"] == "s1_001" and s["label"] == 1 and s["text"] == "text 1 1"


def bad_corpus(root: Path) -> Path:
    good = [("good-a.wav", 1), ("good-b.flac", 1)]
    for name, _ in good:
        write_audio(root / "audio" / name, make_signal(16000, 0.5), 16000)
    (root / "audio" / "zero.wav").write_bytes(b"")
    flac = (root / "audio" / "good-b.flac").read_bytes()
    (root / "audio" / "truncated.flac").write_bytes(flac[: len(flac) // 3])
    (root / "audio" / "text.wav").write_text("this is not audio\n" * 20)
    nan = make_signal(16000, 0.3).astype(np.float32)
    nan[100:200] = np.nan
    sf.write(root / "audio" / "nan.wav", nan, 16000, subtype="FLOAT")
    sf.write(root / "audio" / "silent.wav", np.zeros(16000, np.float32), 16000)
    sf.write(root / "audio" / "one.wav", np.array([0.5], np.float32), 16000, subtype="FLOAT")
    names = [
        "good-a.wav",
        "zero.wav",
        "truncated.flac",
        "text.wav",
        "nan.wav",
        "missing.wav",
        "silent.wav",
        "one.wav",
        "good-b.flac",
    ]
    write_esc50_csv(
        root,
        [
            {
                "filename": n,
                "fold": 1,
                "target": 0,
                "category": "c",
                "esc10": "False",
                "src_file": 1,
                "take": "A",
            }
            for n in names
        ],
    )
    return root


def test_bad_inputs_are_skipped_and_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = bad_corpus(tmp_path / "bad")
    compile_ok(str(root), "-o", str(tmp_path / "a"))
    r = ArchiveReader(tmp_path / "a")
    keys = [r.get("key", i) for i in range(len(r))]
    assert keys == ["audio/good-a.wav", "audio/silent.wav", "audio/one.wav", "audio/good-b.flac"]
    errors = {Path(e["path"]).name: e["reason"] for e in r.errors()}
    assert r.index.skipped_count == 5 == len(errors)
    assert "empty file" in errors["zero.wav"]
    assert "cannot decode" in errors["text.wav"]
    assert "cannot decode" in errors["truncated.flac"] or "no audio" in errors["truncated.flac"]
    assert "non-finite" in errors["nan.wav"]
    assert "not found" in errors["missing.wav"]
    assert "5 skipped" in capsys.readouterr().out


def test_fail_mode_names_the_file_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = bad_corpus(tmp_path / "bad")
    out = tmp_path / "a"
    assert main([str(root), "-o", str(out), "--on-error", "fail", "-q", "--workers", "1"]) == 1
    assert "zero.wav: empty file" in capsys.readouterr().err
    assert not out.exists()
    # an existing (empty) folder stays, and holds nothing afterwards, with workers too
    out.mkdir()
    assert main([str(root), "-o", str(out), "--on-error", "fail", "-q", "--workers", "2"]) == 1
    assert "empty file" in capsys.readouterr().err
    assert list(out.iterdir()) == []


def test_bad_options_and_layouts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = esc50_corpus(tmp_path / "c", [("wav", 16000, 1)])
    (root / "x.trans.txt").write_text("")
    assert main([str(root), "-o", str(tmp_path / "a")]) == 1
    assert "ambiguous" in capsys.readouterr().err
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'source = "{root}"\nlayout = "esc50"\nhop_lenght = 3\n')
    assert main(["--recipe", str(recipe), "-o", str(tmp_path / "a")]) == 1
    assert "hop_lenght" in capsys.readouterr().err
    assert (
        main(
            [
                str(root),
                "--layout",
                "esc50",
                "-o",
                str(tmp_path / "a"),
                "--shard-bytes",
                "12 parsecs",
            ]
        )
        == 1
    )
    assert "12 parsecs" in capsys.readouterr().err
    compile_ok(str(root), "--layout", "esc50", "-o", str(tmp_path / "a"))
    assert main([str(root), "--layout", "esc50", "-o", str(tmp_path / "a")]) == 1
    assert "already holds an archive" in capsys.readouterr().err


@pytest.mark.slow
def test_kill_9_then_resume_gives_the_identical_archive(tmp_path: Path) -> None:
    root = esc50_corpus(tmp_path / "c", [("wav", 44100, 1), ("flac", 22050, 2)] * 20, seconds=2.0)
    env = {**os.environ, "SOURCE_DATE_EPOCH": "1700000000"}
    args = [
        sys.executable,
        "-m",
        "dlop.tools.compile_cli",
        str(root),
        "--workers",
        "1",
        "--shard-bytes",
        "300KiB",
        "--codec",
        "zstd",
        "-q",
    ]
    subprocess.run([*args, "-o", str(tmp_path / "whole")], check=True, env=env)
    out = tmp_path / "killed"
    proc = subprocess.Popen([*args, "-o", str(out)], env=env)
    deadline = time.time() + 120
    while time.time() < deadline:
        if (out / JOURNAL).exists() and any(out.glob("unit-*.dlop")):  # a shard in OUT
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "index.json").exists()
    subprocess.run([*args, "-o", str(out), "--resume"], check=True, env=env)
    assert shard_bytes(out) == shard_bytes(tmp_path / "whole")
    assert (out / "index.json").read_bytes() == (tmp_path / "whole" / "index.json").read_bytes()
    assert not (out / JOURNAL).exists()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        p.name for p in (tmp_path / "whole").iterdir()
    )

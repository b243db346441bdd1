"""What the compiler chose is said, not guessed silently: the layout it detected and the
rate it compiles at (at the start and in the summary), a warning when the preset's rate
drops most of the inputs' bandwidth, and links inside the corpus followed while links
out of it are refused."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from dlop.compiler.corpus.layouts import folder
from dlop.compiler.corpus.place import LocalPlace
from dlop.compiler.errors import CompileError
from dlop.formats import ArchiveReader
from dlop.tools.compile_cli import main

from .fixtures import write_audio


def _tone(rate: int, seconds: float = 0.25) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def _classes(root: Path, rates: dict[str, int]) -> Path:
    """A folder-layout corpus: class folders a/ and b/, one clip per rate given."""
    for n, (name, rate) in enumerate(rates.items()):
        write_audio(root / ("a" if n % 2 == 0 else "b") / f"{name}.wav", _tone(rate), rate)
    return root


def _keys(archive: Path) -> list[str]:
    r = ArchiveReader(archive)
    return sorted(r.sample(i)["key"] for i in range(len(r)))


def _compile(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    assert main(argv) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_start_and_summary_name_the_detected_layout_and_the_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = _classes(tmp_path / "c", {"x": 22050, "y": 16000})
    out, err = _compile([str(corpus), "-o", str(tmp_path / "o"), "--workers", "1"], capsys)
    said = "layout folder (detected), audio, logmel at 22050 Hz (the librosa preset's"
    assert f"compiling {corpus}: {said}" in err
    assert said in out.splitlines()[-1] and out.startswith(f"wrote {tmp_path / 'o'}")
    out, err = _compile(
        [str(corpus), "-o", str(tmp_path / "o2"), "--layout", "folder", "--sample-rate", "16000"],
        capsys,
    )
    assert "layout folder, audio, logmel at 16000 Hz\n" in err
    assert out.rstrip().endswith("layout folder, audio, logmel at 16000 Hz")


def test_a_preset_rate_far_below_the_inputs_is_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = _classes(tmp_path / "c", {"x": 96000, "y": 8000, "z": 48000})
    _, err = _compile([str(corpus), "-o", str(tmp_path / "o"), "--workers", "1"], capsys)
    warning = [line for line in err.splitlines() if line.startswith("dlop-compile: warning:")]
    assert len(warning) == 1, err
    assert "inputs are 8000-96000 Hz (3 of 3 read), resampled to 22050 Hz" in warning[0]
    assert "the librosa preset's rate" in warning[0] and "--sample-rate" in warning[0]
    # the compile went on and kept every input
    assert ArchiveReader(tmp_path / "o").index.num_samples == 3
    # a rate the user chose, even the same one, is no surprise
    _, err = _compile(
        [str(corpus), "-o", str(tmp_path / "o2"), "--sample-rate", "22050", "--workers", "1"],
        capsys,
    )
    assert "warning" not in err


def test_an_append_reads_the_rates_of_the_inputs_it_adds_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An append's warning speaks of what it adds: the archive's own inputs were compiled
    (and warned of) before, and reading their headers again would cost every append a
    read of a few of the inputs it does not compile."""
    corpus = _classes(tmp_path / "c", {"x": 96000, "y": 16000})
    out = tmp_path / "o"
    _, err = _compile([str(corpus), "-o", str(out), "--workers", "1"], capsys)
    assert "inputs are 16000-96000 Hz (2 of 2 read)" in err
    write_audio(corpus / "a" / "z.wav", _tone(22050), 22050)
    _, err = _compile([str(corpus), "-o", str(out), "--workers", "1", "--append"], capsys)
    assert "warning" not in err  # x, held, is not read again
    write_audio(corpus / "b" / "w.wav", _tone(48000), 48000)
    _, err = _compile([str(corpus), "-o", str(out), "--workers", "1", "--append"], capsys)
    warning = [line for line in err.splitlines() if line.startswith("dlop-compile: warning:")]
    assert len(warning) == 1, err
    assert "inputs are 48000 Hz (1 of 1 read)" in warning[0], err
    assert _keys(out) == ["a/x.wav", "a/z.wav", "b/w.wav", "b/y.wav"]


def test_inputs_near_the_rate_give_no_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = _classes(tmp_path / "c", {"x": 44100, "y": 16000})  # 2x down at most
    _, err = _compile([str(corpus), "-o", str(tmp_path / "o"), "--workers", "1"], capsys)
    assert "warning" not in err


def test_links_inside_the_corpus_are_followed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = _classes(tmp_path / "c", {"x": 16000, "y": 16000})
    write_audio(tmp_path / "c" / "all" / "spk1" / "z.wav", _tone(16000), 16000)
    # a Kaldi-style subset: a class folder of links to folders elsewhere in the corpus,
    # and a loop back to its own parent that must not be walked forever
    os.symlink(tmp_path / "c" / "all" / "spk1", tmp_path / "c" / "a" / "spk1")
    os.symlink(tmp_path / "c" / "a", tmp_path / "c" / "a" / "spk1-again")
    os.symlink(tmp_path / "c", tmp_path / "c" / "b" / "up")
    listed = LocalPlace(tmp_path / "c" / "a").files_below(
        (".wav",), corpus=LocalPlace(tmp_path / "c"), allowed=()
    )
    assert [p.relative_to(LocalPlace(tmp_path / "c")).as_posix() for p in listed] == [
        "a/spk1/z.wav",
        "a/x.wav",
    ]
    _compile([str(corpus), "-o", str(tmp_path / "o"), "--workers", "1"], capsys)
    keys = _keys(tmp_path / "o")
    assert "a/spk1/z.wav" in keys


def test_a_link_out_of_the_corpus_is_refused_unless_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = _classes(tmp_path / "c", {"x": 16000, "y": 16000})
    outside = tmp_path / "elsewhere"
    write_audio(outside / "secret.wav", _tone(16000), 16000)
    os.symlink(outside, corpus / "a" / "more")
    os.symlink(outside / "secret.wav", corpus / "b" / "one.wav")
    with pytest.raises(CompileError, match=r"a/more: a link that leads out of the corpus"):
        LocalPlace(corpus / "a").files_below((".wav",), corpus=LocalPlace(corpus), allowed=())
    assert main([str(corpus), "-o", str(tmp_path / "o"), "--workers", "1"]) == 1
    err = capsys.readouterr().err
    assert "leads out of the corpus" in err and "--allow-path" in err
    assert not (tmp_path / "o").exists()
    # detection only probes: the link out is passed over there, refused by the listing
    assert folder.detect(LocalPlace(corpus))
    _compile(
        [str(corpus), "-o", str(tmp_path / "o"), "--workers", "1", "--allow-path", str(outside)],
        capsys,
    )
    keys = _keys(tmp_path / "o")
    assert keys == ["a/more/secret.wav", "a/x.wav", "b/one.wav", "b/y.wav"]


def test_the_rate_probe_reads_headers_only_and_never_waits(tmp_path: Path) -> None:
    """probe_rate runs in the compiling process before any work: a FIFO named as an input
    must not block it, a cut or foreign file gives no rate, and an MP3 is read by its
    frames (libsndfile would print warnings about a cut one)."""
    from dlop.compiler.audio.decode import PROBE_BYTES, probe_rate

    wave = write_audio(tmp_path / "a.wav", _tone(96000, 2.0), 96000)
    mp3 = write_audio(tmp_path / "b.mp3", _tone(22050, 2.0), 22050)
    flac = write_audio(tmp_path / "c.flac", _tone(48000, 2.0), 48000)
    assert [probe_rate(str(p)) for p in (wave, mp3, flac)] == [96000, 22050, 48000]
    assert probe_rate(wave.read_bytes()) == 96000  # a tar member's bytes
    assert wave.stat().st_size > PROBE_BYTES  # the probe read only the head of it
    os.mkfifo(tmp_path / "fifo.wav")  # no writer: a blocking open would wait forever
    assert probe_rate(str(tmp_path / "fifo.wav")) is None
    (tmp_path / "cut.wav").write_bytes(wave.read_bytes()[:20])
    (tmp_path / "noise.wav").write_bytes(os.urandom(5000))
    assert probe_rate(str(tmp_path / "cut.wav")) is None
    assert probe_rate(str(tmp_path / "noise.wav")) is None
    assert probe_rate(str(tmp_path / "missing.wav")) is None
    assert probe_rate(b"") is None


def test_a_fifo_among_the_inputs_does_not_hang_the_compile(tmp_path: Path) -> None:
    """The driver probes input headers before compiling: a FIFO an ESC-50 CSV names is a
    bad input of its own (as its decode says), not a compile that never starts."""
    import subprocess
    import sys

    from .fixtures import esc50_corpus

    corpus = esc50_corpus(tmp_path / "esc", [("wav", 48000, 1)] * 4, seconds=0.25)
    fifo = next((corpus / "audio").glob("*.wav"))
    fifo.unlink()
    os.mkfifo(fifo)
    argv = [str(corpus), "-o", str(tmp_path / "o"), "--workers", "1", "-q"]
    done = subprocess.run(
        [sys.executable, "-m", "dlop.tools.compile_cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert ArchiveReader(tmp_path / "o").index.skipped_count == 1

"""--layout lhotse: RecordingSet + SupervisionSet, and CutSet manifests written by Lhotse."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlop.compiler.corpus.layouts import detect_layout, open_corpus
from dlop.compiler.corpus.place import LocalPlace
from dlop.compiler.errors import CompileError
from dlop.formats import ArchiveReader
from dlop.tools.compile_cli import main

from .fixtures import write_audio
from .signals import make_signal

# (supervision id, recording id, channel, start, duration, text, speaker, language)
SUPS = [
    ("s0", "mono", 0, 0.1, 0.5, "hello there", "spk-a", "English"),
    ("s1", "mono", 0, 0.7, 0.4, "  second — one  ", "spk-b", "English"),
    ("s2", "split", 1, 0.0, 0.6, "the right channel", "spk-c", "German"),
    ("s3", "stereo", 0, 0.2, 0.3, "ünïcode mix", "spk-a", "French"),
]
# what each supervision hears, as a plain manifest line (file, offset, duration)
PLAIN = {
    "s0": ("clips/mono.wav", 0.1, 0.5),
    "s1": ("clips/mono.wav", 0.7, 0.4),
    "s2": ("clips/right.flac", 0.0, 0.6),  # the source that holds channel 1
    "s3": ("clips/stereo.wav", 0.2, 0.3),  # one file holding both channels: their mean
}


def lhotse_corpus(root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from lhotse import (
        AudioSource,
        CutSet,
        Recording,
        RecordingSet,
        SupervisionSegment,
        SupervisionSet,
    )

    write_audio(root / "clips/mono.wav", make_signal(16000, 1.2, seed=1), 16000)
    write_audio(root / "clips/left.flac", make_signal(16000, 0.8, seed=2), 16000)
    write_audio(root / "clips/right.flac", make_signal(16000, 0.8, seed=3), 16000)
    write_audio(root / "clips/stereo.wav", make_signal(8000, 0.6, seed=4, channels=2), 8000)
    monkeypatch.chdir(root)  # Lhotse keeps paths as given: these are relative to the manifests
    split = Recording(
        id="split",
        sources=[
            AudioSource(type="file", channels=[0], source="clips/left.flac"),
            AudioSource(type="file", channels=[1], source="clips/right.flac"),
        ],
        sampling_rate=16000,
        num_samples=12800,
        duration=0.8,
    )
    recordings = RecordingSet.from_recordings(
        [
            Recording.from_file("clips/mono.wav", recording_id="mono"),
            split,
            Recording.from_file("clips/stereo.wav", recording_id="stereo"),
        ]
    )
    supervisions = SupervisionSet.from_segments(
        [
            SupervisionSegment(
                id=s,
                recording_id=r,
                start=a,
                duration=d,
                channel=c,
                text=t,
                speaker=p,
                language=lang,
            )
            for s, r, c, a, d, t, p, lang in SUPS
        ]
    )
    recordings.to_file(root / "demo_recordings_dev.jsonl.gz")
    supervisions.to_file(root / "demo_supervisions_dev.jsonl.gz")
    cuts = CutSet.from_manifests(recordings=recordings, supervisions=supervisions)
    (root / "cuts").mkdir()
    cuts.trim_to_supervisions().to_file(root / "cuts" / "demo_cuts_dev.jsonl.gz")
    lines = [
        {"audio_filepath": f, "offset": o, "duration": d, "text": s[5]}
        for s, (f, o, d) in zip(SUPS, PLAIN.values(), strict=True)
    ]
    (root / "plain.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root


def compile_ok(*args: str) -> None:
    assert main([*args, "-q", "--workers", "1"]) == 0


@pytest.mark.parametrize("form", ["supervisions", "cuts"])
def test_segments_compile_like_the_same_spans_of_plain_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    root = lhotse_corpus(tmp_path / "lh", monkeypatch)
    source = root / "demo_supervisions_dev.jsonl.gz" if form == "supervisions" else root / "cuts"
    assert detect_layout(LocalPlace(source)) == "lhotse"
    # cuts/ names its audio from the working directory (root), outside the cuts folder
    allow = ["--allow-path", str(root)] if form == "cuts" else []
    compile_ok(str(source), *allow, "-o", str(tmp_path / "a"))
    compile_ok(str(root / "plain.jsonl"), "-o", str(tmp_path / "b"))
    a, b = ArchiveReader(tmp_path / "a"), ArchiveReader(tmp_path / "b")
    assert len(a) == len(b) == 4 and a.index.skipped_count == 0
    feature = a.index.metadata["feature_field"]
    for n, (sid, _, _, _, _, text, speaker, language) in enumerate(SUPS):
        s = a.sample(n)
        assert s["key"] == sid or (form == "cuts" and s["key"].startswith(sid[:1]))
        assert s["text"].encode() == text.encode()
        assert (s["speaker"], s["language"]) == (speaker, language)
        assert np.array_equal(s[feature], b.sample(n)[feature]), sid


def test_bad_lines_and_sources_are_skipped_and_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = lhotse_corpus(tmp_path / "lh", monkeypatch)
    recs = root / "demo_recordings_dev.jsonl.gz"
    sups = root / "demo_supervisions_dev.jsonl.gz"
    command = {
        "id": "cmd",
        "sources": [{"type": "command", "channels": [0], "source": "touch /tmp/pwned"}],
        "sampling_rate": 16000,
        "num_samples": 16000,
        "duration": 1.0,
    }
    with gzip.open(recs, "at") as f:
        f.write(json.dumps(command) + "\n")
    extra = [
        {"id": "s4", "recording_id": "nowhere", "start": 0, "duration": 1, "text": "x"},
        {"id": "s5", "recording_id": "cmd", "start": 0, "duration": 1, "text": "y"},
        {"id": "s6", "recording_id": "mono", "start": -1, "duration": 1, "text": "z"},
    ]
    with gzip.open(sups, "at") as f:
        f.write("".join(json.dumps(x) + "\n" for x in extra) + "{broken\n")
    compile_ok(str(sups), "-o", str(tmp_path / "a"))
    r = ArchiveReader(tmp_path / "a")
    assert len(r) == 4 and r.index.skipped_count == 4
    reasons = " | ".join(e["reason"] for e in r.errors())
    assert (
        "'s4' names recording 'nowhere', which demo_recordings_dev.jsonl.gz does not hold"
        in reasons
    )
    assert "audio source type 'command' is not read" in reasons
    assert "start -1 is negative" in reasons
    assert "demo_supervisions_dev.jsonl.gz line 8 (byte" in reasons and "not JSON" in reasons
    out = tmp_path / "f"
    assert main([str(sups), "-o", str(out), "--on-error", "fail", "-q", "--workers", "1"]) == 1


def test_a_folder_must_hold_one_manifest_to_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = lhotse_corpus(tmp_path / "lh", monkeypatch)
    assert len(open_corpus(str(root), "lhotse").items) == 4  # the one supervisions/recordings pair
    (root / "demo_supervisions_test.jsonl.gz").write_bytes(b"")
    with pytest.raises(CompileError, match="pass the one to compile as SOURCE"):
        open_corpus(str(root), "lhotse")
    (root / "demo_recordings_dev.jsonl.gz").unlink()
    with pytest.raises(CompileError, match=r"demo_recordings_dev\.jsonl\.gz is not beside it"):
        open_corpus(str(root / "demo_supervisions_dev.jsonl.gz"), "lhotse")


def corpus_in_bucket(s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The Lhotse corpus, also copied to s3://lhdata/corpus; its local root."""
    root = lhotse_corpus(tmp_path / "lh", monkeypatch)
    s3.make_bucket("lhdata")
    s3.filesystem().put(str(root), "lhdata/corpus", recursive=True)
    return root


@pytest.mark.slow
def test_the_same_manifests_list_from_s3(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = corpus_in_bucket(s3, tmp_path, monkeypatch)
    url = "s3://lhdata/corpus"
    local = open_corpus(str(root / "demo_supervisions_dev.jsonl.gz"), None)
    remote = open_corpus(f"{url}/demo_supervisions_dev.jsonl.gz", None)
    assert remote.layout == "lhotse" and remote.fingerprint == local.fingerprint
    fields = [(it.key, it.text, it.extras, it.offset, it.duration) for it in local.items]
    assert [(it.key, it.text, it.extras, it.offset, it.duration) for it in remote.items] == fields
    for a, b in zip(local.items, remote.items, strict=True):
        assert b.path == url + (a.path or "")[len(str(root)) :]


def same_shards(a: Path, b: Path) -> None:
    names = sorted(p.relative_to(a) for p in a.rglob("*.dlop"))
    assert names and names == sorted(p.relative_to(b) for p in b.rglob("*.dlop"))
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.slow
def test_the_same_manifests_compile_from_s3_to_the_same_archive(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recordings named by relative path: the workers fetch them from the bucket."""
    root = corpus_in_bucket(s3, tmp_path, monkeypatch)
    for form in ("demo_supervisions_dev.jsonl.gz", "cuts"):
        local, remote = tmp_path / f"local-{form}", tmp_path / f"remote-{form}"
        # cuts/ names its audio from the working directory (root): allowed by name
        allow = ["--allow-path", str(root)] if form == "cuts" else []
        compile_ok(str(root / form), *allow, "--layout", "lhotse", "-o", str(local))
        compile_ok(f"s3://lhdata/corpus/{form}", *allow, "--layout", "lhotse", "-o", str(remote))
        assert len(ArchiveReader(remote)) == 4
        same_shards(local, remote)


def test_a_manifest_line_too_long_to_parse_is_refused_before_it_is_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dlop.compiler.corpus import listing
    from dlop.compiler.corpus.layouts import lhotse

    bound = 1 << 20
    monkeypatch.setattr(listing, "MAX_LINE_BYTES", bound)
    monkeypatch.setattr(lhotse, "MAX_LINE_BYTES", bound)
    zeros = tmp_path / "z" / "cuts.jsonl.gz"  # 40 MiB of zeros, no line end: 40 KiB of gzip
    zeros.parent.mkdir()
    with gzip.open(zeros, "wb") as f:
        for _ in range(40):
            f.write(bytes(1 << 20))
    read = []
    real = lhotse.gzip.GzipFile.read

    def counted(self: Any, size: int = -1) -> bytes:
        read.append(size)
        return real(self, size)

    monkeypatch.setattr(lhotse.gzip.GzipFile, "read", counted)
    assert main([str(zeros), "-o", str(tmp_path / "a"), "-q"]) == 1
    assert f"line 1 inflates past {bound} bytes" in capsys.readouterr().err
    assert len(read) <= 3  # stopped at the bound, not after inflating it all
    plain = tmp_path / "m.jsonl"
    plain.write_bytes(b'{"audio_filepath": "a.wav"}\n' + b"0" * (bound + 1) + b"\n")
    assert main([str(plain), "-o", str(tmp_path / "b"), "-q"]) == 1
    assert f"m.jsonl: line 2 (byte 28) is longer than {bound} bytes" in capsys.readouterr().err

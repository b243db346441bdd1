"""One archive on every CPU: MKL's CPU-independent path, the numeric environment in
the index, and --resume refused where the environment that shapes the bytes changed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlop.compiler.audio import numerics
from dlop.compiler.errors import CompileError
from dlop.compiler.faults import KILL_AT as TEST_KILL_AT
from dlop.compiler.output.journal import JOURNAL
from dlop.tools.compile_cli import main

from .fixtures import esc50_corpus
from .media import write_image, write_video

EPOCH = "1700000000"
ROOT = Path(__file__).resolve().parents[2]


def _cpu_has(flag: str) -> bool:
    try:
        return flag in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


# (MKL_CBWR, ATEN_CPU_CAPABILITY): MKL's and torch's code path forced as on other CPUs.
# A path the CPU lacks falls back to one it has; the AVX-512 ones run only where it has them.
PATHS = [("COMPATIBLE", "default"), ("AVX2", "avx2"), ("AVX512", "default")]
if _cpu_has("avx512f"):
    PATHS.append(("AVX512", "avx512"))


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("numerics")
    specs = [("wav", 44100, 1), ("flac", 22050, 2), ("wav", 16000, 1), ("wav", 48000, 1)]
    audio = esc50_corpus(root / "audio", specs, seconds=0.6)
    video = root / "video"
    for n, label in enumerate(("run", "jump")):
        write_video(video / label / f"v{n}.mp4", frames=16, size=(64, 48))
    images = root / "images"
    rng = np.random.default_rng(0)
    for n, (h, w) in enumerate(((40, 56), (48, 36))):
        write_image(images / "Train Imgs" / f"s{n}.png", rng.integers(0, 256, (h, w, 3), np.uint8))
        mask = np.kron(rng.integers(0, 6, (h // 8 + 1, w // 8 + 1)), np.ones((8, 8)))[:h, :w]
        write_image(images / "Maps1_T" / f"s{n}_classimg_nonconvex.png", mask.astype(np.uint8))
    return {"audio": audio, "video": video, "images": images}


def _plan(c: dict[str, Path], out: Path, extra: list[str]) -> list[dict[str, Any]]:
    audio = [str(c["audio"]), "--duration", "0.5", *extra]
    plan = [
        {"name": f"audio-{p}", "args": [*audio, "--preset", p, "-o", out / f"audio-{p}"]}
        for p in ("librosa", "torchaudio", "kaldi", "whisper", "panns", "ast")
    ]
    plan += [
        {"name": "audio-mfcc", "args": [*audio, "--features", "mfcc", "-o", out / "mfcc"]},
        {
            "name": "audio-waveform",
            "args": [*audio, "--features", "waveform", "--sample-rate", "16000", "-o", out / "w"],
        },
        {
            "name": "video",
            "args": [
                str(c["video"]),
                "--clip-frames",
                "4",
                "--size",
                "32",
                *extra,
                "-o",
                out / "v",
            ],
        },
        {"name": "images", "args": [str(c["images"]), "--size", "24", *extra, "-o", out / "i"]},
    ]
    return [{**e, "args": [str(a) for a in e["args"]]} for e in plan]


def _under(mkl: str, aten: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    """``python args`` from the repository root with MKL and torch forced to a code path."""
    env = {
        **os.environ,
        "MKL_CBWR": mkl,
        "ATEN_CPU_CAPABILITY": aten,
        "SOURCE_DATE_EPOCH": EPOCH,
        "PYTHONPATH": str(ROOT),
    }
    return subprocess.run(
        [sys.executable, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def _probe(plan: list[dict[str, Any]], where: Path, mkl: str, aten: str) -> dict[str, str]:
    (where / "plan.json").write_text(json.dumps(plan))
    done = _under(mkl, aten, ["-m", "tests.compiler.numerics_probe", str(where / "plan.json")])
    assert done.returncode == 0, done.stderr[-3000:]
    digests: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    return digests


@pytest.mark.slow
def test_same_shard_bytes_under_every_simulated_code_path(
    corpora: dict[str, Path], tmp_path: Path
) -> None:
    """Every audio preset and feature, video clips and images with masks: the same
    shard bytes whichever code path MKL and torch are forced to, with 1 and 2 workers
    and on a local Dask cluster."""
    runs = {}
    for n, (mkl, aten) in enumerate(PATHS):
        where = tmp_path / f"path{n}"
        where.mkdir()
        runs[(mkl, aten)] = _probe(_plan(corpora, where, ["--workers", "1"]), where, mkl, aten)
    first = next(iter(runs.values()))
    assert len(first) == 10
    for path, digests in runs.items():
        assert digests == first, f"{path} differs: {[k for k in first if digests[k] != first[k]]}"
    # other engines under another path: 2 worker processes, a 2-worker Dask cluster
    where = tmp_path / "engines"
    where.mkdir()
    two = _plan(corpora, where / "two", ["--workers", "2"])
    two = [e for e in two if e["name"] in ("audio-librosa", "audio-kaldi", "video", "images")]
    dask = _plan(corpora, where / "dask", ["--dask", "local:2"])
    dask = [{**e, "name": "dask-" + e["name"]} for e in dask if e["name"] == "audio-mfcc"]
    got = _probe(two + dask, where, "AVX2", "avx2")
    assert {k: got[k] for k in ("audio-librosa", "audio-kaldi", "video", "images")} == {
        k: first[k] for k in ("audio-librosa", "audio-kaldi", "video", "images")
    }
    assert got["dask-audio-mfcc"] == first["audio-mfcc"]


def test_the_index_records_the_numeric_environment(
    corpora: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "a"
    assert main([str(corpora["audio"]), "-o", str(out), "-q", "--workers", "1"]) == 0
    env = json.loads((out / "index.json").read_text())["provenance"]["numerics"]
    assert env == numerics.target()
    assert env["machine"] and env["torch"] and env["numpy"]
    if numerics.has_mkl():
        assert env["mkl_cbwr"] == "COMPATIBLE" and env["mkl"] and env["fft"] == "mkl"
    assert numerics.mkl_mode() in (None, "COMPATIBLE")


class _FakeMkl:
    """MKL that already ran on its AVX2 path: a change of path is refused."""

    def mkl_serv_cbwr_get(self, what: int) -> int:
        return 9

    def mkl_serv_cbwr_set(self, what: int) -> int:
        return -8


def test_a_process_whose_mkl_ran_on_another_path_refuses_to_featurize(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(numerics, "_mkl", lambda: _FakeMkl())
    monkeypatch.setattr(numerics, "has_mkl", lambda: True)
    with pytest.raises(CompileError, match="MKL already ran in this process on its AVX2 code path"):
        numerics.require()
    numerics.prefer()  # at import: silent


def test_resume_in_another_numeric_environment_is_refused(
    corpora: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    args = [str(corpora["audio"]), "--unit-inputs", "1", "--workers", "1", "-q"]
    env = {**os.environ, "SOURCE_DATE_EPOCH": EPOCH, TEST_KILL_AT: "unit:1"}
    cmd = [sys.executable, "-m", "dlop.tools.compile_cli", *args, "-o", str(out)]
    subprocess.run(cmd, env=env, capture_output=True, check=False, timeout=300)
    journal = json.loads((out / JOURNAL).read_text())
    assert journal["numerics"] == numerics.resume_key(numerics.target())
    journal["numerics"]["torch"] = "1.0.0"
    (out / JOURNAL).write_text(json.dumps(journal))
    assert main([*args, "--resume", "-o", str(out)]) != 0
    assert "another numeric environment than the interrupted compile (torch '1.0.0' ->" in (
        capsys.readouterr().err
    )
    del journal["numerics"]
    (out / JOURNAL).write_text(json.dumps(journal))
    assert main([*args, "--resume", "-o", str(out)]) != 0
    assert "recorded no numeric environment" in capsys.readouterr().err
    journal["numerics"] = numerics.resume_key(numerics.target())
    (out / JOURNAL).write_text(json.dumps(journal))
    assert main([*args, "--resume", "-o", str(out)]) == 0  # the same environment resumes


@pytest.mark.slow
@pytest.mark.parametrize(("mkl", "aten"), PATHS[1:])
def test_parity_holds_under_other_code_paths(mkl: str, aten: str) -> None:
    """The parity tests against float64 references, under MKL's and torch's other code
    paths (this process runs the first of PATHS)."""
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "preset or mfcc"]
    done = _under(mkl, aten, [*args, "tests/compiler/test_features.py"])
    assert done.returncode == 0, done.stdout[-3000:]

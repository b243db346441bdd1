"""dlop-bench's `--only` choices are the sections it can run, dispatched in order."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dlop.tools.bench import append_bench, cli, compile_bench, runtime_bench
from dlop.tools.bench.common import Row


def _stub(name: str, calls: list[str]) -> Callable[[cli._Run], list[Row]]:
    def section(run: cli._Run) -> list[Row]:
        calls.append(name)
        return [Row(f"{name}: toy", name, 1.0)]

    return section


def test_only_choices_are_the_runnable_sections() -> None:
    only = next(a for a in cli.build_parser()._actions if "--only" in a.option_strings)
    assert only.choices == list(cli.SECTIONS)
    assert set(cli.DEFAULT_SECTIONS) < set(cli.SECTIONS)
    assert all(callable(run) for run in cli.SECTIONS.values())


def test_only_runs_the_chosen_sections_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    for name in cli.SECTIONS:
        monkeypatch.setitem(cli.SECTIONS, name, _stub(name, calls))
    out = tmp_path / "out"
    assert cli.main(["--only", "vision", "format", "--out", str(out)]) == 0
    assert calls == ["format", "vision"]
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["pipeline"] for r in rows] == ["format", "vision"]


def test_runtime_reuses_the_compile_sections_archive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiles: list[Path] = []
    made = compile_bench.Made(tmp_path / "corpus", tmp_path / "archive", 10.0)

    def compile_run(work: Path, *args: object) -> tuple[list[Row], compile_bench.Made]:
        compiles.append(work)
        return [Row("compile: toy", "dlop-compile", 1.0)], made

    def runtime_run(work: Path, archive: Path, corpus: Path, rate: float, *a: object) -> list[Row]:
        assert (archive, corpus, rate) == (made.archive, made.corpus, made.naive_rate)
        return [Row("runtime: toy", "dlop Loader", 2.0)]

    monkeypatch.setattr(compile_bench, "run", compile_run)
    monkeypatch.setattr(runtime_bench, "run", runtime_run)
    out = tmp_path / "out"
    assert cli.main(["--only", "runtime", "compile", "--out", str(out)]) == 0
    assert len(compiles) == 1
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["pipeline"] for r in rows] == ["dlop-compile", "dlop Loader"]


def test_only_rejects_an_unknown_section(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--only", "nonsense"])
    assert "invalid choice" in capsys.readouterr().err


def test_a_workdir_that_cannot_be_made_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        cli.main(["--only", "append", "--workdir", str(tmp_path / "file" / "work")])
    assert f"--workdir {tmp_path / 'file' / 'work'}: Not a directory" in capsys.readouterr().err


def test_the_startup_section_measures_both_tools(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert cli.main(["--only", "startup", "--repeats", "1", "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["pipeline"] for r in rows] == [
        "python -c pass",
        "dlop-compile --help",
        "dlop-inspect info",
    ]
    assert all(r["extra"]["median_s"] > 0 for r in rows)
    assert [r["extra"].get("goal_s") for r in rows] == [None, 0.5, 0.5]
    assert not (out / "results.png").exists()  # no rates: no chart, and no failure either


@pytest.mark.slow
def test_the_custom_section_compiles_and_reads_one_function(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--only", "custom", "--repeats", "1", "--workers", "1", "--out", str(out)]
    assert cli.main([*argv, "--custom-items", "300", "--custom-clips", "0"]) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    ours = [r for r in rows if r["pipeline"].startswith(("dlop", "read: dlop"))]
    assert [r["pipeline"] for r in ours] == ["dlop compile_map, 1 workers", "read: dlop Loader"]
    assert all(r["samples_per_s"] > 0 for r in ours)
    peers = [r for r in rows if r not in ours]
    for r in peers:  # run, against dlop's row, or said not to have run
        assert r["vs_baseline"] is not None or "not run" in r["pipeline"], r


@pytest.mark.slow
def test_the_short_section_measures_the_limit_and_the_command(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--only", "short", "--repeats", "1", "--workers", "2", "--out", str(out)]
    assert cli.main([*argv, "--short-utts", "12"]) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    by = {r["pipeline"]: r for r in rows}
    assert all(r["samples_per_s"] > 0 for r in rows)
    one = by["dlop compile_corpus, 1 worker (from after its imports)"]
    assert len(one["extra"]["of_limit_rounds"]) == 1 and one["extra"]["of_fastest_limit"] > 0
    assert len(one["extra"]["of_limit_cpu_rounds"]) == 1 and one["extra"]["of_limit_cpu"] > 0
    command = by["dlop-compile, 2 workers, the whole command"]
    assert command["extra"]["wall_s"] > command["extra"]["own_s"] > 0
    workers = "DataLoader(IterableArchive(bucket_by), num_workers=2, persistent_workers=True)"
    for how in ("batches taken", "every page read"):  # read back, against the Loader
        row = by[f"{workers} ({how})"]
        assert row["vs_baseline"] > 0 and row["baseline"] == f"dlop Loader, bucket_by ({how})"
    as_is = by[f"{workers[:-1]}, collate_fn=batch_as_is) (batches taken)"]
    assert as_is["vs_baseline"] > 0
    taken = by[f"{workers} (batches taken)"]["extra"]
    assert taken["batches_in_reused_buffers"] > 0


def test_the_small_section_reads_many_shards_and_few_against_a_bare_gather(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    argv = ["--only", "small", "--small-samples", "3000", "--repeats", "1", "--out", str(out)]
    assert cli.main(argv) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    loaders = [r for r in rows if r["pipeline"].startswith("dlop Loader, ")]
    bare = [r for r in rows if r["pipeline"].startswith("bare gather")]
    assert len(bare) == 6 and len(loaders) == 12  # 3 batch sizes x 2 orders; 2 archives
    assert {r["pipeline"] for r in loaders} == {
        "dlop Loader, 46 shards",
        "dlop Loader, 10 shards",
    }
    for r in loaders:
        ratio = r["extra"]["of_bare"]
        assert ratio["range"][0] <= ratio["median"] <= ratio["range"][1] and ratio["median"] > 0
        assert r["extra"]["us_per_batch"] > 0
    assert all("many_vs_few_shards" in r["extra"] for r in loaders if "46" in r["pipeline"])
    workers = [r for r in rows if "through DataLoader workers" in r["workload"]]
    assert len(workers) == 3 and all(r["extra"]["of_bare"]["median"] > 0 for r in workers)


def test_the_append_section_times_an_append_against_the_whole_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    argv = ["--only", "append", "--append-clips", "100", "--append-times", "2", "--repeats", "1"]
    argv += ["--workers", "1", "--out", str(out), "--workdir", str(tmp_path / "w" / "work")]
    compiled: list[tuple[str, bool]] = []
    original = append_bench.compile_corpus

    def counted(recipe: Any, out: Path, **options: Any) -> Any:
        compiled.append((Path(out).name, bool(options.get("append"))))
        return original(recipe, out, **options)

    monkeypatch.setattr(append_bench, "compile_corpus", counted)
    assert cli.main(argv) == 0  # a --workdir not there yet is made, as --out is
    # per corpus: its 99% archive, then 3 rounds of the whole compile, TRIES appends and
    # as many fresh compiles alternated, and the append that finds nothing to add
    tries = [("grown", True), ("fresh", False)] * append_bench.TRIES
    rounds: list[tuple[str, bool]] = []
    for r in range(3):  # which goes first alternates by round
        rounds += [("whole", False), *(tries[r % 2 :] + tries[: r % 2]), ("grown", True)]
    assert compiled == [("part", False), *rounds] * 2
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert len(rows) == 4  # the corpus, then its clips listed twice
    for (whole, append), clips in zip((rows[:2], rows[2:]), (100, 200), strict=True):
        assert whole["workload"].startswith(f"grow an archive: {clips} ESC-50-shaped clips")
        assert whole["pipeline"] == "compile of the whole corpus" and whole["samples_per_s"] > 0
        assert append["pipeline"].startswith(f"--append of the last {clips // 100} clip")
        share = append["extra"]["append_vs_whole"]
        assert 0 < share["range"][0] <= share["median"] <= share["range"][1]
        assert append["extra"]["inputs_share"] == 0.01
        fresh = append["extra"]["append_vs_fresh"]  # against a compile of the 1% alone
        assert 0 < fresh["range"][0] <= fresh["median"] <= fresh["range"][1]
        seconds = append["extra"]["seconds"]
        assert [len(seconds[k]) for k in ("whole", "append", "listing", "fresh")] == [3] * 4
    assert "(100 listed 2 times)" in rows[2]["workload"]


def test_the_fields_section_times_a_group_against_one_archive(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--only", "fields", "--clips", "64", "--repeats", "1", "--workers", "1"]
    assert cli.main([*argv, "--out", str(out), "--workdir", str(tmp_path / "work")]) == 0
    one, group = json.loads((out / "results.json").read_text())["rows"]
    assert one["pipeline"] == "Loader, both fields in one archive" and one["samples_per_s"] > 0
    assert group["baseline"] == one["pipeline"] and group["samples_per_s"] > 0
    ratio = group["extra"]["group_vs_one"]
    assert 0 < ratio["range"][0] <= ratio["median"] <= ratio["range"][1]
    assert len(group["extra"]["samples_per_s"]["group"]) == 3  # at least three rounds


def test_the_resume_section_times_a_continued_epoch_against_a_fresh_start(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    argv = ["--only", "resume", "--resume-samples", "20000", "--repeats", "1"]
    assert cli.main([*argv, "--out", str(out), "--workdir", str(tmp_path / "work")]) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert len(rows) == 4  # two moves, fresh and continued each
    for fresh, continued in (rows[:2], rows[2:]):
        assert fresh["workload"] == continued["workload"] and fresh["extra"]["ms"] > 0
        ratio = continued["extra"]["continued_vs_fresh"]
        assert 0 < ratio["range"][0] <= ratio["median"] <= ratio["range"][1]
        assert len(continued["extra"]["seconds"]["continued"]) == 5  # at least five rounds


def test_the_budget_section_sets_dlop_beside_lhotse_and_a_bare_gather(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--only", "budget", "--budget-utts", "120", "--repeats", "1", "--workers", "1"]
    assert cli.main([*argv, "--out", str(out), "--workdir", str(tmp_path / "work")]) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    dlop, lhotse = rows[:2]
    assert dlop["pipeline"].startswith("dlop Loader(max_frames=20000")
    for row in (dlop, lhotse):
        assert row["samples_per_s"] > 0 and row["extra"]["batches"] > 0
        assert 0 <= row["extra"]["padded_share"] < 1
    share = dlop["extra"]["padded_share_over_lhotse"]
    assert share["range"][0] <= share["median"] <= share["range"][1]
    short = rows[2:]
    loaders = [r for r in short if r["pipeline"].startswith("dlop Loader, bucketed")]
    assert len(loaders) == 4 and all(r["samples_per_s"] > 0 for r in loaders)
    against_bare = [r for r in loaders if "over_bare" in r["extra"]]
    assert [r["pipeline"].endswith(", fbank") for r in against_bare] == [True, True]
    assert all(r["extra"]["over_bare"]["median"] > 0 for r in against_bare)
    peers = [r for r in short if "dlop_count_over_this" in r["extra"]]
    assert {r["pipeline"].split()[0] for r in peers} == {"Lhotse", "datasets"}

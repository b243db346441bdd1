"""dlop-bench's remote section: without moto it says it did not run instead of failing."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from dlop.tools.bench import cli, remote_bench


def test_without_moto_the_section_is_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "moto.server", None)  # import fails as if not installed
    args = argparse.Namespace(clips=8, repeats=1)
    assert remote_bench.run(tmp_path, args) == []
    assert "moto is not installed" in capsys.readouterr().err
    assert "remote" in cli.SECTIONS and "remote" in cli.DEFAULT_SECTIONS

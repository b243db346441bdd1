"""formats.extras: the one message for a feature whose extra is not installed (each
feature's own, in a reading-only install: tests/tools/test_install.py)."""

from __future__ import annotations

import pickle
import sys

import pytest

from dlop.formats import DlopError
from dlop.formats.extras import MissingExtraError, needs_extra


def test_a_missing_module_names_the_feature_the_module_and_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "soundfile", None)  # import soundfile: not found
    with pytest.raises(MissingExtraError) as caught, needs_extra("compile", "decoding audio"):
        import soundfile  # noqa: F401
    e = caught.value
    assert (
        str(e)
        == "decoding audio needs soundfile, which is not installed: pip install 'dlop[compile]'"
    )
    assert isinstance(e, DlopError) and isinstance(e, ImportError)
    assert (e.name, e.extra) == ("soundfile", "compile")
    assert e.__suppress_context__
    again = pickle.loads(pickle.dumps(e))  # as it comes back from a worker process
    assert (str(again), again.name, again.extra) == (str(e), "soundfile", "compile")


def test_a_module_that_fails_otherwise_raises_its_own_error() -> None:
    with pytest.raises(OSError, match="no libsndfile"), needs_extra("compile", "decoding audio"):
        raise OSError("no libsndfile")
    with needs_extra("compile", "decoding audio"):
        import json  # noqa: F401  (there: nothing raised)

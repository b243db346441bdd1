"""is_text answers from the string's ASCII flag when it can, with the same results."""

from __future__ import annotations

import pytest

from dlop.compiler.corpus.listing import is_text


class NoEncode(str):
    def encode(self, *args: object, **kwargs: object) -> bytes:
        raise AssertionError("encoded an ASCII string to check it")


def test_ascii_text_is_not_encoded() -> None:
    assert is_text(NoEncode("audio/1-100038-A-14.wav"))
    assert is_text(NoEncode(""))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("plain", True),
        ("é and 中文 and 🎵", True),
        ("lone \ud800 surrogate", False),
        ("\udcff", False),
    ],
)
def test_same_answers(value: str, expected: bool) -> None:
    assert is_text(value) is expected

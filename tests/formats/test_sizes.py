"""One grammar for every byte size dlop takes."""

from __future__ import annotations

import pytest

from dlop.formats.sizes import parse_size


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("1000", 1000),
        (4096, 4096),
        ("256MiB", 256 << 20),
        ("1.5GB", 1_500_000_000),
        ("50G", 50 << 30),
        ("50g", 50 << 30),
        ("2 kb", 2000),
        ("10B", 10),
    ],
)
def test_sizes(text: str | int, want: int) -> None:
    assert parse_size(text) == want


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "not a number of bytes"),
        ("12 parsecs", "not a number of bytes"),
        ("-5", "not a number of bytes"),
        ("1e400", "not a number of bytes"),
        ("9" * 400, "too large"),
        ("0", "must be a positive"),
        (0, "must be a positive"),
        (True, "not a number of bytes"),
        (1.5, "not a number of bytes"),
    ],
)
def test_bad_sizes_say_why(text: object, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_size(text)  # type: ignore[arg-type]

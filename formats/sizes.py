"""Byte sizes as people write them, one grammar for every size dlop takes (shard sizes,
cache budgets): ``1000``, ``256MiB``, ``1.5GB``, ``50G``.

``KB``/``MB``/``GB``/``TB`` are decimal (10^3 ...); ``KiB``/``MiB``/``GiB``/``TiB`` and a
bare ``K``/``M``/``G``/``T`` are binary (2^10 ...). Case does not matter.
"""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(I?B)?|(B))?\s*$", re.IGNORECASE)
_POWER = {"k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str | int) -> int:
    """``text`` in bytes (a positive int passes as it is); ValueError saying what is wrong."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE.match(str(text)) if isinstance(text, str) else None
        if m is None:
            raise ValueError(
                f"{text!r} is not a number of bytes with an optional K/M/G/T, KB/MB/GB/TB "
                "or KiB/MiB/GiB/TiB suffix"
            )
        number, letter, tail = m.group(1), m.group(2), (m.group(3) or "").lower()
        scale = 1
        if letter:
            power = _POWER[letter.lower()]
            scale = 1000**power if tail == "b" else 1024**power
        try:
            value = int(float(number) * scale)
        except OverflowError:
            raise ValueError(f"{text!r} is too large a number of bytes") from None
    if value <= 0:
        raise ValueError(f"{text!r} must be a positive number of bytes")
    return value

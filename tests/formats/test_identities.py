"""The identities of a listing's inputs (SPEC.md §6.2): each text's BLAKE2b-128 digest; a
text's k-th repeat is named by the text, a NUL and k, so that every input of a listing has
an identity of its own, given in listing order, whatever order the repeats come in."""

from __future__ import annotations

import hashlib
import random

from dlop.formats.generations import listing_identities


def digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def test_repeats_are_numbered_in_listing_order() -> None:
    texts = ["a", "b", "a", "c", "a", "b"]
    repeats: list[int] = []
    got = [bytes(i) for i in listing_identities(texts, repeats)]
    names = ["a", "b", "a\x001", "c", "a\x002", "b\x001"]
    assert got == [digest(n) for n in names]
    assert repeats == [2, 4, 5]


def test_identities_agree_with_a_plain_count_of_each_text() -> None:
    rng = random.Random(5)
    for _ in range(200):
        texts = [str(rng.randrange(6)) for _ in range(rng.randrange(0, 40))]
        seen: dict[str, int] = {}
        want = []
        for t in texts:
            k = seen.get(t, 0)
            seen[t] = k + 1
            want.append(digest(t if k == 0 else f"{t}\x00{k}"))
        got = [bytes(i) for i in listing_identities(texts)]
        assert got == want
        assert len(set(got)) == len(got)

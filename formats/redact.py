"""Credentials out of every URL dlop stores or prints.

A URL may carry a user name and password (``https://user:password@host/x``) or,
signed, its key, signature and token in the query. dlop reads through such a URL
as given, but what it writes (index.json's recipe and provenance, errors.jsonl,
a cache's ``source.txt``) and every message of its errors (DlopError) holds the
URL without them. A leaf module: errors and urls both use it.
"""

from __future__ import annotations

import re

# A URL inside any text: its scheme, its userinfo if any (``user@``, or ``user:password@``
# whose password may hold an unescaped ``/``, as pasted secret keys do), and the rest up to
# white space or a quote.
_URL_IN_TEXT = re.compile(
    r"([A-Za-z][A-Za-z0-9+.\-]*://)([^/?#\s'\"@:]*:[^\s'\"@]*@|[^/?#\s'\"@]*@)?([^\s'\"]*)"
)
_QUERY_VALUE = re.compile(r"([?&;][^=&;#]*=)[^&;#]*")
REDACTED = "***"


def redact(text: str) -> str:
    """``text`` with the credentials of every URL in it removed: the user name and password
    (``user:password@``) and every query parameter's value (signed URLs carry their key,
    signature and token there). What dlop stores or prints of a URL goes through this."""
    if "://" not in text:
        return text

    def one(m: re.Match[str]) -> str:
        scheme_part, userinfo, rest = m[1], m[2], m[3]
        if "?" in rest:
            path, _, query = rest.partition("?")
            rest = path + _QUERY_VALUE.sub(lambda q: q[1] + REDACTED, "?" + query)
        return scheme_part + (REDACTED + "@" if userinfo else "") + rest

    return _URL_IN_TEXT.sub(one, text)

"""The command-line tools' output: nothing they print holds a URL's credentials.

A SOURCE, OUT or archive URL may carry a user name and password or signed query
values; dlop reads through it as given, but every line the tools write to
stdout or stderr, a storage client's error that reaches them included, goes
through ``dlop.formats.redact`` first.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Iterator
from typing import Any, TextIO

from dlop.formats.redact import redact


class _Redacting:
    """A text stream that writes through to ``inner`` with URL credentials removed."""

    def __init__(self, inner: TextIO) -> None:
        self._inner = inner

    def write(self, text: str) -> int:
        self._inner.write(redact(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:  # flush, isatty, fileno, encoding, ...
        return getattr(self._inner, name)


@contextlib.contextmanager
def redacted_output(tool: str) -> Iterator[None]:
    """stdout and stderr redacted while the tool runs; an error no handler of the tool
    expected is printed here (redacted) as ``<tool>: error:`` with its traceback, exit 1."""
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Redacting(out), _Redacting(err)
    try:
        yield
    except (SystemExit, KeyboardInterrupt, GeneratorExit):
        raise
    except BaseException as e:
        traceback.print_exc()
        print(f"{tool}: error: {type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        sys.stdout, sys.stderr = out, err

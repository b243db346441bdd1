"""The command-line tools' output: nothing they print holds a URL's credentials.

A SOURCE, OUT or archive URL may carry a user name and password or signed query
values; dlop reads through it as given, but every line the tools write to
stdout or stderr, a storage client's error that reaches them included, goes
through ``dlop.formats.redact`` first.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import traceback
from collections.abc import Iterator
from typing import Any, NoReturn, TextIO

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


def exit_now(code: int) -> NoReturn:
    """Ends a command-line tool's process with ``code`` once its work is done, without
    the interpreter's module teardown: with torch imported that teardown alone takes most
    of a second, spent after the last line is printed. What a normal exit does that
    matters still happens first: stdout and stderr are flushed and the ``atexit``
    handlers run (a process pool's, logging's). While a thread other than a daemon one
    still runs, the interpreter exits normally, which waits for it."""
    if any(
        t.is_alive() and not t.daemon
        for t in threading.enumerate()
        if t is not threading.main_thread()
    ):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)

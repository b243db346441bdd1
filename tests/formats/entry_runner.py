"""Child process for the hostile-file tests: opens archives through every entry point.

Usage: ``python entry_runner.py CASES_JSON`` where the file holds a list of
``[case, archive_path, entry]``. For each it prints ``START case entry`` and then
one ``RESULT {json}`` line: ``outcome`` is ``ok``, ``dlop`` (a DlopError, or for
the CLI an exit status 1 with a clean message) or ``other`` (anything else:
a bug). A watchdog ends the process with a traceback if one entry hangs, so the
parent sees the last START without a RESULT.

The address space is capped (RLIMIT_AS) so that a reader that believes a hostile
size fails fast with MemoryError instead of swapping.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import json
import os
import resource
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

ENTRY_TIMEOUT_S = float(os.environ.get("DLOP_ENTRY_TIMEOUT_S", "30"))
ADDRESS_SPACE_BYTES = 4 << 30


def run_formats(path: str) -> None:
    from dlop.formats import ArchiveReader

    with ArchiveReader(path) as reader:
        for i in range(min(len(reader), 3)):
            reader.sample(i)
        reader.errors()
        problems = reader.verify()
        if problems:
            from dlop.formats import FormatError

            raise FormatError(path, f"verify: {problems[0]}")


def run_open_archive(path: str) -> None:
    from dlop.runtime import open_archive

    ds = open_archive(path)
    if len(ds):
        ds[0]
        ds.__getitems__([0])


def run_loader(path: str) -> None:
    from dlop.runtime import Loader

    loader = Loader(path, batch_size=2, shuffle=False, prefetch=1)
    try:
        for _ in loader:
            break
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()


def cli(command: str) -> Callable[[str], dict[str, object]]:
    def run(path: str) -> dict[str, object]:
        from dlop.tools.inspect_cli import main

        argv = [command, path] + (["0"] if command == "show" else [])
        if command == "verify":
            argv.append("-q")
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
        return {"rc": rc, "stdout": out.getvalue()[-2000:], "stderr": err.getvalue()[-2000:]}

    return run


ENTRIES: dict[str, Callable[[str], object]] = {
    "formats": run_formats,
    "open_archive": run_open_archive,
    "loader": run_loader,
    "info": cli("info"),
    "verify": cli("verify"),
    "show": cli("show"),
}


def main() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))
    from dlop.formats import DlopError

    cases = json.loads(Path(sys.argv[1]).read_text())
    for case, path, entry in cases:
        print(f"START {case} {entry}", flush=True)
        faulthandler.dump_traceback_later(ENTRY_TIMEOUT_S, exit=True)
        result: dict[str, object] = {"case": case, "entry": entry}
        try:
            got = ENTRIES[entry](path)
            if isinstance(got, dict):
                result.update(got)
                # exit 1 with a clean message, or (verify) with the problems listed
                reported = str(got["stderr"]).startswith("dlop-inspect: error:") or (
                    entry == "verify" and str(got["stdout"]).startswith("FAIL ")
                )
                clean = got["rc"] == 1 and reported
                result["outcome"] = "ok" if got["rc"] == 0 else "dlop" if clean else "other"
                result["message"] = got["stderr"] or got["stdout"]
            else:
                result["outcome"] = "ok"
        except DlopError as e:
            result.update(outcome="dlop", type=type(e).__name__, message=str(e))
        except BaseException as e:  # reported to the parent as a failure
            result.update(
                outcome="other",
                type=type(e).__name__,
                message=str(e)[:2000],
                traceback=traceback.format_exc()[-4000:],
            )
        faulthandler.cancel_dump_traceback_later()
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

"""dlop-compile: decode and featurize a corpus once into a dlop archive."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dlop-compile", description=__doc__)
    p.parse_args(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""dlop: a precomputed dataset compiler and zero-copy training-time runtime.

Subpackages: ``dlop.formats`` (the archive bytes), ``dlop.compiler`` (offline
featurization), ``dlop.runtime`` (training-time loading) and ``dlop.tools``
(command-line programs).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dlop")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"

__all__ = ["__version__"]

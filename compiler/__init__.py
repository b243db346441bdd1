"""Offline compilation: corpus sources -> decoders -> featurizers -> shard writer.

``corpus`` lists a SOURCE by its layout into inputs; ``audio`` and ``vision`` decode
and featurize them; ``run`` processes them in work units on local processes or Dask
(``run.pipeline.compile_corpus`` is the entry point); ``output`` guards OUT and
commits what the units write. ``recipe`` holds the options, ``urls`` the storage a
compile reads and writes through, ``errors`` the compiler's errors. ``custom`` compiles
a user's own Dataset or function (``compile_dataset``, ``compile_map``, importable from
here).
"""

from typing import Any

__all__ = ["compile_dataset", "compile_map"]


def __getattr__(name: str) -> Any:
    # imported on first use: `import dlop.compiler` stays light (no torch)
    if name in __all__:
        from . import custom

        return getattr(custom, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

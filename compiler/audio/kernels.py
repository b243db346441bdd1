"""The compiler's compiled kernels (compiler/audio/_kernels.c: the spectrum-to-filterbank step
and 16-bit PCM framing), built at install; ``native`` is None where no C compiler was
there, and the featurizer then uses torch products (compiler.audio.features)."""

from __future__ import annotations

import importlib
from types import ModuleType

native: ModuleType | None
try:
    native = importlib.import_module("._kernels", __package__)
except ImportError:  # built without a C compiler
    native = None

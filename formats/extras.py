"""The optional dependency groups ("extras") of the dlop distribution, named where a
feature imports a module that one of them installs and finds it missing.

A plain ``pip install dlop`` reads archives (numpy, zstandard, torch). ``compile``
adds the media decoders, Pillow, matplotlib and the rest a compile machine needs;
``dask``, ``s3``, ``gcs``, ``http`` and ``hf`` add scale-out, object storage and
Parquet corpora (pyproject.toml lists each). Shared by every package, so each
missing extra is told in the same words.
"""

from __future__ import annotations

from types import TracebackType

from .errors import DlopError


def install_hint(extra: str) -> str:
    """The command that installs ``extra``."""
    return f"pip install 'dlop[{extra}]'"


class MissingExtraError(DlopError, ImportError):
    """A feature needs a module that an extra installs, and it is not installed."""

    def __init__(self, feature: str, module: str, extra: str) -> None:
        super().__init__(f"{feature} needs {module}, which is not installed: {install_hint(extra)}")
        self.feature, self.module, self.extra = feature, module, extra
        self.name = module  # as ImportError's

    def __reduce__(self) -> tuple[type[MissingExtraError], tuple[str, str, str]]:
        # as raised: from a compile's worker process to the caller
        return type(self), (self.feature, self.module, self.extra)


class needs_extra:  # lower case: used as a statement, like contextlib.suppress
    """``with needs_extra("compile", "decoding audio"): import soundfile``: a module the
    block cannot find raises MissingExtraError naming the feature, the module and the
    extra. The import stays an import statement, typed as usual; a module that is there
    but fails to load (a missing shared library) raises its own error."""

    def __init__(self, extra: str, feature: str) -> None:
        self.extra = extra
        self.feature = feature

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if isinstance(error, ModuleNotFoundError):
            module = error.name or str(error)
            raise MissingExtraError(self.feature, module, self.extra) from None

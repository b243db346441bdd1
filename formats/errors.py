"""The dlop error hierarchy; every package raises subclasses of DlopError."""

from .redact import redact


class DlopError(Exception):
    """Root of every error dlop raises on purpose. A URL's credentials (user, password,
    query values) never appear in its message: they are removed here (see redact)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


class FormatError(DlopError, ValueError):
    """A shard or index breaks SPEC.md; the message names the file and the problem."""

    def __init__(self, path: object, problem: str) -> None:
        self.path = redact(str(path))
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class ChecksumError(FormatError):
    """Stored bytes do not match their CRC-32."""


class SchemaError(DlopError, ValueError):
    """A field definition or a sample does not fit the schema."""


class StorageError(DlopError):
    """Storage that could not be read or written as asked: a URL no installed fsspec
    backend opens, options that do not fit it, or a read that failed every try (the
    message names the URL and each try's reason)."""


class ResourceLimitError(DlopError):
    """A limit of this process or machine (open files, memory maps) is too low for what
    was asked; the message names the limit and how to raise it. Never retried."""

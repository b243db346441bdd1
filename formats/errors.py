"""The dlop error hierarchy; every package raises subclasses of DlopError."""


class DlopError(Exception):
    """Root of every error dlop raises on purpose."""


class FormatError(DlopError, ValueError):
    """A shard or index breaks SPEC.md; the message names the file and the problem."""

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class ChecksumError(FormatError):
    """Stored bytes do not match their CRC-32."""


class SchemaError(DlopError, ValueError):
    """A field definition or a sample does not fit the schema."""

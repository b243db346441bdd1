"""Compiler errors."""

from dlop.formats import DlopError


class CompileError(DlopError):
    """The compile cannot go on (bad recipe, bad corpus layout, or --on-error fail)."""


class InputError(DlopError):
    """One input cannot be compiled; recorded with its path and reason, or fatal under --on-error fail."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


class CompileWarning(UserWarning):
    """Something the compile chose that the user may not expect (a guessed sample rate that
    drops most of the inputs' bandwidth); dlop-compile prints it as a warning line."""


class AxisVaries(CompileError):
    """An input showed an axis to vary that the compile's schema held fixed: what was
    written is discarded, and a compile of one's own Dataset starts again with that
    axis ragged (dlop.compiler.custom)."""

    def __init__(self, message: str, field: str, axis: int) -> None:
        super().__init__(message)
        self.field, self.axis = field, axis

    def __reduce__(self) -> tuple[type["AxisVaries"], tuple[str, str, int]]:
        # raised in a worker process, it crosses back to the driver whole
        return (AxisVaries, (str(self), self.field, self.axis))

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

"""Errors that stop a command before any finding can be made (exit code 2)."""

from __future__ import annotations


class CkptspecError(Exception):
    """A usage or I/O problem: the input could not be read at all.

    Carries a stable ``code`` and a ``hint`` like a finding, and names the file.
    """

    exit_code = 2

    def __init__(self, code: str, message: str, hint: str, file: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.hint = hint
        self.file = file

    def to_line(self) -> str:
        where = f"{self.file}: " if self.file else ""
        return f"{where}{self.code} {self.message} (hint: {self.hint})"


class InvalidCheckpoint(CkptspecError):
    """The checkpoint itself is wrong or unsafe (exit 1): a bad 'latest', a damaged
    or code-running file, a layout format 1.0 cannot describe."""

    exit_code = 1

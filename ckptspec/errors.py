"""Every exception ckptspec raises.

``CkptspecError`` and its subclasses stop a command before (or instead of) findings: each
carries a stable ``code`` and a ``hint`` like a finding, and names the file; its
``exit_code`` is the CLI's exit status. The others are raised by the library layers:
``TorchFileError`` by the torch-file reader (mapped to CK204/CK205 in one place,
``ckptspec.checkpoint.states``), ``InvalidManifest``/``InvalidInput`` carry findings,
``UnsupportedEngine`` refuses a live engine, ``SafetensorsWriteError`` a bad write.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .findings import Finding


class CkptspecError(Exception):
    """A usage or I/O problem: the input could not be read at all (exit 2).

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

    def __str__(self) -> str:
        # The line the CLI prints: a Python caller sees which input, the code and the hint too.
        return self.to_line()


class FileUnreadable(CkptspecError):
    """CK901: a file or directory of the input cannot be read (permissions, an I/O error): exit 2.
    Never reported as damage (CK205) or a bad 'latest' (CK201): the bytes were never seen."""

    def __init__(self, path: object, exc: OSError):
        if isinstance(exc, PermissionError):
            hint = "this user may not read it: check its permissions and those of the directories above it"
        elif isinstance(exc, FileNotFoundError):
            hint = "it was there a moment ago: is something deleting or moving the checkpoint's files?"
        else:
            hint = "an I/O error: check the storage it is on, then run the command again"
        super().__init__("CK901", f"cannot read: {exc.strerror or exc}", hint, str(path))


# --------------------------------------------------------------------------- manifests


class InvalidDocument(CkptspecError):
    """The bytes decode, but not to something a manifest can be (exit 1)."""

    exit_code = 1


class NotEncodable(CkptspecError):
    """The document holds a value the chosen encoding cannot represent (exit 1)."""

    exit_code = 1

    def __init__(self, message: str, file: str | None = None):
        super().__init__(
            "CK907",
            message,
            "keep manifest values to strings, integers in [-2**63, 2**64), "
            "finite floats, booleans, null, arrays and objects",
            file,
        )


class MigrationError(CkptspecError):
    """No way to migrate, or the migration went wrong (exit 1)."""

    exit_code = 1


class InvalidManifest(Exception):
    """A manifest that must be valid is not; ``findings`` lists why."""

    def __init__(self, name: str, findings: list[Finding]):
        self.findings = findings
        errors = [f for f in findings if f.severity == "error"]
        first = errors[0].to_line() if errors else ""
        super().__init__(f"{name}: invalid manifest ({len(errors)} finding(s)); first: {first}")


class InvalidInput(Exception):
    """The document to migrate is not valid at its own version; ``findings`` lists why."""

    def __init__(self, name: str, findings: list[Finding]):
        self.name = name
        self.findings = findings
        super().__init__(f"{name}: invalid manifest")


# --------------------------------------------------------------------------- checkpoints


class InvalidCheckpoint(CkptspecError):
    """The checkpoint itself is wrong or unsafe (exit 1): a bad 'latest', a damaged
    or code-running file, a layout format 1.0 cannot describe."""

    exit_code = 1


class UnsupportedCheckpoint(InvalidCheckpoint):
    """A checkpoint format 1.0 cannot describe (exit 1)."""

    def __init__(self, message: str, hint: str, file: str | None = None):
        super().__init__("CK202", message, hint, file)


class EmbedError(InvalidCheckpoint):
    """A manifest cannot be embedded in, or read from, this file (exit 1)."""


class CheckpointInvalid(InvalidCheckpoint):
    """Validation found errors; nothing was read or written. ``findings`` lists them."""

    def __init__(self, findings: list[Finding], checkpoint: str):
        self.findings = findings
        errors = [f for f in findings if f.severity == "error"]
        first = errors[0] if errors else None
        super().__init__(
            first.code if first else "CK205",
            f"checkpoint failed validation with {len(errors)} error(s)"
            + (f"; first: {first.to_line()}" if first else ""),
            "fix or regenerate the checkpoint; `ckptspec validate` lists every finding",
            checkpoint,
        )


class RecordMismatch(CheckpointInvalid):
    """The files no longer match the record a writer would replace or build on (``embed``,
    ``migrate --checkpoint``); ``findings`` lists how. Nothing was written (exit 1)."""

    def __init__(self, findings: list[Finding], checkpoint: str, what: str, hint: str):
        super().__init__(findings, checkpoint)
        self.what = what  # "the files do not match what ckptspec.json records"
        self.hint = hint


class ReconstructMismatch(InvalidCheckpoint):
    """CK401: the files do not hold what the validated manifest says (exit 1)."""

    def __init__(self, message: str, file: str | Path | None = None):
        super().__init__(
            "CK401",
            message,
            "the files changed since validation, or the manifest does not describe them; run `ckptspec validate`",
            None if file is None else str(file),
        )


class ReconstructUnsupported(InvalidCheckpoint):
    """CK402: a tensor this reconstruction cannot read or write (exit 1)."""

    def __init__(self, message: str, hint: str, file: str | Path | None = None):
        super().__init__("CK402", message, hint, None if file is None else str(file))


class ReshardUnsupported(InvalidCheckpoint):
    """CK410: a checkpoint ``ckptspec reshard`` cannot write in the target layout (exit 1)."""

    def __init__(self, message: str, hint: str, file: str | Path | None = None):
        super().__init__("CK410", message, hint, None if file is None else str(file))


class TensorDigestMismatch(InvalidCheckpoint):
    """CK222: a tensor read while streaming does not match its recorded digest (exit 1)."""

    def __init__(self, name: str, actual: str, recorded: str, files: list[str]):
        super().__init__(
            "CK222",
            f"{name}: sha256 of the tensor's elements is {actual[:16]}..., the manifest records {recorded[:16]}...",
            "the tensor's bytes changed after the manifest was written (bit rot, a partial copy, another save); "
            "restore the file; nothing was written",
            ", ".join(files) or None,
        )


class FileHashMismatch(InvalidCheckpoint):
    """CK209: a remote file hashed while its tensors streamed does not match its recorded hash (exit 1)."""

    def __init__(self, file: str, algorithm: str, actual: str, recorded: str):
        super().__init__(
            "CK209",
            f"{algorithm} of the file is {actual[:16]}..., the manifest records {recorded[:16]}...",
            "the content changed after the manifest was written (swapped rank files, a re-save, bit rot); "
            "restore it; nothing was written",
            file,
        )


class TorchFileError(Exception):
    """A file cannot be read as a (safe) torch zip file.

    ``path`` is the file (None when the caller knows it) and ``reason`` says what is wrong
    without naming it, so callers can name the file their own way.
    """

    def __init__(self, path: str | Path | None, reason: str):
        super().__init__(path, reason)
        # A remote file (``location.RemotePath``) stays what it is: it has no local path.
        self.path = None if path is None else Path(path) if isinstance(path, (str, os.PathLike)) else path
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}" if self.path is not None else self.reason


class NotATorchFile(TorchFileError):
    """Not a zip archive, or a zip without ``<prefix>/data.pkl`` (e.g. legacy torch format)."""


class LegacyTorchFile(NotATorchFile):
    """A ``torch.save`` file in the legacy (pre-1.6, non-zip) serialization: readable by torch,
    but it has no zip members for a locator to name (CK202, not CK205)."""


class UnsafePickleError(TorchFileError):
    """data.pkl refers to a global that is not on the allowlist."""


class TruncatedFile(TorchFileError):
    """The file ends before the data its zip structures promise."""


class PickleOverCap(TorchFileError):
    """``data.pkl`` is larger than the reader's cap (``CKPTSPEC_MAX_PICKLE_BYTES``): refused unread."""


class RemoteError(CkptspecError):
    """A file at a URL cannot be read (exit 2): not found, access denied, no range requests, changed
    while read, a timeout, a dropped connection (CK910-CK915), a write to a URL (CK916), a backend
    that is not installed (CK917). See ``ckptspec.location``."""


# --------------------------------------------------------------------------- producers and writers


class UnsupportedEngine(ValueError):
    """The engine uses a layout that format 1.0 cannot describe (MoE, pipeline, TP)."""


class EngineLayoutMismatch(UnsupportedEngine):
    """The layout computed from the engine's parameters disagrees with the live optimizer's
    own numbers: a DeepSpeed version whose layout ckptspec does not know (or a ckptspec bug)."""


class SafetensorsWriteError(ValueError):
    """A tensor cannot be written (unknown dtype, wrong byte count, write out of order)."""


# --------------------------------------------------------------------------- writing outputs


class OutputBusy(CkptspecError):
    """Another ckptspec run is writing into the same directory (exit 2)."""

    def __init__(self, directory: str):
        super().__init__(
            "CK908",
            "another ckptspec run is writing into this directory",
            "wait for it to finish, or write somewhere else; two runs would mix their files",
            directory,
        )


class ForeignOutput(CkptspecError):
    """The output directory holds a file of an output's name that ckptspec did not write (exit 2)."""

    def __init__(self, path: str, what: str):
        super().__init__(
            "CK909",
            f"{what} exists and was not written by ckptspec; it would be replaced or left beside the new output",
            "move it away, or write into an empty directory",
            path,
        )

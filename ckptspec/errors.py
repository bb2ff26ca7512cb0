"""Every exception ckptspec raises: one tree under ``CkptspecError``.

Every error carries a stable ``code`` and a ``hint`` like a finding, names the file when it has
one, and its ``exit_code`` is the CLI's exit status. The families (docs/errors.md, "Errors in
Python"):

- ``InvalidDocument`` (exit 1): a manifest or index that is not a valid document
  (``InvalidManifest``, ``InvalidInput``, ``NotEncodable``, ``MigrationError``);
- ``InvalidCheckpoint`` (exit 1): the checkpoint's files are wrong or unsafe (``CheckpointInvalid``,
  ``TorchFileError`` of the torch-file reader, mapped to its finding in ``ckptspec.checkpoint.states``, ...);
- ``Unsupported`` (exit 1): something ckptspec does not do for this input (``UnsupportedCheckpoint``,
  ``ReconstructUnsupported``, ``ReshardUnsupported``, ``UnsupportedEngine``), beside its other family;
- ``InputOutputError`` (exit 2): a file that cannot be read or written (``FileUnreadable``,
  ``RemoteError``, ``OutputBusy``, ``ForeignOutput``); a plain ``CkptspecError`` is a usage or I/O error too;
- ``InternalError`` (exit 2, CK999): a ckptspec bug (``SafetensorsWriteError``).

The classes that had a builtin base keep it (``UnsupportedEngine`` and ``SafetensorsWriteError`` are
``ValueError``s) and the ones raised by library layers keep their ``str()`` (``TorchFileError``:
``path: reason``), so no caller's ``except`` or message changes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .findings import Finding


class CkptspecError(Exception):
    """The base of every ckptspec error; raised itself for a usage or I/O problem: the input could
    not be read at all (exit 2).

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


# --------------------------------------------------------------------------- families


class InvalidDocument(CkptspecError):
    """A manifest or checkpoint index that is not a valid document: the bytes decode, but not to
    something a manifest can be, or its findings have errors (exit 1)."""

    exit_code = 1


class InvalidCheckpoint(CkptspecError):
    """The checkpoint itself is wrong or unsafe (exit 1): a bad 'latest', a damaged
    or code-running file, a layout format 1.0 cannot describe."""

    exit_code = 1


class Unsupported(CkptspecError):
    """Something ckptspec does not do for this input (exit 1): a checkpoint its format cannot describe,
    a tensor a reconstruction cannot write, a target layout reshard cannot write, a live engine.
    Each such class is also in the family of what it refuses (``InvalidCheckpoint``, ``ValueError``)."""

    exit_code = 1


class InputOutputError(CkptspecError):
    """A file or directory that cannot be read or written: a local or remote read that failed, an output
    directory another run holds or that holds foreign files (exit 2)."""

    exit_code = 2


class InternalError(CkptspecError):
    """CK999: a ckptspec bug, not a problem of the input (exit 2). The command line reports it as it
    reports any unexpected exception (``CKPTSPEC_DEBUG=1`` shows the traceback)."""

    exit_code = 2


# --------------------------------------------------------------------------- reading


class FileUnreadable(InputOutputError):
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


class NotEncodable(InvalidDocument):
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


class MigrationError(InvalidDocument):
    """No way to migrate, or the migration went wrong (exit 1)."""


_FINDINGS_HINT = "`ckptspec validate` lists every finding"


class InvalidManifest(InvalidDocument):
    """A manifest (or checkpoint index) that must be valid is not; ``findings`` lists why.
    ``code`` and ``hint`` are the first error's; ``str()`` is ``NAME: invalid manifest (N finding(s)); first: ...``."""

    def __init__(self, name: str, findings: list[Finding]):
        errors = [f for f in findings if f.severity == "error"]
        first = errors[0].to_line() if errors else ""
        message = f"invalid manifest ({len(errors)} finding(s)); first: {first}"
        super().__init__(errors[0].code if errors else "CK001", message, _FINDINGS_HINT, name)
        self.findings = findings
        self.args = (f"{name}: {message}",)

    def __str__(self) -> str:
        return str(self.args[0])


class InvalidInput(InvalidDocument):
    """The document to migrate is not valid at its own version; ``findings`` lists why.
    ``str()`` is ``NAME: invalid manifest``."""

    def __init__(self, name: str, findings: list[Finding]):
        errors = [f for f in findings if f.severity == "error"]
        super().__init__(errors[0].code if errors else "CK001", "invalid manifest", _FINDINGS_HINT, name)
        self.name = name
        self.findings = findings
        self.args = (f"{name}: invalid manifest",)

    def __str__(self) -> str:
        return str(self.args[0])


# --------------------------------------------------------------------------- checkpoints


class UnsupportedCheckpoint(InvalidCheckpoint, Unsupported):
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


class NoValidTag(InvalidCheckpoint):
    """CK260: no tag to resume from is valid (``deepspeed.load_checkpoint``); ``findings``: every tag's tried."""

    def __init__(self, message: str, hint: str, run_dir: str, findings: list[Finding]):
        super().__init__("CK260", message, hint, run_dir)
        self.findings = findings


class RecordMismatch(CheckpointInvalid):
    """The files no longer match the record a writer would replace or build on (``embed``,
    ``migrate --checkpoint``); ``findings`` lists how. Nothing was written (exit 1)."""

    def __init__(self, findings: list[Finding], checkpoint: str, what: str, hint: str):
        super().__init__(findings, checkpoint)
        self.what = what  # "the files do not match what ckptspec.json records"
        self.hint = hint


class ReconstructMismatch(InvalidCheckpoint):
    """CK401: the files do not hold what the validated manifest says (exit 1)."""

    def __init__(self, message: str, file: object = None):  # file: a str, Path or RemotePath (named by str())
        super().__init__(
            "CK401",
            message,
            "the files changed since validation, or the manifest does not describe them; run `ckptspec validate`",
            None if file is None else str(file),
        )


class ReconstructUnsupported(InvalidCheckpoint, Unsupported):
    """CK402: a tensor this reconstruction cannot read or write (exit 1)."""

    def __init__(self, message: str, hint: str, file: object = None):  # file: a str, Path or RemotePath
        super().__init__("CK402", message, hint, None if file is None else str(file))


class KindUnsupported(InvalidCheckpoint, Unsupported):
    """CK403: a command or function this kind of checkpoint does not support (yet), refused by capability
    before anything is read or written (``export/checkpoint.CAPABILITIES``; exit 1)."""

    def __init__(self, message: str, hint: str, file: str | Path | None = None):
        super().__init__("CK403", message, hint, None if file is None else str(file))


class ReshardUnsupported(InvalidCheckpoint, Unsupported):
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


DAMAGED_HINT = "the file is empty, truncated or not a torch checkpoint; restore it"
UNSAFE_HINT = "this file wants to run code on load; ckptspec refuses it (torch.load(weights_only=False) would run it)"
LEGACY_HINT = (
    "format 1.x locates tensors in zip members: save with torch's default (zip) serialization "
    "(DeepSpeed: checkpoint.checkpoint_serialization true, the default), or torch.load and torch.save the file again"
)
# The torch-file reader's cap on one data.pkl (``ckptspec.checkpoint.torchfile.pickle_cap``).
# data.pkl holds names and shapes only, ~180 bytes a tensor in DeepSpeed's model states: 256 MiB is
# ~1.4M tensors (a real 1M-tensor save has 173 MiB). Decoding costs ~10-20x its size in memory, a
# hostile pickle up to ~220x (tests/checkpoint/test_torchfile_fuzz.py): the cap bounds that.
DEFAULT_MAX_PICKLE_BYTES = 256 * 1024 * 1024
MAX_PICKLE_BYTES_VARIABLE = "CKPTSPEC_MAX_PICKLE_BYTES"
OVER_CAP_HINT = (
    f"data.pkl holds each tensor's name and shape (~180 bytes a tensor in DeepSpeed's model states), and is read "
    f"whole; if you trust this checkpoint, raise the cap: {MAX_PICKLE_BYTES_VARIABLE}=BYTES "
    f"(default {DEFAULT_MAX_PICKLE_BYTES})"
)


class TorchFileError(InvalidCheckpoint):
    """A file cannot be read as a (safe) torch zip file: CK205 (damaged), or a subclass's code.

    ``path`` is the file (None when the caller knows it) and ``reason`` says what is wrong
    without naming it, so callers can name the file their own way; ``str()`` is ``path: reason``.
    ``ckptspec.checkpoint.states.unreadable`` turns one into the ``InvalidCheckpoint`` a command reports.
    """

    default_code = "CK205"
    default_hint = DAMAGED_HINT

    def __init__(self, path: object, reason: str, hint: str | None = None):
        # A remote file (``location.RemotePath``) stays what it is: it has no local path.
        where = None if path is None else Path(path) if isinstance(path, (str, os.PathLike)) else path
        super().__init__(self.default_code, reason, hint or self.default_hint, None if where is None else str(where))
        self.args = (path, reason)
        self.path = where
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}" if self.path is not None else self.reason


class NotATorchFile(TorchFileError):
    """Not a zip archive, or a zip without ``<prefix>/data.pkl`` (e.g. legacy torch format)."""


class LegacyTorchFile(NotATorchFile, Unsupported):
    """A ``torch.save`` file in the legacy (pre-1.6, non-zip) serialization: readable by torch,
    but it has no zip members for a locator to name (CK202, not CK205)."""

    default_code = "CK202"
    default_hint = LEGACY_HINT


class UnsafePickleError(TorchFileError):
    """CK204: data.pkl refers to a global that is not on the allowlist."""

    default_code = "CK204"
    default_hint = UNSAFE_HINT


class TruncatedFile(TorchFileError):
    """The file ends before the data its zip structures promise."""


class PickleOverCap(TorchFileError):
    """CK225: ``data.pkl`` is larger than the reader's cap (``CKPTSPEC_MAX_PICKLE_BYTES``): refused unread."""

    default_code = "CK225"
    default_hint = OVER_CAP_HINT


class RemoteError(InputOutputError):
    """A URL cannot be read or written (exit 2): not found, access denied, no range requests, changed while read, a
    timeout, a dropped connection (CK910-CK915), a URL that takes no writes (CK916), a backend that is not installed
    (CK917), an uploaded object that differs from the output written (CK920). See ``ckptspec.location``."""


# --------------------------------------------------------------------------- producers and writers


class UnsupportedEngine(Unsupported, ValueError):
    """CK202: the engine uses a layout ckptspec's formats cannot describe (refused before anything is
    saved). A ``ValueError`` as well; ``str()`` is the message."""

    def __init__(
        self, message: str, hint: str = "save this engine with engine.save_checkpoint; ckptspec does not describe it"
    ):
        super().__init__("CK202", message, hint)

    def __str__(self) -> str:
        return self.message


class EngineLayoutMismatch(UnsupportedEngine):
    """The layout computed from the engine's parameters disagrees with the live optimizer's
    own numbers: a DeepSpeed version whose layout ckptspec does not know (or a ckptspec bug)."""

    def __init__(self, message: str):
        super().__init__(
            message, "a DeepSpeed version whose layout ckptspec does not know, or a ckptspec bug: please report it"
        )


class SafetensorsWriteError(InternalError, ValueError):
    """A tensor cannot be written (unknown dtype, wrong byte count, write out of order): the writer
    was used wrongly, a ckptspec bug (CK999). A ``ValueError`` as well; ``str()`` is the message."""

    def __init__(self, message: str):
        super().__init__("CK999", message, "this is a ckptspec bug; rerun with CKPTSPEC_DEBUG=1 and report it")

    def __str__(self) -> str:
        return self.message


# --------------------------------------------------------------------------- writing outputs


class RankFailed(InputOutputError):
    """CK918: another rank of a torchrun split failed: this rank stopped too, with that rank's exit code."""


class OutputBusy(InputOutputError):
    """Another ckptspec run is writing into the same directory (exit 2)."""

    def __init__(self, directory: str):
        super().__init__(
            "CK908",
            "another ckptspec run is writing into this directory",
            "wait for it to finish, or write somewhere else; two runs would mix their files",
            directory,
        )


class ForeignOutput(InputOutputError):
    """The output directory holds a file of an output's name that ckptspec did not write (exit 2)."""

    def __init__(self, path: str, what: str):
        super().__init__(
            "CK909",
            f"{what} exists and was not written by ckptspec; it would be replaced or left beside the new output",
            "move it away, or write into an empty directory",
            path,
        )

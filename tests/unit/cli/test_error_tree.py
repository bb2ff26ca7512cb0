"""One exception tree: every error ckptspec raises is a ``CkptspecError`` in the family docs/errors.md
("Errors in Python") gives it, and the command line exits with the family's documented code.

The oracle is the table in docs/errors.md: a class, a family or an exit code it does not list fails here.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import click
import pytest

import ckptspec
from ckptspec import errors
from ckptspec.cli import _common, cli, main
from ckptspec.findings import finding

DOCS = Path(__file__).resolve().parents[3] / "docs" / "errors.md"
FAMILIES = ("InvalidDocument", "InvalidCheckpoint", "Unsupported", "InputOutputError", "InternalError")


def _table() -> dict[str, tuple[list[str], int]]:
    """family -> (its classes, its exit code), from the table of docs/errors.md's "Errors in Python"."""
    text = DOCS.read_text("utf-8")
    section = text[text.index("## Errors in Python") :]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"`\w+`", cells[0]) and cells[3].isdigit():
            rows[cells[0].strip("`")] = (re.findall(r"`(\w+)`", cells[2]), int(cells[3]))
    return rows


def _error_classes() -> dict[str, type[BaseException]]:
    return {
        name: cls
        for name, cls in vars(errors).items()
        if inspect.isclass(cls) and issubclass(cls, BaseException) and cls.__module__ == errors.__name__
    }


def test_the_docs_table_lists_the_five_families():
    assert tuple(_table()) == FAMILIES


def test_every_error_is_a_ckptspec_error_in_its_documented_family():
    table, classes = _table(), _error_classes()
    listed = {name for names, _ in table.values() for name in names}
    for name, cls in classes.items():
        assert issubclass(cls, errors.CkptspecError), f"{name} is not under CkptspecError"
        if name != "CkptspecError" and name not in FAMILIES:
            assert name in listed, f"docs/errors.md's Errors in Python lists no family for {name}"
    for family, (names, exit_code) in table.items():
        assert classes[family].exit_code == exit_code, family
        for name in names:
            assert issubclass(classes[name], classes[family]), f"{name} is not a {family}"
            assert classes[name].exit_code == exit_code, f"{name} exits {classes[name].exit_code}, not {exit_code}"
    # the families are exported from the package, with the base
    for name in ("CkptspecError", *FAMILIES):
        assert getattr(ckptspec, name) is classes[name] and name in ckptspec.__all__


def test_builtin_bases_and_old_strings_are_kept():
    """No caller's ``except ValueError`` or message changes: what had a builtin base keeps it, and the
    errors of the library layers print what they printed."""
    for cls in (errors.UnsupportedEngine, errors.EngineLayoutMismatch, errors.SafetensorsWriteError):
        assert issubclass(cls, ValueError), cls
    assert not issubclass(errors.FileUnreadable, OSError)  # docs: a read error never taken for a write error
    for cls in (errors.UnsupportedCheckpoint, errors.ReconstructUnsupported, errors.ReshardUnsupported):
        assert issubclass(cls, errors.InvalidCheckpoint), cls  # `except InvalidCheckpoint` still catches them
    assert str(errors.TorchFileError("x.pt", "file is empty")) == "x.pt: file is empty"
    assert str(errors.TruncatedFile(None, "storage 0 has 4 bytes")) == "storage 0 has 4 bytes"
    assert str(errors.UnsupportedEngine("MoE at ZeRO stage 3")) == "MoE at ZeRO stage 3"
    assert str(errors.SafetensorsWriteError("w: 3 bytes missing")) == "w: 3 bytes missing"
    bad = finding("CK101", "$.groups[0].params[0].numel", "numel 3 is not the product of shape [2]", "fix it")
    assert (
        str(errors.InvalidManifest("m.json", [bad]))
        == f"m.json: invalid manifest (1 finding(s)); first: {bad.to_line()}"
    )
    assert str(errors.InvalidInput("m.json", [bad])) == "m.json: invalid manifest"
    # ... and now carry a code and a hint like every other error
    assert (errors.InvalidManifest("m.json", [bad]).code, errors.InvalidManifest("m.json", [bad]).file) == (
        "CK101",
        "m.json",
    )
    codes = {
        errors.TorchFileError: "CK205",
        errors.NotATorchFile: "CK205",
        errors.TruncatedFile: "CK205",
        errors.UnsafePickleError: "CK204",
        errors.PickleOverCap: "CK225",
        errors.LegacyTorchFile: "CK202",
    }
    for cls, code in codes.items():
        assert cls("x.pt", "why").code == code, cls
        assert cls("x.pt", "why").file == "x.pt"


def _instances() -> list[errors.CkptspecError]:
    bad = finding("CK101", "$.groups[0].params[0].numel", "numel 3 is not the product of shape [2]", "fix it")
    return [
        errors.InvalidManifest("m.json", [bad]),
        errors.NotEncodable("a float that is not finite", "m.json"),
        errors.TorchFileError("x.pt", "file is empty"),
        errors.UnsafePickleError("x.pt", "data.pkl references global os.system, which is not allowlisted"),
        errors.ReconstructMismatch("file changed", "x.pt"),
        errors.UnsupportedCheckpoint("legacy layout", "save it again", "x.pt"),
        errors.UnsupportedEngine("MoE at ZeRO stage 3 is not described"),
        errors.OutputBusy("out"),
        errors.FileUnreadable("x.pt", PermissionError(13, "Permission denied")),
        errors.SafetensorsWriteError("w.safetensors: 3 bytes missing"),
    ]


@pytest.mark.parametrize("error", _instances(), ids=lambda e: type(e).__name__)
def test_the_cli_exits_with_the_documented_code_of_each_family(error, monkeypatch, capsys):
    """A command that fails with ``error`` (through ``_common.fail``, as every command does) exits with its
    family's code from the docs, printing its line; an internal error is reported as any unexpected
    exception is, CK999 with the exception's type (as before the tree)."""
    family = next(f for f in FAMILIES if isinstance(error, getattr(errors, f)))
    documented = _table()[family][1]

    @click.command("fail-with")
    def fail_with() -> None:
        _common.fail(error)

    monkeypatch.setitem(cli.commands, "fail-with", fail_with)
    monkeypatch.setattr(sys, "argv", ["ckptspec", "fail-with"])
    monkeypatch.delenv("CKPTSPEC_DEBUG", raising=False)
    with pytest.raises(SystemExit) as stopped:
        main()
    assert stopped.value.code == documented
    err = capsys.readouterr().err
    if family == "InternalError":
        assert err == (
            f"CK999 internal error: {type(error).__name__}: {error} "
            "(hint: this is a ckptspec bug; rerun with CKPTSPEC_DEBUG=1 and report it)\n"
        )
    else:
        assert err == error.to_line() + "\n"

"""#37 (M2, L1): a checkpoint this user may not read is an I/O error (CK901, exit 2), never an internal
error (CK999), a damaged file (CK205, "restore it") or a bad ``latest`` (CK201); and with
``--format json`` a command still prints its one JSON object, even for an internal error.

The permissions are real: the commands run without root's right to read any file
(``ckptspec_process(..., unprivileged=True)``), so ``chmod 000`` gives a real EACCES.
"""

from __future__ import annotations

import importlib
import json
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from _harness.scenarios import COMMITTED

import ckptspec.cli

TAG = "global_step2"
SHARD = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
# Every command that reads a checkpoint directory, and where it would write.
COMMANDS = {
    "validate": ["validate", "{ck}"],
    "inspect": ["inspect", "{ck}"],
    "generate": ["generate", "{ck}", "-o", "{out}/m.json"],
    "embed": ["embed", "{ck}"],
    "extract": ["extract", "{ck}"],
    "diff": ["diff", "{ck}", "{ck}"],
    "reconstruct": ["reconstruct", "{ck}", "{out}/weights"],
    "reshard": ["reshard", "{ck}", "{out}/resharded", "--world-size", "1"],
    "export": ["export", "{ck}", "{out}/dcp"],
    "export-universal": ["export-universal", "{ck}", "{out}/universal"],
}


@pytest.fixture
def checkpoint(tmp_path):
    """A copy of the committed real checkpoint; every mode is given back before it is removed."""
    ck = tmp_path / "CK"
    shutil.copytree(COMMITTED["s2-bf16-ws2"], ck)
    (tmp_path / "out").mkdir()
    yield ck
    for path in [ck, *ck.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


@pytest.fixture(scope="session")
def _run(ckptspec_process):
    def _run(args: list[str], ck: Path) -> subprocess.CompletedProcess:
        out = ck.parent / "out"
        result = ckptspec_process([a.format(ck=ck, out=out) for a in args], unprivileged=True)
        assert "Traceback" not in result.stdout + result.stderr
        assert "CK999" not in result.stdout + result.stderr, result.stderr
        return result

    return _run


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_unreadable_tag_directory_is_ck901_exit_2(_run, command, checkpoint):
    (checkpoint / TAG).chmod(0)
    result = _run(COMMANDS[command], checkpoint)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{checkpoint / TAG}: CK901 cannot read: Permission denied" in result.stderr
    assert "ckptspec bug" not in result.stderr
    assert not list((checkpoint.parent / "out").iterdir()), "nothing is written"


@pytest.mark.parametrize("command", ["validate", "inspect", "diff"])
def test_json_output_is_one_object_naming_the_error(_run, command, checkpoint):
    (checkpoint / TAG).chmod(0)
    result = _run([*COMMANDS[command], "--format", "json"], checkpoint)
    assert result.returncode == 2
    error = json.loads(result.stdout)["error"]
    assert error["code"] == "CK901" and error["message"] == "cannot read: Permission denied"


def test_an_unreadable_shard_is_an_io_error_not_damage(_run, checkpoint):
    (checkpoint / TAG / SHARD).chmod(0)
    for args in (COMMANDS["validate"], COMMANDS["reconstruct"], COMMANDS["inspect"]):
        result = _run(args, checkpoint)
        assert result.returncode == 2, result.stdout + result.stderr
        assert f"{checkpoint / TAG / SHARD}: CK901 cannot read: Permission denied" in result.stderr
        assert "CK205" not in result.stdout + result.stderr and "restore" not in result.stderr
    report = json.loads(_run([*COMMANDS["validate"], "--format", "json"], checkpoint).stdout)
    assert report["error"]["code"] == "CK901" and report["findings"] == []
    assert not list((checkpoint.parent / "out").iterdir())


def test_an_unreadable_latest_is_an_io_error_not_a_bad_tag(_run, checkpoint):
    (checkpoint / "latest").chmod(0)
    result = _run(COMMANDS["validate"], checkpoint)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{checkpoint / 'latest'}: CK901 cannot read: Permission denied" in result.stderr
    assert "CK201" not in result.stderr and "write the tag name" not in result.stderr


def test_an_unreadable_subfolder_of_the_tag_is_not_left_out(_run, checkpoint):
    """os.walk skips a folder it cannot list without a word: its files would go unchecked."""
    (checkpoint / TAG / "offloaded").mkdir()
    (checkpoint / TAG / "offloaded" / "part.bin").write_bytes(b"x")
    (checkpoint / TAG / "offloaded").chmod(0)
    result = _run(COMMANDS["validate"], checkpoint)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"{checkpoint / TAG / 'offloaded'}: CK901 cannot read: Permission denied" in result.stderr


def _main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # main's SIGTERM handler stays out of pytest
    monkeypatch.setattr("sys.argv", ["ckptspec", *args])
    with pytest.raises(SystemExit) as exited:
        ckptspec.cli.main()
    out, err = capsys.readouterr()
    return exited.value.code, out, err


def test_an_internal_error_is_still_one_json_object(monkeypatch, capsys):
    """docs/cli.md: `validate --format json` prints exactly one JSON object whatever happens; an
    internal error (here a reader made to fail) printed only a line on stderr."""
    manifest = str(Path(__file__).parents[2] / "examples" / "manifests" / "zero2-bf16-2ranks.json")

    def broken(*args, **kwargs):
        raise RuntimeError("made to fail")

    # What each command calls first (attributes of its own module: no other module keeps the stand-in).
    monkeypatch.setattr(importlib.import_module("ckptspec.cli.validate"), "_validate_document_file", broken)
    monkeypatch.setattr(importlib.import_module("ckptspec.cli.inspect"), "load_target", broken)
    code, out, _ = _main(monkeypatch, capsys, "validate", manifest, "--format", "json")
    assert code == 2
    report = json.loads(out)
    assert report["valid"] is False and report["target"] == manifest
    assert report["error"]["code"] == "CK999" and "made to fail" in report["error"]["message"]
    for command in (["inspect", manifest], ["diff", manifest, manifest]):
        code, out, _ = _main(monkeypatch, capsys, *command, "--format", "json")
        assert code == 2 and json.loads(out)["error"]["code"] == "CK999"
    code, out, err = _main(monkeypatch, capsys, "validate", manifest)
    assert (code, out) == (2, "") and "CK999 internal error: RuntimeError: made to fail" in err


def test_an_input_read_late_is_an_io_error_not_an_output_error(ckptspec_process, _run, checkpoint):
    """Second pass: reconstructing a universal folder whose `zero/` this user may not read said
    `OUT: CK906 cannot write` (the writer's OSError handler took every OSError for the output's)."""
    universal = checkpoint.parent / "uc"
    assert ckptspec_process(["export-universal", str(checkpoint), str(universal)]).returncode == 0
    (universal / "zero").chmod(0)  # the folder is the tag directory: zero/, the model states
    try:
        result = _run(["reconstruct", str(universal), "{out}/weights"], checkpoint)
    finally:
        (universal / "zero").chmod(0o755)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "CK901 cannot read: Permission denied" in result.stderr and "CK906" not in result.stderr, result.stderr
    assert str(universal / "zero") in result.stderr
    assert not list((checkpoint.parent / "out").iterdir())


def test_scan_lists_a_tag_it_may_not_read_and_goes_on(_run, checkpoint):
    """`scan`: a folder of the run this user may not list is a tag that cannot be read (CK901), shown, never
    left out; the readable tags are still judged, and --keep leaves it alone."""
    for step in ("global_step1", "global_step3"):
        shutil.copytree(checkpoint / TAG, checkpoint / step)
    (checkpoint / "latest").write_text("global_step3")
    (checkpoint / TAG).chmod(0)
    result = _run(["scan", "{ck}", "--format", "json", "--keep", "1"], checkpoint)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    tags = {t["name"]: t for t in report["tags"]}
    assert tags[TAG]["error"]["code"] == "CK901" and not tags[TAG]["valid"]
    assert tags["global_step1"]["valid"] and report["newest_valid"] == "global_step3"
    assert report["removed"] == ["global_step1"]
    assert report["kept"] == {TAG: "cannot be listed: Permission denied"}
    (checkpoint / TAG).chmod(0o755)
    assert sorted(p.name for p in (checkpoint / TAG).iterdir()) == sorted(
        p.name for p in (checkpoint / "global_step3").iterdir()
    )

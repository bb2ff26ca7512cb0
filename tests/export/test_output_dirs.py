"""The output directory of `export`, `reshard`, `export-universal` and `reconstruct` (issue #37, items 7, 8).

Was (M3): `export` (and the save hook, tests/deepspeed/test_embed.py) published a mkdtemp directory,
mode 0700 whatever the umask. Was (M6): `export` took no writer lock (two runs both "succeeded"),
and renamed a symlinked OUTPUT away, leaving `.link.ckptspec-...` behind and the link's target
empty. Was (L7): a `reshard` that lost a race for a new OUTPUT said `CK906 Directory not empty`.

The race is reproduced without timing: the test holds OUTPUT the way a running writer does
(`_fs.exclusive`), then runs the command.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptspec import _fs
from ckptspec.cli import cli

# What each command writes into OUTPUT from the committed-layout checkpoint, and a file it always writes.
COMMANDS = {
    "export": (["export"], [], "ckptspec-export.json"),
    "reshard": (["reshard"], ["--world-size", "3"], "latest"),
    "export-universal": (["export-universal"], [], "zero"),
    "reconstruct": (["reconstruct"], ["-q"], "model.safetensors"),
}
PUBLISHED = ["export", "reshard", "export-universal"]  # built beside OUTPUT, then put in its place


@pytest.fixture(scope="module")
def ckpt(ds) -> Path:
    return ds.path("s2-bf16-ws2")


def _args(name: str, ckpt: Path, out: Path) -> list[str]:
    head, tail, _ = COMMANDS[name]
    return [*head, str(ckpt), str(out), *tail]


def _run(name: str, ckpt: Path, out: Path):
    return CliRunner().invoke(cli, _args(name, ckpt, out))


@pytest.fixture
def umask():
    """Run the command under umask 027 (not the usual 022, nor mkdtemp's 077)."""
    old = os.umask(0o027)
    yield 0o027
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("name", COMMANDS)
def test_a_new_output_gets_the_mode_mkdir_gives(name, ckpt, tmp_path, umask):
    out = tmp_path / "out"
    result = _run(name, ckpt, out)
    assert result.exit_code == 0, result.output
    assert _mode(out) == 0o777 & ~umask == 0o750


@pytest.mark.parametrize("name", COMMANDS)
def test_an_existing_output_keeps_its_mode(name, ckpt, tmp_path, umask):
    out = tmp_path / "out"
    out.mkdir(mode=0o711)
    out.chmod(0o711)
    result = _run(name, ckpt, out)
    assert result.exit_code == 0, result.output
    assert _mode(out) == 0o711


@pytest.mark.parametrize("name", COMMANDS)
def test_a_second_writer_is_refused_while_the_first_holds_output(crash, name, ckpt, tmp_path):
    """Was: `export` wrote anyway (exit 0, the last to finish won); `reshard` and `export-universal`
    wrote into the held new directory too."""
    out = tmp_path / "out"
    out.mkdir()
    with _fs.exclusive(out):  # what a running writer holds
        result = crash.run(_args(name, ckpt, out))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"{out}: CK908 another ckptspec run is writing into this directory"), result.stderr
    assert list(out.iterdir()) == [] and [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("name", ["reshard", "export-universal"])
def test_the_loser_of_a_race_for_a_new_output_gets_ck908_or_ck909_never_ck906(crash, name, ckpt, tmp_path):
    """L7: the winner made OUTPUT and holds it (CK908), or has published into it already (CK909)."""
    out = tmp_path / "out"
    out.mkdir()
    with _fs.exclusive(out):
        held = crash.run(_args(name, ckpt, out))
    assert held.returncode == 2 and "CK908" in held.stderr, held.stderr
    assert crash.run(_args(name, ckpt, out)).returncode == 0  # the winner
    after = crash.run(_args(name, ckpt, out))
    assert after.returncode == 2 and "CK909 the output exists and is not empty" in after.stderr, after.stderr


@pytest.mark.parametrize("name", COMMANDS)
def test_a_symlinked_output_is_written_where_it_points(name, ckpt, tmp_path):
    """Was (`export`): the link was renamed to `.link.ckptspec-...` and left behind, a new 0700
    directory took its name, and the link's target stayed empty. `reshard` and `export-universal`
    failed with CK906 `Not a directory`."""
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    result = _run(name, ckpt, link)
    assert result.exit_code == 0, result.output
    marker = COMMANDS[name][2]
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert (real / marker).exists(), sorted(p.name for p in real.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]
    if name == "export":  # an earlier export is replaced, still through the link
        assert _run(name, ckpt, link).exit_code == 0
        assert link.is_symlink() and (real / marker).exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


@pytest.mark.parametrize("name", PUBLISHED)
def test_a_run_that_fails_removes_the_output_it_created(name, tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    result = _run(name, missing, tmp_path / "out")
    assert result.exit_code != 0
    assert list(tmp_path.iterdir()) == []


def test_export_holds_output_while_it_still_validates(ckpt, tmp_path, monkeypatch):
    """M6, second pass: `export` held OUTPUT only while writing, so a second export started while the
    first validated a slow (remote) checkpoint "succeeded" too and the last to finish won. Now OUTPUT
    is held from the start: another writer is refused (CK908) during validation already."""
    from ckptspec.deepspeed.check import zero as ds_validate
    from ckptspec.errors import OutputBusy

    out = tmp_path / "out"
    seen = []
    validate = ds_validate.validate_checkpoint

    def validate_while_a_second_writer_tries(*args, **kwargs):
        with pytest.raises(OutputBusy):
            with _fs.exclusive(out):
                pass
        seen.append(True)
        return validate(*args, **kwargs)

    monkeypatch.setattr(ds_validate, "validate_checkpoint", validate_while_a_second_writer_tries)
    result = _run("export", ckpt, out)
    assert result.exit_code == 0, result.output
    assert seen == [True]


def _library(name: str):
    """The Python function behind a published command: (checkpoint, output) -> result."""
    from ckptspec.export.reshard import reshard
    from ckptspec.export.universal import export_universal

    return {"reshard": lambda c, o: reshard(c, o, 3), "export-universal": export_universal}[name]


@pytest.mark.parametrize("name", ["reshard", "export-universal"])
def test_a_file_as_output_is_ck909_through_the_library_too(name, ckpt, tmp_path):
    """Review: holding OUTPUT before looking at it made a regular file a bare NotADirectoryError for a
    library caller (the CLI refuses a file before); it was CK909 before, and is again."""
    from ckptspec.errors import CkptspecError

    out = tmp_path / "out"
    out.write_text("mine")
    with pytest.raises(CkptspecError) as caught:
        _library(name)(ckpt, out)
    assert caught.value.code == "CK909" and out.read_text() == "mine"


@pytest.mark.parametrize("name", PUBLISHED)
def test_a_refused_run_leaves_no_folders_it_made(name, tmp_path):
    """Review: OUTPUT is made (to be held) before the checkpoint is read; a run refused then removed
    OUTPUT but left the parent folders it had made for it (`a/b/` of `a/b/out`)."""
    missing = tmp_path / "no-such-checkpoint"
    result = _run(name, missing, tmp_path / "a" / "b" / "out")
    assert result.exit_code == 2 and "CK901" in result.output, result.output
    assert [p.name for p in tmp_path.iterdir()] == []

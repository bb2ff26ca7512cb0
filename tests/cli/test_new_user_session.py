"""Issue #22: the commands of a new user's session, as a user expects them to behave.

Each test runs the command of the report (in-process through click's CliRunner; a subprocess where
the process boundary matters) on real DeepSpeed checkpoints the harness committed (ZeRO-2 from
DeepSpeed 0.19.8, ZeRO-3 from 0.15.4: no job to run), and asserts the code, the exit status and
that the message names the input.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from _harness.scenarios import COMMITTED
from click.testing import CliRunner

from ckptspec.cli import cli
from ckptspec.errors import CkptspecError

pytestmark = pytest.mark.deepspeed

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "manifests" / "zero2-bf16-2ranks.json"
STAGE3_0154 = ROOT / "tests" / "data" / "deepspeed-0.15.4" / "old-s3-bf16-ws2"
TAG = "global_step2"


def run(*args, input: bytes | str | None = None):
    result = CliRunner().invoke(cli, [str(a) for a in args], input=input)
    # Only SystemExit may end a command: anything else would be a traceback for the user.
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    assert "CK999" not in result.output + result.stderr, result.output + result.stderr
    return result


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A scratch copy of a real DeepSpeed ZeRO-2 save directory (tag global_step2)."""
    dest = tmp_path / "CKPT"
    shutil.copytree(COMMITTED["s2-bf16-ws2"], dest)
    return dest


@pytest.fixture
def embedded(ckpt) -> Path:
    assert run("embed", ckpt).exit_code == 0
    return ckpt


# --------------------------------------------------------------------------- 5. --tag stays inside CHECKPOINT


@pytest.fixture
def other(tmp_path) -> Path:
    """Another checkpoint beside CKPT: the one a `--tag ../OTHER/...` would read."""
    dest = tmp_path / "OTHER"
    shutil.copytree(STAGE3_0154, dest)
    return dest


def _tags(ckpt: Path, other: Path) -> list[str]:
    return [f"../{other.name}/{TAG}", str(other / TAG), str(ckpt / TAG), f"{TAG}/", ".", "..", f"{TAG}/../{TAG}"]


@pytest.mark.parametrize(
    "command",
    [
        ["validate", "{ckpt}"],
        ["validate", "{manifest}", "--checkpoint", "{ckpt}"],
        ["generate", "{ckpt}"],
        ["reconstruct", "{ckpt}", "{out}"],
        ["embed", "{ckpt}"],
        ["extract", "{ckpt}"],
        ["inspect", "{ckpt}"],
        ["diff", "{ckpt}", "{ckpt}"],
    ],
    ids=lambda c: " ".join(c[:2]) if "--checkpoint" in c else c[0],
)
def test_tag_is_a_name_inside_the_checkpoint(ckpt, other, tmp_path, command):
    manifest = tmp_path / "m.json"
    assert run("generate", ckpt, "-o", manifest).exit_code == 0
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for tag in _tags(ckpt, other):
        args = [a.format(ckpt=ckpt, manifest=manifest, out=tmp_path / "OUT") for a in command]
        option = ["--tag-a", tag] if command[0] == "diff" else ["--tag", tag]
        result = run(*args, *option)
        assert result.exit_code == 1, (tag, result.output)
        assert "CK201" in result.stderr and "not a tag" in result.stderr, (tag, result.stderr)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written


def test_tag_inside_the_checkpoint_still_works(ckpt):
    assert run("validate", ckpt, "--tag", TAG).exit_code == 0


def test_python_api_refuses_a_tag_outside(ckpt, other):
    import ckptspec

    with pytest.raises(CkptspecError) as info:
        ckptspec.load_state_dict(ckpt, tag=f"../{other.name}/{TAG}")
    assert info.value.code == "CK201"

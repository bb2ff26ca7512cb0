"""Issue #22: the commands of a new user's session, as a user expects them to behave.

Each test runs the command of the report (in-process through click's CliRunner; a subprocess where
the process boundary matters) on real DeepSpeed checkpoints the harness committed (ZeRO-2 from
DeepSpeed 0.19.8, ZeRO-3 from 0.15.4: no job to run), and asserts the code, the exit status and
that the message names the input.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _harness.scenarios import COMMITTED
from click.testing import CliRunner

from ckptspec.cli import cli
from ckptspec.errors import CkptspecError

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


# --------------------------------------------------------------------------- 4. extract on a non-object sidecar


@pytest.mark.parametrize("text", ["[]\n", '"hello"\n', "42\n", "null\n"])
def test_extract_refuses_a_sidecar_that_is_not_an_object(embedded, text):
    sidecar = embedded / TAG / "ckptspec.json"
    sidecar.write_text(text)
    result = run("extract", embedded)
    assert result.exit_code == 1, result.output
    assert result.stdout == ""  # nothing printed
    assert "CK302" in result.stderr and "ckptspec.json" in result.stderr
    listed = run("extract", embedded, "--list")
    assert listed.exit_code == 1, listed.output
    assert "CK302" in listed.output and "agree" not in listed.output


def test_extract_refuses_a_manifest_file_that_is_not_an_object(tmp_path):
    path = tmp_path / "m.json"
    path.write_text("[]")
    result = run("extract", path)
    assert result.exit_code == 1 and "CK302" in result.stderr and result.stdout == ""


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


# --------------------------------------------------------------------------- 6. an empty or truncated sidecar


@pytest.mark.parametrize("text", ["", '{"broken": '], ids=["empty", "truncated"])
def test_damaged_sidecar_is_ck302_exit_1(embedded, tmp_path, text):
    sidecar = embedded / TAG / "ckptspec.json"
    sidecar.write_text(text)

    result = run("validate", embedded, "--format", "json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert "error" not in report and report["valid"] is False
    codes = [(f["code"], f.get("file")) for f in report["findings"]]
    assert ("CK302", "ckptspec.json") in codes
    # The files are still checked, against a manifest generated from DeepSpeed's metadata:
    # the clean shards give no other finding.
    assert [c for c, _ in codes] == ["CK302"], codes

    text_run = run("validate", embedded)
    assert text_run.exit_code == 1 and "CK302" in text_run.stdout and "ckptspec.json" in text_run.stdout

    for args in (["inspect", embedded], ["reconstruct", embedded, tmp_path / "OUT"], ["extract", embedded]):
        result = run(*args)
        assert result.exit_code == 1, (args, result.output)
        assert "CK302" in result.output + result.stderr, (args, result.output)
    assert not (tmp_path / "OUT").exists()


def test_damaged_sidecar_beside_a_damaged_shard_names_both(embedded):
    (embedded / TAG / "ckptspec.json").write_text("")
    shard = embedded / TAG / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:1000])
    report = json.loads(run("validate", embedded, "--format", "json").stdout)
    codes = {(f["code"], f.get("file")) for f in report["findings"]}
    assert ("CK302", "ckptspec.json") in codes and ("CK205", shard.name) in codes


# --------------------------------------------------------------------------- 12. errors name the input


def test_python_exceptions_name_the_input(tmp_path):
    import ckptspec
    from ckptspec.format.documents import validate_file

    (tmp_path / "empty").mkdir()
    for call, name in (
        (lambda: ckptspec.load_state_dict(tmp_path / "missing"), "missing"),
        (lambda: validate_file(tmp_path / "missing.json"), "missing.json"),
        (lambda: ckptspec.load_state_dict(tmp_path / "empty"), "empty"),
    ):
        with pytest.raises(CkptspecError) as info:
            call()
        assert str(tmp_path / name) in str(info.value), str(info.value)
        assert info.value.code in str(info.value)


def test_a_shard_given_to_validate_gets_a_hint_to_pass_the_directory(ckpt):
    shard = ckpt / TAG / "mp_rank_00_model_states.pt"
    result = run("validate", shard)
    assert result.exit_code == 2
    assert "CK903" in result.stderr and "UTF-8" not in result.stderr
    assert "checkpoint directory" in result.stderr, result.stderr


# --------------------------------------------------------------------------- 13. small differences


def test_extract_of_a_file_with_tag_is_a_usage_error(tmp_path):
    result = run("extract", EXAMPLE, "--tag", "x")
    assert result.exit_code == 2 and "--tag" in result.stderr


def test_diff_usage_error_names_the_option_given(ckpt):
    result = run("diff", EXAMPLE, ckpt, "--tag-a", TAG)
    assert result.exit_code == 2 and "--tag-a" in result.stderr, result.stderr
    result = run("diff", ckpt, EXAMPLE, "--tag-b", TAG)
    assert result.exit_code == 2 and "--tag-b" in result.stderr, result.stderr


def test_ck207_hint_says_what_deepspeed_would_read(ckpt):
    """DeepSpeed's zero_to_fp32 globs '*_optim_states.pt' and '*_model_states.pt' in the tag directory
    only: a stray in a subfolder is not read by it, and each pattern is named for its own files."""
    tag = ckpt / TAG
    (tag / "blobs").mkdir()
    shard = tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(shard, tag / "blobs" / shard.name)
    shutil.copy(shard, tag / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt")
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "old_mp_rank_00_model_states.pt")
    result = run("validate", ckpt, "--format", "json")
    assert result.exit_code == 1
    hints = {f["file"]: f["hint"] for f in json.loads(result.stdout)["findings"] if f["code"] == "CK207"}
    assert set(hints) == {
        f"blobs/{shard.name}",
        "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt",
        "old_mp_rank_00_model_states.pt",
    }, hints
    assert "glob" not in hints[f"blobs/{shard.name}"]
    assert "'*_optim_states.pt'" in hints["bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"]
    assert "model_states" not in hints["bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"]
    assert "'*_model_states.pt'" in hints["old_mp_rank_00_model_states.pt"]
    assert "optim_states" not in hints["old_mp_rank_00_model_states.pt"]


def test_untie_summary_counts_the_elements_written(ckpt, tmp_path):
    from safetensors import safe_open

    for untie in (False, True):
        out = tmp_path / f"out-{untie}"
        result = run("reconstruct", ckpt, out, *(["--untie"] if untie else []))
        assert result.exit_code == 0, result.output
        with safe_open(out / "model.safetensors", framework="np") as f:
            keys = list(f.keys())
            elements = sum(math.prod(f.get_slice(k).get_shape()) for k in keys)
        assert f"wrote {len(keys)} tensors" in result.stdout, result.stdout
        assert f"{elements} elements" in result.stdout, result.stdout


def test_stdin_is_an_input_as_it_is_an_output(tmp_path):
    """`-` is standard input wherever a manifest file is read, as for cat, jq and json.tool."""
    text = EXAMPLE.read_text("utf-8")
    result = run("validate", "-", input=text)
    assert result.exit_code == 0 and result.stdout == "-: valid\n", result.output
    result = run("convert", "-", tmp_path / "m.msgpack", input=text)
    assert result.exit_code == 0, result.output
    result = run("convert", tmp_path / "m.msgpack", "-")
    assert json.loads(result.stdout) == json.loads(text)
    result = run("inspect", "-", "--format", "json", input=text)
    assert result.exit_code == 0 and json.loads(result.stdout)["target"] == "-"
    result = run("validate", "-", input="{")
    assert result.exit_code == 2 and result.stderr.startswith("-: CK903"), result.stderr


def test_stdin_through_the_installed_command():
    proc = subprocess.run(
        [sys.executable, "-m", "ckptspec", "convert", "-", "-"],
        input=EXAMPLE.read_bytes(),
        capture_output=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == json.loads(EXAMPLE.read_text("utf-8"))

"""Issue #37 (M7, L5): messages and docs that said what is not so. Each test runs the command of the
new user's report on a real checkpoint of the harness (or a committed document) and asserts what a
user reads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

import ckptspec
from ckptspec.cli import cli

ROOT = Path(__file__).resolve().parents[2]
INDEX = ROOT / "tests" / "conformance" / "index-1.0" / "pp2dp2-s1-fp32-ws4.json"


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    return result


def _tag(ds, name: str) -> Path:
    info = json.loads((ds.path(name) / "parallel.json").read_text())
    return ds.path(name) / info["tag"]


def test_the_synopsis_lists_every_command():
    text = (ROOT / "docs" / "cli.md").read_text()
    synopsis = text[text.index("ckptspec [--version]") : text.index("```", text.index("ckptspec [--version]"))]
    listed = {line.split()[0] for line in synopsis.splitlines()[2:] if line.startswith("  ") and line.strip()}
    assert set(cli.commands) <= listed, sorted(set(cli.commands) - listed)


def test_schema_prints_the_checkpoint_index_schema():
    result = run("schema", "--checkpoint-index")  # the latest, 1.1
    assert result.exit_code == 0
    assert result.stdout == (ROOT / "schema" / "checkpoint-1.1.schema.json").read_text()
    older = run("schema", "--checkpoint-index", "--version", "1.0")
    assert older.exit_code == 0 and older.stdout == (ROOT / "schema" / "checkpoint-1.0.schema.json").read_text()


def test_extract_list_describes_an_index():
    result = run("extract", "--list", INDEX)
    assert result.exit_code == 0
    assert "checkpoint index 1.0.0, 2 domains" in result.stdout and "?" not in result.stdout


def test_a_safetensors_file_is_named_as_such(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    path = tmp_path / "model.safetensors"
    save_file({"w": np.zeros(3, dtype=np.float32)}, str(path))
    result = run("validate", path)
    assert result.exit_code == 2
    assert "CK903" in result.stderr and "safetensors" in result.stderr and "UTF-8" not in result.stderr
    assert "ckptspec extract" in result.stderr


def test_reconstruct_is_in_the_python_api():
    from ckptspec.export.api import reconstruct

    assert ckptspec.reconstruct is reconstruct


def test_inspect_of_a_stage0_index_prints_no_none(ds):
    result = run("inspect", _tag(ds, "s0-bf16-ws2"))
    assert result.exit_code == 0 and "None" not in result.stdout
    assert re.search(r"dense: ZeRO-0 over \d+ ranks", result.stdout), result.stdout
    assert "(0 saved copies)" not in result.stdout  # second pass: the masters are saved once, not zero times


def test_inspect_json_of_an_index_has_its_summary_version(ds):
    result = run("inspect", _tag(ds, "tp2-s1-fp32-ws2"), "--format", "json")
    doc = json.loads(result.stdout)
    assert doc["summary_version"] == "1.0" and doc["document"] == "ckptspec.checkpoint"


def test_reconstruct_of_an_index_counts_its_elements(ds, tmp_path):
    from safetensors.numpy import load_file

    result = run("reconstruct", _tag(ds, "tp2-s1-fp32-ws2"), tmp_path / "out")
    assert result.exit_code == 0
    written = sum(a.size for a in load_file(str(tmp_path / "out" / "model.safetensors")).values())
    assert written > 0 and f", {written} elements) to " in result.stdout, result.stdout


@pytest.mark.parametrize("name", ["moe-ep2-s1-fp32-ws2", "pp2-s1-fp32-ws2"])
def test_ck202_hints_name_the_checkpoint_index(ds, tmp_path, name):
    """A 1.x-only command (embed) on a kind the index describes: the hint says which commands read it,
    not "not described by format 1.0"."""
    import shutil

    copy = tmp_path / "checkpoint"
    shutil.copytree(ds.path(name), copy, ignore=shutil.ignore_patterns("*.pt", "*.json", "*.log"), dirs_exist_ok=True)
    shutil.copytree(_tag(ds, name), copy / _tag(ds, name).name, dirs_exist_ok=True)
    result = run("embed", copy, "--no-hash")
    assert result.exit_code == 1 and "CK202" in result.stderr
    assert "format 1.0" not in result.stderr and "checkpoint index" in result.stderr
    assert f"(hint: write the checkpoint index as the sidecar: `ckptspec embed {copy} --sidecar-only`" in result.stderr


def test_extract_on_an_index_kind_sends_the_user_to_embed_sidecar_only(ds):
    """CK303's hint: plain `ckptspec embed CHECKPOINT` refuses these kinds; `--sidecar-only` writes their index."""
    result = run("extract", _tag(ds, "moe-ep2-s1-fp32-ws2"))
    assert result.exit_code == 1 and "CK303" in result.stderr
    assert "`ckptspec embed CHECKPOINT --sidecar-only`" in result.stderr

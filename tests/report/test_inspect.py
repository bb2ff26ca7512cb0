"""`ckptspec inspect` on real DeepSpeed checkpoints, on manifests, and on bad input."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
from _harness.job.model import build_model, normalize_spec
from _harness.scenarios import MATRIX_SPECS
from click.testing import CliRunner

from ckptspec.cli import cli

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "manifests" / "zero2-bf16-2ranks.json"
INVALID = ROOT / "tests" / "conformance" / "1.0" / "invalid"


def run(*args: str):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    # Only SystemExit may end a command: anything else would be a traceback for the user.
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    return result


def inspect_json(*args: str) -> dict:
    result = run("inspect", *args, "--format", "json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def model_facts(spec: dict) -> dict:
    """Counts from the model train.py builds (the ground truth for roles)."""
    model = build_model(normalize_spec(spec))
    unique = dict(model.named_parameters())
    every = dict(model.named_parameters(remove_duplicate=False))
    persistent = set(model.state_dict()) - set(every)
    return {
        "trainable": sum(p.requires_grad for p in unique.values()),
        "trainable_numel": sum(p.numel() for p in unique.values() if p.requires_grad),
        "frozen": sum(not p.requires_grad for p in unique.values()),
        "aliases": len(every) - len(unique),
        "buffers": len(persistent),
    }


@pytest.fixture(scope="module", params=["s2-bf16-ws2", "s3-bf16-ws2-sub"])
def checkpoint(request, ds):
    spec, world_size = MATRIX_SPECS[request.param]
    return ds.path(request.param), spec, world_size


def test_totals_match_deepspeed_and_the_model(zero_to_fp32, checkpoint):
    save_dir, spec, world_size = checkpoint
    summary = inspect_json(save_dir)
    assert summary["source"] == "generated" and summary["valid"] is True
    assert summary["layout"]["zero_stage"] == spec["stage"] and summary["layout"]["world_size"] == world_size

    # DeepSpeed's own reconstruction: every tensor it returns is in the summary, with its numel.
    reference = zero_to_fp32(save_dir)
    totals = summary["totals"]
    assert totals["tensors"] == len(reference)
    assert totals["tensor_numel"] == sum(t.numel() for t in reference.values())

    facts = model_facts(spec)
    for key, value in facts.items():
        assert totals[key] == value, key
    largest = summary["largest"][0]
    assert (largest["name"], largest["numel"]) == ("emb.weight", math.prod(reference["emb.weight"].shape))


def test_files_and_ranks_match_the_directory(checkpoint):
    save_dir, spec, world_size = checkpoint
    summary = inspect_json(save_dir)
    tag_dir = save_dir / (save_dir / "latest").read_text().strip()
    on_disk = {p.name: p.stat().st_size for p in tag_dir.iterdir() if p.name.endswith(".pt")}
    assert {f["path"]: f["size"] for f in summary["files"]} == on_disk
    assert [r["rank"] for r in summary["ranks"]] == list(range(world_size))
    assert sum(r["bytes"] for r in summary["ranks"]) == sum(on_disk.values())
    # Every rank's master partitions add up to the padded groups (stage 3: minus nothing saved twice).
    saved = sum(r["master_numel"] for r in summary["ranks"])
    assert summary["totals"]["trainable_numel"] <= saved <= summary["totals"]["padded_numel"]


def test_text_output_is_plain_and_stable(checkpoint):
    save_dir, *_ = checkpoint
    first, second = run("inspect", save_dir), run("inspect", save_dir)
    assert first.exit_code == 0 and first.stdout == second.stdout
    assert "\x1b[" not in first.stdout  # no colour without a terminal
    tables = first.stdout.split("\n\n", 1)[1]  # after the header, whose first line is the path
    assert max(len(line) for line in tables.splitlines()) <= 100
    for title in (
        "Groups",
        "Largest tensors",
        "Aliases (tied parameters)",
        "Frozen parameters",
        "Buffers",
        "Files",
        "Ranks",
    ):
        assert title in first.stdout
    assert "head.weight   emb.weight" in first.stdout


def test_a_sidecar_is_preferred_like_validate_dir(checkpoint, tmp_path):
    save_dir, *_ = checkpoint
    copy = tmp_path / "ckpt"
    shutil.copytree(save_dir, copy)
    assert run("embed", copy, "--sidecar-only", "--no-hash").exit_code == 0
    summary = inspect_json(copy)
    assert summary["source"] == "sidecar" and summary["manifest"].endswith("ckptspec.json")
    # A broken sidecar is reported, not silently replaced by a generated manifest.
    sidecar = Path(summary["manifest"])
    doc = json.loads(sidecar.read_text())
    doc["layout"]["world_size"] = 0
    sidecar.write_text(json.dumps(doc))
    result = run("inspect", copy)
    assert result.exit_code == 1
    assert f"{copy}: ckptspec.json: $.layout.world_size: CK001" in result.stdout  # as `validate DIR` says it


def test_manifest_summary_and_top():
    summary = inspect_json(EXAMPLE, "--top", "2")
    assert summary["source"] == "manifest" and summary["summary_version"] == "1.0"
    assert [t["name"] for t in summary["largest"]] == ["emb.weight", "l1.weight"]
    doc = json.loads(EXAMPLE.read_text())
    assert summary["totals"]["trainable_numel"] == sum(p["numel"] for g in doc["groups"] for p in g["params"])
    assert summary["totals"]["file_bytes"] == sum(f["size"] for f in doc["files"])
    assert inspect_json(EXAMPLE, "--top", "0")["largest"] == []


def test_msgpack_manifest():
    path = ROOT / "tests" / "conformance" / "1.0" / "valid" / "stage3-per-param-two-subgroups-ws3.msgpack"
    from ckptspec.format.codec import load_document

    doc = load_document(path)
    summary = inspect_json(path)
    assert summary["layout"]["zero_stage"] == 3
    assert [g["params"] for g in summary["groups"]] == [len(g["params"]) for g in doc["groups"]]


@pytest.mark.parametrize(
    "args,code,exit_code",
    [
        (["missing.json"], "CK901", 2),
        ([str(EXAMPLE), "--tag", "global_step2"], None, 2),  # --tag needs a directory
        ([str(INVALID / "CK105-alias-zero-size-tie.json")], "CK105", 1),
        ([str(ROOT / "examples")], "CK201", 1),  # a directory that is no checkpoint
    ],
)
def test_bad_input_gives_a_code(args, code, exit_code, tmp_path):
    result = run("inspect", *args)
    assert result.exit_code == exit_code, result.output
    if code:
        assert code in result.output
        assert len(result.output.strip().splitlines()) == 1


def test_not_a_manifest(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    array = tmp_path / "array.json"
    array.write_text("[1, 2]")
    result = run("inspect", text)
    assert result.exit_code == 2 and "CK903" in result.output
    result = run("inspect", array, "--format", "json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["valid"] is False and [f["code"] for f in report["findings"]] == ["CK001"]


def test_json_error_object():
    result = run("inspect", "missing.json", "--format", "json")
    assert result.exit_code == 2
    assert json.loads(result.stdout)["error"]["code"] == "CK901"


def test_rich_is_imported_only_for_text():
    import subprocess
    import sys

    code = (
        "import sys; from click.testing import CliRunner; from ckptspec.cli import cli; "
        f"r = CliRunner().invoke(cli, ['inspect', {str(EXAMPLE)!r}, '--format', 'json']); "
        "assert r.exit_code == 0; print('rich' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_json_error_names_the_file_text_mode_names(tmp_path):
    """Issue #22, defect 8: the error object names the file, as the text line does."""
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "latest").write_text("../elsewhere")
    text = run("inspect", save)
    assert text.exit_code == 1 and text.output.startswith(f"{save / 'latest'}: CK201"), text.output
    result = run("inspect", save, "--format", "json")
    assert result.exit_code == 1
    error = json.loads(result.stdout)["error"]
    assert error["code"] == "CK201" and error["file"] == str(save / "latest"), error


def test_text_output_has_no_trailing_spaces():
    """Issue #22, defect 13: the tables are padded to their width, the lines are not."""
    result = run("inspect", EXAMPLE, "--top", "3")
    assert result.exit_code == 0
    assert [line for line in result.stdout.splitlines() if line != line.rstrip()] == []
    # The transcript of docs/cli.md, byte for byte.
    doc = (ROOT / "docs" / "cli.md").read_text("utf-8")
    start = doc.index("$ ckptspec inspect examples/manifests/zero2-bf16-2ranks.json --top 3\n")
    shown = doc[start:].split("\n", 1)[1].split("```", 1)[0]
    assert result.stdout.replace(str(EXAMPLE), "examples/manifests/zero2-bf16-2ranks.json") == shown

"""examples/node-reader reads a torch DCP document too (issue #42): its verdicts are ckptspec's, and every tensor it
rebuilds from the document alone (no torch, no pickle, no zip) is the FSDP2 job's ``full_tensor()`` bit for bit.

``node validate.js`` gives every file of tests/conformance/dcp-1.0 exactly the codes of its ``expected.json``, and the
schema alone (``schema/dcp-1.0.schema.json``) gives every file of version 1.0 ckptspec's reference verdict in ajv 8
strict (through validate.js) and in check-jsonschema (ECMA-262 regexes, at ckptspec's paths).

For the real FSDP2 saves of the harness (world size 1, 2, 3, both steps), ``ckptspec generate --hash`` writes the
document and ``node reader.js DOC DCP_DIR OUT.safetensors`` writes every tensor of the saved state dict, in its
saved dtype. A directory that is not the document's (a file of the other
save, of the same size; a file cut short) and a document with a gap are refused with ckptspec's codes, nothing
written.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _harness.scenarios import DCP_SAVE_WORLD_SIZES, dcp_save_name
from click.testing import CliRunner
from safetensors import safe_open

from ckptspec.cli import cli
from ckptspec.format.codec import load_document
from ckptspec.format.schemas import DCP_SCHEMAS, schema, schema_findings

ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "examples" / "node-reader"
CORPUS = ROOT / "tests" / "conformance" / "dcp-1.0"
EXPECTED = json.loads((CORPUS / "expected.json").read_text("utf-8"))


def node(*args: str | Path) -> subprocess.CompletedProcess:
    assert (NODE_DIR / "node_modules" / "ajv").is_dir(), "run ./scripts/env.sh (npm ci in examples/node-reader)"
    return subprocess.run(["node", *map(str, args)], capture_output=True, text=True, timeout=120)


def _generate(directory: Path, out: Path) -> Path:
    result = CliRunner().invoke(cli, ["generate", str(directory), "-o", str(out), "--hash"])
    assert result.exit_code == 0, result.output
    return out


def test_node_gives_the_corpus_verdicts():
    files = sorted(CORPUS.glob("*/*.json"))
    run = node(NODE_DIR / "validate.js", *files)
    verdicts = {json.loads(line)["file"]: json.loads(line) for line in run.stdout.splitlines()}
    assert len(verdicts) == len(files) == len(EXPECTED)
    for file in files:
        got, want = verdicts[str(file)], EXPECTED[file.relative_to(CORPUS).as_posix()]
        assert (got["codes"], got["warnings"]) == (want["codes"], want["warnings"]), file.name
        if want["codes"] in (["CK001"], []) and not want["warnings"]:
            assert got["raw_valid"] == (want["codes"] == []), file.name


def test_other_engines_give_the_schema_verdicts():
    """Raw schema verdicts: ajv and check-jsonschema refuse a 1.0 document exactly when ckptspec's reference
    validator does, check-jsonschema at exactly its paths."""
    files = [f for f in sorted(CORPUS.glob("*/*.json")) if load_document(f)["format_version"].startswith("1.0.")]
    dcp_schema = ROOT / "schema" / DCP_SCHEMAS["1.0"]
    proc = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--schemafile", str(dcp_schema), "-o", "json"]
        + ["--regex-variant", "default", *map(str, files)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode in (0, 1), proc.stderr
    errors: dict[str, set[str]] = {str(f): set() for f in files}
    for error in json.loads(proc.stdout).get("errors", []):
        errors[error["filename"]].add(error["path"])
    run = node(NODE_DIR / "validate.js", *files)
    ajv = {json.loads(line)["file"]: json.loads(line) for line in run.stdout.splitlines()}
    refused = 0
    for f in files:
        reference = {finding.path for finding in schema_findings(load_document(f), schema(DCP_SCHEMAS["1.0"]))}
        assert ajv[str(f)]["raw_valid"] == (not reference), f.name
        assert errors[str(f)] == reference, f.name
        refused += bool(reference)
    assert refused == 5  # the CK001 files


@pytest.mark.parametrize("save", ["dcp", "dcp-step2"])
@pytest.mark.parametrize("world_size", DCP_SAVE_WORLD_SIZES)
def test_node_rebuilds_every_tensor_of_the_save(world_size, save, ds, tmp_path):
    import torch

    entry = ds.path(dcp_save_name(world_size))
    doc = _generate(entry / save, tmp_path / "doc.json")
    out = tmp_path / "node.safetensors"
    run = node(NODE_DIR / "reader.js", doc, entry / save, out)
    assert run.returncode == 0, run.stderr
    with safe_open(str(out), "np") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    described = json.loads(doc.read_text())
    assert sorted(got) == sorted(t["name"] for t in described["tensors"])
    oracle = torch.load(entry / "oracle.pt", weights_only=True)
    params, state = (oracle["params"], oracle["state"]) if save == "dcp" else (oracle["params2"], oracle["state2"])
    for name, tensor in params.items():
        assert np.array_equal(got[f"model.{name}"], tensor.numpy()), name
    for name, moments in state.items():
        for key, tensor in moments.items():
            value = got[f"optim.state.{name}.{key}"]
            assert value.dtype == tensor.numpy().dtype and np.array_equal(value, tensor.numpy()), (name, key)
    if save == "dcp":
        for name, tensor in torch.load(entry / "torch_save.pt", weights_only=True)["model"].items():
            assert got[f"model.{name}"].dtype == tensor.numpy().dtype, name
            assert np.array_equal(got[f"model.{name}"], tensor.numpy()), name


def test_node_refuses_what_is_not_the_document(ds, tmp_path):
    entry = ds.path(dcp_save_name(2))
    doc = _generate(entry / "dcp", tmp_path / "doc.json")
    out = tmp_path / "node.safetensors"

    swapped = tmp_path / "swapped"
    shutil.copytree(entry / "dcp", swapped)
    shutil.copy(entry / "dcp-step2" / "__1_0.distcp", swapped / "__1_0.distcp")
    run = node(NODE_DIR / "reader.js", doc, swapped, out)
    assert run.returncode == 1 and "CK256" in run.stderr and "__1_0.distcp" in run.stderr, run.stderr
    run = node(NODE_DIR / "reader.js", "--no-hash", doc, swapped, out)  # the same sizes: no hash, no refusal
    assert run.returncode == 0, run.stderr
    out.unlink()

    data = (swapped / "__0_0.distcp").read_bytes()
    (swapped / "__0_0.distcp").write_bytes(data[:-8])
    run = node(NODE_DIR / "reader.js", "--no-hash", doc, swapped, out)
    assert run.returncode == 1 and "CK256" in run.stderr, run.stderr

    gap = json.loads(doc.read_text())
    del gap["tensors"][2]["chunks"][1]
    (tmp_path / "gap.json").write_text(json.dumps(gap))
    run = node(NODE_DIR / "reader.js", tmp_path / "gap.json", entry / "dcp", out)
    assert run.returncode == 1 and "$.tensors[2].chunks: CK701" in run.stderr, run.stderr
    assert not out.exists()

"""Issue #39: documents of both kinds, everywhere a document is read, on the indexes `generate` writes
for real harness checkpoints of three kinds (AutoTP tp2 x dp2 ZeRO-2, MoE ep2 ZeRO-1, dense ZeRO stage 0).

`ckptspec.validate` / `ckptspec.load` read each index from JSON and msgpack as an index; the
manifest-only functions name it (CK005); `migrate` writes its domains' manifests at 1.0 and back at
1.1, and the result is judged by the shipped schemas on their own (jsonschema, nothing of ckptspec)
and by `validate INDEX --checkpoint DIR` against the real files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from jsonschema import Draft202012Validator

import ckptspec
from ckptspec.cli import cli
from ckptspec.format.codec import load_document

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = {
    name: Draft202012Validator(json.loads((ROOT / "schema" / f"{name}.schema.json").read_text()))
    for name in ("checkpoint-1.0", "manifest-1.0", "manifest-1.1")
}
KINDS = ["tp2dp2-s2-bf16-ws4", "moe-ep2-s1-bf16-ws2", "s0-bf16-ws2"]


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    assert "CK999" not in result.output + result.stderr
    return result


def _schema_errors(doc: dict) -> list[str]:
    """The shipped schemas' verdict, read with jsonschema alone: the index's, and each domain's
    manifest against the schema of its own version."""
    errors = [e.message for e in SCHEMAS["checkpoint-1.0"].iter_errors(doc)]
    for domain in doc["domains"]:
        version = ".".join(domain["manifest"]["format_version"].split(".")[:2])
        errors += [e.message for e in SCHEMAS[f"manifest-{version}"].iter_errors(domain["manifest"])]
    return errors


@pytest.fixture(scope="module")
def indexes(ds, tmp_path_factory):
    """name -> (checkpoint directory, {"json": path, "msgpack": path}) of the index `generate` writes."""
    out = {}
    for name in KINDS:
        where = tmp_path_factory.mktemp(name)
        assert run("generate", ds.path(name), "-o", where / "index.json", "--hash").exit_code == 0
        assert run("convert", where / "index.json", where / "index.msgpack").exit_code == 0
        out[name] = (ds.path(name), {"json": where / "index.json", "msgpack": where / "index.msgpack"})
    return out


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_validate_and_load_read_a_real_index(indexes, name, encoding):
    _, paths = indexes[name]
    doc = json.loads(paths["json"].read_text())
    assert doc["format"] == "ckptspec.checkpoint" and _schema_errors(doc) == []
    report = ckptspec.validate(paths[encoding])
    assert isinstance(report, ckptspec.IndexReport) and report.ok and report.findings == []
    assert report.manifest.to_dict() == doc
    assert ckptspec.validate(load_document(str(paths[encoding]))).manifest.to_dict() == doc
    assert ckptspec.load(paths[encoding]).to_dict() == doc
    assert [f.code for f in ckptspec.validate_document(doc).findings] == ["CK005"]
    with pytest.raises(ckptspec.InvalidManifest) as caught:
        ckptspec.load_manifest(paths[encoding])
    assert [f.code for f in caught.value.findings] == ["CK005"]


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_migrate_down_and_up_keeps_checking_the_real_files(indexes, tmp_path, name, encoding):
    checkpoint, paths = indexes[name]
    doc = json.loads(paths["json"].read_text())
    down, up = tmp_path / f"down.{encoding}", tmp_path / "up.json"
    result = run("migrate", paths[encoding], down, "--to", "1.0")
    assert result.exit_code == 0, result.stderr
    # generate writes 1.1 manifests in a tp index's domains (their 1.1 fields dropped: CK313); on main, 1.0 ones
    # for MoE and stage 0 (a version bump going up)
    was_1_1 = {d["manifest"]["format_version"] for d in doc["domains"]} == {"1.1.0"}
    assert "CK001" not in result.stderr and ("CK313 warning" in result.stderr) == was_1_1
    migrated = load_document(str(down))
    assert {d["manifest"]["format_version"] for d in migrated["domains"]} == {"1.0.0"}
    assert migrated["format_version"] == doc["format_version"]
    assert {k: v for k, v in migrated.items() if k != "domains"} == {k: v for k, v in doc.items() if k != "domains"}
    assert _schema_errors(migrated) == []
    checked = run("validate", down, "--checkpoint", checkpoint)
    assert checked.exit_code == 0, checked.output + checked.stderr

    result = run("migrate", down, up, "--to", "1.1")
    assert result.exit_code == 0, result.stderr
    raised = json.loads(up.read_text())
    assert {d["manifest"]["format_version"] for d in raised["domains"]} == {"1.1.0"}
    assert _schema_errors(raised) == []
    checked = run("validate", up, "--checkpoint", checkpoint)
    assert checked.exit_code == 0, checked.output + checked.stderr


def test_migrate_refuses_to_fill_a_real_index_from_its_checkpoint(indexes, tmp_path):
    checkpoint, paths = indexes["tp2dp2-s2-bf16-ws4"]
    result = run("migrate", paths["json"], tmp_path / "out.json", "--to", "1.1", "--checkpoint", checkpoint)
    assert result.exit_code == 1 and "CK311 --checkpoint fills" in result.stderr and "CK001" not in result.stderr
    assert not (tmp_path / "out.json").exists()

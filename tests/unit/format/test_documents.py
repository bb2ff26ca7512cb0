"""Documents of both kinds, wherever a document is read (issue #39): ``ckptspec.validate`` and
``ckptspec.load`` dispatch on ``format`` (a manifest 1.x or a checkpoint index), the manifest-only
functions refuse an index by name (CK005), and migrating an index migrates the manifest of each
of its domains.

The indexes are the committed conformance documents of three real harness checkpoints
(tests/conformance/index-1.0/, written by ``ckptspec generate``); the manifest is the committed example.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

import ckptspec
from ckptspec.errors import InvalidInput, MigrationError
from ckptspec.format.codec import write_manifest
from ckptspec.format.documents import migrate
from ckptspec.format.index_validate import validate_index_document
from ckptspec.format.migrate import migrate_document

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "tests" / "conformance" / "index-1.0"
INDEXES = sorted(p.name for p in FIXTURES.glob("*.json"))
MANIFEST = ROOT / "examples" / "manifests" / "zero2-bf16-2ranks-1.1.json"


def _load(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def _broken(name: str) -> dict:
    doc = _load(name)
    doc["topology"]["model_parallel_size"] += 1  # the product of the degrees: CK602
    return doc


@pytest.fixture(params=["json", "msgpack"])
def encoded(request, tmp_path):
    """``encoded(doc)``: the path of ``doc`` written in JSON, then in msgpack."""

    def write(doc: dict) -> Path:
        path = tmp_path / f"doc.{request.param}"
        write_manifest(doc, str(path), request.param)
        return path

    return write


def test_the_fixtures_cover_three_kinds():
    assert INDEXES == ["pp2dp2-s1-fp32-ws4.json", "s0-bf16-ws2-fused.json", "tp2dp2-s2-bf16-ws4.json"]


@pytest.mark.parametrize("name", INDEXES)
def test_validate_reads_an_index_from_a_path_or_data(name, encoded):
    doc = _load(name)
    for given in (encoded(doc), str(encoded(doc)), doc):
        report = ckptspec.validate(given)
        assert isinstance(report, ckptspec.IndexReport)
        assert report.ok and report.findings == []
        assert isinstance(report.manifest, ckptspec.CheckpointIndex)
        assert report.manifest.to_dict() == doc


def test_validate_reads_a_manifest_from_a_path_or_data(encoded):
    doc = json.loads(MANIFEST.read_text())
    for given in (encoded(doc), doc):
        report = ckptspec.validate(given)
        assert isinstance(report, ckptspec.Report) and report.ok and report.findings == []
        assert isinstance(report.manifest, ckptspec.Manifest)
        assert report.manifest.to_dict() == doc


@pytest.mark.parametrize("name", INDEXES)
def test_validate_judges_an_index_as_an_index(name, encoded):
    for given in (encoded(_broken(name)), _broken(name)):
        report = ckptspec.validate(given)
        codes = [f.code for f in report.findings]
        assert isinstance(report, ckptspec.IndexReport)
        assert not report.ok and "CK602" in codes and "CK001" not in codes, codes


def test_validate_judges_a_manifest_as_a_manifest():
    doc = json.loads(MANIFEST.read_text())
    doc["groups"][0]["params"][0]["numel"] += 1
    report = ckptspec.validate(doc)
    assert isinstance(report, ckptspec.Report) and not report.ok
    assert "CK101" in [f.code for f in report.findings]


@pytest.mark.parametrize("name", INDEXES)
def test_load_gives_the_model_of_either_kind(name, encoded):
    index = ckptspec.load(encoded(_load(name)))
    assert isinstance(index, ckptspec.CheckpointIndex) and index.to_dict() == _load(name)
    manifest = ckptspec.load(MANIFEST)
    assert isinstance(manifest, ckptspec.Manifest) and manifest.to_dict() == json.loads(MANIFEST.read_text())


@pytest.mark.parametrize("name", INDEXES)
def test_load_raises_with_the_findings(name, encoded):
    with pytest.raises(ckptspec.InvalidManifest) as caught:
        ckptspec.load(encoded(_broken(name)))
    assert "CK602" in [f.code for f in caught.value.findings]


@pytest.mark.parametrize("name", INDEXES)
def test_manifest_only_functions_refuse_an_index_by_name(name, encoded):
    report = ckptspec.validate_document(_load(name))
    assert [f.code for f in report.findings] == ["CK005"] and not report.ok
    assert "ckptspec.load" in report.findings[0].hint
    with pytest.raises(ckptspec.InvalidManifest) as caught:
        ckptspec.load_manifest(encoded(_load(name)))
    assert [f.code for f in caught.value.findings] == ["CK005"]
    # validate_file keeps reading either kind
    assert ckptspec.validate_file(encoded(_load(name))).manifest.to_dict() == _load(name)


def _all_but_manifests(doc: dict) -> dict:
    rest = copy.deepcopy(doc)
    for domain in rest["domains"]:
        del domain["manifest"]
    return rest


@pytest.mark.parametrize("name", INDEXES)
@pytest.mark.parametrize("target", ["1.0", "1.1"])
def test_migrating_an_index_migrates_each_domain_manifest(name, target):
    doc = _load(name)
    result = migrate(doc, target, name)
    # the index goes to the target's line too: 1.0 -> 1.1 a version bump (its extras not described), nothing else
    assert _all_but_manifests(result.document) == {**_all_but_manifests(doc), "format_version": f"{target}.0"}
    for i, domain in enumerate(result.document["domains"]):
        alone = migrate_document(doc["domains"][i]["manifest"], target)
        assert domain["manifest"] == alone.document
        assert domain["manifest"]["format_version"] == f"{target}.0"
        inside = f"$.domains[{i}].manifest"
        dropped = [f.path for f in result.findings if f.code == "CK313" and f.path.startswith(inside + ".")]
        assert dropped == [inside + f.path[1:] for f in alone.findings if f.code == "CK313"]
    report = validate_index_document(result.document)
    assert report.ok and report.findings == []
    assert doc == _load(name)  # the input is not changed


@pytest.mark.parametrize("name", INDEXES)
def test_dropped_fields_are_named_inside_their_domain(name):
    doc = _load(name)
    result = migrate(doc, "1.0", name)
    paths = [f.path for f in result.findings if f.code == "CK313"]
    on_1_1 = [i for i, d in enumerate(doc["domains"]) if d["manifest"]["format_version"].startswith("1.1")]
    assert bool(paths) == bool(on_1_1)
    assert all(any(p.startswith(f"$.domains[{i}].manifest.") for i in on_1_1) for p in paths), paths
    assert {f.severity for f in result.findings} <= {"warning"}


def test_up_then_down_is_the_identity_on_a_1_0_index():
    doc = _load("s0-bf16-ws2-fused.json")
    assert {d["manifest"]["format_version"] for d in doc["domains"]} == {"1.0.0"}
    up = migrate(doc, "1.1")
    assert up.steps == [("1.0", "1.1")] and up.findings == []
    assert migrate(up.document, "1.0").document == doc


@pytest.mark.parametrize("name", INDEXES)
def test_an_invalid_index_is_not_migrated(name):
    with pytest.raises(InvalidInput) as caught:
        migrate(_broken(name), "1.0", name)
    assert "CK602" in [f.code for f in caught.value.findings]


def test_an_index_cannot_reach_a_version_no_manifest_reaches():
    with pytest.raises(MigrationError) as caught:
        migrate(_load(INDEXES[0]), "2.0", "index.json")
    assert caught.value.code == "CK311"


def test_the_manifest_migration_refuses_an_index_by_name():
    with pytest.raises(MigrationError) as caught:
        migrate_document(_load(INDEXES[0]), "1.0", "index.json")
    assert caught.value.code == "CK005" and "documents.migrate" in caught.value.hint
